"""Selectivity s and the selection exponent beta: two knobs for one setting, s = 1 / (beta + 1).

Pure Python, so the config can check them without importing torch.
"""

from __future__ import annotations

import math

# The paper's middle setting (beta = 2), raysb's default everywhere.
DEFAULT_SELECTIVITY = 1.0 / 3.0


def beta_from_selectivity(selectivity: float) -> float:
    """The beta whose expected kept fraction is `selectivity` (s = 1 / (beta + 1))."""
    if not 0.0 < selectivity <= 1.0:
        raise ValueError(f"selectivity must be in (0, 1], got {selectivity}")
    return 1.0 / selectivity - 1.0


def selectivity_from_beta(beta: float) -> float:
    """Expected kept fraction for percentiles uniform on [0, 1]: E[U^beta] = 1 / (beta + 1)."""
    if not beta >= 0.0 or math.isinf(beta):
        raise ValueError(f"beta must be a finite number >= 0, got {beta}")
    return 1.0 / (beta + 1.0)


def resolve_beta(beta: float | None, selectivity: float | None) -> float:
    """The beta that `beta` and `selectivity` name, the one place the two knobs meet: either, or
    neither (the default selectivity), or both where they agree (a saved config.yaml carries both)."""
    if beta is not None and not (beta >= 0.0 and math.isfinite(beta)):
        # beta 0 is selectivity 1: every keep probability is CDF^0 = 1, every example is kept.
        raise ValueError(f"beta must be a finite number >= 0, got {beta}")
    if selectivity is None:
        return beta_from_selectivity(DEFAULT_SELECTIVITY) if beta is None else float(beta)
    resolved = beta_from_selectivity(selectivity)
    if beta is not None and not math.isclose(beta, resolved, rel_tol=1e-9):
        raise ValueError(
            f"selectivity={selectivity} and beta={beta} disagree; give one of them (selectivity = 1 / (beta + 1))"
        )
    return resolved


def check_keep_floor(keep_floor: float) -> None:
    """A least keep probability for every example (BENCHMARKS.md, "Stability"): below 1, or nothing is selected."""
    if not 0.0 <= keep_floor < 1.0:
        raise ValueError(f"keep_floor must be in [0, 1), got {keep_floor!r}")


KEPT_FRACTION_SCHEDULES = ("constant", "lr")


def scheduled_selectivity(schedule: str, selectivity: float, lr_share: float) -> float:
    """The kept fraction at a point of the run where the lr is `lr_share` of its peak.

    constant: `selectivity` throughout. lr: rising from `selectivity` at the peak lr to 1 (every
    example) as the lr decays to 0, s(t) = s0 + (1 - s0)(1 - lr(t) / lr_peak): selection where
    the steps are large, the whole data where the model settles (BENCHMARKS.md, issue 45)."""
    if schedule == "constant":
        return selectivity
    if schedule == "lr":
        return selectivity + (1.0 - selectivity) * (1.0 - min(max(lr_share, 0.0), 1.0))
    raise ValueError(f"unknown kept_fraction_schedule {schedule!r}; choose one of {', '.join(KEPT_FRACTION_SCHEDULES)}")


SELECTION_STRENGTH_SCHEDULES = ("constant", "lr")


def scheduled_strength(schedule: str, lr_share: float) -> float:
    """How strongly the keep rule prefers high scores at a point of the run where the lr is
    `lr_share` of its peak: 1 is SB's rule, 0 a uniform draw of the same kept fraction
    (raysb.core.keep_rule.keep_probabilities).

    constant: 1 throughout. lr: lr(t) / lr_peak, fading from SB's rule at the peak lr to a
    uniform subset as the lr decays: the hardest examples where the steps are large, and where
    the model settles every example as likely as any, so that the examples selection kept
    choosing are not fitted alone (BENCHMARKS.md, issue 45: a uniform subset was lowest at the
    CPU's 3x, where every score-based strategy ended above Traditional)."""
    if schedule == "constant":
        return 1.0
    if schedule == "lr":
        return min(max(lr_share, 0.0), 1.0)
    raise ValueError(
        f"unknown selection_strength_schedule {schedule!r}; choose one of {', '.join(SELECTION_STRENGTH_SCHEDULES)}"
    )


def trained_at_most(cap: float, selectivity: float, window: int) -> int:
    """The most epochs of any `window` consecutive ones an example may be kept in under a train cap of
    `cap`: `cap` times the s W a uniform draw of `selectivity` s keeps it in, rounded down. A small
    epsilon keeps a product that is whole in exact arithmetic (1.5 * (1/3) * 6) whole in floats."""
    return math.floor(cap * selectivity * window + 1e-9)


def selects(epoch: int, progress: float, *, first_epoch: int, total_epochs: int | None, anneal_epochs: int,
            anneal_share: float, strategy_anneals: bool) -> bool:
    """Whether `epoch`, starting at `progress` of the run (in [0, 1]), selects at all, as Composer's
    `should_selective_backprop` says whether a step does: not while priming (the epochs before
    `first_epoch`), not annealing to the full data in the last `anneal_epochs` of the run's
    `total_epochs` (None: a budget alone ends it) or the last `anneal_share` of the run (an epoch that
    starts inside it: under a time budget the epochs are not known in advance), and not where the
    strategy anneals by its own rule (`strategy_anneals`)."""
    return not (epoch < first_epoch or (total_epochs is not None and epoch >= total_epochs - anneal_epochs)
                or (anneal_share > 0 and progress >= 1 - anneal_share) or strategy_anneals)
