"""What `--resume` may change: a run continues from its own config.yaml, with only the keys
that do not change what it trains given anew."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable

from raysb.config import ConfigError, TrainConfig, coerce_key, merge_overrides
from raysb.core.schedules import ACCELERATION
from raysb.core.settings import OptimizationSettings, RunSettings

SAVED_CONFIG = "config.yaml"
CHECKPOINT_FILE = "checkpoint.pt"

# The keys a resume may change: how long the run goes on, what it reports, and where and with
# what safety nets it runs. Every other key shapes what is trained (data, subset, model, strategy,
# selection, batch sizes, optimizer and schedule, seed, precision, device, compilation, ...): the
# checkpoint holds state made under it, so a changed value could only be refused deep in the
# restore (a tensor of the wrong size, a missing selector) or, worse, be accepted and silently
# break the promise that a resumed run goes on as the uninterrupted one would. A key added to
# its section (raysb.core.settings) is therefore fixed until it is named here.
RESUMABLE_KEYS = frozenset({
    # this invocation
    "out", "resume", "overwrite", "download",
    # how long it goes on (the lr schedule may follow: `schedule_note` says how)
    "epochs", "time_budget", "work_budget",
    # what it reports, and how often
    "eval_every", "eval_batch_size", "progress_seconds", "log_to", "verbose", "collapse_patience",
    # where it runs, how often it checkpoints, how it survives failures
    "address", "storage_path", "cpus_per_worker", "pipeline_cpus",
    "checkpoint_every", "max_failures", "placement_timeout", "placement_strategy", "chaos",
    # how the device runs the same steps (a CUDA graph or eager launches)
    "capture_training", "capture_selection",
})


def resumed_values(given: dict[str, Any], source: str) -> dict[str, Any]:
    """The values of a `--resume` invocation: the run's own config.yaml, with the keys the user
    gave (`given`: config file, --set and flags) on top, where a resume may change them.

    Only what was given is compared, so a flag left at its default never counts as a change.
    Without a run in --out, `given` is returned as it is (train() then says that there is
    nothing to resume)."""
    out = Path(given.get("out", TrainConfig.out))
    made = saved_config(out)
    if made is None:
        return given
    saved = made.to_dict()
    merged = merge_overrides(saved, given)
    # merge_overrides drops selectivity and beta when either is given: compare what is left.
    compared = {key: coerce_key(key, merged[key], source) for key in given if key in saved and key in merged}
    refuse_changes(out, saved, compared)
    return merged


def check_resume(run: RunSettings, optimization: OptimizationSettings, log: Callable[[str], None]) -> None:
    """Before a resumed run loads anything: refuse what it cannot honour, and say what a new
    --epochs or --time-budget does to the lr schedule."""
    out = Path(run.out)
    saved = saved_config(out)
    if saved is None:
        return
    refuse_changes(out, saved.to_dict(), dict(run.record))
    refuse_spent_budget(out, optimization)
    note = schedule_note(saved.settings().optimization, optimization)
    if note:
        log(note)


def refuse_spent_budget(out: Path, optimization: OptimizationSettings) -> None:
    """One line for a run its budget ended, resumed with that budget no larger: it has nothing left to
    train (a run that finished its epochs is refused the same way, until given more)."""
    summary = out / "summary.json"
    if not summary.is_file():
        return
    ended = json.loads(summary.read_text())
    for kind, unit in (("work", " epochs"), ("time", "s")):
        spent, given = ended.get("config", {}).get(f"{kind}_budget"), getattr(optimization, f"{kind}_budget")
        if ended.get("status") == f"{kind}_budget_reached" and given is not None and given <= spent:
            raise ConfigError(f"--resume: --out {out} has spent its {kind} budget of {spent:g}{unit}; "
                              f"give a larger --{kind}-budget to train on")


def saved_config(out: Path) -> TrainConfig | None:
    """What the run in `out` was made with (None: no run there). Its checkpoint carries the config
    its state was made under; config.yaml beside it may have been edited or deleted since. A
    config.yaml that differs from it where a resume cannot change anything is refused: resumed as
    the file says, a free-sb checkpoint once went on as uniform without a word."""
    header = checkpoint_header(out)
    written = out / SAVED_CONFIG
    saved = TrainConfig.load(written) if written.is_file() else None
    if header is None or header[1] is None:
        return saved
    made = TrainConfig.from_dict(header[1], source=str(out / "checkpoint.pt"))
    if saved is not None:
        refuse_edited(out, made.to_dict(), saved.to_dict())
    # config.yaml also holds what the last resume changed (--epochs, say) before its first checkpoint.
    return saved if saved is not None else made


def refuse_edited(out: Path, made: dict[str, Any], written: dict[str, Any]) -> None:
    """One line when the run's config.yaml (`written`) differs from the config its checkpoint was
    made with (`made`) where a resume cannot change anything."""
    edited = _changed(made, written)
    if edited:
        raise ConfigError(
            f"--resume: {out / SAVED_CONFIG} says {_listed(edited, written)}, but the checkpoint in {out} was made "
            f"with {_listed(edited, made)}; a resume continues a run as it was made: put config.yaml back (or "
            "delete it: the checkpoint carries its config), or give another --out for a new run"
        )


def refuse_changes(out: Path, saved: dict[str, Any], values: dict[str, Any]) -> None:
    """One line naming every key of `values` that differs from the saved run's where a resume cannot change it."""
    changed = _changed(saved, values)
    if not changed:
        return
    raise ConfigError(
        f"--resume: the run in {out} was made with {_listed(changed, saved)}, not {_listed(changed, values)}; "
        "a resume continues a run as it was made: "
        f"leave {'it' if len(changed) == 1 else 'them'} out to resume, or give another --out for a new run"
    )


