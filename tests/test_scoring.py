"""Selection forwards and their cheaper variants: same losses (or nearly), BatchNorm untouched."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_data import make_dataset

from raysb.config import ConfigError, TrainConfig
from raysb.data.shards import MemoryShard
from raysb.models import build_model
from raysb.training.builders import build_engine
from raysb.training.selection.scoring import SelectionScorer


def model_and_batch():
    torch.manual_seed(0)
    model = build_model("small-cnn", 10, 3, 8, width=8)
    with torch.no_grad():  # non-trivial BatchNorm statistics, as mid-training
        model.train()
        model(torch.randn(256, 3, 8, 8) * 2 + 1)
    return model, torch.randn(64, 3, 8, 8), torch.randint(0, 10, (64,))


def test_fp32_scorer_is_the_eval_mode_loss_and_leaves_batchnorm_alone():
    model, x, y = model_and_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = SelectionScorer(model, torch.device("cpu"))(x, y)
    model.eval()
    with torch.no_grad():
        expected = F.cross_entropy(model(x), y, reduction="none")
    assert torch.allclose(losses, expected)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_channels_last_and_bf16_barely_change_the_losses():
    model, x, y = model_and_batch()
    reference = SelectionScorer(model, torch.device("cpu"))(x, y)
    last = model.to(memory_format=torch.channels_last)
    assert torch.allclose(SelectionScorer(last, torch.device("cpu"), channels_last=True)(x, y), reference, atol=1e-5)
    bf16 = SelectionScorer(model, torch.device("cpu"), precision="bf16")(x, y)
    assert bf16.dtype == torch.float32
    assert torch.allclose(bf16, reference, rtol=0.05, atol=0.05)
    # the ranking selection depends on is nearly unchanged
    assert (bf16.argsort().argsort() - reference.argsort().argsort()).abs().float().mean() < 2


def test_unknown_precisions_are_clear_config_errors():
    with pytest.raises(ConfigError, match="unknown selection_precision 'fp8'"):
        TrainConfig(selection_precision="fp8")
    with pytest.raises(ConfigError, match="unknown precision 'fp64'; choose one of auto, fp32, bf16, fp16"):
        TrainConfig(precision="fp64")


@pytest.mark.parametrize("batchnorm, graphs", [
    ("running", 2),  # the last chunk is padded: one scoring graph, one training graph
    ("batch", 3),  # padding would change a chunk's statistics: the last chunk has a graph of its own
])
def test_compiled_forwards_compile_once_whatever_the_last_chunk_holds(monkeypatch, batchnorm, graphs):
    # Dynamo's guards and recompiles are the backend's business-free part: "eager" runs them
    # without the minutes of code generation a real backend takes on a CPU.
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    config = TrainConfig(model_options={"width": 8}, batch_size=16, selection_batch_size=32, compile_selection=True,
                         compile_training=True, selection_batchnorm=batchnorm, record_analysis=False, device="cpu")
    # 200 examples: six chunks of 32 and a last one of 8, every epoch.
    engine = build_engine(config.settings(), MemoryShard(make_dataset(n=200, num_classes=4)), torch.device("cpu"))
    engine.train_epoch(0)
    assert counters["stats"]["unique_graphs"] == graphs
    for epoch in (1, 2):
        engine.train_epoch(epoch)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation after the first epoch
    # Checkpoints hold the bare module, not the compiled wrapper's prefixed names.
    assert not any(key.startswith("_orig_mod") for key in engine.shared_state_dict()["model"])


def test_a_kept_set_of_a_new_size_each_epoch_trains_on_the_one_compiled_graph(monkeypatch):
    # free-sb under a kept-fraction schedule keeps a different number of examples each epoch; the
    # training batches stay exactly b, and the epoch's remainder waits in the queue (raysb.core.batch_former).
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    config = TrainConfig(strategy="free-sb", kept_fraction_schedule="lr", selectivity=0.25, epochs=4,
                         model_options={"width": 8}, batch_size=16, compile_training=True, record_analysis=False,
                         device="cpu")
    engine = build_engine(config.settings(), MemoryShard(make_dataset(n=200, num_classes=4)), torch.device("cpu"))
    kept = []
    for epoch in range(4):
        before = engine.progress_counts()["examples_kept"]
        engine.train_epoch(epoch)
        kept.append(engine.progress_counts()["examples_kept"] - before)
        assert counters["stats"]["unique_graphs"] == 1, epoch
    assert len(set(kept[1:])) == 3, kept  # a new kept-set size each epoch after the first (which keeps all)


def test_a_forward_torch_compile_cannot_compile_is_scored_by_the_plain_module(monkeypatch):
    # Compiled by default where captured on a GPU: a backend that fails there must not end the run.
    def failing_compile(model, **options):
        def compiled(inputs):
            raise RuntimeError("BackendCompilerFailed: inductor raised\nwith more lines")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    model, x, y = model_and_batch()
    scorer = SelectionScorer(model, torch.device("cpu"), compile=True)
    expected = SelectionScorer(model, torch.device("cpu"))(x, y)
    assert torch.equal(scorer(x, y), expected)
    assert scorer.forward.refused and torch.equal(scorer(x, y), expected)
    assert scorer.stats() == {"selection_compile_refused": "RuntimeError: BackendCompilerFailed: inductor raised"}
    # An error of the model's own is still raised, from the plain module.
    broken = SelectionScorer(model, torch.device("cpu"), compile=True)
    with pytest.raises(RuntimeError, match="to have 3 channels, but got 5"):
        broken(torch.randn(4, 5, 8, 8), y[:4])


def test_padding_a_compiled_chunk_changes_no_real_examples_loss():
    model, x, y = model_and_batch()
    plain = SelectionScorer(model, torch.device("cpu"))
    padded = SelectionScorer(model, torch.device("cpu"))
    padded.static_rows = 64  # as after a full chunk; the forward itself is the plain one here
    assert torch.allclose(padded(x[:10], y[:10]), plain(x[:10], y[:10]), atol=1e-6)
    assert padded(x[:0], y[:0]).numel() == 0


def test_batch_statistics_scoring_normalizes_by_the_chunk_and_leaves_running_statistics_alone():
    model, x, y = model_and_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = SelectionScorer(model, torch.device("cpu"), batchnorm="batch")(x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # incl. num_batches_tracked
    assert not model.training and all(m.track_running_stats for m in model.modules() if hasattr(m, "track_running_stats"))
    # What a training forward computes for this chunk, without its running-statistics update.
    trained_copy = copy.deepcopy(model).train()
    with torch.no_grad():
        expected = F.cross_entropy(trained_copy(x), y, reduction="none")
    assert torch.allclose(losses, expected, atol=1e-6)
    assert not torch.allclose(losses, SelectionScorer(model, torch.device("cpu"))(x, y), atol=1e-3)


def test_sb_scores_a_deep_batchnorm_network_as_its_training_forward_normalizes_by_default():
    """A WideResNet-10-1 (nine BatchNorm layers) at b = 512 scored with BatchNorm's running
    statistics fell to 79% error after 116 steps of SB on Fashion-MNIST (Traditional: 31%); scored
    with each chunk's own statistics, as the training forward normalizes, 36% (BENCHMARKS.md, "SB at
    large b"; that 2-minute run is its evidence, not a test). A default run must score so."""
    config = TrainConfig(strategy="sb", batch_size=512, model="wideresnet",
                         model_options={"depth": 10, "widen_factor": 1})
    dataset = make_dataset(n=64, channels=1, size=28, num_classes=10)
    engine = build_engine(config.settings(), MemoryShard(dataset), torch.device("cpu"))
    x, y = dataset.images[:32].float() / 255, dataset.labels[:32]
    trained_copy = copy.deepcopy(engine.feed.scoring_model).train()
    with torch.no_grad():
        expected = F.cross_entropy(trained_copy(x), y, reduction="none")
    assert torch.allclose(engine.feed.scorer(x, y, 0), expected, atol=1e-5)


def test_batch_statistics_and_int8_do_not_mix():
    with pytest.raises(ConfigError, match="int8 folds BatchNorm"):
        build_engine(TrainConfig(selection_precision="int8", selection_batchnorm="batch", model_options={"width": 8}).settings(),
                     MemoryShard(make_dataset(n=40, num_classes=10)), torch.device("cpu"))
    with pytest.raises(ConfigError, match="unknown selection_batchnorm 'train'"):
        TrainConfig(selection_batchnorm="train")
