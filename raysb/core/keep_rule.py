"""Selective-Backprop's keep rule, P = CDF_R(loss) ** beta: percentiles, keep probabilities, decisions.

Everything here is vectorized over a batch of per-example losses and free of
Ray and torch.distributed, so the same functions serve the single-process
trainer, every distributed rank, and users' own training loops.
"""

from __future__ import annotations

import functools
import math

import torch

from raysb.core.errors import NonFiniteLossError
from raysb.core.selectivity import check_keep_floor, resolve_beta, selectivity_from_beta


def percentile_ranks(
    history: torch.Tensor, losses: torch.Tensor, tie_break: torch.Tensor
) -> torch.Tensor:
    """Percentile of each loss within `history`, with ties broken uniformly at random.

    The rank of a loss is the fraction of the history strictly below it plus a
    uniform share of the entries equal to it. For continuous losses this is the
    plain CDF_R; when many losses are equal (all zero early or late in
    training) it keeps the ranks uniform on [0, 1] instead of collapsing them
    to 0 (which would stop all selection) or 1 (which would keep everything).

    `tie_break` holds one U(0, 1) draw per loss.
    """
    return _ranks_in_sorted(torch.sort(history).values, history.numel(), losses, tie_break)


def filled_percentile_ranks(
    slots: torch.Tensor, filled: torch.Tensor, losses: torch.Tensor, tie_break: torch.Tensor
) -> torch.Tensor:
    """`percentile_ranks` against the first `filled` of `slots`, `filled` a device count: every shape
    is the whole ring's, so a CUDA graph can replay it as the ring fills. The unfilled slots sort last
    as +inf, above every finite loss, so the ranks are percentile_ranks' on the filled ones."""
    valid = torch.arange(slots.numel(), device=slots.device) < filled
    return _ranks_in_sorted(torch.sort(torch.where(valid, slots, torch.inf)).values, filled, losses, tie_break)


def _ranks_in_sorted(ordered: torch.Tensor, count: int | torch.Tensor, losses: torch.Tensor,
                     tie_break: torch.Tensor) -> torch.Tensor:
    """The percentile of each loss among the first `count` of `ordered` (ascending; any others larger)."""
    below = torch.searchsorted(ordered, losses, right=False)
    at_or_below = torch.searchsorted(ordered, losses, right=True)
    return (below + tie_break * (at_or_below - below)) / count


def keep_probabilities(
    percentiles: torch.Tensor, beta: float, floor: float = 0.0, strength: float = 1.0
) -> torch.Tensor:
    """P(L) = CDF_R(L) ** beta (the paper's equation 1), raised to at least `floor`.

    A floor gives every example some chance of a backward pass, so easy examples
    keep anchoring the model while it trains on the hard ones.
    `strength` w in [0, 1] mixes the rule with a uniform draw of the same expected kept fraction:
    P = w CDF ** beta + (1 - w) / (beta + 1), both terms averaging 1 / (beta + 1) over uniform
    percentiles, so w moves which examples are kept and not how many (1: the paper's rule).
    """
    probabilities = percentiles.pow(beta)
    if strength < 1.0:
        probabilities = probabilities.mul(strength).add_((1.0 - strength) * selectivity_from_beta(beta))
    return probabilities.clamp(min=floor) if floor > 0 else probabilities


# The largest weight `unbiased_weights` gives: InfoBatch's, whose kept share is at least 0.1.
MAX_UNBIASED_WEIGHT = 10.0


def unbiased_weights(probabilities: torch.Tensor) -> torch.Tensor:
    """Each example's weight were it kept: mean(P) / P_i, at most MAX_UNBIASED_WEIGHT.

    A step's mean loss over kept examples, each weighted so, has the expectation of the mean
    loss over every example the probabilities were drawn for (importance sampling, as
    InfoBatch rescales what it keeps of the well-learned examples): selection then changes which
    examples a step sees, not what its gradient estimates. mean(P) is the chunk's expected kept
    share, so a chunk kept whole (P = 1) weighs 1. The cap bounds a rare low-P example's step,
    at the price of a small bias for P below a tenth of the mean."""
    return (probabilities.mean() / probabilities.clamp_min(torch.finfo(probabilities.dtype).tiny)).clamp(
        max=MAX_UNBIASED_WEIGHT)


