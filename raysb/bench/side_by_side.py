"""Runs trained one after another in one process, a markdown table row each, epoch times as ratios to the first."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from raysb.analysis.cost_model import cost_model_ratio
from raysb.api import train
from raysb.config import TrainConfig, parse_overrides


def run_side_by_side(header: list[str], runs) -> list[str]:
    """Train each (config, cells) of `runs` one after another, a markdown table row each.

    `cells(summary, seconds_per_epoch, ratio_to_first)` gives the row's cells; the
    ratio compares each run's epoch time with the first run's.
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    first = None
    for config, cells in runs:
        # A benchmark's runs are its own: running it again replaces them.
        summary = train(dataclasses.replace(config, overwrite=True)).summary
        per_epoch = summary["training_wall_s"] / summary["epochs_completed"]
        first = first or per_epoch
        lines.append("| " + " | ".join(str(c) for c in cells(summary, per_epoch, per_epoch / first)) + " |")
    return lines


def compare_workers(base: dict, worker_counts: list[int], data_modes: list[str], out: Path) -> list[str]:
    """The same run on 1..N Ray Train workers (per-worker batch b) and each data mode, one after another."""
    header = ["data", "workers", "final test error", "training wall s", "s/epoch", "epoch ratio vs first",
              "data s", "optimizer steps", "per-rank steps", "kept", "lockstep exchange ms/step",
              "exchange KB/step", "CDF merge ms/step", "of which CDF bins KB/step", "exchange + merge share of training"]

    def runs():
        for mode in data_modes:
            for workers in worker_counts:
                config = TrainConfig.from_dict(
                    {**base, "workers": workers, "data_mode": mode, "out": str(out / f"{mode}-workers-{workers}")}
                )
                yield config, lambda s, per_epoch, ratio, mode=mode, workers=workers: [
                    mode, workers, f"{s['final_test_error']:.2%}", f"{s['training_wall_s']:.1f}",
                    f"{per_epoch:.1f}", f"{ratio:.2f}", f"{s['time_breakdown_s']['data']:.1f}",
                    s["optimizer_steps"], s["per_rank_optimizer_steps"], f"{s['kept_fraction']:.1%}",
                    _shared(s.get("lockstep_exchange_ms_per_step")), _shared(s.get("lockstep_exchange_kb_per_step")),
                    _shared(s.get("histogram_merge_ms_per_step")), _shared(s.get("histogram_kb_per_step")),
                    _ray_layer_share(s),
                ]

    return run_side_by_side(header, runs())


def _ray_layer_share(summary: dict) -> str:
    """What crossing ranks cost (the exchange and the CDF_R's merge) as a share of training time."""
    if "lockstep_exchange_seconds" not in summary:
        return "-"
    shared = summary["lockstep_exchange_seconds"] + summary.get("histogram_merge_seconds", 0.0)
    return f"{shared / summary['training_wall_s']:.1%}"


def _shared(value: float | None) -> str:
    """A figure of what ranks share; one worker shares nothing (raysb.distributed.worker)."""
    return "-" if value is None else f"{value:.2f}"


