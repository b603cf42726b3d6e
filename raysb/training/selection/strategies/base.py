"""What a strategy is: a decision. Shown a selection chunk's example ids, and the scores it asks for,
it says which of them to train on and with what loss weights; the rounds
(raysb.training.selection.rounds) load, score and queue. Where it needs no scores to decide, its
decision can take a whole epoch's ids at once (`decides_epoch`), and the epoch runs as a plain loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch

from raysb.core.batch_former import Batch
from raysb.core.keep_rule import Selector
from raysb.core.label_doubt import ClassLogits
from raysb.core.selectivity import beta_from_selectivity
from raysb.core.spec import SelectionSpec
from raysb.training.selection.loss_table import LossTable


class ChunkContext(Protocol):
    """A chunk is opaque to the rounds (row positions, streamed examples or a user's batch, see
    raysb.data.shards): they index it with positions and hand it back to load."""

    def sample_ids(self, chunk) -> torch.Tensor:
        """Stable ids of the chunk's examples."""

    def load(self, chunk) -> Batch:
        """Gather and augment the chunk's examples."""

    def score(self, batch: Batch) -> torch.Tensor:
        """Per-example losses from a selection forward pass (no autograd)."""


class Scores(enum.Enum):
    """Which of a chunk's examples a strategy asks a selection forward for (`Strategy.wants_scores`),
    where not some of them by position."""

    NONE = "none"
    ALL = "all"



@dataclass
class Decision:
    """What a strategy keeps of the examples it was shown: `kept`, their positions (ascending, or
    repeated where it samples with replacement; None: every one); `weights`, the kept examples' loss
    weights where they are not all 1; `keep_probabilities`, every shown example's probability of
    being kept where its keep rule has one (the staleness correction weighs by them)."""

    kept: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    keep_probabilities: torch.Tensor | None = None


class Strategy:
    """What every strategy answers; each one implements `build` and `decide`."""

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

    def wants_scores(self, epoch: int, ids: torch.Tensor) -> Scores | torch.Tensor:
        """Which of the examples `ids` (a chunk's, in its order) `decide` needs a selection forward's
        losses for: none (Scores.NONE), all (Scores.ALL), or those at some positions. Asked before
        every `decide`."""
        return Scores.NONE

    def decide(self, epoch: int, ids: torch.Tensor, scores: torch.Tensor | None) -> Decision:
        """Which of `ids` to train on in `epoch`: `scores` are the selection losses `wants_scores`
        asked for (of every example, or of the positions it named, in their order), None where it
        asked for none."""
        raise NotImplementedError

    def decides_epoch(self, epoch: int, ids: torch.Tensor) -> bool:
        """Whether `decide` may take `epoch`'s ids (this rank's, in its order) all at once, with no
        scores: the same distribution as chunk by chunk (the epoch then runs as a plain loop)."""
        return False

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
        """Whether every chunk of `epoch` is loaded and scored whole (so they can be scored ahead)."""
        return False

    def observe_training_losses(self, batch: Batch, losses: torch.Tensor, logits: ClassLogits | None = None) -> None:
        """The per-example losses of a training step's forward on `batch` (free scores), and its logits
        where the loss function gives them (their margins: raysb.core.label_doubt)."""

    # -- the run's held-out split (its card's `holdout_share`) ------------------------------
    def irreducible_epochs(self) -> int:
        """Epochs of an irreducible-loss model to train once on the held-out split before the run
        trains, whose losses on the training examples reach `use_irreducible_losses`
        (raysb.training.irreducible_loss); 0: none, or none needed any more (restored ones)."""
        return 0

    def use_irreducible_losses(self, sample_ids: torch.Tensor, losses: torch.Tensor) -> None:
        """The irreducible losses of the training examples `sample_ids` (host tensors)."""
        raise NotImplementedError(f"strategy {self.name} reads no irreducible losses")

    def watches_held_out(self) -> bool:
        """Whether each epoch's end measures the loss on the held-out split for `observe_held_out_loss`."""
        return False

    def observe_held_out_loss(self, epoch: int, loss: float, trained_loss: float) -> str | None:
        """The mean loss on the held-out split at the end of `epoch` (the model in eval mode) and the
        epoch's mean training loss (its steps', the metrics row's train_loss); a line for the run's
        console where the strategy acts on them."""
        return None

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

    def label_doubt_row(self) -> dict:
        """For the metrics row: what the current epoch does with the labels the model doubts (free-sb's
        label_doubt rules), where the strategy doubts any."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FreeScores(Strategy):
    """A strategy whose score of an example is its loss in the last training step it was in:
    the training forward computes it anyway, so scoring costs no forward of its own."""

    def __init__(self, table: LossTable):
        self.table = table
        # Strategy.after_loss_read's, for the table it always has: the table's flush itself, no call between
        # on every step. Not where a subclass overrides it, which this instance attribute would hide.
        if type(self).after_loss_read is Strategy.after_loss_read:
            self.after_loss_read = table.flush

    def observe_training_losses(self, batch: Batch, losses: torch.Tensor, logits: ClassLogits | None = None) -> None:
        self.table.record(batch.sample_ids, losses, logits)

    def loss_table(self) -> LossTable:
        return self.table
