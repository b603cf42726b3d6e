"""Host time per selection round and per optimizer step, with a model that costs nothing.

    python -m raysb.bench --host-overhead --workers 0 2

On a GPU the host must queue a step's kernels faster than the device runs them, or the
device waits; whatever raysb's rounds do on the host between steps (ranking, batch forming,
the queue, the exchange) is what a GPU user pays when it does not hide. Here the model is a
single linear layer over 4x4 images, so nearly everything measured is raysb's host path.

Each strategy trains `epochs` epochs (4: InfoBatch anneals only its last) of a synthetic set in one process (workers 0) or on N
gloo ranks in N processes (each a thread); the first epoch is thrown away as warm-up. A
round's host time is the epoch's time outside the training steps over its rounds; a step's
is the time inside them (the free model's forward, backward and optimizer step, raysb's
loss bookkeeping and, on ranks, the step's agreement and DDP's all-reduce) over its steps.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from raysb.config import TrainConfig
from raysb.data import ImageDataset
from raysb.data.shards import MemoryShard
from raysb.training.engine import GPU_LOSS_READ_EVERY
from raysb.training.collective import TorchCollective
from raysb.training.run_engine import ready_engine
from raysb.training.selection.merged_histogram import MergedLossHistogram

IMAGE = (1, 4, 4)
# A run's synthetic examples and b, unless told otherwise (`--examples`, `--batch-size`).
EXAMPLES, BATCH_SIZE = 20_000, 128


def free_model(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """A model that costs nothing: one linear layer over the pixels."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, num_classes))


def synthetic(examples: int, seed: int = 0) -> ImageDataset:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (examples, *IMAGE), dtype=torch.uint8, generator=generator)
    return ImageDataset(images, torch.randint(0, 10, (examples,), generator=generator), torch.arange(examples), 10,
                        (0.5,), (0.25,))


def measure(strategy: str, examples: int, batch_size: int, epochs: int, plan_epochs: bool = True,
            collective=None) -> dict[str, float]:
    """One run's host microseconds per round and per step, epochs after the first. `plan_epochs`: the
    config key (False: every epoch in rounds, chunk by chunk)."""
    world = 1 if collective is None else collective.world_size
    # As raysb runs on a GPU: a fixed kept count (no read of it), training losses read every 16 steps.
    config = TrainConfig(model=f"{__name__}:free_model", strategy=strategy, batch_size=batch_size, epochs=epochs,
                         selectivity=0.33, record_analysis=False, device="cpu", workers=None if world == 1 else world,
                         lr_warmup_epochs=0, kept_per_chunk="fixed", plan_epochs=plan_epochs)
    data = synthetic(examples)
    rank = 0 if collective is None else collective.rank
    order = (lambda order: order[rank::world]) if world > 1 else (lambda order: order)
    history = None
    if world > 1:
        history = MergedLossHistogram(config.history_size, world_size=world, rank=rank)
    wrap = (lambda model: nn.parallel.DistributedDataParallel(model)) if world > 1 else (lambda model: model)
    torch.manual_seed(0)
    # As a run sets it up: the held-out split taken out, rho-loss's irreducible losses fitted.
    engine = ready_engine(config.settings(), data, torch.device("cpu"), shard=lambda part: MemoryShard(part, order),
                          wrap_model=wrap, history=history, collective=collective)
    engine.rounds.reads.every = GPU_LOSS_READ_EVERY
    stepping = [0.0]
    step = engine.train_step

    def timed_step(batch):
        started = time.perf_counter()
        step(batch)
        stepping[0] += time.perf_counter() - started

    engine.train_step = timed_step
    per_round, per_step, all_in, measured_rounds, measured_steps, planned = [], [], [], 0, 0, 0
    for epoch in range(epochs):
        steps_before, stepping[0] = engine.counters.optimizer_steps, 0.0
        started = time.perf_counter()
        engine.train_epoch(epoch)
        total = time.perf_counter() - started
        steps = max(1, engine.counters.optimizer_steps - steps_before)
        if epoch:
            rounds = engine.rounds.epoch_rounds
            # A planned epoch (raysb.training.selection.rounds) has no rounds: its time outside the
            # steps is its decisions and exchanges as it starts.
            if rounds:
                per_round.append(1e6 * (total - stepping[0]) / rounds)
            per_step.append(1e6 * stepping[0] / steps)
            all_in.append(1e6 * total / steps)
            measured_rounds += rounds
            measured_steps += steps
            planned += not rounds
    return {"round_us": statistics.median(per_round) if per_round else float("nan"),
            "step_us": statistics.median(per_step), "all_in_step_us": statistics.median(all_in),
            "rounds_per_step": measured_rounds / max(1, measured_steps), "planned_epochs": planned}


