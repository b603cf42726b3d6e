"""What a scoring forward costs relative to a training example, measured on the run's own machine
and model (the weight a work budget gives each scored example: raysb.core.work_units)."""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

from raysb.training.collective import bare_module
from raysb.training.cuda_graphs import timing_copy
from raysb.training.engine import Engine
from raysb.training.precision import autocast

REPEATS = 7


def measure_scoring_cost(engine: Engine, repeats: int = REPEATS) -> float:
    """A scored example's time over a trained example's (forward and backward; the whole captured
    step where the run captures it), each the median of
    `repeats` timed calls after two to warm up, at the run's chunk and batch sizes. The two kinds
    of call alternate, so a load that comes and goes weighs on both alike.

    Synthetic inputs of the data's shape (a convolution's time does not depend on pixel values), a
    copy of the model for the training side, and forked random streams: the run itself is left
    exactly as it was, so a measured run trains as an unmeasured one does."""
    shape = engine.shard.image_shape
    device = engine.device

    def inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.zeros((rows, *shape), dtype=torch.uint8, device=device)
        return engine.feed.transform(images, None, train=False), torch.zeros(rows, dtype=torch.int64, device=device)

    chunk, batch = inputs(engine.chunk_size), inputs(engine.batch_size)
    if engine.step.captured_step is not None:  # the step as the run trains it: one graph
        captured = timing_copy(bare_module(engine.model), engine.step.precision, device, engine.step.compiled)

        def train_step() -> None:
            captured(*batch, None)
    else:
        model = copy.deepcopy(bare_module(engine.model)).train()

        def train_step() -> None:
            with autocast(engine.step.precision, device):
                loss = F.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            model.zero_grad(set_to_none=True)

    calls = {"scored": lambda: engine.feed.scorer(*chunk), "trained": train_step}
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for repeat in range(2 + repeats):  # the first two warm up: allocations, kernels, a compiled graph
            for name, call in calls.items():
                elapsed = _seconds(call, device)
                if repeat >= 2:
                    seconds[name].append(elapsed)
    scored = statistics.median(seconds["scored"]) / engine.chunk_size
    trained = statistics.median(seconds["trained"]) / engine.batch_size
    return scored / trained


def _seconds(call, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
