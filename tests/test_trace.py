"""What a run records for `raysb report`: gradient probes, selection counts, tracked decisions."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raysb.api import train
from raysb.config import TrainConfig
from raysb.core.probes import agreement, gradient_similarity
from raysb.data import BatchTransform, ImageDataset, flip_labels
from raysb.data.prepare import prepare_data
from raysb.models import build_model
from raysb.training.trace import TRACKED_EXAMPLES, SelectionTrace

from conftest import needs_fashion_mnist


def softmax_regression_gradient(weights: np.ndarray, inputs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """d/dW of mean cross-entropy for logits = x W^T, by the textbook formula (p - onehot)^T x / n."""
    logits = inputs @ weights.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(labels)), labels] -= 1.0
    return (p.T @ inputs / len(labels)).reshape(-1)


def test_gradient_similarity_matches_a_hand_computation():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3, bias=False).double()
    inputs = torch.randn(8, 5, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    kept = torch.tensor([1, 1, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    random = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    result = gradient_similarity(model, inputs, labels, kept, random)

    w, x, y = model.weight.detach().numpy(), inputs.numpy(), labels.numpy()
    full = softmax_regression_gradient(w, x, y)
    for name, mask in (("kept", kept.numpy()), ("random", random.numpy())):
        sub = softmax_regression_gradient(w, x[mask], y[mask])
        cosine = full @ sub / np.linalg.norm(full) / np.linalg.norm(sub)
        assert result[f"cosine_{name}"] == pytest.approx(cosine, rel=1e-9)
        assert result[f"same_sign_{name}"] == pytest.approx(np.mean(np.sign(full) == np.sign(sub)))
    assert model.weight.grad is None  # probing leaves training's gradients alone


def test_agreement_of_opposite_and_identical_vectors():
    v = torch.tensor([1.0, -2.0, 3.0, 0.5])
    assert agreement(v, v) == pytest.approx((1.0, 1.0))
    assert agreement(v, -v) == pytest.approx((-1.0, 0.0))


def test_trace_counts_duplicates_and_records_each_tracked_example_once_per_epoch():
    ids = torch.arange(100, 140)
    trace = SelectionTrace(ids, torch.device("cpu"), seed=0)
    tracked = trace.tracked_ids
    assert tracked.numel() == TRACKED_EXAMPLES and set(tracked.tolist()) <= set(ids.tolist())
    for epoch in (1, 2):
        for chunk in ids.split(16):
            losses = chunk.float() / 100
            keep = chunk % 2 == 0
            trace.record_chunk(chunk, chunk[keep].repeat(2))  # drawn twice (importance sampling may)
            trace.record_decisions(epoch, 3 * epoch, chunk, losses, losses / 2, losses / 4, keep)
        trace.close_epoch()
    assert trace.considered.tolist() == [2] * 40
    assert trace.kept.tolist() == [4 if i % 2 == 0 else 0 for i in range(100, 140)]
    rows = trace.decisions
    assert rows.shape == (2 * TRACKED_EXAMPLES, 7)
    assert rows[:TRACKED_EXAMPLES, 2].long().tolist() == tracked.tolist()
    assert rows[:, 0].tolist() == [1.0] * TRACKED_EXAMPLES + [2.0] * TRACKED_EXAMPLES
    assert torch.allclose(rows[:, 3], rows[:, 2] / 100)
    assert torch.equal(rows[:, 6].bool(), rows[:, 2].long() % 2 == 0)


def test_cdf_snapshots_are_copies_of_a_changing_history():
    trace = SelectionTrace(torch.arange(4), torch.device("cpu"), seed=0)
    history = torch.tensor([0.5, 1.5, 2.5])
    trace.snapshot_cdf(1, history)
    history.add_(10)  # the ring buffer moves on
    trace.snapshot_cdf(2, history)
    assert [h.tolist() for _, h in trace.cdf_snapshots] == [[0.5, 1.5, 2.5], [10.5, 11.5, 12.5]]


@needs_fashion_mnist
def test_sb_run_writes_traces_consistent_with_its_summary(tmp_path):
    config = TrainConfig.from_dict(
        dict(dataset="fashion-mnist", subset=1000, test_subset=300, epochs=2, batch_size=32,
             model_options={"width": 4}, strategy="sb", selectivity=0.33, record_analysis=True,
             out=str(tmp_path / "run"))
    )
    result = train(config, log=lambda _: None)
    out = Path(result.out_dir)
    summary = json.loads((out / "summary.json").read_text())

    counts = pq.read_table(out / "selection_counts.parquet").to_pandas()
    assert len(counts) == 1000 and (counts.considered == 2).all()
    assert counts.kept.sum() == summary["examples_kept"]

    tracked = pq.read_table(out / "tracked_examples.parquet").to_pandas()
    assert len(tracked) == 2 * TRACKED_EXAMPLES
    assert tracked.groupby("sample_id").epoch.agg(lambda epochs: sorted(epochs) == [1, 2]).all()
    kept_decisions = tracked.groupby("sample_id").kept.sum()
    assert (counts.set_index("sample_id").kept[kept_decisions.index] == kept_decisions).all()
    assert tracked.probability.between(0, 1).all()
    assert np.allclose(tracked.probability, tracked.percentile ** summary["config"]["beta"], rtol=1e-5)

    cdf = pq.read_table(out / "loss_cdf.parquet").to_pandas()
    assert cdf.groupby("epoch").size().to_dict() == {1: 1000, 2: 1024}  # R = 1024 losses, once seen

    gradients = pq.read_table(out / "gradient_similarity.parquet").to_pandas()
    assert set(gradients.epoch) == {1, 2}
    assert gradients[["cosine_kept", "cosine_random"]].abs().le(1 + 1e-9).all().all()

    # model.pt is the final model: rebuilt, it reproduces the final test error.
    _, test_data, _ = prepare_data(config.settings().data, config.batch_size)
    model = build_model(config.model, 10, 1, 28, **config.model_options)
    model.load_state_dict(torch.load(out / "model.pt"))
    model.eval()
    with torch.no_grad():
        logits = model(BatchTransform(test_data.mean, test_data.std)(test_data.images, None, train=False))
    error = float((logits.argmax(1) != test_data.labels).float().mean())
    assert error == pytest.approx(summary["final_test_error"], abs=1 / 300)


@needs_fashion_mnist
def test_record_analysis_off_by_default_writes_no_trace(tmp_path):
    config = TrainConfig.from_dict(
        dict(dataset="fashion-mnist", subset=500, test_subset=100, epochs=1, batch_size=32,
             model_options={"width": 4}, strategy="sb", out=str(tmp_path / "run"))
    )
    out = Path(train(config, log=lambda _: None).out_dir)
    assert not (out / "selection_counts.parquet").exists() and not (out / "model.pt").exists()


def test_tracked_examples_are_drawn_independently_of_the_flipped_labels():
    # flip_labels and the trace both draw from the run's seed; sharing one stream
    # would make the tracked examples exactly the first flipped ones.
    ids = torch.arange(2000)
    dataset = ImageDataset(torch.zeros(2000, 1, 4, 4, dtype=torch.uint8), ids % 10, ids, 10, (0.0,), (1.0,))
    for seed in range(3):
        _, flipped = flip_labels(dataset, 0.1, seed)
        tracked = SelectionTrace(ids, torch.device("cpu"), seed=seed).tracked_ids
        assert torch.isin(tracked, flipped).sum() <= 6  # 1.6 expected of 16 at 10% noise


@needs_fashion_mnist
def test_primed_epochs_are_not_counted_as_selection(tmp_path):
    config = TrainConfig.from_dict(
        dict(dataset="fashion-mnist", subset=600, test_subset=200, epochs=2, prime_epochs=1, batch_size=32,
             model_options={"width": 4}, strategy="sb", selectivity=0.33, record_analysis=True,
             out=str(tmp_path / "run"))
    )
    out = Path(train(config, log=lambda _: None).out_dir)
    counts = pq.read_table(out / "selection_counts.parquet").to_pandas()
    assert (counts.considered == 1).all()  # offered in epoch 2 only: epoch 1 trained on everything unasked
    assert counts.kept.sum() < 0.6 * len(counts)
    tracked = pq.read_table(out / "tracked_examples.parquet").to_pandas()
    assert set(tracked.epoch) == {2}
