"""Every selection setting of a run, resolved once: `SelectionSpec`.

Built from a `TrainConfig` (`TrainConfig.selection_spec()`) or from the arguments a
user gives `raysb.SelectiveBackprop`; everything that selects, batches or weights
examples reads it from here. Pure Python, so the config can build it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from raysb.core.selectivity import DEFAULT_SELECTIVITY, resolve_beta, selectivity_from_beta

STALENESS_CORRECTIONS = ("auto", "always", "never")


def corrects_stale_scores(setting: str | bool, selection_batch_size: int, batch_size: int, pipelined: bool) -> bool:
    """Whether kept examples are weighted by (keep probability now) / (when scored).

    "auto" turns it on where scores feed later steps: a selection batch larger than b
    (its kept examples fill several steps) or selection pipelined ahead of training.
    """
    if setting in (True, "always"):
        return True
    if setting in (False, "never"):
        return False
    if setting != "auto":
        raise ValueError(f"staleness_correction must be one of auto, always, never (or True/False), got {setting!r}")
    return selection_batch_size > batch_size or pipelined


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
    ) -> SelectionSpec:
        """The spec of `raysb.SelectiveBackprop`'s arguments (its docstring says what each means)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if selectivity is None and beta is None:
            selectivity = DEFAULT_SELECTIVITY
        selection_batch_size = selection_batch_size or batch_size
        return cls(
            strategy=strategy,
            batch_size=batch_size,
            beta=resolve_beta(beta, selectivity),
            selection_batch_size=selection_batch_size,
            staleness=staleness,
            history_size=history_size,
            keep_floor=keep_floor,
            correct_staleness=corrects_stale_scores(staleness_correction, selection_batch_size, batch_size, False),
            seed=seed,
            kath18_reweight=kath18_reweight,
        )
