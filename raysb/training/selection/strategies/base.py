"""What a strategy is: it sees the epoch one selection chunk at a time and returns the
examples to queue for training, or, where nothing needs a forward of its own, decides the whole
epoch as it starts (`EpochPlan`).

It reaches data and the model only through `ChunkContext`, so it does not care whether
it runs in one process or on a Ray Train rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from raysb.core.batch_former import Batch
from raysb.core.keep_rule import Selector
from raysb.core.selectivity import beta_from_selectivity
from raysb.core.spec import SelectionSpec
from raysb.training.selection.loss_table import LossTable


class ChunkContext(Protocol):
    """A chunk is opaque to strategies (row positions or streamed examples, see
    raysb.data.shards): they only index it with a mask or a slice and hand it back."""

    def sample_ids(self, chunk) -> torch.Tensor:
        """Stable ids of the chunk's examples."""

    def load(self, chunk) -> Batch:
        """Gather and augment the chunk's examples."""

    def score(self, batch: Batch) -> torch.Tensor:
        """Per-example losses from a selection forward pass (no autograd)."""

    def progress(self) -> float:
        """How much of the run is done, in [0, 1]: epochs over the run's epochs, or training time
        over its time budget when the schedule is keyed to time (raysb.core.schedules)."""


@dataclass
class EpochPlan:
    """An epoch decided whole as it starts, from recorded scores alone: `kept` are the positions,
    in the epoch's order, of the examples to train on (ascending), `weights` their loss weights
    where they are not all 1."""

    kept: torch.Tensor
    weights: torch.Tensor | None = None


class Strategy:
    """What every strategy answers; each one implements `build` and `kept_batch`."""

    name: str
    # The CDF_R selector, for strategies that have one.
    selector: Selector | None = None

    @classmethod
    def build(
        cls, spec: SelectionSpec, *, history, sample_ids: torch.Tensor | None, device: torch.device | str,
    ) -> Strategy:
        """This strategy for a run (its card's `implementation` names the class): `history` is the
        ranks' shared CDF_R (raysb.training.selection.merged_histogram) or None, `sample_ids` the
        training set's ids or None where they are not known in advance (a user's own data)."""
        raise NotImplementedError

    def plans_epoch(self, epoch: int, sample_ids: torch.Tensor) -> bool:
        """Whether `epoch`, over examples `sample_ids` in its order, can be decided whole as it starts:
        what it keeps needs no forward of its own (raysb.training.selection.rounds runs it as a plain loop)."""
        return False

    def plan_epoch(self, epoch: int, sample_ids: torch.Tensor) -> EpochPlan:
        """`epoch`'s decisions over `sample_ids` (its examples in its order), where `plans_epoch` says so.
        The same distribution as `kept_batch` over the epoch's chunks."""
        raise NotImplementedError(f"strategy {self.name} decides chunk by chunk")

    def kept_batch(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        """The examples of `chunk` to queue for training, loaded (and scored where it needs scores)."""
        raise NotImplementedError

    def set_selectivity(self, epoch: int, selectivity: float) -> None:
        """Keep about `selectivity` of the examples from `epoch` on (a kept-fraction schedule's)."""
        if self.selector is None:
            raise ValueError(f"strategy {self.name} keeps no fraction that a schedule could set")
        self.selector.beta = beta_from_selectivity(selectivity)

    def set_selection_strength(self, epoch: int, strength: float) -> None:
        """Prefer high scores with `strength` from `epoch` on: 1 is SB's rule, 0 a uniform draw of
        the same kept fraction (a selection-strength schedule's; raysb.core.selection.keep_probabilities)."""
        if self.selector is None:
            raise ValueError(f"strategy {self.name} has no keep rule that a schedule could weaken")
        self.selector.strength = strength

    def anneals(self, epoch: int, progress: float) -> bool:
        """Whether `epoch`, starting at `progress` of the run (in [0, 1]), trains on every example
        without choosing (InfoBatch's last epochs)."""
        return False

    def scores_whole_chunks(self, epoch: int) -> bool:
        """Whether `kept_batch` loads and scores every chunk of `epoch` whole (so they can be scored ahead)."""
        return False

    def observe_training_losses(self, batch: Batch, losses: torch.Tensor) -> None:
        """The per-example losses of a training step's forward on `batch` (free scores)."""

    def after_loss_read(self) -> None:
        """The rounds have just waited for the device (they read the training losses): device
        state can come to the host now at no further wait. Recorded losses do."""
        table = self.loss_table()
        if table is not None:
            table.flush()

    def device_tensors(self) -> list[torch.Tensor]:
        """The selection state this strategy keeps on the training device (raysb.bench.host_syncs
        counts only what waits for that device); none by default: the rest lives on the host."""
        return []

    def loss_table(self) -> LossTable | None:
        """Per-example losses that must be shared across ranks, if the strategy keeps any."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FreeScores(Strategy):
    """A strategy whose score of an example is its loss in the last training step it was in:
    the training forward computes it anyway, so scoring costs no forward of its own."""

    def __init__(self, table: LossTable):
        self.table = table

    def observe_training_losses(self, batch: Batch, losses: torch.Tensor) -> None:
        self.table.record(batch.sample_ids, losses)

    def loss_table(self) -> LossTable:
        return self.table