def compare_pipeline_variants(base: dict, specs: list[str], out: Path) -> list[str]:
    """The same run with selection inline and pipelined (MODE[:DEPTH[:SYNC_EVERY]]), one after another."""
    header = ["selection", "depth", "sync every", "final test error", "training wall s", "s/epoch",
              "epoch ratio vs first", "selection s (incl. waiting)", "train fwd s", "backward s",
              "staleness steps (mean / max)", "kept"]
    defaults = TrainConfig()

    def runs():
        for spec in specs:
            mode, *numbers = spec.split(":")
            depth = int(numbers[0]) if numbers else defaults.pipeline_depth
            sync_every = int(numbers[1]) if len(numbers) > 1 else defaults.pipeline_sync_every
            config = TrainConfig.from_dict(
                {**base, "pipeline_selection": mode, "pipeline_depth": depth, "pipeline_sync_every": sync_every,
                 "out": str(out / spec.replace(":", "-"))}
            )
            pipelined = mode != "inline"

            def cells(s, per_epoch, ratio, mode=mode, depth=depth, sync_every=sync_every, pipelined=pipelined):
                split = s["time_breakdown_s"]
                staleness = (
                    f"{s['pipeline_mean_staleness_steps']:.2f} / {s['pipeline_max_staleness_steps']}"
                    if pipelined else "0 / 0"
                )
                return [
                    mode, depth if pipelined else "–", sync_every if pipelined else "–",
                    f"{s['final_test_error']:.2%}", f"{s['training_wall_s']:.1f}", f"{per_epoch:.2f}",
                    f"{ratio:.2f}", f"{split['selection']:.1f}", f"{split['train_forward']:.1f}",
                    f"{split['backward']:.1f}", staleness, f"{s['kept_fraction']:.1%}",
                ]

            yield config, cells

    return run_side_by_side(header, runs())


def compare_config_variants(base: dict, variants: list[str], out: Path) -> list[str]:
    """The same run under each comma-separated set of KEY=VALUE overrides, one after another."""
    header = ["variant", "final test error", "training wall s", "s/epoch", "epoch ratio vs first",
              "F_sel us/example", "selection rounds", "bookkeeping ms/round", "bookkeeping share", "kept"]

    def runs():
        for spec in variants:
            overrides = parse_overrides([item for item in spec.split(",") if item])
            name = spec or "base"
            config = TrainConfig.from_dict(
                {**base, **overrides, "out": str(out / name.replace("=", "-").replace(",", "_"))}
            )

            def cells(s, per_epoch, ratio, name=name, config=config):
                split = s["time_breakdown_s"]
                rounds = s["examples_considered"] / config.selection_spec().selection_batch_size
                scored = s["selection_forward_examples"]
                return [
                    name, f"{s['final_test_error']:.2%}", f"{s['training_wall_s']:.1f}", f"{per_epoch:.2f}",
                    f"{ratio:.2f}", f"{split['selection'] / scored * 1e6 if scored else 0:.0f}", f"{rounds:.0f}",
                    f"{split['bookkeeping'] / rounds * 1e3:.2f}",
                    f"{split['bookkeeping'] / s['training_wall_s']:.1%}", f"{s['kept_fraction']:.1%}",
                ]

            yield config, cells

    return run_side_by_side(header, runs())


def compare_strategies(base: dict, strategies: list[str], costs: dict[str, float], out: Path) -> list[str]:
    """Each strategy trained one after another: epoch time vs Traditional's and the cost-model bound."""
    header = ["strategy", "final test error", "training wall s", "s/epoch", "epoch ratio vs traditional",
              "cost-model bound", "selection s", "train fwd s", "backward s", "data s", "bookkeeping s",
              "bookkeeping share", "other s", "kept", "backprop examples"]

    def runs():
        for strategy in strategies:
            config = TrainConfig.from_dict({**base, "strategy": strategy, "out": str(out / strategy)})

            def cells(summary, per_epoch, ratio, config=config):
                epochs = summary["epochs_completed"]
                primed = min(config.prime_epochs, epochs) / epochs
                bound = cost_model_ratio(config.strategy, costs, config.selectivity, config.staleness, primed)
                split = summary["time_breakdown_s"]
                return [
                    config.strategy, f"{summary['final_test_error']:.2%}", f"{summary['training_wall_s']:.1f}",
                    f"{per_epoch:.1f}", f"{ratio:.2f}", f"{bound:.2f}", f"{split['selection']:.1f}",
                    f"{split['train_forward']:.1f}", f"{split['backward']:.1f}", f"{split['data']:.1f}",
                    f"{split['bookkeeping']:.2f}", f"{split['bookkeeping'] / summary['training_wall_s']:.1%}",
                    f"{split['other']:.1f}", f"{summary['kept_fraction']:.1%}", summary["backprop_examples"],
                ]

            yield config, cells

    return run_side_by_side(header, runs())
