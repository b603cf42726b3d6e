"""Pipelined selection: a model copy scores ahead of training, refreshed every k steps."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from raysb.api import train
from raysb.config import ConfigError, TrainConfig
from raysb.core.batch_former import Batch
from raysb.training.selection.pipeline import PipelinedSelection, ThreadBackend
from raysb.training.selection.scoring import SelectionScorer

from conftest import needs_fashion_mnist

CPU = torch.device("cpu")


def tiny_pipeline(depth=2, sync_every=2):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    backend = ThreadBackend(model, CPU, lambda copy: SelectionScorer(copy, CPU))
    return model, PipelinedSelection(backend, depth=depth, sync_every=sync_every)


def batch_of(seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch(torch.arange(4), {"inputs": torch.randn(4, 6, generator=generator), "labels": torch.tensor([0, 1, 2, 0])})


def test_chunks_are_scored_by_the_weights_of_the_last_refresh_and_staleness_is_counted():
    model, pipeline = tiny_pipeline(sync_every=2)
    try:
        pipeline.sync(model, step=0)
        before = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():  # "training" moves the weights after the refresh
            for p in model.parameters():
                p.add_(1.0)
        pipeline.sync(model, step=1)  # 1 step since the refresh < sync_every: no refresh
        first, second = batch_of(1), batch_of(2)
        pipeline.submit("chunk-1", first)
        pipeline.submit("chunk-2", second)
        assert pipeline.batch_for("chunk-1") is first and pipeline.batch_for("chunk-2") is None

        old_model = torch.nn.Linear(6, 3)
        with torch.no_grad():
            for p, q in zip(old_model.parameters(), before):
                p.copy_(q)
        expected = F.cross_entropy(old_model(first["inputs"]), first["labels"], reduction="none")
        assert torch.allclose(pipeline.losses_for(first, step=3), expected.detach())
        assert pipeline.losses_for(first, step=3) is None  # consumed once; the next is chunk-2

        pipeline.sync(model, step=3)  # now a refresh: chunk-3 sees the moved weights
        third = batch_of(3)
        pipeline.submit("chunk-3", third)
        pipeline.release("chunk-2")
        moved = F.cross_entropy(model(third["inputs"]), third["labels"], reduction="none")
        assert torch.allclose(pipeline.losses_for(third, step=4), moved.detach())
        stats = pipeline.stats()
        assert stats["pipeline_weight_syncs"] == 2
        assert stats["pipeline_scored_chunks"] == 2
        assert stats["pipeline_mean_staleness_steps"] == pytest.approx((3 + 1) / 2)
        assert stats["pipeline_max_staleness_steps"] == 3
    finally:
        pipeline.close()


def test_bad_pipeline_settings_are_config_errors():
    with pytest.raises(ConfigError, match="pipeline_selection"):
        TrainConfig(pipeline_selection="async")
    with pytest.raises(ConfigError, match="pipeline_depth must be >= 1"):
        TrainConfig(pipeline_selection="thread", pipeline_depth=0)
    with pytest.raises(ConfigError, match="set workers"):
        TrainConfig(pipeline_selection="actor")


def run_config(tmp_path, name, **overrides) -> TrainConfig:
    # Chunks of one training batch: a chunk in flight trains at most one step, so staleness has a tight bound.
    values = dict(dataset="fashion-mnist", subset=1500, test_subset=300, epochs=2, batch_size=32,
                  selection_batch_size=32, model_options={"width": 4}, strategy="sb", selectivity=0.33,
                  record_analysis=False, out=str(tmp_path / name))
    return TrainConfig.from_dict({**values, **overrides})


@needs_fashion_mnist
def test_threaded_pipeline_scores_every_example_and_is_reproducible(tmp_path):
    summaries = []
    for name in ("a", "b"):
        config = run_config(tmp_path, name, pipeline_selection="thread", pipeline_depth=3, pipeline_sync_every=2)
        train(config, log=lambda _: None)
        summaries.append(json.loads((Path(config.out) / "summary.json").read_text()))
    a, b = summaries
    assert a["selection_forward_examples"] == 2 * 1500  # every example scored each epoch, none twice
    assert a["pipeline_scored_chunks"] == 2 * -(-1500 // config.selection_spec().selection_batch_size)
    assert 0.2 < a["kept_fraction"] < 0.45
    # Three chunks ahead plus a refresh every 2 steps: a chunk's weights are a few steps old, never more
    # than the steps the chunks in flight can train.
    assert 0 < a["pipeline_mean_staleness_steps"] <= a["pipeline_max_staleness_steps"] <= 3 + 2
    # Which weights score which chunk depends on step counts, not thread timing.
    for key in ("examples_kept", "final_test_error", "optimizer_steps", "pipeline_mean_staleness_steps"):
        assert a[key] == b[key], key


@needs_fashion_mnist
def test_stale_sb_pipelines_only_its_selection_epochs(tmp_path):
    config = run_config(tmp_path, "stale", strategy="stale-sb", staleness=2, epochs=3, pipeline_selection="thread")
    summary = train(config, log=lambda _: None).summary
    assert summary["selection_forward_examples"] == 2 * 1500  # epochs 1 and 3 select; epoch 2 reuses
    assert summary["pipeline_scored_chunks"] == 2 * -(-1500 // config.selection_spec().selection_batch_size)
