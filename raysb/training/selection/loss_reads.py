"""The training and selection losses as the rounds read them: a loss function's call and checks, and
the reads that bring the losses to the host, summed and agreed finite on every rank.

On a GPU a read is a wait for the device, so the rounds read every `every` steps (and at an epoch's
end), each read taking every unread step's loss and every round's selection losses' finiteness in
one copy. A non-finite one stops every rank together, naming the first step or round it was in.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from raysb.core.batch_former import Batch
from raysb.core.errors import AgreedError, BadBatchError, NonFiniteLossError
from raysb.core.keep_rule import staleness_weights
from raysb.core.label_doubt import ClassifiedLosses, ClassLogits
from raysb.core.transfer import to_host

# One loss per example, or a ClassifiedLosses where the loss comes from class logits (their margins
# then record each trained example's signal, raysb.core.label_doubt).
LossFunction = Callable[[torch.nn.Module, Batch], "torch.Tensor | ClassifiedLosses"]


def called(loss_fn: LossFunction, model: torch.nn.Module, batch: Batch,
           purpose: str) -> tuple[torch.Tensor, ClassLogits | None]:
    """`loss_fn(model, batch)` as (per-example losses, their forward's logits or None), its failures
    turned into a BadBatchError every rank can raise."""
    try:
        output = loss_fn(model, batch)
    except AgreedError:
        raise
    except Exception as error:
        raise BadBatchError(f"loss_fn raised {type(error).__name__} in {purpose}: {error}") from error
    if isinstance(output, ClassifiedLosses):
        return output.losses, output.logits
    return output, None


def check_per_example(losses, rows: int, purpose: str) -> None:
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (rows,):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise BadBatchError(
            f"the loss function must return one loss per example, shape ({rows},), in {purpose}; it returned "
            f"{shape} (use reduction='none')"
        )


def batch_loss(losses: torch.Tensor, batch: Batch, staleness_selector=None) -> torch.Tensor:
    """The loss to backpropagate from a batch's per-example `losses`: their mean, weighted by the batch's
    weights, or where the staleness correction is on (`staleness_selector`, the keep rule), by how much
    likelier selection keeps each example now than when it kept it."""
    if batch.weights is not None:
        return (losses * batch.weights).mean()
    if staleness_selector is not None and batch.keep_probabilities is not None:
        # The training forward's own losses say what selection would keep now.
        now = staleness_selector.current_keep_probabilities(losses)
        weights = staleness_weights(now, batch.keep_probabilities)
        # Self-normalised: the step keeps its size however stale the batch was.
        return (losses * weights).sum() / weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)
    return losses.mean()


class LossReads:
    def __init__(self, every: int = 1):
        """`every`: training losses are read to the host (summed, and checked finite on every rank) every
        this many steps and at an epoch's end; 1 checks each before its backward."""
        if every < 1:
            raise ValueError(f"loss_read_every must be >= 1, got {every}")
        self.every = every
        # The training losses of the epoch's last steps not read yet, one a step, in order (the rounds
        # append them).
        self.unread: list[torch.Tensor] = []
        # Each round's selection losses' sum since the last read, on their device, with the round and the
        # steps taken before it: (round, steps, sum).
        self.selection_sums: list[tuple[int, int, torch.Tensor]] = []
        self.loss_sum = 0.0  # the running epoch's training losses read so far

    def new_epoch(self) -> None:
        self.loss_sum = 0.0

    def clear(self) -> None:
        """Whether the epoch ended or failed: nothing of it is left to read."""
        self.unread.clear()
        self.selection_sums = []

    def read(self, strategy, exchange, epoch_number: int, last_step: int) -> None:
        """The unread steps' training losses (the last of them the epoch's step `last_step`) and the
        selection losses' finiteness in one host read (on a GPU, the wait for their forwards): the
        training losses summed for the epoch, and both agreed finite on every rank over `exchange`.
        Every rank reads at the same steps. The `strategy` is told (`after_loss_read`): device state
        can come to the host now at no wait."""
        losses = torch.stack(self.unread).double() if self.unread else None
        scored = self.selection_sums
        self.unread.clear()
        self.selection_sums = []
        parts = [losses.sum().view(1)] if losses is not None else []
        for _, _, total in scored:
            parts.append(total)
        if not parts:
            strategy.after_loss_read()
            return
        # The one read: the training losses' sum, then each round's selection losses' sum.
        device = parts[0].device
        for i, part in enumerate(parts):
            parts[i] = part.reshape(1).to(device)
        read = to_host(torch.cat(parts)).tolist()
        strategy.after_loss_read()
        failure = None
        if losses is not None:
            total = read.pop(0)
            self.loss_sum += total
            if not math.isfinite(total):
                failure = _training_failure(losses, last_step - len(losses) + 1, epoch_number)
        for (index, steps, _), total in zip(scored, read):
            if not math.isfinite(total):
                # The one that happened first: a round scored before step k + 1 comes before that step.
                if failure is None or steps + 1 <= failure[0]:
                    failure = steps + 1, NonFiniteLossError(
                        f"selection losses are not finite at epoch {epoch_number}, round {index + 1}; "
                        "lower the learning rate or check the data and labels"
                    )
                break
        exchange.agree(None if failure is None else failure[1])

    def unread_sum(self) -> float:
        """The unread losses' sum, leaving them unread: progress lines ask on one rank alone, and only
        `read`, which every rank reaches at the same step, may agree on them."""
        return float(torch.stack(self.unread).sum()) if self.unread else 0.0


def _training_failure(losses: torch.Tensor, first_step: int, epoch_number: int) -> tuple[int, NonFiniteLossError]:
    """The first non-finite of the steps' `losses` (the first the epoch's step `first_step`), as an error."""
    values = to_host(losses).tolist()
    bad = next(i for i, value in enumerate(values) if not math.isfinite(value))
    step = first_step + bad
    return step, NonFiniteLossError(
        f"training loss is not finite (here {values[bad]}) at epoch {epoch_number}, "
        f"step {step}; lower the learning rate or check the data and labels"
    )
