"""SB's selection round as one CUDA graph: a chunk's positions in, its kept rows out.

Eagerly a round gathers its chunk's examples, crops, flips and normalizes them, scores them, checks the
losses finite, decides with the keep rule and gathers the kept rows: each step a few kernel launches and
host operations, sixty a round (BENCHMARKS.md, the launch count). Where the examples are in the device's
memory and the rule keeps a fixed count, every shape in that is fixed, so the whole round is captured
once and replayed. Outside the graph the host writes the chunk's positions, the augmentation's draws and
the keep rule's draws into the graph's buffers, drawing from the generators the eager round draws from,
in the same order, so a captured round decides and augments as the eager round does
(tests/test_round_graph.py).

The kept rows go into a ring of output slots that the training queue reads without a copy. The queue
hands out its oldest rows first (raysb.core.batch_former) and steps take every full batch after each
round, so the rows a round leaves queued (at least one) are taken once later rounds bring the rest of a
batch: after at most ceil((b - 1) / kept) more rounds, whose slots are written before that step, and a
step trains on its rows before the next round. With ceil(b / kept) + 1 slots no slot is written while
its rows are still queued (tests/test_round_graph.py fails with one fewer).

The paper's per-example draw keeps a count only the device knows. Its round writes the kept rows into a
device queue (`KeptQueue`) at places a cumulative sum of the keep mask gives them, and the count is
copied to the host without a wait; the host learns it `lag` rounds later (waiting, if at all, for work
that old) and hands those rows to the training queue then, every round still in flight by the epoch's
end. On the CPU the lag is 0, and a captured run trains the eager rule's rows step for step.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from raysb.core.batch_former import Batch
from raysb.data.shards import MemoryShard
from raysb.data.transforms import BatchTransform, crop_and_flip_draws
from raysb.training.cuda_graphs import GraphedFunction, Replay, capture_restoring
from raysb.training.selection.keep_rule_graph import KeepRuleGraph
from raysb.training.selection.scoring import SelectionScorer
from raysb.training.selection.strategies.sb import SBStrategy

# Rounds a CUDA run learns a per-example round's kept count late: the host queues that much work ahead of
# the device instead of waiting for each round's count.
CUDA_COUNT_LAG = 2


class OutputRows:
    """Device rows a round graph writes kept examples into (inputs, labels and ids, keep probabilities),
    handed to the training queue as views."""

    def __init__(self, image_shape: torch.Size, device: torch.device, with_probabilities: bool):
        self.image_shape, self.device, self.with_probabilities = image_shape, device, with_probabilities

    def allocate(self, rows: int) -> None:
        self.inputs = torch.zeros(rows, *self.image_shape, device=self.device)
        self.labels_and_ids = torch.zeros(2, rows, dtype=torch.int64, device=self.device)
        self.probabilities = torch.zeros(rows, device=self.device)

    def state_tensors(self) -> list[torch.Tensor]:
        """What a round writes in place, for a capture to undo its warmup's writes: those rounds write
        ahead of the one captured, where rows still queued may be."""
        return [self.inputs, self.labels_and_ids, self.probabilities]

    def rows(self, part: slice) -> Batch:
        labels_and_ids = self.labels_and_ids[:, part]
        return Batch(labels_and_ids[1], {"inputs": self.inputs[part], "labels": labels_and_ids[0]},
                     keep_probabilities=self.probabilities[part] if self.with_probabilities else None)


class KeptSlots(OutputRows):
    """Where a round that keeps a fixed count puts its kept rows: a ring of output slots of that count,
    which the training queue reads as views (ceil(b / kept) + 1 of them: the module's docstring)."""

    def __init__(self, rule: KeepRuleGraph, image_shape: torch.Size, batch_size: int, with_probabilities: bool):
        super().__init__(image_shape, rule.device, with_probabilities)
        self.rule, self.batch_size = rule, batch_size
        self.draws = rule.draws  # the walk's offset, then a tie-break each
        self.slot = torch.zeros((), dtype=torch.int64, device=self.device)
        self._slot = self.slot_count = 0

    def count_of(self, rows: int) -> int:
        return self.rule.selector.fixed_count_of(rows)

    def prepare(self, constants: tuple) -> None:
        """Output slots for rounds that keep `constants[0]` rows. Rows still queued from the old slots keep
        those alive, as views of them."""
        count = constants[0]
        self.slot_count = math.ceil(self.batch_size / max(1, count)) + 1
        self.allocate(self.slot_count * count)
        self.slot.zero_()
        self.slot_rows = torch.arange(count, device=self.device)
        self._slot = 0

    def write(self, losses: torch.Tensor, inputs: torch.Tensor, labels_and_ids: torch.Tensor,
              constants: tuple) -> None:
        """On the device: the fixed count decided, and the kept rows into the next slot."""
        kept, probabilities, _ = self.rule.decide(losses, self.draws, constants)
        into = self.slot * constants[0] + self.slot_rows
        self.inputs.index_copy_(0, into, inputs.index_select(0, kept))
        self.labels_and_ids.index_copy_(1, into, labels_and_ids.index_select(1, kept))
        if self.with_probabilities:
            self.probabilities.index_copy_(0, into, probabilities.index_select(0, kept))
        self.slot.add_(1).remainder_(self.slot_count)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.slot, *super().state_tensors()]

    def handed(self) -> Batch:
        """After a replay: the slot it wrote, as the round's kept rows."""
        slot, count = self._slot, len(self.slot_rows)
        self._slot = (slot + 1) % self.slot_count
        return self.rows(slice(slot * count, (slot + 1) * count))

    def drained(self) -> None:
        """Nothing: each round's rows are handed over as it ends."""


