"""How well a subset's gradient stands in for the full batch's (the paper's Figure 5).

SB trains on the kept subset of a batch; its update is useful to the degree
that the subset's gradient points where the full batch's does. Compared with a
random subset of the same size, this shows whether SB's choice is better than
chance at preserving the descent direction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def flat_gradient(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Gradient of the mean cross-entropy over all trainable parameters, as one vector.

    Uses torch.autograd.grad, so parameters' .grad (and a DDP wrapper's hooks) are untouched.
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    loss = F.cross_entropy(model(inputs), labels)
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, parameters)])


def agreement(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, fraction of components with the same sign)."""
    cosine = F.cosine_similarity(reference.double(), other.double(), dim=0)
    same_sign = (torch.sign(reference) == torch.sign(other)).double().mean()
    return float(cosine), float(same_sign)


def gradient_similarity(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    kept: torch.Tensor,
    random: torch.Tensor,
) -> dict[str, float]:
    """Agreement of the `kept` and `random` subsets' gradients (boolean masks) with the full batch's."""
    full = flat_gradient(model, inputs, labels)
    cosine_kept, same_sign_kept = agreement(full, flat_gradient(model, inputs[kept], labels[kept]))
    cosine_random, same_sign_random = agreement(full, flat_gradient(model, inputs[random], labels[random]))
    return {
        "cosine_kept": cosine_kept,
        "cosine_random": cosine_random,
        "same_sign_kept": same_sign_kept,
        "same_sign_random": same_sign_random,
    }
