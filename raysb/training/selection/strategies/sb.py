"""Selective-Backprop: every example scored every epoch, kept with probability CDF_R(loss) ** beta."""

from __future__ import annotations

import torch

from raysb.core.keep_rule import Selector
from raysb.core.spec import SelectionSpec
from raysb.training.selection.strategies.base import Decision, Scores, Strategy


def cdf_selector(spec: SelectionSpec, history, device) -> Selector:
    """The selector that ranks a run's losses on CDF_R: `history` where the ranks share one."""
    return Selector(beta=spec.beta, history_size=spec.history_size, seed=spec.seed, device=device, history=history,
                    keep_floor=spec.keep_floor)


def fixed_count(spec: SelectionSpec, device) -> bool:
    """Whether SB keeps a fixed count of each chunk: `kept_per_chunk` auto means on a GPU, where an eager
    round's random count, read every round, would stop the host from queuing ahead (SB's captured round
    learns it rounds late; BENCHMARKS.md, "The paper's per-example draw in SB's round graph": its final
    error on a GPU decides whether the paper's rule becomes the GPU default)."""
    return spec.kept_per_chunk == "fixed" or (spec.kept_per_chunk == "auto" and torch.device(device).type == "cuda")


class SBStrategy(Strategy):
    """Score every example each epoch; keep it with probability CDF_R(loss) ** beta."""

    name = "sb"

    def __init__(self, selector: Selector, fixed_count: bool = False):
        """`fixed_count`: keep exactly round(s n) of each chunk (`Selector.kept_positions`), which no round
        waits for; else each example by its own draw, whose count a GPU reads every eager round."""
        self.selector = selector
        self.fixed_count = fixed_count

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> SBStrategy:
        return cls(cdf_selector(spec, history, device), fixed_count(spec, device))

    def wants_scores(self, epoch: int, ids: torch.Tensor) -> Scores | torch.Tensor:
        # At s = 1 (beta 0) P = CDF_R ** 0 keeps every example: a forward would choose nothing.
        return Scores.ALL if self.selector.beta > 0 else Scores.NONE

    def decide(self, epoch: int, ids: torch.Tensor, scores: torch.Tensor | None) -> Decision:
        return Decision() if scores is None else self._keep(ids, scores)

    def _keep(self, ids: torch.Tensor, losses: torch.Tensor) -> Decision:
        """The kept positions, with the probability every example was kept with."""
        # Non-finite losses are caught where the rounds read the training losses.
        kept, probabilities = self.selector.kept_positions(losses, ids, fixed_count=self.fixed_count)
        return Decision(kept, keep_probabilities=probabilities)

    def scores_whole_chunks(self, epoch: int) -> bool:
        return self.selector.beta > 0

    def device_tensors(self) -> list[torch.Tensor]:
        # CDF_R and the kept count live where the selection losses are.
        return self.selector.state_tensors()

    def state_dict(self) -> dict:
        return {"selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.selector.load_state_dict(state["selector"])