def _changed(saved: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """The keys of `values` that differ from `saved` where a resume cannot change them."""
    return [
        key for key in values
        if key not in RESUMABLE_KEYS and _comparable(key, values[key]) != _comparable(key, saved[key])
    ]


def _listed(keys: list[str], values: dict[str, Any]) -> str:
    return ", ".join(f"{key}={_shown(values[key])}" for key in keys)


def schedule_note(saved: OptimizationSettings, resumed: OptimizationSettings) -> str | None:
    """What a changed epochs or time_budget does to the lr schedule (None when neither changed)."""
    changed = [key for key in ("epochs", "time_budget", "work_budget") if getattr(saved, key) != getattr(resumed, key)]
    if not changed:
        return None
    given = ", ".join(
        f"{key}={_shown(getattr(resumed, key))} (made with {_shown(getattr(saved, key))})" for key in changed
    )
    action, before = schedule_end(saved)
    _, after = schedule_end(resumed)
    schedule = f"the {resumed.lr_schedule} lr schedule, keyed to {_KEY_NAMES[resumed.lr_schedule_key]}"
    if after == before:
        note = f"{schedule}, is unchanged: it {action} {after}"
        if any(resumed.lr_schedule_key != key and getattr(resumed, f"{key}_budget") is not None
               for key in ("time", "work") if f"{key}_budget" in changed):
            note += "; a budget that stops the run sooner stops it before the lr has decayed"
    else:
        note = f"{schedule}, now {action} {after} instead of {before}"
    return f"raysb: resuming with {given}: {note}"


def schedule_end(optimization: OptimizationSettings) -> tuple[str, str]:
    """(what the schedule does, where it does it), in the units of its key (raysb.core.schedules)."""
    epochs = optimization.schedule_epochs
    if optimization.lr_schedule == "static":
        return "stays at", f"lr {optimization.lr:g}"
    if optimization.lr_schedule in ("cosine", "linear"):
        return "decays to 0", _at(optimization, [epochs])
    scale = ACCELERATION if optimization.lr_schedule == "accelerated" else 1.0
    milestones = [m * scale for m in optimization.lr_milestones]
    return f"decays by {optimization.lr_factor:g}", _at(optimization, milestones)


_KEY_NAMES = {"epoch": "epochs", "backprop": "backpropagated examples", "time": "the time budget",
              "work": "the work budget"}


def _at(optimization: OptimizationSettings, points: list[float]) -> str:
    """Points of an epoch-unit schedule as a place in its key's units."""
    key, epochs = optimization.lr_schedule_key, optimization.schedule_epochs
    listed = ", ".join(f"{p:g}" for p in points)
    at_epochs = f"at epoch{'s' if len(points) > 1 else ''} {listed}"
    if key == "epoch":
        return at_epochs
    if key == "backprop":
        return f"at {listed} epochs' worth of backpropagated examples"
    # Budget-keyed progress is epochs x spent / budget: epoch-unit point p falls at p / epochs of the budget.
    if key == "work":
        at_budget = "at " + ", ".join(f"{p * optimization.work_budget / epochs:g}" for p in points) + " epochs of work"
    else:
        at_budget = "at " + ", ".join(f"{p * optimization.time_budget / epochs:g}s" for p in points) + " of training"
    # Epochs given beside the budget end the run too: the schedule goes by whichever comes first.
    return at_budget if optimization.epochs is None else f"{at_budget} or {at_epochs}, whichever comes first"


def _comparable(key: str, value: Any) -> Any:
    # --workers 0 (Ray Train in this process) and 1 both train as one rank.
    if key == "workers" and value is not None:
        return max(value, 1)
    return value


def _shown(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def checkpoint_header(out: Path) -> tuple[int, dict | None] | None:
    """The epoch of the checkpoint in `out` and the config it was made with (None for a checkpoint
    from before checkpoints carried it); None when there is no checkpoint. Read without loading its
    tensors (memory-mapped), so a resume is checked before any data loads. A file torch cannot read
    as a raysb checkpoint (truncated, overwritten) is one line, and is left where it is."""
    path = out / CHECKPOINT_FILE
    if not path.exists():
        return None
    import torch  # here, not at the top: `import raysb.config` and every `raysb` command load no torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError):
        state = None  # torch's words (a zip archive's central directory, mmap) do not say what to do
    if not isinstance(state, dict) or "epoch" not in state:
        raise ConfigError(
            f"--resume: {path} cannot be read as a checkpoint: it is cut short, damaged or not a raysb checkpoint; "
            "put back a copy of it, or start the run again with --overwrite"
        )
    return state["epoch"], state.get("config")
