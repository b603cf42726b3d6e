"""What SelectiveBackprop costs per step in a user's own loop, next to raysb's own trainer.

Both train the same model on the same examples with the same SB settings, one after
the other in one process, alternating. raysb's trainer keeps its examples as tensors
on each rank and exchanges only ids between ranks; the user's loop hands
SelectiveBackprop dict batches of its own, which it validates, cuts into selection
chunks and, between ranks, exchanges whole (the images travel).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from raysb.api import train
from raysb.config import TrainConfig
from raysb.data import BatchTransform
from raysb.data.prepare import prepare_data
from raysb.models import build_model
from raysb.selective_backprop import SelectiveBackprop

RESULT_FILE = "user_loop.json"


def user_loop(config_values: dict) -> None:
    """A user's loop over raysb's model and data (rank 0 writes its metrics to the run folder)."""
    config = TrainConfig.from_dict(config_values)
    torch.set_num_threads(max(1, int(config.cpus_per_worker)))
    rank, world = 0, 1
    if config.workers:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(config.seed)
    train_data, _, _ = prepare_data(config.settings().data, config.batch_size)
    channels, height, _ = train_data.images.shape[1:]
    model = build_model(config.model, train_data.num_classes, channels, height, **config.model_options)
    if config.workers:
        model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    normalize = BatchTransform(train_data.mean, train_data.std)

    def loss_fn(model, batch):
        inputs = normalize(batch["image"], None, train=False)
        return F.cross_entropy(model(inputs), batch["label"], reduction="none")

    sb = SelectiveBackprop(loss_fn, config.batch_size, selectivity=config.selectivity, seed=config.seed)
    started = time.perf_counter()
    for epoch in range(config.epochs):
        order = torch.randperm(len(train_data), generator=torch.Generator().manual_seed(epoch))[rank::world]
        source = ({"image": train_data.images[rows], "label": train_data.labels[rows]}
                  for rows in order.split(config.batch_size))
        for batch in sb.batches(model, source):
            loss = sb.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    metrics = {**sb.metrics(), "loop_wall_s": time.perf_counter() - started}
    if hasattr(sb.rounds.exchange, "exchanged_bytes"):
        metrics["exchanged_bytes"] = sb.rounds.exchange.exchanged_bytes
    if rank == 0:
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / RESULT_FILE).write_text(json.dumps(metrics))


def run_user_loop(config: TrainConfig) -> dict:
    if not config.workers:
        user_loop(config.to_dict())
    else:
        import ray.train
        from ray.train.torch import TorchConfig, TorchTrainer

        from raysb.distributed.cluster import connect_ray

        connect_ray(config.address)
        TorchTrainer(
            user_loop,
            train_loop_config=config.to_dict(),
            scaling_config=ray.train.ScalingConfig(
                num_workers=config.workers, resources_per_worker={"CPU": config.cpus_per_worker}
            ),
            torch_config=TorchConfig(backend="gloo"),
            run_config=ray.train.RunConfig(storage_path=str(Path(config.out).resolve()), name="user-loop"),
        ).fit()
    return json.loads((Path(config.out) / RESULT_FILE).read_text())


def compare_api_overhead(base: dict, worker_counts: list[int], repeats: int, out: Path) -> list[str]:
    """raysb's trainer and a user's loop on SelectiveBackprop, alternating, `repeats` times each."""
    header = ["workers", "trainer", "run", "optimizer steps", "ms/step", "selection ms/step",
              "bookkeeping ms/step", "data ms/step", "exchange KB/step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out = out.resolve()  # Ray Train workers write from a working directory of their own
    for workers in worker_counts:
        for repeat in range(repeats):
            common = {**base, "workers": workers or None, "strategy": "sb", "lr_warmup_epochs": 0}
            config = TrainConfig.from_dict({**common, "out": str(out / f"raysb-w{workers}-{repeat}"), "overwrite": True})
            summary = train(config).summary
            steps = summary["optimizer_steps"]
            split = summary["time_breakdown_s"]
            exchange = summary.get("lockstep_exchange_kb_per_step", 0.0)
            lines.append(_row(workers, "raysb train", repeat, steps, summary["training_wall_s"], split, exchange))
            user = run_user_loop(TrainConfig.from_dict({**common, "out": str(out / f"user-w{workers}-{repeat}")}))
            split = {phase: user[f"time_{phase}_s"] for phase in ("selection", "bookkeeping", "data")}
            exchange = user.get("exchanged_bytes", 0) / 1024 / max(1, user["optimizer_steps"])
            lines.append(_row(workers, "user loop + SelectiveBackprop", repeat, user["optimizer_steps"],
                              user["loop_wall_s"], split, exchange))
    return lines


def _row(workers, trainer, repeat, steps, wall, split, exchange_kb) -> str:
    per_step = lambda seconds: f"{1000 * seconds / max(1, steps):.2f}"  # noqa: E731
    cells = [workers or 1, trainer, repeat + 1, steps, per_step(wall), per_step(split["selection"]),
             per_step(split["bookkeeping"]), per_step(split["data"]), f"{exchange_kb:.1f}"]
    return "| " + " | ".join(str(c) for c in cells) + " |"
