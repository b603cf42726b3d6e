"""The epoch loop and what it leaves behind, shared by a single process and every Ray Train rank."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from raysb.config import write_config
from raysb.core.errors import NonFiniteLossError
from raysb.core.settings import RunSettings
from raysb.data import ImageDataset
from raysb.training.collapse import CollapseGuard
from raysb.training.collective import Collective, bare_module
from raysb.training.engine import Engine
from raysb.training.interrupt import raise_if_received
from raysb.training.label_suspects import label_share, margin_table, write_suspects
from raysb.training.metric_sinks import MetricSinks
from raysb.training.outputs import MetricsWriter, versions, write_json
from raysb.training.progress import EpochProgress, closing_line, epoch_line
from raysb.training.run_callback import RunCallback
from raysb.training.saved_model import save_best_model
from raysb.training.scoring_cost import measure_scoring_cost
from raysb.training.selection.counts import counter_values, kept_fraction, metrics_row
from raysb.training.trace import PROBE_BATCHES


@dataclass
class RunResult:
    out_dir: Path
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def final_test_error(self) -> float:
        return self.summary["final_test_error"]


# Counts that are the same step on every rank in lockstep: taken once, not summed.
LOCKSTEP_COUNTS = ("optimizer_steps", "epoch_steps")
# The statuses of a run a budget ended; "budget_reached" is what runs made before the two were told apart say.
BUDGET_STATUSES = ("work_budget_reached", "time_budget_reached", "budget_reached")


def run_epochs(
    engine: Engine,
    run: RunSettings,
    test_data: ImageDataset,
    flipped_ids: torch.Tensor,
    metrics: MetricsWriter,
    log: Callable[[str], None],
    callback: RunCallback | None = None,
) -> RunResult:
    """The epoch loop and its outputs, shared by a single process and every Ray Train rank.

    `callback` is this rank's part (raysb.training.run_callback). The collectives every rank must
    call at the same points, the totals over ranks and the writer's stop verdict, run here, on the
    engine's collective (a world of one in a single process), whatever the callback does."""
    callback = callback or RunCallback()
    collective = engine.rounds.collective
    out = Path(run.out)
    if callback.writes_outputs:
        out.mkdir(parents=True, exist_ok=True)
        write_config(run.saved, out / "config.yaml")
        # Only where the strategy reads it: Traditional keeps everything, InfoBatch its prune ratio decides.
        selectivity = f"selectivity {run.selectivity:.3f}, " if run.selectivity is not None else ""
        log(
            f"raysb: {run.strategy} on {run.dataset} ({engine.shard.num_examples} train / {len(test_data)} test), "
            f"model {run.model}, {selectivity}device {engine.device} ({engine.step.precision}), out {out}"
        )
    summary: dict[str, Any] = {
        "status": "running",
        "config": dict(run.record),
        "versions": versions(),
        "device": str(engine.device),
        "precision": engine.step.precision,
        "train_examples": engine.shard.num_examples,
        "test_examples": len(test_data),
        "label_noise_flipped_ids": flipped_ids.tolist(),
    }
    if run.work_budget is not None and engine.scoring_cost is None:  # a resumed run keeps its own
        engine.scoring_cost = _scoring_cost(run, engine)
    # The training clock starts here: loading data, building the model and joining the worker group
    # are start-up, not training.
    startup = time.time() - callback.started_at if callback.started_at is not None else 0.0
    engine.start_training_clock(startup, restored=callback.start_epoch > 0)
    budget_hit = False
    collapse = CollapseGuard(engine.shard.num_classes, run.collapse_patience)
    for done in metrics.rows:  # a resumed run continues the count
        collapse.update(done["epoch"], done["test_error"])
    diverged = None
    progress = EpochProgress(
        log if callback.writes_outputs else (lambda line: None),
        run.epochs,
        summary["train_examples"],
        collective.world_size,
        run.progress_seconds,
    )
    should_stop = _stop_check(engine, run, callback, progress)
    sinks = MetricSinks(list(run.log_to) if callback.writes_outputs else [], run.record, out, callback.start_epoch)
    notify = log if callback.writes_outputs else (lambda line: None)
    for line in engine.take_notices():
        notify(line)
    try:
        for epoch in _epochs(run, callback.start_epoch):
            budget_hit = engine.train_epoch(epoch, should_stop=should_stop)
            if _has_budget(run):
                # A budget the epoch's last step spent ends the run with it, not after an epoch with no step.
                budget_hit = engine.agreed_epoch_end(_budget_spent(run, engine)) or budget_hit
            for line in engine.take_notices():
                notify(line)
            totals = totals_over_ranks(collective, engine.progress_counts())
            # A budget the epoch's first rounds spent before its first step (an SB run's scoring forwards)
            # ends the run after the last epoch that trained: this one's row would be that one's again.
            stepless = budget_hit and not totals["epoch_steps"]
            last = budget_hit or epoch + 1 == run.epochs
            row = None
            if callback.writes_outputs and not stepless and ((epoch + 1) % run.eval_every == 0 or last):
                row = epoch_row(engine, epoch, test_data, run.eval_batch_size, totals)
                record_probes(engine, epoch)
                metrics.append(row)
                sinks.write(row)
                if row["test_error"] <= min(r["test_error"] for r in metrics.rows):
                    with engine.timer.phase("checkpointing"):
                        save_best_model(bare_module(engine.model), engine.shard, run.record, out)
                log(epoch_line(row, run.epochs))
                diverged = collapse.update(epoch + 1, row["test_error"])
            # Only the writer evaluated: its verdict stops every rank in the same epoch.
            diverged = collective.broadcast_object(diverged)
            callback.after_epoch(epoch, row, budget_hit or diverged is not None)
            if diverged is not None:
                if callback.writes_outputs:
                    log(f"raysb: stopping in epoch {epoch + 1}: {diverged}")
                break
            if budget_hit:
                if callback.writes_outputs:
                    log(f"{_budget_reached(run, engine)} as epoch {epoch + 1} began, before its first step; stopping"
                        + (f" after epoch {epoch}" if epoch else "") if stepless else
                        f"{_budget_reached(run, engine)} in epoch {epoch + 1}; stopping")
                    if not totals["optimizer_steps"]:
                        log(f"raysb: warning: the {_budget_reached(run, engine).removesuffix(' reached')} ended the "
                            "run before its first optimizer step: nothing was trained, and no model was written")
                break
            if epoch + 1 == run.epochs and _has_budget(run) and callback.writes_outputs:
                log(_epochs_first(run, engine))
    except NonFiniteLossError as error:
        summary.update(status="failed", error=str(error))
        # No collective here: other ranks may be anywhere; report this rank's counts.
        _finish_summary(summary, engine, metrics, engine.progress_counts())
        if callback.writes_outputs:
            write_json(out / "summary.json", summary)
        raise
    finally:
        sinks.close()
        if engine.pipeline is not None:
            engine.pipeline.close()
    if diverged is not None:
        summary.update(status="diverged", error=diverged)
    else:
        summary["status"] = _ending(run, engine, budget_hit)
    if callback.writes_outputs and metrics.rows:
        note = _schedule_left_note(run, metrics.rows[-1]["lr"], totals["backprop_examples"] / summary["train_examples"])
        if note:
            log(note)
    write_analysis(engine, out, callback.writes_outputs)
    if callback.writes_outputs:
        summary.update(write_suspects(engine.strategy, out, flipped_ids))
    _finish_summary(summary, engine, metrics, totals_over_ranks(collective, engine.progress_counts()))
    summary.update(callback.summary_extras())
    summary.update(engine.step.capture_stats())
    summary.update(engine.feed.scorer.stats())
    if engine.keep_rule_graph is not None:
        summary.update(engine.keep_rule_graph.stats())
    if engine.rounds.round_graph is not None:
        summary.update(engine.rounds.round_graph.stats())
    if run.compiles or engine.step.compiled or engine.feed.scorer.compiled:
        from torch._dynamo.utils import counters

        # Graphs dynamo compiled in this process: more than one per compiled forward means recompiles.
        summary["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
    if engine.pipeline is not None:
        summary.update(engine.pipeline.stats())
    if callback.writes_outputs:
        write_json(out / "summary.json", summary)
        log(closing_line(summary, out))
    return RunResult(out, metrics.rows, summary)


def epoch_row(
    engine: Engine, epoch: int, test_data: ImageDataset, eval_batch_size: int, totals: dict
) -> dict:
    """One metrics row; counts are `totals` (summed over ranks), times are this rank's."""
    wall = engine.timer.training_seconds()
    split = engine.timer.breakdown()
    test_error, test_loss = engine.evaluation.evaluate(test_data, eval_batch_size)
    row = {
        "epoch": epoch + 1,
        "wall_s": wall,
        "test_error": test_error,
        "test_loss": test_loss,
        **metrics_row(totals, split, lr=engine.schedule.lr()),
    }
    table = margin_table(engine.strategy)
    if table is not None:
        row["suspected_label_share"] = label_share(table)
    row.update(engine.strategy.label_doubt_row())
    return row


def record_probes(engine: Engine, epoch: int) -> None:
    """The CDF_R snapshot and gradient probes for `raysb report`, timed as probes, not training."""
    trace, selector = engine.trace, engine.strategy.selector
    if trace is None or selector is None or len(selector.history) == 0:
        return
    with engine.timer.phase("probes"):
        history = selector.history.values()
        trace.snapshot_cdf(epoch + 1, history)
        if engine.shard.carries_examples:
            return  # a streamed shard has no fixed examples to probe every epoch
        probed = min(engine.shard.num_examples, PROBE_BATCHES * engine.batch_size)
        raw = engine.shard.raw(torch.arange(probed))
        inputs = engine.feed.transform(raw.images, None, train=False)
        trace.probe_gradients(
            epoch + 1,
            engine.feed.scoring_model,
            inputs,
            raw.labels,
            history,
            selector.beta,
            selector.keep_floor,
            engine.batch_size,
        )


def write_analysis(engine: Engine, out: Path, writes_outputs: bool) -> None:
    """The trace's tables and the final model for `raysb report`, timed as probes. A collective where
    there is a trace: every rank's counts are merged."""
    if engine.trace is None:
        return
    with engine.timer.phase("probes"):
        engine.trace.merge_ranks()
        if writes_outputs:
            engine.trace.write(out)
            torch.save(engine.feed.scoring_model.state_dict(), out / "model.pt")


def totals_over_ranks(collective: Collective, counts: dict[str, float]) -> dict[str, float]:
    """The run's counts over all ranks: examples summed, lockstep step counts taken once, the loss
    averaged. A collective: every rank calls it at the same points."""
    keys = sorted(counts)
    gathered = collective.all_gather(torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64))
    stacked = torch.stack(gathered)
    combined = {k: float(stacked[:, i].sum()) for i, k in enumerate(keys)}
    for key in LOCKSTEP_COUNTS:
        combined[key] = float(stacked[:, keys.index(key)].max())
    combined["epoch_loss_sum"] = float(stacked[:, keys.index("epoch_loss_sum")].mean())
    return combined