def _rank_main(rank: int, world: int, port: int, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        measured = measure(*args, collective=TorchCollective())
        if rank == 0:
            results.put(measured)
            results.close()
            results.join_thread()  # the figures are with the parent before this rank exits
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # About one rank in 40 aborted ("terminate called without an active exception") after this
    # point, in the interpreter's own teardown with no Python frame left (faulthandler): a C++
    # thread still joinable as the process exits. Its work is done and reported; skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def measure_ranks(strategy: str, examples: int, batch_size: int, epochs: int, plan_epochs: bool,
                  world: int) -> dict[str, float]:
    """`measure` on `world` gloo ranks in as many processes; rank 0's figures."""
    context = mp.get_context("spawn")
    results = context.Queue()
    # A port free now, not one derived from this process: each call's ranks rendezvous afresh. Free on
    # every address, as the store listens on all of them (a port free on 127.0.0.1 alone may be
    # held on the node's IP, as Ray's agents hold theirs).
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    mp.start_processes(_rank_main, args=(world, port, (strategy, examples, batch_size, epochs, plan_epochs), results),
                       nprocs=world, start_method="spawn")
    return results.get(timeout=60)


def compare_host_overhead(strategies: list[str], workers: list[int], repeats: int, examples: int = EXAMPLES,
                          batch_size: int = BATCH_SIZE, epochs: int = 4) -> list[str]:
    """The table: per strategy and worker count, the median over `repeats` runs of host us per round and step;
    a strategy whose epochs are decided as they start (raysb.training.selection.rounds) again chunk by chunk."""
    lines = [
        f"Host time per round and per step ({examples} examples of 1x4x4, a linear model, b {batch_size}, selection "
        f"batch b, s = 0.33, CPU, {torch.get_num_threads()} threads in one process, 1 a rank; median of {repeats} "
        f"runs, each the median over epochs 2-{epochs}):",
        "",
        "| workers | strategy | rounds a step | host us a round | host us in a step | host us a step, all in |",
        "|---|---|---|---|---|---|",
    ]
    for world in workers:
        def run(strategy: str, plan_epochs: bool) -> dict[str, float]:
            if world <= 1:
                return measure(strategy, examples, batch_size, epochs, plan_epochs)
            return measure_ranks(strategy, examples, batch_size, epochs, plan_epochs, world)

        # A strategy whose epochs are decided as they start is measured chunk by chunk too.
        first = {strategy: run(strategy, True) for strategy in strategies}
        rows = [(strategy, plan) for strategy in strategies
                for plan in ((True, False) if first[strategy]["planned_epochs"] else (True,))]
        runs = {row: [first[row[0]]] if row[1] else [] for row in rows}
        # Round robin, not each row's repeats back to back: a machine whose speed drifts over
        # minutes (a shared one) then moves every row alike.
        for repeat in range(repeats):
            for row in rows:
                if len(runs[row]) < repeats:
                    runs[row].append(run(*row))
        for (strategy, plan_epochs), measured in runs.items():
            name = strategy if plan_epochs else f"{strategy}, chunk by chunk"
            lines.append(
                f"| {world or 'one process'} | {name} | {statistics.median(r['rounds_per_step'] for r in measured):.2f} | "
                f"{_us(statistics.median(r['round_us'] for r in measured))} | "
                f"{statistics.median(r['step_us'] for r in measured):.0f} | "
                f"{statistics.median(r['all_in_step_us'] for r in measured):.0f} |"
            )
            print(lines[-1], flush=True)
    return lines


def _us(value: float) -> str:
    return "-" if value != value else f"{value:.0f}"  # NaN: no rounds (planned epochs)
