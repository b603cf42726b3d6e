"""A plain PyTorch training loop, written apart from raysb's engine, to check it against.

It shares only raysb's data preparation and model builder (both are checked on their
own elsewhere), so a gap between it and `raysb train` on the same config is a gap in
raysb's training path. Selective-Backprop here is the paper's algorithm in a dozen
lines: score each chunk in eval mode (BatchNorm by the chunk's statistics unless
`selection_batchnorm: running`), rank against the last R losses, keep with
probability percentile**beta, train on every full batch of kept examples (with
`staleness_correction`, each weighted by its keep probability now over the one it
was kept with). It draws
its random numbers as raysb does (order, tie-breaks, keep draws), so the two agree
example for example, and any difference in what they compute shows at once.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.nn.functional as F

from raysb.config import TrainConfig
from raysb.data.prepare import prepare_data
from raysb.models import build_model


def reference_test_errors(config: TrainConfig) -> list[float]:
    """Test error after each epoch of `config` (traditional or sb), trained the plain way."""
    train_data, test_data, _ = prepare_data(config.settings().data, config.batch_size)
    torch.manual_seed(config.seed)
    model = build_model(config.model, 10, 1, 28, **config.model_options)
    batch_norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    mean, std = train_data.mean[0], train_data.std[0]

    def inputs(images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255 - mean) / std

    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    order = torch.Generator().manual_seed(config.seed)
    selection_draws = torch.Generator().manual_seed(config.seed + 2)
    beta = 1 / config.selectivity - 1
    history: deque[float] = deque(maxlen=config.history_size)
    waiting: list[tuple[int, float]] = []  # (example, probability it was kept with; NaN: unselected)
    backprop_examples, batch, current_epoch = 0, config.batch_size, 0
    warmup_examples = config.lr_warmup_epochs * len(train_data)

    def decayed(lr: float) -> float:
        """The epoch-keyed schedules a reference run may use: raysb's default cosine, or none."""
        if config.lr_schedule == "static":
            return lr
        assert (config.lr_schedule, config.lr_schedule_key) == ("cosine", "epoch"), "not in the reference loop"
        # Epochs done, the running one in part: its chunks so far over all of them.
        return lr * 0.5 * (1 + math.cos(math.pi * current_epoch / config.epochs))

    def percentiles(losses: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
        ordered = torch.tensor(sorted(history))
        below = torch.searchsorted(ordered, losses)
        equal = torch.searchsorted(ordered, losses, right=True) - below
        return (below + ties * equal) / len(ordered)

    def train_step(examples: list[tuple[int, float]]) -> None:
        nonlocal backprop_examples
        index, kept_with = torch.tensor([e for e, _ in examples]), torch.tensor([p for _, p in examples])
        warmup = min(1.0, (backprop_examples + batch) / warmup_examples) if warmup_examples else 1.0
        for group in optimizer.param_groups:
            group["lr"] = decayed(config.lr) * warmup
        model.train()
        losses = F.cross_entropy(model(inputs(train_data.images[index])), train_data.labels[index], reduction="none")
        selected = ~kept_with.isnan()
        if config.selection_spec().correct_staleness and selected.any():
            now = percentiles(losses.detach(), torch.full_like(losses, 0.5)) ** beta
            weights = torch.where(selected, now / kept_with, 1.0)
            loss = (losses * weights).sum() / weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)
        else:
            loss = losses.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        backprop_examples += len(index)

    errors = []
    chunk_size = config.selection_spec().selection_batch_size
    for epoch in range(config.epochs):
        for chunk_index, chunk in enumerate(torch.randperm(len(train_data), generator=order).split(chunk_size)):
            current_epoch = epoch + min(1.0, (chunk_index + 1) * chunk_size / len(train_data))
            if config.strategy == "traditional" or epoch < config.prime_epochs:
                waiting.extend((example, float("nan")) for example in chunk.tolist())
            else:
                model.eval()
                if config.selection_batchnorm != "running":
                    # Normalize by the chunk's own statistics; momentum 0 keeps the running ones.
                    for norm in batch_norms:
                        norm.train()
                        norm.momentum = 0.0
                with torch.inference_mode():
                    logits = model(inputs(train_data.images[chunk]))
                    losses = F.cross_entropy(logits, train_data.labels[chunk], reduction="none")
                for norm in batch_norms:
                    norm.momentum = 0.1
                history.extend(losses.tolist())
                # A loss's percentile: the history below it plus a random share of the
                # entries equal to it (itself included), as raysb breaks ties.
                ties, draws = torch.rand(2, len(chunk), generator=selection_draws)
                probabilities = percentiles(losses, ties) ** beta
                for example, draw, probability in zip(chunk.tolist(), draws, probabilities):
                    if draw < probability:
                        waiting.append((example, float(probability)))
            # Kept examples wait, across epochs too, until a full batch is ready.
            while len(waiting) >= batch:
                train_step(waiting[:batch])
                del waiting[:batch]
        errors.append(_test_error(model, inputs, test_data))
    return errors


def _test_error(model, inputs, test_data) -> float:
    model.eval()
    with torch.inference_mode():
        logits = model(inputs(test_data.images))
    return float((logits.argmax(1) != test_data.labels).float().mean())
