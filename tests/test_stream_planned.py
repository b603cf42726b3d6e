"""Streamed epochs decided as they start read only the rows they keep (issue 69, item 4). Quick: a streamed
shard whose reads take rows from memory (its orders, decisions and counts without Ray Data), against the
in-memory epoch decided as it starts. Slow: a Fashion-MNIST subset as PNG in Parquet, in small row groups,
streamed through Ray Data in this process (the engine a `--workers 0` rank builds, without Ray Train's
start-up). On 2 gloo Ray Train workers, Stale-SB's epochs between its passes read only their kept rows in
tests/test_distributed.py's streamed Hugging Face run (one Ray Train fit fewer for the suite's time)."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from raysb.bench.stream_reads import epoch_reads
from raysb.config import TrainConfig
from raysb.data import ImageDataset, load_dataset, stratified_subset, write_parquet
from raysb.data.row_groups import PositionedRowGroups, ReadBytes, RowGroup
from raysb.data.shards import MemoryShard, StreamShard, stream_shard
from raysb.data.streaming import StreamedSplit, inspect_split, read_bytes, ray_dataset
from raysb.training.selection.sources import StreamedPlan, WholeEpoch
from raysb.training.builders import build_engine
from raysb.training.checkpoint import load_checkpoint_file, save_checkpoint_file
from raysb.training.loop import run_epochs
from raysb.training.outputs import MetricsWriter
from raysb.training.run_callback import RunCallback

from conftest import needs_fashion_mnist
from run_rows import untimed
from test_data import make_dataset
from test_epoch_plans import engine_for

QUIET = lambda line: None  # noqa: E731
TRAIN_ROWS, ROW_GROUP_ROWS = 1200, 8
# The kept fraction's target: a planned epoch decodes at most this much over s of a Traditional epoch's rows.
DECODE_SLACK = 1.1


def memory_stream(data: ImageDataset, row_group: int) -> StreamShard:
    """`data` as a streamed shard in row groups of `row_group` rows whose reads take the rows from memory: a
    whole epoch in a seeded random order, kept rows in file order."""
    rows = len(data)
    split = StreamedSplit("memory", data.sample_ids, data.num_classes, tuple(data.images.shape[1:]), data.mean,
                          data.std, {})
    groups = [RowGroup("memory", i, start, min(row_group, rows - start), 100, 100)
              for i, start in enumerate(range(0, rows, row_group))]

    def columns(positions: torch.Tensor) -> dict:
        return {"sample_id": data.sample_ids[positions], "image": data.images[positions],
                "label": data.labels[positions]}

    def batches(chunk_size: int, seed: int):
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        return (columns(part) for part in order.split(chunk_size))

    def kept_batches(positions: torch.Tensor, chunk_size: int, seed: int):
        return (columns(part) for part in positions.sort().values.split(chunk_size))

    return StreamShard(split, batches, kept_batches, ReadBytes(groups))


def sources_of(engine) -> list:
    """The source of each epoch `engine` trains from here on, and the batches it yields."""
    seen, epoch_of = [], engine.rounds.epoch

    def marked(epoch, source, *args, **kwargs):
        seen.append(source)
        return epoch_of(epoch, source, *args, **kwargs)

    engine.rounds.epoch = marked
    return seen


def test_a_streamed_epoch_decided_as_it_starts_decodes_only_its_kept_rows():
    data = make_dataset(n=320, num_classes=4)
    engine = engine_for("free-sb", shard=memory_stream(data, row_group=4))
    sources = sources_of(engine)
    decoded, read = [], []
    for epoch in range(3):
        before = engine.shard.rows_decoded, engine.shard.bytes_read
        engine.train_epoch(epoch)
        decoded.append(engine.shard.rows_decoded - before[0])
        read.append(engine.shard.bytes_read - before[1])
    assert all(isinstance(source, StreamedPlan) for source in sources)
    counts = engine.progress_counts()
    # The first epoch keeps every row (nothing scored yet) and streams them all; the others decode their kept rows.
    assert decoded[0] == 320 and 0 < decoded[1] < 1.1 * 320 / 3 and 0 < decoded[2] < 1.1 * 320 / 3
    assert counts["stream_rows_decoded"] == sum(decoded) and counts["stream_bytes_read"] == sum(read)
    assert counts["examples_kept"] == sum(decoded) == counts["backprop_examples"] + engine.rounds.queued()
    # 80 row groups of 100 bytes: a whole read fetches each once; one of kept rows skips those holding none.
    assert read[0] == pytest.approx(8000)
    assert all(0 < bytes_read < 8000 and bytes_read % 100 == 0 for bytes_read in read[1:])

    sb = engine_for("sb", shard=memory_stream(data, row_group=4))
    sources = sources_of(sb)
    sb.train_epoch(0)
    assert not isinstance(sources[0], StreamedPlan) and sb.shard.rows_decoded == 320


def test_a_streamed_epochs_decisions_are_the_in_memory_epochs_decided_as_it_starts():
    """The same table, the same rows in the same order: the same kept ids, in the same order, as the in-memory
    epoch decided as it starts (not a streamed epoch's decided chunk by chunk, whose order the reads make)."""
    data = make_dataset(n=320, num_classes=4)
    streamed = engine_for("free-sb", shard=memory_stream(data, row_group=4))
    streamed.train_epoch(0)
    in_memory = engine_for("free-sb", shard=MemoryShard(data))
    kept = {}
    for name, engine in (("streamed", streamed), ("in memory", in_memory)):
        decide = engine.strategy.decide

        def recorded(epoch, ids, scores, name=name, decide=decide):
            decision = decide(epoch, ids, scores)
            kept[name] = ids[decision.kept]
            return decision

        engine.strategy.decide = recorded
    in_memory.strategy.load_state_dict(copy.deepcopy(streamed.strategy.state_dict()))
    # The streamed epoch's order is drawn from a seed its order generator draws; given that seed, the
    # in-memory epoch draws the same order.
    ahead = torch.Generator()
    ahead.set_state(streamed.feed.order_generator.get_state())
    in_memory.feed.order_generator = torch.Generator().manual_seed(streamed.shard.epoch_seed(ahead))
    sources = sources_of(in_memory)
    in_memory.train_epoch(1)
    streamed.train_epoch(1)
    assert isinstance(sources[0], WholeEpoch)
    assert 0 < len(kept["streamed"]) < 320 and torch.equal(kept["streamed"], kept["in memory"])


@pytest.fixture(scope="module")
def png_parquet(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("png")
    for split, size in (("train", TRAIN_ROWS), ("test", 200)):
        data = stratified_subset(load_dataset("fashion-mnist", split), size, seed=1)
        write_parquet(data, str(folder / f"{split}.parquet"), row_group_size=ROW_GROUP_ROWS)
    return folder


def config(folder: Path, out: Path, **overrides) -> TrainConfig:
    values = dict(dataset="parquet", data_dir=str(folder), data_mode="stream", workers=0, epochs=3, batch_size=32,
                  lr=0.05, model_options={"width": 8}, strategy="free-sb", out=str(out), stream_shuffle_buffer=256)
    values.update(overrides)
    return TrainConfig.from_dict(values)


def streamed_engine(cfg: TrainConfig):
    """The engine of a `--workers 0` rank on `cfg`'s split, its whole epochs read by one Ray Dataset here
    (as the driver reads it for Ray Train), and the test split."""
    settings = cfg.settings()
    split = inspect_split("train", settings.data.data_dir)
    whole = ray_dataset(split).randomize_block_order(seed=settings.data.seed)
    whole.context.execution_options.preserve_order = True

    def batches(chunk_size: int, seed: int):
        return whole.iter_torch_batches(batch_size=chunk_size, local_shuffle_buffer_size=256, local_shuffle_seed=seed)

    torch.manual_seed(settings.run.seed)
    shard, test = stream_shard(settings.data, batches)
    return build_engine(settings, shard, torch.device("cpu")), test


class Resumed(RunCallback):
    def __init__(self, start_epoch: int):
        self.start_epoch = start_epoch


def run(cfg: TrainConfig, engine, test, rows=None, start_epoch: int = 0):
    metrics = MetricsWriter(Path(cfg.out) / "metrics.parquet", rows)
    return run_epochs(engine, cfg.settings().run, test, torch.empty(0, dtype=torch.int64), metrics, QUIET,
                      Resumed(start_epoch))


def decoded_and_read(rows: list[dict]) -> list[tuple[int, int]]:
    """Each epoch's rows decoded and bytes read (raysb.bench.stream_reads.epoch_reads of the metrics rows)."""
    return [(epoch["stream_rows_decoded"], epoch["stream_bytes_read"]) for epoch in epoch_reads(rows)]


@needs_fashion_mnist
def test_a_read_of_kept_positions_reads_their_row_groups_alone_and_yields_those_rows(png_parquet):
    split = inspect_split("train", str(png_parquet))
    keep = np.array([3, 4, 40, 41, 1199])  # row groups 0, 5 and 149
    source = PositionedRowGroups(split.path, ["image", "label", "sample_id"], "sample_id", len(split), keep)
    blocks = [block for task in source.get_read_tasks(4) for block in task()]
    assert len(blocks) == 3, "a row group holding no kept row is not read"
    read = torch.tensor([i for block in blocks for i in block["sample_id"].to_pylist()])
    assert torch.equal(read, split.sample_ids[torch.from_numpy(keep)])
    # Many row groups of one file to a task, read in file order, in any order of tasks drawn from a seed.
    position = {int(i): p for p, i in enumerate(split.sample_ids.tolist())}
    many = np.unique(torch.randperm(len(split), generator=torch.Generator().manual_seed(0))[:400].numpy())
    for tasks, seed in ((1, None), (4, None), (4, 7)):
        source = PositionedRowGroups(split.path, ["image", "label", "sample_id"], "sample_id", len(split), many, seed)
        blocks = [block["sample_id"].to_pylist() for task in source.get_read_tasks(tasks) for block in task()]
        places = [[position[i] for i in block] for block in blocks]
        assert sorted(p for block in places for p in block) == many.tolist()
        assert all(block == sorted(block) for block in places)
    prices = read_bytes(split)
    assert prices.of_groups(torch.from_numpy(keep)) == int(prices.bytes[[0, 5, 149]].sum())
    # A whole read's rows, however divided, price the whole split.
    halves = torch.randperm(len(split)).chunk(2)
    assert sum(prices.of_rows(half) for half in halves) == pytest.approx(float(prices.bytes.sum()))


@needs_fashion_mnist
@pytest.mark.slow
def test_a_streamed_free_sb_epoch_decodes_only_the_rows_it_keeps(ray_session, tmp_path, png_parquet):
    """Once every example has a score, an epoch is decided as it starts and only its kept rows are read and
    decoded: each the strategy's decision on every row in the epoch's order, as an in-memory epoch decided
    as it starts takes it, and trained on (or queued) once, its image as stored."""
    traditional, test = streamed_engine(config(png_parquet, tmp_path / "traditional", strategy="traditional",
                                               epochs=1))
    full = decoded_and_read(run(config(png_parquet, tmp_path / "traditional", strategy="traditional", epochs=1),
                           traditional, test).metrics)[0]
    assert full[0] == TRAIN_ROWS and full[1] == pytest.approx(float(read_bytes(traditional.shard.split).bytes.sum()),
                                                              abs=1)

    cfg = config(png_parquet, tmp_path / "free-sb")
    engine, test = streamed_engine(cfg)
    decided, trained = {}, {}
    decide = engine.strategy.decide

    def recorded_decide(epoch, ids, scores):
        decision = decide(epoch, ids, scores)
        decided[epoch] = (ids.clone(), ids[decision.kept].clone())
        return decision

    engine.strategy.decide = recorded_decide
    step = engine.train_step

    def recorded_step(batch):
        trained.setdefault(engine.schedule.epoch, []).append((batch.sample_ids.clone(), batch["images"].clone()))
        step(batch)

    engine.train_step = recorded_step
    queued = {}
    original_epoch = engine.train_epoch

    def recorded_epoch(epoch, should_stop=None):
        before = engine.rounds.exchange.state_dict()["remainder"]
        stopped = original_epoch(epoch, should_stop)
        queued[epoch] = (before, engine.rounds.exchange.state_dict()["remainder"])
        return stopped

    engine.train_epoch = recorded_epoch
    rows = run(cfg, engine, test).metrics
    reads = decoded_and_read(rows)
    selectivity = cfg.settings().selection.spec.selectivity
    in_memory = load_dataset("parquet", "train", str(png_parquet))
    position = {int(i): p for p, i in enumerate(in_memory.sample_ids.tolist())}
    for epoch in (1, 2):  # epoch 0 keeps every row (nothing scored yet) and streams them all
        ids, kept = decided[epoch]
        assert sorted(ids.tolist()) == sorted(in_memory.sample_ids.tolist()), "one decision on every row"
        assert reads[epoch][0] == len(kept) <= DECODE_SLACK * selectivity * full[0]
        assert reads[epoch][1] < full[1]
        before, after = queued[epoch]
        took = torch.cat([ids for ids, _ in trained[epoch]])
        queued_before = before.sample_ids if before is not None else torch.empty(0, dtype=torch.int64)
        queued_after = after.sample_ids if after is not None else torch.empty(0, dtype=torch.int64)
        # kept = trained + queued: every kept row once, no other
        assert sorted(torch.cat([took, queued_after]).tolist()) == sorted(torch.cat([queued_before, kept]).tolist())
        for ids_of_step, images in trained[epoch]:
            rows_of_step = torch.tensor([position[int(i)] for i in ids_of_step])
            assert torch.equal(images, in_memory.images[rows_of_step])
    assert reads[0][0] == TRAIN_ROWS
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["stream_rows_decoded"] == sum(r[0] for r in reads)


class Stopped(Exception):
    pass


class StopAfter(RunCallback):
    """Checkpoints after epoch `epochs`, as a single process does, and stops the run there."""

    def __init__(self, engine, cfg: TrainConfig, metrics: MetricsWriter, epochs: int):
        self.engine, self.cfg, self.metrics, self.epochs = engine, cfg, metrics, epochs

    def after_epoch(self, epoch: int, row: dict | None, stopped: bool) -> None:
        if epoch + 1 == self.epochs:
            save_checkpoint_file(self.engine, Path(self.cfg.out), self.epochs, self.metrics.rows,
                                 self.cfg.settings().run.saved)
            raise Stopped


@needs_fashion_mnist
@pytest.mark.slow
def test_a_streamed_planned_run_resumes_exactly(ray_session, tmp_path, png_parquet):
    """InfoBatch, whose planned epochs weigh their kept examples: stopped after its second epoch and
    resumed, its third epoch (planned; the fourth anneals to every row) reads, decides and trains what the
    unbroken run's did."""
    whole_cfg = config(png_parquet, tmp_path / "whole", strategy="infobatch", epochs=4)
    whole = run(whole_cfg, *streamed_engine(whole_cfg)).metrics

    cfg = config(png_parquet, tmp_path / "stopped", strategy="infobatch", epochs=4)
    engine, test = streamed_engine(cfg)
    metrics = MetricsWriter(Path(cfg.out) / "metrics.parquet")
    with pytest.raises(Stopped):
        run_epochs(engine, cfg.settings().run, test, torch.empty(0, dtype=torch.int64), metrics, QUIET,
                   StopAfter(engine, cfg, metrics, 2))
    engine, test = streamed_engine(cfg)
    restored = load_checkpoint_file(engine, Path(cfg.out))
    rows = run(cfg, engine, test, copy.deepcopy(restored.metrics_rows), restored.epoch).metrics
    assert restored.epoch == 2 and untimed(rows) == untimed(whole)
    assert [rows < TRAIN_ROWS for rows, _ in decoded_and_read(rows)] == [False, True, True, False]
