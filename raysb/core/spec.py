"""Every selection setting of a run, resolved once: `SelectionSpec`.

Built from a `TrainConfig` (`TrainConfig.selection_spec()`) or from the arguments a
user gives `raysb.SelectiveBackprop`; everything that selects, batches or weights
examples reads it from here. Pure Python, so the config can build it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raysb.core.errors import check_choice
from raysb.core.selectivity import check_keep_floor, resolve_beta, selectivity_from_beta
from raysb.core.strategy_options import resolved_options
from raysb.core.strategy_table import strategy_card

STALENESS_CORRECTIONS = ("auto", "always", "never")
# How many of a chunk SB keeps: a random count (each example by its own draw, the paper's rule),
# a fixed one (round(s n), no host read of the count), or auto: fixed on a GPU, random elsewhere.
KEPT_PER_CHUNK = ("auto", "random", "fixed")


@dataclass(frozen=True)
class SelectionSpec:
    """What selection needs to know, each value final.

    `seed` seeds selection's own random stream (keep and tie draws, Kath18's sampling);
    `first_epoch` is the first epoch that selects (Stale-SB counts its n from it);
    `pipelined`: chunks are scored ahead of training; `lockstep`: N > 1 ranks exchange what
    they keep (raysb.training.selection.rounds; one worker trains as one process does);
    `sharded_table`: each lockstep rank's loss table holds only the examples it owns.
    """

    strategy: str
    batch_size: int
    beta: float
    selection_batch_size: int
    history_size: int = 1024
    keep_floor: float = 0.0
    staleness_correction: str | bool = "never"
    pipelined: bool = False
    lockstep: bool = False
    seed: int = 0
    first_epoch: int = 0
    kept_per_chunk: str = "auto"
    sharded_table: bool = False
    # The strategy's own options (its card's): those given, over its card's defaults once the spec is made.
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Every check of a selection setting, in one place: a config's (raysb.config turns these
        errors into ConfigErrors) and `raysb.SelectiveBackprop`'s arguments alike."""
        for name in ("batch_size", "selection_batch_size", "history_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        check_keep_floor(self.keep_floor)
        # Resolved here, so every spec holds them whole, however it was made (frozen: set as made).
        object.__setattr__(self, "options", resolved_options(self.strategy, self.options))
        check_choice("kept_per_chunk", self.kept_per_chunk, KEPT_PER_CHUNK)
        if self.staleness_correction not in (True, False):
            check_choice("staleness_correction", self.staleness_correction, STALENESS_CORRECTIONS)
        card = strategy_card(self.strategy)
        if self.lockstep and card.lockstep_refusal is not None:
            raise ValueError(f"strategy {self.strategy} {card.lockstep_refusal}")
        if card.check is not None:
            card.check(self)

    @property
    def selectivity(self) -> float:
        return selectivity_from_beta(self.beta)

    @property
    def runs_scoring_forwards(self) -> bool:
        """Whether the run spends forwards of its own on scoring (a work budget measures their cost)."""
        card = strategy_card(self.strategy)
        # Whether it scores at all: with a selection pass every epoch (staleness n = 1), if ever.
        return card.scored_share(1) > 0 if card.scores is None else card.scores(self)

    @property
    def holdout_share(self) -> float:
        """The share of the training data held out of training (its card's `holdout_share`; 0: none)."""
        share = strategy_card(self.strategy).holdout_share
        return 0.0 if share is None else share(self)

    @property
    def chunk_size(self) -> int:
        """The examples each selection round reads: the card's `chunk_size`, else the selection batch."""
        size = strategy_card(self.strategy).chunk_size
        return self.selection_batch_size if size is None else size(self)

    @property
    def rounds_per_exchange(self) -> int:
        """Selection chunks each lockstep rank scores between two exchanges: about a batch of b
        kept examples a rank, from the share of a chunk its strategy keeps (its card's
        `chunk_kept_share`; 1 for one process alone, which queues every chunk's keeps at once).
        Every exchange makes ranks wait for the slowest; at one a chunk, SB at s = 1/3 spent a
        sizeable share of a 2-worker CPU run waiting there (BENCHMARKS.md, "Exchanging every few
        selection batches")."""
        kept_share = strategy_card(self.strategy).chunk_kept_share if self.lockstep else None
        if kept_share is None:
            return 1
        return max(1, round(self.batch_size / (kept_share(self) * self.selection_batch_size)))

    @property
    def correct_staleness(self) -> bool:
        """Whether kept examples are weighted by (keep probability now) / (when scored).

        "auto" turns it on where scores feed later steps: a selection batch larger than b
        (its kept examples fill several steps), selection pipelined ahead of training, or
        lockstep ranks that score a few chunks between exchanges (their kept examples wait
        for it). Uncorrected, exchanging every 3 chunks cost SB several points of test error
        after 4 epochs on 2 workers; corrected, none (BENCHMARKS.md, "Exchanging every few
        selection batches").
        """
        if self.staleness_correction in (True, "always"):
            return True
        if self.staleness_correction in (False, "never"):
            return False
        return self.selection_batch_size > self.batch_size or self.pipelined or self.rounds_per_exchange > 1

    @classmethod
    def for_user(
        cls,
        strategy: str,
        batch_size: int,
        *,
        selectivity: float | None,
        beta: float | None,
        selection_batch_size: int | None,
        history_size: int,
        keep_floor: float,
        staleness_correction: bool | str,
        seed: int,
        lockstep: bool,
        options: dict[str, Any] | None = None,
        option_keys: dict[str, Any] | None = None,
    ) -> SelectionSpec:
        """The spec of `raysb.SelectiveBackprop`'s arguments (its docstring says what each means);
        `lockstep`: ranks exchange what they keep (raysb.training.selection.rounds); `option_keys`: the
        strategy's options given by name as keywords, as a config gives a built-in's
        (raysb.core.strategy_options)."""
        return cls(
            strategy=strategy,
            batch_size=batch_size,
            beta=resolve_beta(beta, selectivity),
            selection_batch_size=batch_size if selection_batch_size is None else selection_batch_size,
            history_size=history_size,
            keep_floor=keep_floor,
            staleness_correction=staleness_correction,
            lockstep=lockstep,
            seed=seed,
            options=resolved_options(strategy, options, option_keys),
        )
