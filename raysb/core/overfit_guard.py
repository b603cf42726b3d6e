"""The over-fitting guard's decision and what it does to selection: pure functions of loss histories.

Selection over-fits the examples it keeps choosing once a run is long enough (BENCHMARKS.md,
"Selection that never loses"): their training loss collapses while the loss on data the model never
trained on rises. The guard reads both each epoch, the second on a small held-out share of the
training data, and where they part so, moves selection half way toward a uniform draw (the keep
rule's strength) or toward keeping every example (the kept fraction). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

# The held-out loss must stand this share above its lowest to count as risen: at the guard's default
# split (3% of full Fashion-MNIST, 1,800 examples) a mean loss's standard error is about 5% of it.
RISE = 0.10
# The trained examples' loss must have fallen below this share of what it was when the held-out
# loss was lowest: a collapse, not the fall every run's training loss makes.
COLLAPSE = 0.5
# Each time the guard acts it moves selection this share of the way to uniform (or to every example).
STEP = 0.5


def overfitting(held_out: Sequence[float], trained: Sequence[float], rise: float = RISE,
                collapse: float = COLLAPSE) -> bool:
    """Whether the last epoch shows selection over-fitting: `held_out[e]` and `trained[e]` are epoch
    e's mean loss on the held-out split (at its end) and on the examples it trained on.

    Over-fitting when the held-out loss rose in the last epoch, to more than (1 + `rise`) times its
    lowest in the epochs before, while the trained examples' loss fell below `collapse` times what it
    was in the epoch of that lowest held-out loss. A held-out loss that falls or holds, or one that
    rises while the training loss holds too (an lr step, noise), is left alone."""
    if len(held_out) != len(trained):
        raise ValueError(f"one held-out and one trained loss an epoch, got {len(held_out)} and {len(trained)}")
    if len(held_out) < 2:
        return False
    earlier = held_out[:-1]
    best = min(range(len(earlier)), key=earlier.__getitem__)
    risen = held_out[-1] > held_out[-2] and held_out[-1] > (1 + rise) * earlier[best]
    return risen and trained[-1] < collapse * trained[best]


def guarded_strength(strength: float, guard: float) -> float:
    """The keep rule's strength once the guard has acted: `guard` is STEP ** (times it acted), the share
    of the way to a uniform draw (strength 0) not yet taken."""
    return strength * guard


def guarded_selectivity(selectivity: float, guard: float) -> float:
    """The kept fraction once the guard has acted: `guard`'s share of the way to keeping every example
    not yet taken, from `selectivity`."""
    return 1.0 - (1.0 - selectivity) * guard


# strength: the keep rule's strength falls toward 0, a uniform draw of the same kept fraction;
# fraction: the kept fraction rises toward every example.
GUARD_ACTIONS = ("strength", "fraction")


class OverfitGuard:
    """The guard over a run: each epoch's held-out and trained losses, and how far it has moved
    selection (`remaining`: STEP ** the times it acted, the share of the way not yet taken)."""

    def __init__(self, action: str):
        if action not in GUARD_ACTIONS:
            raise ValueError(f"an over-fitting guard moves selection toward {' or '.join(GUARD_ACTIONS)}, "
                             f"got {action!r}")
        self.action = action
        self.held_out: list[float] = []
        self.trained: list[float] = []
        self.remaining = 1.0

    def update(self, held_out: float, trained: float) -> bool:
        """Record an epoch's losses; whether the guard acts on them (`overfitting`)."""
        self.held_out.append(held_out)
        self.trained.append(trained)
        acts = overfitting(self.held_out, self.trained)
        if acts:
            self.remaining *= STEP
        return acts

    def strength(self, strength: float) -> float:
        """The keep rule's strength a schedule's `strength` becomes under the guard."""
        return guarded_strength(strength, self.remaining) if self.action == "strength" else strength

    def selectivity(self, selectivity: float) -> float:
        """The kept fraction a schedule's `selectivity` becomes under the guard."""
        return guarded_selectivity(selectivity, self.remaining) if self.action == "fraction" else selectivity

    def state_dict(self) -> dict:
        return {"held_out": list(self.held_out), "trained": list(self.trained), "remaining": self.remaining}

    def load_state_dict(self, state: dict) -> None:
        self.held_out, self.trained = list(state["held_out"]), list(state["trained"])
        self.remaining = float(state["remaining"])
