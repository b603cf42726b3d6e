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
"""

from __future__ import annotations

import math

import torch

from raysb.core.batch_former import Batch
from raysb.data.shards import MemoryShard
from raysb.data.transforms import BatchTransform, crop_and_flip_draws
from raysb.training.cuda_graphs import GraphedFunction, Replay, capture_restoring
from raysb.training.selection.keep_rule_graph import KeepRuleGraph
from raysb.training.selection.scoring import SelectionScorer
from raysb.training.selection.strategies.sb import SBStrategy


class RoundGraph:
    """SB's round over a chunk of `rule.rows` positions of `shard`, captured for each way BatchNorm
    normalizes in a selection forward (the chunk's statistics, or the running ones) and again whenever
    the keep rule's constants change. `__call__` returns the kept rows as a `Batch`, or None where the
    round runs eagerly (a chunk of another size, a recorded trace, a refused capture)."""

    def __init__(self, rule: KeepRuleGraph, shard: MemoryShard, transform: BatchTransform, scorer: SelectionScorer,
                 generator: torch.Generator, batch_size: int, with_probabilities: bool, replay: Replay):
        """`generator`: the augmentation's; `with_probabilities`: the kept rows carry their keep probability
        (the staleness correction weighs by it)."""
        self.rule, self.shard, self.transform, self.scorer = rule, shard, transform, scorer
        self.generator, self.batch_size, self.with_probabilities = generator, batch_size, with_probabilities
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
        """`chunk`'s kept rows under the weights of optimizer step `step`, and a value that is not finite
        where a selection loss was not (read with the training losses); None: decide it eagerly."""
        rule, selector, rows = self.rule, self.rule.selector, self.rows
        if self.refused is not None or len(chunk) != rows or selector.observer is not None or selector.beta <= 0:
            return None  # at s = 1 SB keeps every example unscored
        constants = rule.constants(selector.fixed_count_of(rows))
        if constants != self._constants:
            self._new_outputs(constants)
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
        rule.draws.uniform_(generator=selector.generator)  # torch.rand's draws, in place
        graph()
        rule.follow()
        selector.examples_seen += rows
        slot, count, check = self._slot, constants[0], self._check
        self._slot, self._check = (slot + 1) % self.slot_count, (check + 1) % len(self.finite_checks)
        part = slice(slot * count, (slot + 1) * count)
        labels_and_ids = self.kept_labels_and_ids[:, part]
        kept = Batch(labels_and_ids[1], {"inputs": self.kept_inputs[part], "labels": labels_and_ids[0]},
                     keep_probabilities=self.kept_probabilities[part] if self.with_probabilities else None)
        return kept, self.finite_checks[check]

    def _new_outputs(self, constants: tuple) -> None:
        """Output slots for rounds that keep `constants[0]` rows, the graphs captured for others dropped.
        Rows still queued from the old slots keep those alive, as views of them."""
        self._constants, self.graphs = constants, {}
        count = constants[0]
        self.slot_count = math.ceil(self.batch_size / max(1, count)) + 1
        images = self.shard.data.images
        self.kept_inputs = torch.zeros(self.slot_count * count, *images.shape[1:], device=self.device)
        self.kept_labels_and_ids = torch.zeros(2, self.slot_count * count, dtype=torch.int64, device=self.device)
        self.kept_probabilities = torch.zeros(self.slot_count * count, device=self.device)
        self.slot = torch.zeros((), dtype=torch.int64, device=self.device)
        self.slot_rows = torch.arange(count, device=self.device)
        self._slot = 0

    def _round(self, norms: list) -> None:
        """The round on the device: gather, augment, score, check, decide, and the kept rows into the slot."""
        data, positions, count = self.shard.data, self.positions, self._constants[0]
        inputs = self.transform.with_draws(data.images.index_select(0, positions), self.augmentation)
        labels_and_ids = torch.stack([data.labels.index_select(0, positions),
                                      data.sample_ids.index_select(0, positions)])
        with torch.no_grad():
            losses = self.scorer.losses_of(self.scorer.prepared(inputs), labels_and_ids[0], norms, cache=False)
        kept, probabilities, _ = self.rule.decide(losses, self.rule.draws, self._constants)
        into = self.slot * count + self.slot_rows
        self.kept_inputs.index_copy_(0, into, inputs.index_select(0, kept))
        self.kept_labels_and_ids.index_copy_(1, into, labels_and_ids.index_select(1, kept))
        if self.with_probabilities:
            self.kept_probabilities.index_copy_(0, into, probabilities.index_select(0, kept))
        # As the eager round's: a NaN or infinity makes the float64 sum non-finite.
        self.finite_checks.index_copy_(0, self.check.view(1), losses.sum(dtype=torch.float64).view(1))
        self.check.add_(1).remainder_(len(self.finite_checks))
        self.slot.add_(1).remainder_(self.slot_count)

    def _capture(self, norms: list) -> GraphedFunction | None:
        graph = GraphedFunction(lambda: self._round(norms), self.device, self.replay)
        self.refused = capture_restoring(graph, [*self.rule.state_tensors(), self.slot, self.check])
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
                   batch_size: int, with_probabilities: bool, device: torch.device, replay: Replay,
                   scoring_ahead: bool, lockstep: bool) -> RoundGraph | None:
    """A `RoundGraph` where the paper's SB keeps a fixed count with its keep rule captured
    (raysb.training.selection.keep_rule_graph) and the round can run whole on the device: one process,
    its examples in the device's memory, no scoring ahead, no cutout (drawn as it augments), no int8
    copy (which scores on the CPU). Elsewhere None: the rounds run eagerly."""
    if type(strategy) is not SBStrategy or not isinstance(strategy.selector.captured_rule, KeepRuleGraph):
        return None  # Stale-SB's passes also record their losses: its rounds decide with the captured rule alone
    if (lockstep or scoring_ahead or not isinstance(shard, MemoryShard) or shard.device != device
            or transform.cutout_length or scorer.quantized is not None):
        return None
    rule = strategy.selector.captured_rule
    return RoundGraph(rule, shard, transform, scorer, generator, batch_size, with_probabilities, replay)