def keep_decisions(
    history: torch.Tensor,
    losses: torch.Tensor,
    tie_draws: torch.Tensor,
    keep_draws: torch.Tensor,
    beta: float,
    floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paper's keep rule, whole: rank each loss in `history`, P = rank ** beta (at
    least `floor`), keep where the U(0, 1) draw falls below P. Returns (keep, ranks, P).

    Every keep decision in raysb (training, the report's probes, the selection
    benchmark) ends in `keep_from_ranks`, so they cannot drift apart.
    """
    ranks = percentile_ranks(history, losses, tie_draws)
    keep, probabilities = keep_from_ranks(ranks, keep_draws, beta, floor)
    return keep, ranks, probabilities


def keep_from_ranks(
    ranks: torch.Tensor, keep_draws: torch.Tensor, beta: float, floor: float = 0.0, strength: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keep rule from percentile ranks, however they were found: (keep, P = rank ** beta)."""
    probabilities = keep_probabilities(ranks, beta, floor, strength)
    return keep_draws < probabilities, probabilities


def fixed_count_inclusion(probabilities: torch.Tensor, count: int) -> torch.Tensor:
    """Inclusion probabilities pi_i = min(1, c P_i), with the c that makes them sum to `count`.

    In closed form, no host read: the examples capped at 1 are the m largest, the P_j whose
    place from the top, k (0 for the largest), has P_j (count - k) reaching the sum of P_j
    and all smaller ones (a condition that holds for the largest few, and never from place
    `count` on); c = (count - m) / (the sum of the rest). Sorted ascending, those sums are a
    plain cumulative sum, summed small to large. Few operations: each one is a GPU launch.
    """
    if count >= probabilities.numel():
        return torch.ones_like(probabilities)
    weights = probabilities.clamp_min(torch.finfo(probabilities.dtype).tiny)
    ascending = torch.sort(weights).values
    up_to_here = torch.cumsum(ascending, 0)
    capped = ascending.mul(_places_left(count, weights.numel(), weights.device, weights.dtype)).ge(up_to_here)
    rest = torch.where(capped, 0.0, ascending).sum()
    scale = (count - capped.sum()) / rest
    return weights.mul(scale).clamp_(max=1.0)


