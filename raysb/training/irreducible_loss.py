"""Irreducible losses (RHO-LOSS, Mindermann et al., 2022): a model of the run's own kind and recipe,
trained once with raysb's own engine on the run's held-out split, plain SGD on every example, and its
loss on each training example, which the strategy subtracts from the model's to rank by reducible loss.

As the authors' code computes them (OATML/RHO-Loss: src/train_irreducible.py trains on a held-out
split, then src/utils/utils.py's compute_losses_with_sanity_checks takes the trained model's
cross-entropy on every training example in eval mode); raysb takes the split from the training data
(the authors' CIFAR-10 holds out half of it) and counts the model's training and its forward in the
run's work.
"""

from __future__ import annotations

import dataclasses

import torch

from raysb.core.errors import ConfigError
from raysb.core.settings import Settings
from raysb.core.strategy_table import REFERENCE_STRATEGY
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine
from raysb.training.engine import Engine


def fit_irreducible_losses(engine: Engine, settings: Settings) -> None:
    """Where `engine`'s strategy asks for irreducible losses (and does not hold them already, restored
    from a checkpoint), train the model on the engine's held-out split and hand the strategy its losses
    on the training examples; their work (the examples trained, the forwards at a scored example's
    cost) joins the run's, and a line saying so its console."""
    epochs = engine.strategy.irreducible_epochs()
    if not epochs:
        return
    held_out = None if engine.held_out is None else engine.held_out.data
    if held_out is None or len(held_out) < settings.optimization.batch_size:
        held = 0 if held_out is None else len(held_out)
        raise ConfigError(f"the irreducible-loss model trains on the held-out split, {held} examples here, fewer "
                          f"than a batch of {settings.optimization.batch_size}: hold out a larger share")
    device = engine.device
    # Its own random streams, from the run's seed: the run's own draws are those of a run without it.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(settings.run.seed)
        model = build_engine(irreducible_settings(settings, epochs), MemoryShard(held_out), device)
        for epoch in range(epochs):
            model.train_epoch(epoch)
        training = engine.shard.data
        losses = model.evaluation.example_losses(training, settings.run.eval_batch_size)
    engine.strategy.use_irreducible_losses(training.sample_ids.cpu(), losses.cpu())
    counters = engine.counters
    counters.side_trained_examples += model.counters.backprop_examples
    counters.side_forward_examples += len(training)
    engine.notice(f"raysb: irreducible losses from a {settings.model.name} trained {epochs} epochs on the "
                  f"{len(held_out)} held-out examples (mean {float(losses.mean()):.4g}); its "
                  f"{model.counters.backprop_examples} trained and {len(training)} scored examples are the run's work")


def irreducible_settings(settings: Settings, epochs: int) -> Settings:
    """`settings` for the irreducible-loss model: the run's model, optimizer, lr schedule and augmentation,
    every example every epoch for `epochs` epochs, no budget, nothing held out, nothing recorded."""
    selection = settings.selection
    spec = dataclasses.replace(selection.spec, strategy=REFERENCE_STRATEGY, options={}, pipelined=False,
                               sharded_table=False)
    return dataclasses.replace(
        settings,
        data=dataclasses.replace(settings.data, held_out_share=0.0),
        scoring=dataclasses.replace(settings.scoring, pipeline="inline"),
        optimization=dataclasses.replace(settings.optimization, epochs=epochs, time_budget=None, work_budget=None,
                                         lr_schedule_key="epoch"),
        selection=dataclasses.replace(selection, strategy=REFERENCE_STRATEGY, spec=spec, prime_epochs=0,
                                      anneal_epochs=0, anneal_share=0.0, kept_fraction_schedule="constant",
                                      selection_strength_schedule="constant", loss_table="replicated"),
        run=dataclasses.replace(settings.run, record_analysis=False),
    )
