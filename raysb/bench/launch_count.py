"""The host's work between captured graphs: the operations an epoch launches outside them, a step and a round.

    python -m raysb.bench.launch_count --out runs/launch-count

With the training step and the selection forward replayed as CUDA graphs, what the host still
launches one kernel at a time is raysb's own work: gathering and augmenting a batch, copying it
into the graph's buffers, ranking and choosing examples, queueing the kept ones. Each launch costs
the host a few microseconds and the device at least one small kernel. This counts them on any
device: one epoch of each strategy (after a first that captures), under a dispatch mode that
counts every aten operation that is not a view, outside the graphs (a graph's replay counts as
none; on a CPU, where the captured path runs its function directly, its operations are left out).
Operations on the host's own bookkeeping count too (a chunk's positions, a CPU generator's draws),
so the count is an upper bound on a GPU's launches. Training losses are read as a GPU run reads
them, every GPU_LOSS_READ_EVERY steps; a third epoch reads them every step, as a CPU run does (the
`a step, reading each` column: what this bench reported before 2026-12-07).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raysb.bench.gpu import STRATEGIES as GPU_BENCH_STRATEGIES, synthetic_cifar
from raysb.bench.per_strategy import per_strategy_main
from raysb.config import TrainConfig
from raysb.training.engine import GPU_LOSS_READ_EVERY
from raysb.training.run_engine import ready_engine


class OpCounter(TorchDispatchMode):
    """Counts aten operations that are not views, except while `paused`."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def outside(self, function):
        """`function`, its operations not counted (a graph's, which a GPU replays in one launch)."""

        def uncounted(*args, **kwargs):
            self.paused = True
            try:
                return function(*args, **kwargs)
            finally:
                self.paused = False

        return uncounted


# The paper's per-example draw (SB's round graph learns each round's kept count from the device late).
VARIANTS = {"sb-random": GPU_BENCH_STRATEGIES["sb-random"]}


@dataclass
class EpochOps:
    strategy: str
    steps: int
    rounds: int
    ops: int
    ops_per_step: float
    ops_per_round: float | None
    by_op: dict[str, int]
    # The same, an epoch whose training losses are read every step (a CPU run's cadence).
    ops_per_step_reading_each: float
    ops_per_round_reading_each: float | None


def epoch_ops(label: str, device: torch.device, examples: int, batch_size: int) -> EpochOps:
    """Epochs of the strategy `label` names (or `VARIANTS`), captured as on CUDA, after a first that
    captures its graphs: the second reading training losses as a GPU run does, the third every step."""
    strategy, settings = VARIANTS.get(label, (label, {}))
    # What `auto` keeps on CUDA: a fixed count a chunk, which no round reads back.
    settings = {"kept_per_chunk": "fixed", **settings}
    config = TrainConfig(strategy=strategy, model="small-cnn", model_options={"width": 8}, batch_size=batch_size,
                         record_analysis=False, device=device.type, capture_training=True, capture_selection=True,
                         compile_training=False, crop_padding=4, horizontal_flip=True,
                         kath18_tau_threshold=0.5 if strategy == "kath18" else None, **settings)
    train_data, _ = synthetic_cifar(examples, 16, 32, seed=0)
    torch.manual_seed(0)
    engine = ready_engine(config.settings(), train_data, device)  # as a run sets it up (rho-loss's losses)
    engine.train_epoch(0)
    counter = OpCounter()
    for graph in engine.graphs():
        graph.function = counter.outside(graph.function)

    def counted_epoch(epoch: int, read_every: int) -> tuple[int, int, Counter[str]]:
        engine.rounds.reads.every = read_every
        counter.by_op = Counter()
        steps = engine.counters.optimizer_steps
        with counter:
            engine.train_epoch(epoch)
        return engine.counters.optimizer_steps - steps, engine.rounds.epoch_rounds, counter.by_op

    steps, rounds, by_op = counted_epoch(1, GPU_LOSS_READ_EVERY)
    each_steps, each_rounds, each_by_op = counted_epoch(2, 1)
    total, each_total = sum(by_op.values()), sum(each_by_op.values())
    return EpochOps(label, steps, rounds, total, total / max(1, steps), total / rounds if rounds else None,
                    dict(by_op.most_common()), each_total / max(1, each_steps),
                    each_total / each_rounds if each_rounds else None)


def report_lines(device: torch.device, batch_size: int, rows: list[EpochOps]) -> list[str]:
    lines = [
        f"Operations outside the captured graphs in one epoch (the second) of each strategy on {device.type}, "
        f"b = {batch_size}, training losses read every {GPU_LOSS_READ_EVERY} steps as on a GPU (an upper bound "
        "on a GPU's launches; raysb.bench.launch_count); the last two columns: the third epoch, read every step.",
        "",
        "| strategy | steps | rounds | operations | a step | a round | most frequent | a step, reading each "
        "| a round, reading each |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        common = ", ".join(f"{op.removeprefix('aten.')} {count}" for op, count in list(row.by_op.items())[:4])
        lines.append(f"| {row.strategy} | {row.steps} | {row.rounds} | {row.ops} | {row.ops_per_step:.1f} | "
                     f"{_per_round(row.ops_per_round)} | {common} | {row.ops_per_step_reading_each:.1f} | "
                     f"{_per_round(row.ops_per_round_reading_each)} |")
    return lines


def _per_round(ops: float | None) -> str:
    return "-" if ops is None else f"{ops:.1f}"


def main(argv: list[str] | None = None) -> int:
    return per_strategy_main(argv, "python -m raysb.bench.launch_count", __doc__, epoch_ops, report_lines,
                             lambda row: f"{row.ops_per_step:.1f} operations a step", "runs/launch-count", 8192,
                             tuple(VARIANTS))


if __name__ == "__main__":
    raise SystemExit(main())
