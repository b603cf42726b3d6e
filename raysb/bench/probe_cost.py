"""What the analysis probes cost a run (issue 59), measured on this machine:

    python -m raysb.bench.probe_cost --strategies free-sb sb --out runs/probe-cost

A run trained with `--record-analysis` probes at every evaluated epoch (raysb.training.loop.record_probes:
the CDF_R snapshot, and gradient similarity on 4 fixed training batches, each a forward and three
backwards). Timed whole, a run's `probes_s` and training time move with the machine's load, which on
a shared machine comes and goes within a run; here one evaluated epoch's probes and a training step
are timed in turn instead (the median of `--repeats` each, after two to warm up), so a load weighs on
both alike. The probes are given as a share of a selecting epoch of the full training set: its kept
examples plus its scored ones at the scoring forward's measured cost (raysb.training.scoring_cost),
in training steps of b examples.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from raysb.bench.reports import write_report
from raysb.config import TrainConfig, parse_overrides
from raysb.core.strategy_table import strategy_card
from raysb.data.prepare import prepare_data
from raysb.training.builders import resolve_device
from raysb.training.collective import bare_module
from raysb.training.engine import Engine
from raysb.training.loop import record_probes
from raysb.training.run_engine import ready_engine
from raysb.training.scoring_cost import measure_scoring_cost
from raysb.training.timing import device_synchronizer

# Steps trained before measuring: the losses the probes rank against (free-sb's first scores too).
WARM_STEPS = 20


def measure(strategy: str, overrides: dict, repeats: int) -> dict:
    """One strategy's probes against its training step, and the selecting epoch they are a share of."""
    config = TrainConfig.from_dict({**overrides, "strategy": strategy, "record_analysis": True})
    settings = config.settings()
    device = resolve_device(config.device)
    train_data, _, _ = prepare_data(settings.data, config.batch_size)
    engine = ready_engine(settings, train_data, device)  # as a run sets it up (rho-loss's losses)
    _warm_up(engine)
    seconds = _timed_in_turn({"probes": lambda: record_probes(engine, 0), "step": _training_step(engine)},
                             repeats, device)
    card = strategy_card(strategy)
    scored = card.scored_share(config.staleness or 1)
    scoring_cost = measure_scoring_cost(engine) if scored > 0 else 0.0
    epoch_steps = len(train_data) * (card.kept_share(config.selectivity) + scoring_cost * scored) / config.batch_size
    return {"strategy": strategy, "probes_s": seconds["probes"], "step_s": seconds["step"],
            "batch_size": config.batch_size, "examples": len(train_data), "epoch_steps": epoch_steps,
            "share": seconds["probes"] / (epoch_steps * seconds["step"])}


def _warm_up(engine: Engine) -> None:
    """A few steps of each epoch until the probes have losses to rank against: free-sb ranks against
    the scores recorded when an epoch began, which its first epoch has none of."""
    for epoch in range(3):
        selector = engine.strategy.selector
        if selector is not None and len(selector.history) > 0:
            return
        engine.train_epoch(epoch, should_stop=lambda epoch, done: done >= WARM_STEPS)
    raise SystemExit(f"raysb.bench.probe_cost: {engine.strategy.name} keeps no losses for the probes to rank against")


def _training_step(engine: Engine):
    """A training step of b real examples (forward, backward, SGD update) on a copy of the run's model."""
    model = copy.deepcopy(bare_module(engine.model)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    raw = engine.shard.raw(torch.arange(engine.batch_size))
    inputs, labels = engine.feed.transform(raw.images, None, train=False), raw.labels

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    return step


def _timed_in_turn(calls: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """The median seconds of each call, the calls taking turns, the first two rounds warming up."""
    sync = device_synchronizer(device)
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(2 + repeats):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            call()
            sync()
            if repeat >= 2:
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def report(rows: list[dict], command: str) -> list[str]:
    lines = [
        f"`{command}`",
        "",
        "| strategy | probes per evaluated epoch | training step (b examples) | a selecting epoch "
        "| probes' share of it |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['strategy']} | {row['probes_s']:.3f} s | {row['step_s']:.4f} s (b = {row['batch_size']}) "
            f"| {row['epoch_steps']:,.0f} steps' worth of {row['examples']:,} examples "
            f"({row['epoch_steps'] * row['step_s']:.1f} s) | {row['share']:.1%} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysb.bench.probe_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["free-sb", "sb"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a train config key (default: full Fashion-MNIST, the small CNN)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="runs/probe-cost")
    args = parser.parse_args(argv)
    overrides = {"out": args.out, **parse_overrides(args.set)}
    rows = [measure(strategy, overrides, args.repeats) for strategy in args.strategies]
    command = "python -m raysb.bench.probe_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    return write_report(Path(args.out), report(rows, command.strip()))


if __name__ == "__main__":
    raise SystemExit(main())