class KeptQueue(OutputRows):
    """Where a round that keeps each example by its own draw puts its kept rows: a device queue, written in
    the graph from its tail (from its start where a whole chunk would not fit before its end, so that a
    round's rows are one view), whose rows the host hands to the training queue once it learns their count,
    `lag` rounds later. At most b - 1 rows wait for a step after each round and at most `lag` rounds' rows
    for their count, so with the gap a round leaves at the end, b + (lag + 2) chunks never overwrite a row
    still queued; the rows a round does not keep are written past them, a place each."""

    def __init__(self, rule: KeepRuleGraph, image_shape: torch.Size, batch_size: int, with_probabilities: bool,
                 lag: int):
        super().__init__(image_shape, rule.device, with_probabilities)
        self.rule, self.lag, self.chunk, device = rule, lag, rule.rows, rule.device
        self.capacity = batch_size + (lag + 2) * self.chunk
        self.allocate(self.capacity + self.chunk)
        self.unkept_places = torch.arange(self.capacity, self.capacity + self.chunk, device=device)
        self.draws = torch.zeros(2, self.chunk, device=device)  # the tie-breaks, then the keep draws
        self.tail = torch.zeros((), dtype=torch.int64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        # The counts of the rounds in flight, copied without a wait (pinned: the copy does not block the host)
        # and read through an array that shares their memory (no operation of the framework's).
        self.counts = torch.zeros(lag + 1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.count_values = self.counts.numpy()
        self.copied = [torch.cuda.Event() for _ in range(lag + 1)] if device.type == "cuda" else None
        self.in_flight: deque[int] = deque()
        self._tail = self._next = 0

    def count_of(self, rows: int) -> None:
        return None

    def prepare(self, constants: tuple) -> None:
        """Nothing to resize: the queue's rows do not depend on the rule's constants."""

    def write(self, losses: torch.Tensor, inputs: torch.Tensor, labels_and_ids: torch.Tensor,
              constants: tuple) -> None:
        """On the device: each example's draw, and the kept rows in the chunk's order from the queue's tail."""
        keep, probabilities = self.rule.decide_each(losses, self.draws, constants)
        places = keep.cumsum(0)
        start = self.tail.masked_fill(self.tail > self.capacity - self.chunk, 0)
        into = torch.where(keep, (places - 1).add_(start), self.unkept_places)
        self.inputs.index_copy_(0, into, inputs)
        self.labels_and_ids.index_copy_(1, into, labels_and_ids)
        if self.with_probabilities:
            self.probabilities.index_copy_(0, into, probabilities)
        self.count.copy_(places[-1])
        self.tail.copy_(start + self.count)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.tail, self.count, *super().state_tensors()]

    def handed(self) -> Batch:
        """After a replay: its count copied to the host, and the rows of the round `lag` rounds back."""
        place = self._next
        self._next = (place + 1) % (self.lag + 1)
        self.counts[place].copy_(self.count, non_blocking=True)
        if self.copied is not None:
            self.copied[place].record()
        self.in_flight.append(place)
        return self._learned(len(self.in_flight) - self.lag)

    def drained(self) -> Batch | None:
        """The rows of every round still in flight (before an eager round's, and as an epoch may end), or None
        where there are none."""
        rows = self._learned(len(self.in_flight)) if self.in_flight else None
        return rows if rows is not None and len(rows) else None

    def _learned(self, rounds: int) -> Batch:
        """The rows of the oldest `rounds` rounds in flight, their counts read (waiting for those rounds), the
        host following the device's tail as `write` moved it."""
        parts = []
        for _ in range(rounds):
            place = self.in_flight.popleft()
            if self.copied is not None:
                self.copied[place].synchronize()
            start = 0 if self._tail > self.capacity - self.chunk else self._tail
            self._tail = start + int(self.count_values[place])
            parts.append(self.rows(slice(start, self._tail)))
        if len(parts) <= 1:  # none while the first `lag` rounds are in flight
            return parts[0] if parts else self.rows(slice(0, 0))
        return Batch.concat(parts)


class RoundGraph:
    """SB's round over a chunk of `rule.rows` positions of `shard`, captured for each way BatchNorm
    normalizes in a selection forward (the chunk's statistics, or the running ones) and again whenever
    the keep rule's constants change. `outputs` decides and takes the kept rows: `KeptSlots` for a
    fixed count, `KeptQueue` for the paper's per-example draw. `__call__` returns the kept rows the
    training queue takes now, or None where the round runs eagerly (a chunk of another size, a
    recorded trace, a refused capture)."""

    def __init__(self, rule: KeepRuleGraph, shard: MemoryShard, transform: BatchTransform, scorer: SelectionScorer,
                 generator: torch.Generator, outputs: KeptSlots | KeptQueue, replay: Replay):
        """`generator`: the augmentation's."""
        self.rule, self.shard, self.transform, self.scorer = rule, shard, transform, scorer
        self.generator, self.outputs = generator, outputs
        self.device, self.replay, self.rows = rule.device, replay, rule.rows
        self.positions = torch.zeros(self.rows, dtype=torch.int64, device=self.device)
        # Each round's selection losses' float64 sum, non-finite where one was, read with the training
        # losses: at the latest as the epoch ends (raysb.training.selection.loss_reads), so one an epoch's
        # rounds is never overwritten unread.
        self.finite_checks = torch.zeros(math.ceil(shard.num_examples / self.rows) + 1, dtype=torch.float64,
                                         device=self.device)
        self.check = torch.zeros((), dtype=torch.int64, device=self.device)
        self._check = 0
        self.augmentation = torch.zeros(3, self.rows, dtype=torch.int64, device=self.device)
        self.graphs: dict[bool, GraphedFunction] = {}
        self.refused: str | None = None
        self.captures = 0
        self._constants: tuple | None = None

    def __call__(self, chunk: torch.Tensor, step: int) -> tuple[Batch, torch.Tensor] | None:
        """The kept rows the training queue takes after `chunk`'s round under the weights of optimizer step
        `step`, and a value that is not finite where a selection loss was not (read with the training
        losses); None: decide it eagerly."""
        rule, selector, rows = self.rule, self.rule.selector, self.rows
        if self.refused is not None or len(chunk) != rows or selector.observer is not None or selector.beta <= 0:
            return None  # at s = 1 SB keeps every example unscored
        constants = rule.constants(self.outputs.count_of(rows))
        if constants != self._constants:
            self._constants, self.graphs = constants, {}
            self.outputs.prepare(constants)
        norms = self.scorer.norms_at(step)
        rule.sync_cursor()
        self.scorer.model.eval()
        graph = self.graphs.get(bool(norms)) or self._capture(norms)
        if graph is None:
            return None
        # Drawn after any capture, so that a refused one leaves the eager round the draws it would have made.
        self.positions.copy_(chunk, non_blocking=True)  # the epoch's order is pinned (MemoryShard.epoch_order)
        staging = torch.empty((3, rows), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        crop_and_flip_draws(rows, self.transform.crop_padding, self.transform.horizontal_flip, self.generator,
                            out=staging)
        self.augmentation.copy_(staging, non_blocking=True)
        self.outputs.draws.uniform_(generator=selector.generator)  # torch.rand's draws, in place
        graph()
        rule.follow()
        selector.examples_seen += rows
        check = self._check
        self._check = (check + 1) % len(self.finite_checks)
        return self.outputs.handed(), self.finite_checks[check]

    def drained(self) -> Batch | None:
        """The kept rows of captured rounds the training queue has not taken yet, or None."""
        return self.outputs.drained()

    def _round(self, norms: list) -> None:
        """The round on the device: gather, augment, score, check, decide, and the kept rows out."""
        data, positions = self.shard.data, self.positions
        inputs = self.transform.with_draws(data.images.index_select(0, positions), self.augmentation)
        labels_and_ids = torch.stack([data.labels.index_select(0, positions),
                                      data.sample_ids.index_select(0, positions)])
        with torch.no_grad():
            losses = self.scorer.losses_of(self.scorer.prepared(inputs), labels_and_ids[0], norms, cache=False)
        self.outputs.write(losses, inputs, labels_and_ids, self._constants)
        # As the eager round's: a NaN or infinity makes the float64 sum non-finite.
        self.finite_checks.index_copy_(0, self.check.view(1), losses.sum(dtype=torch.float64).view(1))
        self.check.add_(1).remainder_(len(self.finite_checks))

    def _capture(self, norms: list) -> GraphedFunction | None:
        graph = GraphedFunction(lambda: self._round(norms), self.device, self.replay)
        # Everything the warmup writes, undone: its rounds write the output rows, and the finite checks, of
        # rounds ahead of this one, where rows still queued and checks still unread may be.
        self.refused = capture_restoring(graph, [*self.rule.state_tensors(), *self.outputs.state_tensors(),
                                                 self.check, self.finite_checks])
        if self.refused is not None:
            return None
        self.graphs[bool(norms)] = graph
        self.captures += 1
        return graph

    def captured_graphs(self) -> list[GraphedFunction]:
        return list(self.graphs.values())

    def stats(self) -> dict:
        """For a run's summary: how often the round was captured, and why it runs eagerly if it does."""
        stats = {"round_graphs": self.captures}
        if self.refused is not None:
            stats["round_capture_refused"] = self.refused
        return stats


def capture_rounds(strategy, shard, transform: BatchTransform, scorer: SelectionScorer, generator: torch.Generator,
                   rows: int, batch_size: int, with_probabilities: bool, device: torch.device, replay: Replay,
                   scoring_ahead: bool, lockstep: bool) -> RoundGraph | None:
    """A `RoundGraph` where the paper's SB decides against its own CDF_R ring and the round can run whole
    on the device: one process, its examples in the device's memory, no scoring ahead, no cutout (drawn
    as it augments), no int8 copy (which scores on the CPU). A fixed count shares the captured keep rule
    (raysb.training.selection.keep_rule_graph); the per-example draw gets a device form of its own.
    Elsewhere None: the rounds run eagerly. `rows`: the selection chunk; `with_probabilities`: the kept rows carry their keep
    probability (the staleness correction weighs by it)."""
    if type(strategy) is not SBStrategy:
        return None  # Stale-SB's passes also record their losses: its rounds decide with the captured rule alone
    if (lockstep or scoring_ahead or not isinstance(shard, MemoryShard) or shard.device != device
            or transform.cutout_length or scorer.quantized is not None):
        return None
    image_shape = shard.data.images.shape[1:]
    if strategy.fixed_count:
        rule = strategy.selector.captured_rule
        if not isinstance(rule, KeepRuleGraph):
            return None
        outputs = KeptSlots(rule, image_shape, batch_size, with_probabilities)
    else:
        try:
            rule = KeepRuleGraph(strategy.selector, rows, device, replay)
        except ValueError:  # chunks of R or more: decided eagerly
            return None
        outputs = KeptQueue(rule, image_shape, batch_size, with_probabilities,
                            CUDA_COUNT_LAG if device.type == "cuda" else 0)
    return RoundGraph(rule, shard, transform, scorer, generator, outputs, replay)
