"""The engine a run trains with, set up as a run sets it up, for the run itself and for every
benchmark that trains strategies: the held-out split the strategy's card asks for taken out of the
training data first, and what the strategy needs before its first round (RHO-LOSS's irreducible
losses) given to it. A benchmark that built its engine without them broke on the first strategy
that needed them (`python -m raysb.bench.launch_count` on rho-loss)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from raysb.core.settings import Settings
from raysb.data import ImageDataset
from raysb.data.prepare import split_holdout, to_device
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine
from raysb.training.engine import Engine
from raysb.training.irreducible_loss import fit_irreducible_losses


def run_engine(settings: Settings, train_data: ImageDataset, device: torch.device,
               shard: Callable[[ImageDataset], MemoryShard] = MemoryShard, **options) -> Engine:
    """`build_engine` over `train_data` less its held-out split (raysb.data.prepare.split_holdout), which
    the engine keeps; `shard` makes the training shard of the rest, on `device`. What the strategy needs
    before training is `fit_irreducible_losses`' (after a checkpoint is restored, which may hold it)."""
    train_data, held_out = split_holdout(settings.data, train_data, settings.optimization.batch_size)
    return build_engine(settings, shard(to_device(train_data, device)), device,
                        held_out=None if held_out is None else to_device(held_out, device), **options)


def ready_engine(settings: Settings, train_data: ImageDataset, device: torch.device, **options) -> Engine:
    """`run_engine`, its strategy given what it needs before its first round: a fresh run's engine."""
    engine = run_engine(settings, train_data, device, **options)
    fit_irreducible_losses(engine, settings)
    return engine