def _stop_check(
    engine: Engine, run: RunSettings, callback: RunCallback, progress: EpochProgress
) -> Callable[[int, int], bool]:
    """Asked before each round's exchange: the rank's callback hears of the round, progress is
    shown, then the time and work budgets are checked."""

    def should_stop(epoch: int, round_index: int) -> bool:
        raise_if_received()
        callback.before_round(epoch, round_index)
        progress.update(epoch, engine.progress_counts)
        return _budget_spent(run, engine)

    return should_stop


def _budget_spent(run: RunSettings, engine: Engine) -> bool:
    """Whether the run's time or work budget is spent, by this rank's clock and counts."""
    # The host's clock: on a GPU, waiting for the device every round would cost more than the
    # queued work it leaves uncounted (the epoch's end reads the exact time).
    return ((run.time_budget is not None and engine.timer.host_training_seconds() >= run.time_budget)
            or (run.work_budget is not None and engine.work_done() >= run.work_budget))


def _scoring_cost(run: RunSettings, engine: Engine) -> float:
    """The weight of a scored example in this run's work: the configured one, else measured where
    the strategy runs scoring forwards, else 0 (nothing scored)."""
    if run.scoring_cost is not None:
        return run.scoring_cost
    return measure_scoring_cost(engine) if run.runs_scoring_forwards else 0.0


