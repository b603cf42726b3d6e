"""SB's fixed-count keep rule replayed as one CUDA graph a selection round.

Eagerly, a round's decision is about thirty small operations: the chunk's losses written into
CDF_R's ring, the ring sorted, the losses ranked in it, P = rank ** beta, the inclusion
probabilities that keep exactly round(s n) and the systematic walk that picks them
(raysb.core.keep_rule). On a GPU each is a kernel launch and a few microseconds of the host's
time, every round (BENCHMARKS.md, the launch count). Every shape in it is fixed by the selection
chunk and R, so the whole decision is captured once and replayed: the ring's next slot and fill
live on the device and advance in the graph, with the host following them by arithmetic
(the ring's state dict, and the eager rule where a chunk of another size comes, read them).

The draws come from the selector's own generator, outside the graph, as the eager rule draws
them, so a captured run keeps the eager run's random stream and, on the CPU, its every decision
(tests/test_keep_rule_graph.py). On CUDA the graph divides the ranks by a device count where the
eager rule multiplies by a host reciprocal, which can move a rank by one rounding step.

The paper's per-example rule has the same device form (`decide_each`), used inside SB's round graph
(raysb.training.selection.round_graph), whose device queue takes its kept rows; alone it stays eager,
since taking its kept rows needs their count.
"""

from __future__ import annotations

import torch

from raysb.core.keep_rule import LossHistory, Selector, filled_percentile_ranks, fixed_count_keep, keep_from_ranks
from raysb.training.cuda_graphs import GraphedFunction, Replay, capture_restoring
from raysb.training.selection.strategies.sb import SBStrategy


class KeepRuleGraph:
    """`selector`'s fixed-count rule for chunks of `rows` losses, captured at its first such chunk and
    again whenever the rule's constants change (an epoch's scheduled selectivity or strength). Set as
    `selector.captured_rule`: `__call__(losses, draws, count)` returns the kept positions, P and the
    ranks, or None for a chunk of another size (the selector decides it eagerly)."""

    def __init__(self, selector: Selector, rows: int, device: torch.device, replay: Replay):
        history = selector.history
        if not isinstance(history, LossHistory):
            raise ValueError("a captured keep rule ranks against a rank's own CDF_R ring, not a merged histogram")
        if not 0 < rows < history.capacity:
            raise ValueError(f"a captured keep rule needs chunks of fewer than R = {history.capacity} losses, got {rows}")
        self.selector, self.history, self.rows, self.device, self.replay = selector, history, rows, device, replay
        self.losses = torch.zeros(rows, device=device)
        self.draws = torch.zeros(rows + 1, device=device)
        # The ring's next slot and fill as the graph reads them; `_synced` is the host's record of
        # what they hold, so that an eager write or a restored state is copied in before a replay.
        self.next_slot = torch.zeros((), dtype=torch.int64, device=device)
        self.filled = torch.zeros((), dtype=torch.int64, device=device)
        self.offsets = torch.arange(rows, device=device)
        self._synced: tuple[int, int] | None = None
        self._graph: GraphedFunction | None = None
        self._constants: tuple | None = None
        self.refused: str | None = None
        self.captures = 0

    def __call__(self, losses: torch.Tensor, draws: torch.Tensor, count: int):
        if self.refused is not None or len(losses) != self.rows:
            return None
        self.sync_cursor()
        constants = self.constants(count)
        if constants != self._constants and not self._capture(constants):
            return None
        self.losses.copy_(losses)
        self.draws.copy_(draws)
        kept, probabilities, ranks = self._graph()
        self.follow()
        # The next replay overwrites the graph's outputs; the kept positions are used before it.
        return kept, probabilities.clone(), ranks if self.selector.observer is None else ranks.clone()

    # -- what a graph that decides with this rule shares (this one, and raysb.training.selection.round_graph) --
    def constants(self, count: int | None) -> tuple:
        """What a captured decision of `count` kept examples (None: each by its own draw) bakes in: a change
        needs a new capture."""
        selector = self.selector
        return count, selector.beta, selector.keep_floor, selector.strength

    def sync_cursor(self) -> None:
        """The ring's next slot and fill copied to the device where the host's differ from what they hold
        (an eager write, a restored state)."""
        cursor = self.history.cursor
        if cursor != self._synced:
            self.next_slot.fill_(cursor[0])
            self.filled.fill_(cursor[1])
            self._synced = cursor

    def follow(self) -> None:
        """After a replay: the host follows the ring as the graph moved it."""
        self.history.advance(self.rows)
        self._synced = self.history.cursor

    def state_tensors(self) -> list[torch.Tensor]:
        """What `decide` writes in place (a capture's warmup writes undone)."""
        return [self.history.slots, self.next_slot, self.filled, self.selector.kept_counter]

    def decide(self, losses: torch.Tensor, draws: torch.Tensor,
               constants: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rule on the device, every shape fixed: `losses` into the ring, their ranks against it, the
        `count` kept positions and every P (`draws`: the walk's offset, then a tie-break each)."""
        count, beta, floor, strength = constants
        ranks = self._ranked(losses, draws[1:])
        kept, probabilities = fixed_count_keep(ranks, draws[0], count, beta, floor, strength)
        self.selector.kept_counter.add_(count)
        return kept, probabilities, ranks

    def decide_each(self, losses: torch.Tensor, draws: torch.Tensor,
                    constants: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The paper's rule on the device: `losses` into the ring, their ranks against it, each example kept
        where its draw falls below its P (`draws`: the tie-breaks, then the keep draws, as
        `Selector.keep_mask_and_probabilities` draws them). The keep mask, and every P."""
        _, beta, floor, strength = constants
        ranks = self._ranked(losses, draws[0])
        keep, probabilities = keep_from_ranks(ranks, draws[1], beta, floor, strength)
        self.selector.kept_counter.add_(keep.sum())
        return keep, probabilities

    def _ranked(self, losses: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
        """`losses` written into CDF_R's ring at its next slots, and their ranks against the filled ring."""
        history = self.history
        ring = history.slots
        ring.index_copy_(0, (self.next_slot + self.offsets).remainder_(history.capacity), losses)
        self.next_slot.add_(self.rows).remainder_(history.capacity)
        self.filled.add_(self.rows).clamp_(max=history.capacity)
        return filled_percentile_ranks(ring, self.filled, losses, tie_break)

    def _capture(self, constants: tuple) -> bool:
        self._constants = constants
        graph = GraphedFunction(lambda: self.decide(self.losses, self.draws, constants), self.device, self.replay)
        self.refused = capture_restoring(graph, self.state_tensors())
        self._graph = graph if self.refused is None else None
        self.captures += self.refused is None
        return self.refused is None

    def captured_graphs(self) -> list[GraphedFunction]:
        return [self._graph] if self._graph is not None else []

    def stats(self) -> dict:
        """For a run's summary: how often the rule was captured, and why it decides eagerly if it does."""
        stats = {"keep_rule_graphs": self.captures}
        if self.refused is not None:
            stats["keep_rule_capture_refused"] = self.refused
        return stats


def capture_keep_rule(strategy, rows: int, device: torch.device, replay: Replay) -> None:
    """Replay `strategy`'s keep rule as a graph where it keeps a fixed count of chunks of `rows` against
    its own CDF_R ring (SB and Stale-SB on one GPU); elsewhere it stays eager."""
    if not (isinstance(strategy, SBStrategy) and strategy.fixed_count):
        return
    try:
        strategy.selector.captured_rule = KeepRuleGraph(strategy.selector, rows, device, replay)
    except ValueError:  # lockstep ranks' merged histogram, or chunks of R or more: decided eagerly
        pass
