"""Every selection setting of a run, resolved once: `SelectionSpec`.

Built from a `TrainConfig` (`TrainConfig.selection_spec()`) or from the arguments a
user gives `raysb.SelectiveBackprop`; everything that selects, batches or weights
examples reads it from here. Pure Python, so the config can build it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from raysb.core.selectivity import DEFAULT_SELECTIVITY, resolve_beta, selectivity_from_beta

STALENESS_CORRECTIONS = ("auto", "always", "never")
# Strategies that keep about a selectivity's share of each selection chunk; the others keep
# every example (Traditional) or one batch a chunk (Kath18's presample).
KEEPS_A_FRACTION = ("sb", "stale-sb", "uniform")


def corrects_stale_scores(
    setting: str | bool, selection_batch_size: int, batch_size: int, pipelined: bool, rounds_per_exchange: int = 1
) -> bool:
    """Whether kept examples are weighted by (keep probability now) / (when scored).

    "auto" turns it on where scores feed later steps: a selection batch larger than b
    (its kept examples fill several steps), selection pipelined ahead of training, or
    lockstep ranks that score a few chunks between exchanges (their kept examples wait
    for it). Uncorrected, exchanging every 3 chunks cost SB 4.5-6 points of test error
    after 4 epochs on 2 workers (BENCHMARKS.md, issue 28); corrected, none.
    """
    if setting in (True, "always"):
        return True
    if setting in (False, "never"):
        return False
    if setting != "auto":
        raise ValueError(f"staleness_correction must be one of auto, always, never (or True/False), got {setting!r}")
    return selection_batch_size > batch_size or pipelined or rounds_per_exchange > 1


def rounds_per_exchange(strategy: str, batch_size: int, selectivity: float, selection_batch_size: int) -> int:
    """Selection chunks each lockstep rank scores between two exchanges: about a batch of b kept
    examples a rank. Every exchange makes ranks wait for the slowest; at one a chunk, SB at
    s = 1/3 spent 6-7% of a 2-worker CPU run waiting there (BENCHMARKS.md, issue 28)."""
    if strategy not in KEEPS_A_FRACTION:
        return 1
    return max(1, round(batch_size / (selectivity * selection_batch_size)))


@dataclass(frozen=True)
class SelectionSpec:
    """What selection needs to know, each value final.

    `seed` seeds selection's own random stream (keep and tie draws, Kath18's sampling);
    `first_epoch` is the first epoch that selects (Stale-SB counts its n from it).
    """

    strategy: str
    batch_size: int
    beta: float
    selection_batch_size: int
    staleness: int = 1
    history_size: int = 1024
    keep_floor: float = 0.0
    correct_staleness: bool = False
    seed: int = 0
    first_epoch: int = 0
    kath18_tau_threshold: float | None = None
    kath18_reweight: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "selection_batch_size", "staleness", "history_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.keep_floor < 1.0:
            raise ValueError(f"keep_floor must be in [0, 1), got {self.keep_floor}")

    @property
    def selectivity(self) -> float:
        return selectivity_from_beta(self.beta)

    @property
    def rounds_per_exchange(self) -> int:
        """Selection chunks each lockstep rank scores between two exchanges (`rounds_per_exchange`)."""
        return rounds_per_exchange(self.strategy, self.batch_size, self.selectivity, self.selection_batch_size)

    def losses_per_exchange(self, world_size: int) -> int:
        """The losses `world_size` ranks rank between two exchanges: what one merge of the shared
        loss histogram counts (raysb.training.merged_histogram)."""
        return world_size * self.selection_batch_size * self.rounds_per_exchange

    @classmethod
    def for_user(
        cls,
        strategy: str,
        batch_size: int,
        *,
        selectivity: float | None,
        beta: float | None,
        staleness: int,
        selection_batch_size: int | None,
        history_size: int,
        keep_floor: float,
        staleness_correction: bool | str,
        seed: int,
        kath18_reweight: bool,
        lockstep: bool,
    ) -> SelectionSpec:
        """The spec of `raysb.SelectiveBackprop`'s arguments (its docstring says what each means);
        `lockstep`: ranks exchange what they keep (raysb.training.rounds)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if selectivity is None and beta is None:
            selectivity = DEFAULT_SELECTIVITY
        selection_batch_size = selection_batch_size or batch_size
        beta = resolve_beta(beta, selectivity)
        exchange_every = (
            rounds_per_exchange(strategy, batch_size, selectivity_from_beta(beta), selection_batch_size)
            if lockstep else 1
        )
        return cls(
            strategy=strategy,
            batch_size=batch_size,
            beta=beta,
            selection_batch_size=selection_batch_size,
            staleness=staleness,
            history_size=history_size,
            keep_floor=keep_floor,
            correct_staleness=corrects_stale_scores(
                staleness_correction, selection_batch_size, batch_size, False, exchange_every
            ),
            seed=seed,
            kath18_reweight=kath18_reweight,
        )