def _epochs(run: RunSettings, start: int) -> Iterable[int]:
    """The epochs to train from `start`: up to the run's epochs, or where a budget alone ends the
    run, until it does."""
    return itertools.count(start) if run.epochs is None else range(start, run.epochs)


def _has_budget(run: RunSettings) -> bool:
    return run.time_budget is not None or run.work_budget is not None


def _spent_budget(run: RunSettings, engine: Engine) -> str:
    """Which budget stopped the run: "work" where its work is done, else "time"."""
    return "work" if run.work_budget is not None and engine.work_done() >= run.work_budget else "time"


def _budget_reached(run: RunSettings, engine: Engine) -> str:
    if _spent_budget(run, engine) == "work":
        return f"work budget of {run.work_budget:g} epochs reached"
    return f"time budget of {run.time_budget:g}s reached"


def _schedule_left_note(run: RunSettings, lr: float, backpropagated_epochs: float) -> str | None:
    """The line of a run whose schedule, keyed to backpropagated examples, ended above its end."""
    if run.record["lr_schedule_key"] != "backprop" or lr <= 0 or run.epochs is None:
        return None
    return (f"raysb: note: lr_schedule_key backprop keys the schedule to backpropagated examples, as the authors' "
            f"code does: this run backpropagated {backpropagated_epochs:.2f} epochs' worth of its schedule's "
            f"{run.epochs} and ended at lr {lr:.3g}, above the schedule's end; lr_schedule_key epoch ends it with "
            "the run")


