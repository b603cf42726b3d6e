"""A distributed run's checkpoint: rank 0 writes the state every rank shares and each rank's own.

The state is raysb.training.checkpoint's, taken at an epoch boundary; every rank reports
it to Ray Train in the same call, so Ray Train commits it for the whole worker group, and
a restarted group restores each rank from its own part.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import ray.train
import torch

from raysb.core.settings import RunSettings
from raysb.distributed.chaos import ChaosRunner
from raysb.resume import refuse_edited
from raysb.training.checkpoint import Restored, restore_run_state, run_state
from raysb.training.collective import Collective
from raysb.training.engine import Engine

# Inside Ray Train's checkpoint folder.
CHECKPOINT_FILE = "raysb_state.pt"


def save_checkpoint(
    engine: Engine, collective: Collective, finished: int, row: dict | None, metrics_rows: list[dict],
    chaos: ChaosRunner, run: RunSettings,
) -> None:
    """Report epoch `finished` with a checkpoint of it (a collective: every rank calls it), carrying
    the config it was made with (`run.saved`), as a single process's does."""
    if engine.trace is not None:
        engine.trace.merge_ranks()
    rank_states = collective.gather_object(engine.rank_state_dict())
    report = {"epoch": finished, **(row or {})}
    if collective.rank != 0:
        chaos.while_checkpointing(finished)
        ray.train.report(report)
        return
    with tempfile.TemporaryDirectory() as folder:
        state = {**run_state(engine, rank_states, finished, metrics_rows), "config": run.saved}
        torch.save(state, Path(folder) / CHECKPOINT_FILE)
        chaos.while_checkpointing(finished)
        ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(folder))


def restore_checkpoint(
    engine: Engine, collective: Collective, device: torch.device, run: RunSettings
) -> Restored | None:
    """Load Ray Train's latest checkpoint into this rank's engine; None when the run starts fresh.
    A config (`run.record`: the run's config.yaml, on a resume) that differs from the one the checkpoint was
    made with, where a resume cannot change anything, is refused (raysb.resume)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location=device, weights_only=False)
    if state.get("config") is not None:  # checkpoints from before they carried it have none
        refuse_edited(Path(run.out), state["config"], dict(run.record))
    return restore_run_state(engine, state, collective.rank, collective.world_size)
