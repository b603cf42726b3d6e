"""Which labels the model persistently disagrees with, from the training forward's own logits.

An example's margin is its given label's logit minus the largest other one (Pleiss et al., 2020,
"Identifying Mislabeled Data using the Area Under the Margin Ranking"): positive where the model
agrees with the label, negative where another class wins. A mislabelled example keeps a negative
margin until the network memorises it; a hard but correct one climbs above 0 as it is learnt.
AUM averages the margin over every epoch; raysb keeps a running margin that weighs the newest
training by MARGIN_DECAY, so an example that the model has come to agree with leaves the suspects
in a training or two instead of carrying its first epochs' margins forever.

Every function here is pure and vectorized over examples.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The newest margin's weight in the running margin: about the last two trainings decide.
MARGIN_DECAY = 0.5
# A suspect is confidently wrong only once it has been trained this often: a single training's margin
# may be the untrained network's (the first epoch's first steps).
MIN_TRAININGS = 2
# ...and while its running margin is below -CONFIDENT_MARGIN: the model holds another class at least e
# times as likely as the given label. Hard examples with correct labels hover near 0 and seldom go that
# far; a wrong label the model has not memorised sits well below (BENCHMARKS.md, "Labels the model
# disagrees with"). The estimate of wrong labels counts these, and label_doubt=tiered learns nothing
# from their labels once they have been trained SILENT_AFTER_TRAININGS times.
CONFIDENT_MARGIN = 1.0
# label_doubt=tiered trains a confidently wrong suspect with loss weight 0 only once it has been trained this
# often: its first trainings teach as anyone's, so a hard example whose label is right gets a few to be learnt
# from before it is silenced. Silenced from the second training, 20% flipped ended 0.19 and 0.14 points above
# Traditional at 1x and 2x of the work; from the fourth, 0.23 and 0.14 below it, and 2.26 below at 4x, where
# Traditional memorises the flipped labels (full Fashion-MNIST, seed 0; BENCHMARKS.md, "Silenced after four
# trainings"): at s = 1/3 the fourth training comes about the tenth epoch of 4x's ~30.
SILENT_AFTER_TRAININGS = 4
# label_doubt=auto doubts only in a run whose measure of its labels (recent_wrong_share, as the third epoch
# starts) is above this share: 6.6-8.9% on clean Fashion-MNIST (hard examples the model is sure of another
# class for), 23.2-23.6% with 20% of labels flipped (BENCHMARKS.md, "Doubt only where the labels look noisy").
NOISY_SHARE = 0.10


class LogitMargins(NamedTuple):
    """A forward's margins (the given label's logit minus the largest other), the labels it predicted
    (argmax) and the labels it was given."""

    margins: torch.Tensor
    predicted: torch.Tensor
    labels: torch.Tensor


class ClassLogits(NamedTuple):
    """A forward's class logits and the labels it was given, detached, in float32: what its margins are
    computed from (`logit_margins`). A training step only keeps them; the loss table computes the margins
    of every step since its last flush in one go, so a step pays no operation of its own for its signal."""

    logits: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, labels: torch.Tensor) -> ClassLogits:
        return cls(logits.detach().float(), labels.detach())


class ClassifiedLosses(NamedTuple):
    """What a loss function over class logits may return in place of its bare per-example losses:
    the losses with the forward's logits, whose margins raysb records as each trained example's signal."""

    losses: torch.Tensor
    logits: ClassLogits


def logit_margins(logits: torch.Tensor, labels: torch.Tensor) -> LogitMargins:
    """Each row's margin and its predicted label (argmax), in float32, without autograd."""
    logits = logits.detach().float()
    given = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    others = logits.scatter(1, labels.unsqueeze(1), float("-inf"))
    return LogitMargins(given - others.amax(1), logits.argmax(1), labels.detach())