def _epochs_first(run: RunSettings, engine: Engine) -> str:
    """The line of a run whose given epochs ended it before its budget did."""
    if run.work_budget is not None:
        budget = f"its work budget of {run.work_budget:g} epochs ({engine.work_done():.3g} done)"
    else:
        budget = f"its time budget of {run.time_budget:g}s ({engine.timer.training_seconds():.1f}s of training done)"
    return f"raysb: epochs={run.epochs} ended the run before {budget}; the lr schedule ended with them"


def _ending(run: RunSettings, engine: Engine, budget_hit: bool) -> str:
    """The summary's status of a run that trained to its end: which limit ended it. A run without a
    budget is "completed", as it always was."""
    if budget_hit:
        return f"{_spent_budget(run, engine)}_budget_reached"
    return "epochs_reached" if _has_budget(run) else "completed"


def _finish_summary(summary: dict, engine: Engine, metrics: MetricsWriter, totals: dict) -> None:
    rows = metrics.rows
    counters = counter_values(totals)
    wall = engine.timer.wall_split()
    summary.update(
        final_test_error=rows[-1]["test_error"] if rows else None,
        best_test_error=min(r["test_error"] for r in rows) if rows else None,
        epochs_completed=rows[-1]["epoch"] if rows else 0,
        # The run's wall time and its parts, which add up to it.
        wall_s=sum(wall.values()),
        startup_s=wall["startup"],
        training_wall_s=wall["training"],
        evaluation_s=wall["evaluation"],
        probes_s=wall["probes"],
        checkpointing_s=wall["checkpointing"],
        time_breakdown_s=engine.timer.breakdown(),
        kept_fraction=kept_fraction(counters["examples_kept"], counters["examples_considered"]),
        # Work (raysb.core.work) where the run knows what a scored example costs.
        work_epochs=engine.work_done() if engine.scoring_cost is not None else None,
        scoring_cost=engine.scoring_cost,
        unused_kept_examples=engine.rounds.queued(),
        finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **counters,
    )