@functools.lru_cache(maxsize=8)
def _places_left(count: int, size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """count - k for the k-th largest of `size` sorted ascending, made once for each chunk size."""
    return count - torch.arange(size - 1, -1, -1, device=device, dtype=dtype)


def systematic_sample(inclusion: torch.Tensor, count: int, offset: float | torch.Tensor) -> torch.Tensor:
    """Exactly `count` positions, position i among them with probability inclusion[i] (which sum
    to `count`, each at most 1): systematic sampling from the U(0, 1) `offset`, walking the
    positions in their given order, which must not depend on the inclusions (a selection chunk's
    order is the epoch's random one). Static shapes, so no host read."""
    if count >= inclusion.numel():
        return torch.arange(inclusion.numel(), device=inclusion.device)
    reach = torch.cumsum(inclusion, 0) + offset
    hits = torch.floor(reach) - torch.floor(reach - inclusion)  # 1 where the walk passes an integer
    # Rounding can leave the walk a hair short of `count` hits: the largest inclusions fill in.
    return torch.topk(hits + 1e-3 * inclusion, count).indices


def fixed_count_keep(
    ranks: torch.Tensor, offset: float | torch.Tensor, count: int, beta: float, floor: float = 0.0,
    strength: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed-count rule from percentile ranks: exactly `count` positions, each with probability
    min(1, c P), and P = rank ** beta. `offset`: the systematic walk's U(0, 1) start."""
    probabilities = keep_probabilities(ranks, beta, floor, strength)
    return systematic_sample(fixed_count_inclusion(probabilities, count), count, offset), probabilities


def staleness_weights(probabilities_now: torch.Tensor, probabilities_kept: torch.Tensor) -> torch.Tensor:
    """Importance weights that turn a selection made on stale scores into a fresh one.

    An example kept with probability q (from a loss scored some optimizer steps
    ago) that the current model would keep with probability p is weighted p / q,
    so the kept batch's expected gradient is the one fresh selection gives. Without
    it, selection on scores even one step old amplifies what the last steps did
    instead of correcting it (BENCHMARKS.md, "Stability"). NaN marks examples that
    no selection chose (plain-SGD epochs); they keep weight 1.
    """
    unselected = probabilities_kept.isnan()
    return torch.where(unselected, torch.ones_like(probabilities_now), probabilities_now / probabilities_kept)


def check_finite(losses: torch.Tensor, where: str) -> None:
    # One reduction and one host sync per call (this runs every selection round):
    # a NaN or infinity makes the float64 sum non-finite, and float32 losses
    # cannot overflow a float64 sum.
    if not math.isfinite(float(losses.sum(dtype=torch.float64))):
        bad = int((~torch.isfinite(losses)).sum())
        raise NonFiniteLossError(
            f"{bad} of {losses.numel()} losses are NaN or infinite at {where}; "
            "lower the learning rate or check the data and labels"
        )


class LossHistory:
    """A ring buffer of the last `capacity` losses: the R of CDF_R."""

    def __init__(self, capacity: int = 1024, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"history size R must be >= 1, got {capacity}")
        self.capacity = capacity
        self._values = torch.zeros(capacity, device=device)
        self._size = 0
        self._next = 0

    def __len__(self) -> int:
        return self._size

    def values(self) -> torch.Tensor:
        """The stored losses in slot order (all a percentile needs)."""
        return self._values[: self._size]

    def ranks(self, losses: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
        """Percentiles of `losses` in the stored losses (`percentile_ranks`); 1.0 while it is empty."""
        if not self._size:
            return torch.ones_like(losses)
        return percentile_ranks(self._values[: self._size].to(losses.device), losses, tie_break)

    @property
    def slots(self) -> torch.Tensor:
        """The ring itself, every slot, filled or not (a captured graph writes into it in place)."""
        return self._values

    @property
    def cursor(self) -> tuple[int, int]:
        """(the slot the next loss goes to, how many slots are filled)."""
        return self._next, self._size

    def advance(self, count: int) -> None:
        """Move the cursor past `count` losses written into `slots` elsewhere (by a captured graph)."""
        self._next = (self._next + count) % self.capacity
        self._size = min(self.capacity, self._size + count)

    def chronological(self) -> torch.Tensor:
        """Oldest first, so replaying them into a new history rebuilds this one exactly."""
        if self._size < self.capacity:
            return self._values[: self._size]
        return torch.cat([self._values[self._next :], self._values[: self._next]])

    def extend(self, losses: torch.Tensor) -> None:
        losses = losses.detach().reshape(-1).to(self._values)
        if losses.numel() >= self.capacity:
            self._values.copy_(losses[-self.capacity :])
            self._size, self._next = self.capacity, 0
            return
        # At most two slice copies (up to the end of the ring, then from its start).
        count = losses.numel()
        head = min(count, self.capacity - self._next)
        self._values[self._next : self._next + head].copy_(losses[:head])
        if count > head:
            self._values[: count - head].copy_(losses[head:])
        self._next = (self._next + count) % self.capacity
        self._size = min(self.capacity, self._size + count)

    def state_dict(self) -> dict:
        return {"values": self._values.cpu(), "size": self._size, "next": self._next}

    def load_state_dict(self, state: dict) -> None:
        if state["values"].numel() != self.capacity:
            raise ValueError(
                f"checkpoint history holds {state['values'].numel()} losses, "
                f"this run is configured for R={self.capacity}"
            )
        self._values.copy_(state["values"])
        self._size, self._next = int(state["size"]), int(state["next"])


class Selector:
    """Decides which examples of a batch get a backward pass.

    Each call adds the batch's losses to the history first (as the authors'
    code did), ranks them against it, and keeps each example independently
    with probability percentile ** beta.

        selector = Selector(selectivity=0.33)
        keep = selector.select(per_example_losses)   # indices into the batch
        loss_fn(model(x[keep]), y[keep]).backward()
    """

    def __init__(
        self,
        beta: float | None = None,
        selectivity: float | None = None,
        history_size: int = 1024,
        seed: int = 0,
        device: torch.device | str = "cpu",
        history=None,
        keep_floor: float = 0.0,
    ):
        """`history` replaces the private ring buffer, e.g. with one shared by all
        ranks (raysb.training.selection.merged_histogram.MergedLossHistogram): anything with
        `extend(losses)`, `ranks(losses, tie_break)` and a state dict."""
        self.beta = resolve_beta(beta, selectivity)
        check_keep_floor(keep_floor)
        self.keep_floor = keep_floor
        # 1 is the paper's rule; a selection-strength schedule lowers it (keep_probabilities).
        self.strength = 1.0
        self.history = history if history is not None else LossHistory(history_size, device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.initial_seed = seed
        self.examples_seen = 0
        # Counted where the decisions are (a GPU), read only when asked: no host sync per call.
        self._kept = torch.zeros((), dtype=torch.int64, device=device)
        # The fixed-count rule replayed as one device graph where it applies (kept, P and the ranks, or
        # None: decided here), as captured_rule(losses, draws, count) (raysb.training.selection.keep_rule_graph).
        self.captured_rule = None
        # Called as observer(sample_ids, losses, percentiles, probabilities, keep) for
        # decisions whose ids are known (raysb.training.trace records them for `raysb report`).
        self.observer = None

    @property
    def examples_kept(self) -> int:
        return int(self._kept)

    @property
    def kept_counter(self) -> torch.Tensor:
        """The kept count where the decisions are, unread (a captured rule adds to it in place)."""
        return self._kept

    @property
    def kept_fraction(self) -> float:
        return self.examples_kept / self.examples_seen if self.examples_seen else 0.0

    def keep_mask(
        self, losses: torch.Tensor, sample_ids: torch.Tensor | None = None, *, checked: bool = False
    ) -> torch.Tensor:
        """Which examples are kept, one independent draw each (the paper's rule)."""
        return self.keep_mask_and_probabilities(losses, sample_ids, checked=checked)[0]

    def keep_mask_and_probabilities(
        self, losses: torch.Tensor, sample_ids: torch.Tensor | None = None, *, checked: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keep mask and the probability each example was kept with.

        `checked`: the caller has already made sure every loss is finite (raysb's
        selection round does, once per round), so this call adds no host sync for it.
        """
        losses = losses.detach().reshape(-1).float()
        if not checked:
            check_finite(losses, "selection")
        self.history.extend(losses)
        draws = torch.rand(
            2, losses.numel(), generator=self.generator, device=self.generator.device
        ).to(losses.device)
        ranks = self.history.ranks(losses, draws[0])
        keep, probabilities = keep_from_ranks(ranks, draws[1], self.beta, self.keep_floor, self.strength)
        self.examples_seen += losses.numel()
        self._kept += keep.sum().to(self._kept.device)
        if self.observer is not None and sample_ids is not None:
            self.observer(sample_ids, losses, ranks, probabilities, keep)
        return keep, probabilities

    def current_keep_probabilities(self, losses: torch.Tensor) -> torch.Tensor:
        """Keep probabilities of `losses` against the history as it stands, drawing nothing.

        Ties take the middle of their share, so this changes no random stream.
        """
        losses = losses.detach().reshape(-1).float()
        ranks = self.history.ranks(losses, torch.full_like(losses, 0.5))
        return keep_probabilities(ranks, self.beta, self.keep_floor, self.strength)

    def kept_positions(
        self, losses: torch.Tensor, sample_ids: torch.Tensor | None = None, *, fixed_count: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept examples' positions in `losses`, and every example's keep probability P.

        By default each example is kept by its own draw (the paper's rule; how many are kept is
        known only once the draws are read). `fixed_count`: exactly round(s n) are kept, example
        i with probability min(1, c P_i), c making them sum to round(s n) (`systematic_sample`):
        the same preference for high losses, a chunk's share of hard examples moving c instead
        of the kept count, and no host read (a GPU keeps queuing). Losses must be finite.
        """
        losses = losses.detach().reshape(-1).float()
        if not fixed_count:
            keep, probabilities = self.keep_mask_and_probabilities(losses, sample_ids, checked=True)
            return keep.nonzero().squeeze(1), probabilities
        draws = torch.rand(losses.numel() + 1, generator=self.generator, device=self.generator.device).to(losses.device)
        count = self.fixed_count_of(losses.numel())
        decided = None if self.captured_rule is None else self.captured_rule(losses, draws, count)
        if decided is None:
            self.history.extend(losses)
            ranks = self.history.ranks(losses, draws[1:])
            kept, probabilities = fixed_count_keep(ranks, draws[0], count, self.beta, self.keep_floor, self.strength)
            self._kept += count
        else:
            kept, probabilities, ranks = decided
        self.examples_seen += losses.numel()
        if self.observer is not None and sample_ids is not None:
            keep = torch.zeros_like(losses, dtype=torch.bool).index_fill_(0, kept, True)
            self.observer(sample_ids, losses, ranks, probabilities, keep)
        return kept, probabilities

    def fixed_count_of(self, rows: int) -> int:
        """How many of `rows` examples the fixed-count rule keeps: round(s n)."""
        return round(selectivity_from_beta(self.beta) * rows)

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors this selector keeps (its history's and its kept count), where they live."""
        return [*(value for value in vars(self.history).values() if isinstance(value, torch.Tensor)), self._kept]

    def select(self, losses: torch.Tensor) -> torch.Tensor:
        """The kept examples' positions in `losses`, checked finite: the rule in one call for a user's loop."""
        return self.keep_mask(losses).nonzero().squeeze(1)

    def state_dict(self) -> dict:
        return {
            "history": self.history.state_dict(),
            "generator": self.generator.get_state(),
            "examples_seen": self.examples_seen,
            "examples_kept": self.examples_kept,
        }

    def load_state_dict(self, state: dict) -> None:
        self.history.load_state_dict(state["history"])
        self.generator.set_state(state["generator"])
        self.examples_seen = int(state["examples_seen"])
        self._kept.fill_(int(state["examples_kept"]))