def running_margin(previous: torch.Tensor, trainings: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The running margin after one more training whose margin is `new`: the first training's
    margin itself, then MARGIN_DECAY of the new one and the rest of the old."""
    return torch.where(trainings > 0, previous.lerp(new, MARGIN_DECAY), new)


def suspected(running: torch.Tensor, trainings: torch.Tensor) -> torch.Tensor:
    """Examples the model disagrees with on the balance of their recent trainings: trained, and their
    running margin below 0 (another class wins). One training is enough: the second epoch is the first
    that selects, and with only twice-trained examples doubted it doubted none and chose the wrong
    labels, whose first losses are the highest (40% of labels flipped, 10,000 examples, 2.5 epochs of
    work: 49% test error, against 15.8% doubting after one training and Traditional's 16.0%). Doubting
    too much costs little: a doubted example is drawn as `uniform` draws it, and a training that
    agrees with its label clears it."""
    return (trainings > 0) & (running < 0)


def confidently_wrong(running: torch.Tensor, trainings: torch.Tensor) -> torch.Tensor:
    """The suspects whose label the model is confident is wrong: trained at least MIN_TRAININGS times,
    and their running margin below -CONFIDENT_MARGIN."""
    return (trainings >= MIN_TRAININGS) & (running < -CONFIDENT_MARGIN)


def silenced(running: torch.Tensor, trainings: torch.Tensor) -> torch.Tensor:
    """The suspects label_doubt=tiered trains with loss weight 0: confidently wrong after at least
    SILENT_AFTER_TRAININGS trainings."""
    return confidently_wrong(running, trainings) & (trainings >= SILENT_AFTER_TRAININGS)


def estimated_wrong_share(running: torch.Tensor, trainings: torch.Tensor) -> float | None:
    """The run's estimate of its share of wrong labels: of the examples trained at all, those confidently
    wrong (None while none was trained MIN_TRAININGS times)."""
    if not bool((trainings >= MIN_TRAININGS).any()):
        return None
    return float(confidently_wrong(running, trainings).sum()) / int((trainings > 0).sum())


def recent_wrong_counts(running: torch.Tensor, trainings: torch.Tensor, recorded_epoch: torch.Tensor,
                        epoch: int) -> tuple[int, int]:
    """Of the examples trained in `epoch` that had been trained MIN_TRAININGS times by then: how many
    are confidently wrong, and how many there are (what recent_wrong_share divides; the counts of a
    sharded table's ranks add up)."""
    judged = (recorded_epoch == epoch) & (trainings >= MIN_TRAININGS)
    return int((confidently_wrong(running, trainings) & judged).sum()), int(judged.sum())


def recent_wrong_share(running: torch.Tensor, trainings: torch.Tensor, recorded_epoch: torch.Tensor,
                       epoch: int) -> float | None:
    """Of the examples trained in `epoch` that had been trained MIN_TRAININGS times by then, the share
    confidently wrong; None where there were none. In an epoch that doubts as uniform or tiered do (auto's
    second), the doubted are drawn at the uniform rate s and s of the rest are kept, so the epoch's
    trained examples sample the labels without favouring the doubted or the trusted.
    estimated_wrong_share counts every trained example, most of which were trained once as the third
    epoch starts and cannot yet be confidently wrong: with 20% of labels flipped it read under 10% there."""
    return share_of(*recent_wrong_counts(running, trainings, recorded_epoch, epoch))


def share_of(wrong: int, judged: int) -> float | None:
    """`wrong` of `judged` as a share; None where none was judged."""
    return wrong / judged if judged else None


def automatic_rule(share: float | None) -> str:
    """The rule label_doubt=auto applies, from its measure of the labels (recent_wrong_share, taken once,
    as the first epoch after one that trained examples a second time starts): tiered above NOISY_SHARE,
    off at or below it (on clean labels doubt costs accuracy and saves nothing), and uniform before the
    measure (the second epoch): left off there, the first epoch that selects would choose the wrong
    labels, whose losses are the highest, above all others."""
    if share is None:
        return "uniform"
    return "tiered" if share > NOISY_SHARE else "off"
