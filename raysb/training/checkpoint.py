"""A run's checkpoint, taken at an epoch boundary: what continues it exactly, in one process or on N ranks.

The state every rank shares (model, optimizer, gradient scaler), each rank's own (BatchNorm
buffers, selection state, data and augmentation generators, counters, clock), rank 0's
selection trace, the epoch it follows and the metrics rows written by then. A single
process writes it to OUT/checkpoint.pt (`save_checkpoint_file`); a Ray Train run hands the
same state to Ray Train (raysb.distributed.checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from raysb.resume import CHECKPOINT_FILE
from raysb.training.engine import Engine
from raysb.training.outputs import save_atomically


@dataclass
class Restored:
    """Where a resumed run continues: after `epoch`, with the metrics rows written by then."""

    epoch: int
    metrics_rows: list[dict]


def run_state(engine: Engine, rank_states: list[dict], finished: int, metrics_rows: list[dict]) -> dict:
    """The checkpoint after epoch `finished`; `rank_states` holds every rank's `rank_state_dict()`, in rank order."""
    return {
        "engine": engine.shared_state_dict(),
        "rank_states": rank_states,
        "trace": engine.trace.state_dict() if engine.trace is not None else None,
        "epoch": finished,
        "metrics_rows": metrics_rows,
    }


def restore_run_state(engine: Engine, state: dict, rank: int, world_size: int) -> Restored:
    rank_states = state["rank_states"]
    if len(rank_states) != world_size:
        raise ValueError(
            f"the checkpoint was written by {len(rank_states)} workers; resume with --workers {len(rank_states)}"
        )
    engine.load_state_dict(state["engine"], rank_states[rank])
    # Rank 0 checkpointed the trace merged over all ranks; the others start theirs afresh.
    if engine.trace is not None and rank == 0:
        engine.trace.load_state_dict(state["trace"])
    return Restored(state["epoch"], state["metrics_rows"])


def save_checkpoint_file(
    engine: Engine, out: Path, finished: int, metrics_rows: list[dict], saved_config: dict
) -> None:
    """A single process's checkpoint, written whole and then renamed into place: a run killed
    at any moment leaves the previous checkpoint or this one, never half of one. It carries the
    config it was made with (`saved_config`, `RunSettings.saved`): config.yaml beside it can be
    edited or deleted (raysb.resume)."""
    state = run_state(engine, [engine.rank_state_dict()], finished, metrics_rows)
    save_atomically({**state, "config": saved_config}, out / CHECKPOINT_FILE)


def load_checkpoint_file(engine: Engine, out: Path) -> Restored:
    state = torch.load(out / CHECKPOINT_FILE, map_location=engine.device, weights_only=False)
    return restore_run_state(engine, state, 0, 1)
