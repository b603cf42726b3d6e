"""Is SB's test error at a large batch BatchNorm's doing? (BENCHMARKS.md, "SB at large b")

    .venv/bin/python scripts/batchnorm_bisect.py --scoring running --model wideresnet --depth 10 --widen 1

Trains SB with raysb's engine and, after every epoch, prints the test error twice: with
the running statistics training left, and with statistics recomputed from 10,240
unbiased training examples under the final weights. `--scoring` picks how the selection
forward normalizes: `running` (eval mode), `batch` (each chunk's own statistics), or
`follow` (batch statistics, with the running ones updated by the scored chunks only and
left alone by training forwards on selected batches).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from raysb.config import TrainConfig
from raysb.data.prepare import prepare_data, to_device
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine


def recalibrated_error(engine, train_data, test_data) -> float:
    """Test error with BatchNorm statistics recomputed from unbiased data; the model is restored after."""
    model = engine.scoring_model
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a plain average over the batches below
    model.train()
    with torch.no_grad():
        for start in range(0, min(10_240, len(train_data)), 512):
            model(engine.transform(train_data.images[start : start + 512].to(engine.device), None, train=False))
    error = engine.evaluate(test_data, 1024)[0]
    model.load_state_dict(saved)
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
    return error


class FollowingScorer:
    """Scores with batch statistics that also update the running ones; training forwards leave them."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]

    def __call__(self, inputs, labels, step=0):
        self.model.train()
        self._momentum(0.1)
        with torch.no_grad():
            losses = F.cross_entropy(self.model(inputs), labels, reduction="none")
        self._momentum(0.0)
        return losses

    def _momentum(self, value: float) -> None:
        for norm in self.norms:
            norm.momentum = value

    def new_epoch(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scoring", choices=["running", "batch", "follow"], default="running")
    parser.add_argument("--model", default="wideresnet")
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--widen", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    options = {"depth": args.depth, "widen_factor": args.widen} if args.model == "wideresnet" else {}
    config = TrainConfig(dataset=args.dataset, data_dir=args.data_dir, epochs=args.epochs, batch_size=args.batch_size,
                         model=args.model, model_options=options, strategy="sb", record_analysis=False,
                         selection_batchnorm="running" if args.scoring == "running" else "batch")
    torch.manual_seed(config.seed)
    train_data, test_data, _ = prepare_data(config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine = build_engine(config, MemoryShard(to_device(train_data, device)), device)
    if args.scoring == "follow":
        engine.scorer = FollowingScorer(engine.scoring_model)
    for epoch in range(config.epochs):
        engine.train_epoch(epoch)
        print(f"epoch {epoch + 1}  steps {engine.counters.optimizer_steps}  "
              f"test error {engine.evaluate(test_data, 1024)[0]:.2%}  "
              f"with BatchNorm statistics of unbiased data {recalibrated_error(engine, train_data, test_data):.2%}",
              flush=True)


if __name__ == "__main__":
    main()
