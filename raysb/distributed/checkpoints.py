"""A distributed run's checkpoint: rank 0 writes the state every rank shares and each rank's own.

A checkpoint is taken at an epoch boundary (raysb.training.engine: shared and per-rank
state) and every rank reports it to Ray Train in the same call, so Ray Train commits it
for the whole worker group; a restarted group restores each rank from its own part.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import ray.train
import torch

from raysb.distributed.drills import DrillRunner
from raysb.training.collective import Collective
from raysb.training.engine import Engine

CHECKPOINT_FILE = "raysb_state.pt"


@dataclass
class Restored:
    """Where a resumed worker group continues: after `epoch`, with the metrics rows written by then."""

    epoch: int
    metrics_rows: list[dict]


def save_checkpoint(
    engine: Engine, collective: Collective, finished: int, row: dict | None, metrics_rows: list[dict],
    drills: DrillRunner,
) -> None:
    """Report epoch `finished` with a checkpoint of it (a collective: every rank calls it)."""
    if engine.trace is not None:
        engine.trace.merge_ranks()
    rank_states = collective.gather_object(engine.rank_state_dict())
    report = {"epoch": finished, **(row or {})}
    if collective.rank != 0:
        drills.while_checkpointing(finished)
        ray.train.report(report)
        return
    with tempfile.TemporaryDirectory() as folder:
        state = {
            "engine": engine.shared_state_dict(),
            "rank_states": rank_states,
            "trace": engine.trace.state_dict() if engine.trace is not None else None,
            "epoch": finished,
            "metrics_rows": metrics_rows,
        }
        torch.save(state, Path(folder) / CHECKPOINT_FILE)
        drills.while_checkpointing(finished)
        ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(folder))


def restore_checkpoint(engine: Engine, collective: Collective, device: torch.device) -> Restored | None:
    """Load Ray Train's latest checkpoint into this rank's engine; None when the run starts fresh."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location=device, weights_only=False)
    rank_states = state["rank_states"]
    if len(rank_states) != collective.world_size:
        raise ValueError(
            f"the checkpoint was written by {len(rank_states)} workers; resume with --workers {len(rank_states)}"
        )
    engine.load_state_dict(state["engine"], rank_states[collective.rank])
    # Rank 0 checkpointed the trace merged over all ranks; the others start theirs afresh.
    if engine.trace is not None and collective.rank == 0:
        engine.trace.load_state_dict(state["trace"])
    return Restored(state["epoch"], state["metrics_rows"])
