"""Katharopoulos & Fleuret (2018) importance sampling, as the SB paper evaluated it.

Presample B > b examples uniformly, score them by loss, and draw b of them with
probability proportional to the score. "Variable starting": sample uniformly
until the estimated variance reduction tau exceeds tau_th.
"""

from __future__ import annotations

import torch

from raysb.core.transfer import to_host


def default_tau_threshold(presample_size: int, batch_size: int) -> float:
    """Kath18's break-even point: scoring B examples must pay for itself, (B + 3b) / 3b."""
    return (presample_size + 3 * batch_size) / (3 * batch_size)


def variance_reduction(scores: torch.Tensor) -> torch.Tensor:
    """tau = (1 - ||g - u||^2 / ||g||^2) ** -1/2 for g = scores normalized, u uniform.

    tau is 1 when the scores are uniform (importance sampling buys nothing) and
    grows as they concentrate on few examples. A 0-d tensor where the scores are: no host read.
    """
    scores = scores.detach().double().clamp_min(0)
    total = scores.sum()
    uniform = torch.full_like(scores, 1.0 / scores.numel())
    g = torch.where(total > 0, scores / total.clamp_min(torch.finfo(scores.dtype).tiny), uniform)
    ratio = ((g - uniform) ** 2).sum() / (g**2).sum()
    return (1.0 - ratio).clamp_min(1e-12).rsqrt()


def importance_sample(
    scores: torch.Tensor, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw `batch_size` indices with replacement, P(i) proportional to scores[i].

    Returns the indices and the unbiasing weights 1 / (B * P(i)), which average
    to 1 in expectation so the weighted loss stays on the scale of a mean.
    """
    scores = scores.detach().float().clamp_min(0)
    scores = torch.where(scores.sum() > 0, scores, torch.ones_like(scores))
    probabilities = scores / scores.sum()
    draw = torch.multinomial(
        probabilities.to(generator.device), batch_size, replacement=True, generator=generator
    ).to(scores.device)
    weights = 1.0 / (scores.numel() * probabilities[draw])
    return draw, weights


class VarianceReductionGate:
    """Exponential moving average of tau; importance sampling runs once it passes tau_th.

    tau moves on the device with every update; whether it has passed the threshold is read
    only at `refresh` (where raysb's rounds read the training losses anyway, every 16 steps
    on a GPU), so the gate opens up to that many steps late and no round waits for it.
    """

    def __init__(self, threshold: float, momentum: float = 0.9, device: torch.device | str = "cpu"):
        self.threshold = threshold
        self.momentum = momentum
        self.tau = torch.zeros((), dtype=torch.float64, device=device)
        self.open = False

    def update(self, scores: torch.Tensor) -> None:
        self.tau = self.momentum * self.tau + (1 - self.momentum) * variance_reduction(scores).to(self.tau.device)

    def refresh(self) -> None:
        self.open = float(to_host(self.tau)) > self.threshold

    def state_dict(self) -> dict:
        return {"tau": float(to_host(self.tau)), "open": self.open}

    def load_state_dict(self, state: dict) -> None:
        self.tau.fill_(float(state["tau"]))
        self.open = bool(state.get("open", float(state["tau"]) > self.threshold))
