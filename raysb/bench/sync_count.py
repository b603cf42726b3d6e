"""Host syncs of an epoch of each strategy: as CUDA reports them, and as raysb's counter counts them.

    python -m raysb.bench.sync_count --out runs/sync-count

The suite asserts what a round and a step may make the host wait for by counting, on the CPU,
the aten operations that would wait on a GPU (raysb.bench.host_syncs.HostSyncCounter). This
checks the counter against the device: on a GPU, one epoch of each strategy (after a first,
uncounted one) runs under both the counter and `torch.cuda.set_sync_debug_mode("warn")`, whose
warnings are the synchronizing calls CUDA saw. Where the two columns differ, the counter misses
a kind of sync (or counts one that is not), and the CPU tests' counts mean less than they say.
On a CPU only the counter's column is filled: CUDA reports nothing there.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

import torch

from raysb.bench.gpu import synthetic_cifar
from raysb.bench.host_syncs import HostSyncCounter, engine_device_tensors
from raysb.bench.per_strategy import per_strategy_main
from raysb.config import TrainConfig
from raysb.training.run_engine import ready_engine

# What CUDA's sync debug mode warns with (c10/cuda/CUDAFunctions.cpp's warn_or_error_on_sync).
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


@dataclass
class EpochSyncs:
    strategy: str
    steps: int
    cuda_syncs: int | None  # None: not on a GPU
    counted_syncs: int
    counted_by_op: dict[str, int]


def epoch_syncs(strategy: str, device: torch.device, examples: int, batch_size: int) -> EpochSyncs:
    """One epoch of `strategy` after an uncounted first, under the counter (and CUDA's debug mode on a GPU)."""
    # Kath18's threshold low enough that its importance sampling starts in the counted epoch.
    config = TrainConfig(strategy=strategy, model="small-cnn", batch_size=batch_size, record_analysis=False,
                         device=device.type, kath18_tau_threshold=0.5 if strategy == "kath18" else None)
    train_data, _ = synthetic_cifar(examples, 16, 32, seed=0)
    torch.manual_seed(0)
    engine = ready_engine(config.settings(), train_data, device)  # as a run sets it up (rho-loss's losses)
    engine.train_epoch(0)
    steps_before = engine.counters.optimizer_steps
    on_gpu = device.type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if on_gpu:
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostSyncCounter(engine_device_tensors(engine)) as counted:
                engine.train_epoch(1)
        finally:
            if on_gpu:
                torch.cuda.set_sync_debug_mode("default")
    cuda = sum(CUDA_SYNC_WARNING in str(warning.message) for warning in caught) if on_gpu else None
    return EpochSyncs(strategy, engine.counters.optimizer_steps - steps_before, cuda, counted.total,
                      dict(Counter(counted.by_op)))


def report_lines(device: torch.device, rows: list[EpochSyncs]) -> list[str]:
    lines = [
        f"Host syncs of one epoch (the second) of each strategy on {device.type}: CUDA's sync debug mode "
        "against raysb.bench.host_syncs.HostSyncCounter.",
        "",
        "| strategy | steps | CUDA's syncs | counted | counted, by op |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        cuda = "-" if row.cuda_syncs is None else str(row.cuda_syncs)
        ops = ", ".join(f"{op} {count}" for op, count in sorted(row.counted_by_op.items())) or "none"
        lines.append(f"| {row.strategy} | {row.steps} | {cuda} | {row.counted_syncs} | {ops} |")
    if any(row.cuda_syncs is not None and row.cuda_syncs != row.counted_syncs for row in rows):
        lines += ["", "**The counter and CUDA disagree: the CPU tests' sync counts need the counter fixed.**"]
    return lines


def main(argv: list[str] | None = None) -> int:
    return per_strategy_main(argv, "python -m raysb.bench.sync_count", __doc__, epoch_syncs,
                             lambda device, batch_size, rows: report_lines(device, rows),
                             lambda row: f"CUDA {row.cuda_syncs}, counted {row.counted_syncs}", "runs/sync-count", 4096)


if __name__ == "__main__":
    raise SystemExit(main())
