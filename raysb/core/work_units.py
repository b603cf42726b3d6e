"""A budget counted in work instead of seconds: what a run did, not how busy the machine was.

A time budget follows the wall clock, so the same seed and budget end differently on a loaded
machine and an idle one. Work is counted in training examples (a forward and a backward each),
plus every scoring forward's examples weighted by that forward's cost relative to a training
example, measured once on the run's machine and model (raysb.training.scoring_cost) and stored with the
run. A strategy that scores nothing (Traditional, uniform, free-sb, InfoBatch) needs no
measurement: its work is its trained examples, the same on any machine.
"""

from __future__ import annotations


def work_epochs(
    trained_examples: int, scored_examples: int, scoring_cost: float, world_size: int, train_size: int
) -> float:
    """Work done, in epochs of Traditional training (`train_size` trained examples each), from one
    rank's counts: lockstep ranks train the same number of examples and score shards of one size."""
    return world_size * (trained_examples + scoring_cost * scored_examples) / train_size
