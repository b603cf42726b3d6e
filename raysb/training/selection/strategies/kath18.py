"""Katharopoulos & Fleuret (2018) importance sampling, as the SB paper evaluated it."""

from __future__ import annotations

import torch

from raysb.core.batch_former import Batch
from raysb.core.importance_sampling import VarianceReductionGate, default_tau_threshold, importance_sample
from raysb.training.selection.strategies.base import Decision, Scores, Strategy


class Kath18Strategy(Strategy):
    """Importance sampling baseline: each chunk of B = b / selectivity yields one batch of b."""

    name = "kath18"

    def __init__(
        self,
        batch_size: int,
        presample_size: int,
        seed: int,
        tau_threshold: float | None = None,
        reweight: bool = False,
        device: torch.device | str = "cpu",
    ):
        self.batch_size = batch_size
        self.presample_size = presample_size
        threshold = tau_threshold or default_tau_threshold(self.presample_size, batch_size)
        self.gate = VarianceReductionGate(threshold, device=device)
        self.reweight = reweight
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> Kath18Strategy:
        # Its rounds read the presample of B = b / s (its card's chunk_size).
        return cls(spec.batch_size, spec.chunk_size, spec.seed, spec.options["kath18_tau_threshold"],
                   spec.options["kath18_reweight"], device)

    def scores_whole_chunks(self, epoch: int) -> bool:
        return self.gate.open

    def wants_scores(self, epoch: int, ids: torch.Tensor) -> Scores | torch.Tensor:
        return Scores.ALL if self.gate.open else Scores.NONE

    def decide(self, epoch: int, ids: torch.Tensor, scores: torch.Tensor | None) -> Decision:
        if scores is None:
            # Chunks arrive shuffled, so the head of one is a uniform sample.
            return Decision(torch.arange(min(self.batch_size, len(ids))))
        self.gate.update(scores)
        draw, weights = importance_sample(scores, self.batch_size, self.generator)
        return Decision(draw, weights if self.reweight else None)

    def observe_training_losses(self, batch: Batch, losses: torch.Tensor, margins=None) -> None:
        # Training losses are checked finite where the rounds read them.
        if not self.gate.open:
            self.gate.update(losses)

    def after_loss_read(self) -> None:
        self.gate.refresh()

    def device_tensors(self) -> list[torch.Tensor]:
        return [self.gate.tau]

    def state_dict(self) -> dict:
        return {"gate": self.gate.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gate.load_state_dict(state["gate"])
        self.generator.set_state(state["generator"])
