"""What one example costs in each pass (F, B, F_sel), and what cheaper selection forwards change."""

from __future__ import annotations

import copy
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from raysb.config import TrainConfig
from raysb.data import BatchTransform
from raysb.data.prepare import prepare_data
from raysb.models import build_model
from raysb.training.builders import (build_engine, compiles_training, device_settings, resolve_device, scorer_options,
                                     warmup_steps)
from raysb.training.cuda_graphs import timing_copy
from raysb.training.precision import autocast
from raysb.training.selection.scoring import SelectionScorer
from raysb.training.timing import device_synchronizer


def measure_pass_costs(config: TrainConfig, repeats: int = 20) -> dict[str, float]:
    """Seconds per example of a training forward (F), backward+step (B) and selection forward (F_sel).

    F_sel is the configured selection forward (`selection_precision`, `channels_last`,
    `compile_selection`, `capture_selection`), without an int8 copy's refreshes: the selection-variants
    table gives their cost. Where the training step is captured (`capture_training`), one graph
    holds its forward and backward: F + B is that step's time, split as the eager passes split."""
    device = resolve_device(config.device)
    settings = config.settings()
    train_data, _, _ = prepare_data(settings.data, config.batch_size)
    channels, height, _ = train_data.images.shape[1:]
    model = build_model(config.model, train_data.num_classes, channels, height, **config.model_options)
    model = model.to(device)
    on_device = device_settings(settings.model, settings.scoring, device)
    if on_device.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scorer = SelectionScorer(model, device, **scorer_options(
        settings.scoring, on_device, warmup_steps(settings.optimization, len(train_data))))
    transform = BatchTransform(train_data.mean, train_data.std)
    sync = device_synchronizer(device)

    def batch(size: int):
        index = torch.randint(len(train_data), (size,))
        images = transform(train_data.images[index].to(device), None, train=False)
        return images, train_data.labels[index].to(device)

    timed = partial(_seconds, sync=sync)

    x, y = batch(config.batch_size)
    xs, ys = batch(config.selection_spec().selection_batch_size)
    forward, backward, selection = [], [], []
    for i in range(repeats + 3):
        model.train()
        holder = {}

        def forward_pass():
            with autocast(on_device.precision, device):
                holder.update(loss=F.cross_entropy(model(x), y))

        f = timed(forward_pass)

        def step():
            optimizer.zero_grad(set_to_none=True)
            holder["loss"].backward()
            optimizer.step()

        b = timed(step)
        s = timed(lambda: scorer(xs, ys))
        if i >= 3:  # warm-up iterations excluded
            forward.append(f / len(y))
            backward.append(b / len(y))
            selection.append(s / len(ys))
    costs = {"F": statistics.median(forward), "B": statistics.median(backward), "F_sel": statistics.median(selection)}
    if on_device.capture_training:
        captured = timing_copy(model, on_device.precision, device,
                               compiles_training(settings.model, on_device.capture_training, device))
        seconds = [timed(lambda: captured(x, y, None)) / len(y) for _ in range(repeats + 3)][3:]
        step, eager = statistics.median(seconds), costs["F"] + costs["B"]
        costs.update(F=step * costs["F"] / eager, B=step * costs["B"] / eager)
    return costs


def _seconds(fn, sync) -> float:
    """Wall seconds of `fn()`, with the device synchronized before and after."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


# Overrides of the configured selection forward (raysb.training.builders.scorer_options), each
# measured against it.
SELECTION_VARIANTS = {
    "fp32": {"precision": "fp32"},
    "int8": {"precision": "int8", "batchnorm": "running", "compile": False},
    "bf16": {"precision": "bf16"},
    # Weights and inputs stored in bf16 rather than autocast; measured only, not a run option.
    "bf16-weights": {"precision": "fp32", "channels_last": True, "cast": torch.bfloat16},
    "fp16": {"precision": "fp16"},
    "channels-last": {"channels_last": True},
    "running-bn": {"batchnorm": "running"},
    "scale-0.75": {"scale": 0.75},
    "scale-0.5": {"scale": 0.5},
    "running-bn+scale-0.5": {"batchnorm": "running", "scale": 0.5},
    "compile": {"compile": True},
    "compile-graphs": {"compile": True, "compile_mode": "reduce-overhead"},
    "running-bn+compile-graphs": {"batchnorm": "running", "compile": True, "compile_mode": "reduce-overhead"},
}


def compare_selection_variants(config: TrainConfig, variants: list[str], repeats: int = 10) -> list[str]:
    """Each cheaper selection forward's cost and how much it changes which examples are kept, against
    the selection forward `config` configures (on a GPU: bf16, channels-last, the chunk's BatchNorm
    statistics).

    The model trains `config.epochs` epochs of plain SGD and the variants are measured after the
    first, the middle and the last, so that losses spread as they do early, midway and late in a
    run. Each variant ranks its losses against its own last R (as a run scoring that way would:
    downsampled inputs have losses of another scale) under the same uniform draws, and its keep
    decisions are compared with the configured forward's. An int8 copy is calibrated on the first
    measured chunk at each point, as a run recalibrates at each epoch's start; its refresh and
    recalibration costs are listed below the table.
    """
    from raysb.data.shards import MemoryShard

    device = resolve_device(config.device)
    settings = config.settings()
    train_data, _, _ = prepare_data(settings.data, config.batch_size)
    engine = build_engine(TrainConfig.from_dict({**config.to_dict(), "strategy": "traditional"}).settings(),
                          MemoryShard(train_data), device)
    configured = scorer_options(settings.scoring, device_settings(settings.model, settings.scoring, device),
                                warmup_steps(settings.optimization, len(train_data)))
    costs = measure_pass_costs(config)
    step = costs["F"] + costs["B"]
    transform = BatchTransform(train_data.mean, train_data.std)
    size = config.selection_spec().selection_batch_size
    chunks = [torch.randperm(len(train_data), generator=torch.Generator().manual_seed(i))[:size] for i in range(8)]
    inputs = [transform(train_data.images[c].to(device), None, train=False) for c in chunks]
    labels = [train_data.labels[c].to(device) for c in chunks]
    points = sorted({1, max(1, config.epochs // 2), config.epochs})
    described = ", ".join(f"{key} {value}" for key, value in configured.items() if key != "refresh_steps")
    lines = [
        f"Selection forward variants ({config.model}, selection batch {size}, device {device}, "
        f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"measured after epochs {', '.join(map(str, points))} of plain SGD on {len(train_data)} examples). "
        f"Configured: {described}. A training step (F + B) costs {step * 1e6:.1f} us an example (b {config.batch_size}).",
        "",
        "| after epoch | variant | F_sel us/example | vs configured | F_sel / (F + B) | keep decisions equal to "
        "configured | kept-set Jaccard vs configured |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for epoch in range(config.epochs):
        engine.train_epoch(epoch)
        if epoch + 1 in points:
            rows, note = _variant_rows(engine.feed.scoring_model, device, configured, variants, inputs, labels, config,
                                       repeats, step)
            lines += [f"| {epoch + 1} {row}" for row in rows]
            print(*lines[-len(rows):], sep="\n", flush=True)
            notes += [f"- after epoch {epoch + 1}: {note}"] if note else []
    return lines + (["", *notes] if notes else [])


def decision_agreement(reference: torch.Tensor, keep: torch.Tensor) -> tuple[float, float]:
    """Share of equal keep decisions, and the Jaccard index of the two kept sets."""
    same = (keep == reference).float().mean().item()
    jaccard = (keep & reference).sum().item() / max(1, (keep | reference).sum().item())
    return same, jaccard


def _casting(scorer: SelectionScorer, dtype: torch.dtype):
    """`scorer` on inputs cast to its model's dtype, giving float32 losses."""

    def score(inputs, labels):
        return scorer(inputs.to(dtype), labels).float()

    return score


def _variant_rows(model, device, configured, variants, inputs, labels, config, repeats, step) -> tuple[list[str], str]:
    from raysb.core.keep_rule import keep_decisions

    size = len(inputs[0])
    sync = device_synchronizer(device)
    timed = partial(_seconds, sync=sync)
    generator = torch.Generator().manual_seed(0)
    draws = torch.rand(size * len(inputs), generator=generator)
    ties = torch.rand(size * len(inputs), generator=generator)
    rows, note = [], ""
    reference_keep, reference_time = None, None
    for name in ["configured", *variants]:
        options = {**configured, **SELECTION_VARIANTS.get(name, {})}
        cast = options.pop("cast", None)
        scored = copy.deepcopy(model).to(dtype=cast)
        if options.get("channels_last"):
            scored = scored.to(memory_format=torch.channels_last)
        try:
            scorer = SelectionScorer(scored, device, **options)
        except ValueError as error:
            rows.append(f"| {name} | skipped: {error} | | | | |")
            continue
        score = scorer if cast is None else _casting(scorer, cast)
        try:
            for x, y in zip(inputs[:2], labels[:2]):  # warm-up; compilation, or int8 calibration on the first chunk
                score(x, y)
        except Exception as error:  # a backend that cannot build this variant here (a compiler, CUDA graphs)
            rows.append(f"| {name} | failed: {type(error).__name__}: {str(error).splitlines()[0][:120]} | | | | |")
            continue
        timings = [timed(lambda: score(x, y)) / size for _ in range(repeats) for x, y in zip(inputs, labels)]
        losses = torch.cat([score(x, y).float() for x, y in zip(inputs, labels)]).cpu()
        per_example = statistics.median(timings)
        keep = keep_decisions(losses[-config.history_size :], losses, ties, draws, config.beta)[0]
        if reference_keep is None:
            reference_keep, reference_time = keep, per_example
        same, jaccard = decision_agreement(reference_keep, keep)
        rows.append(
            f"| {name} | {per_example * 1e6:.1f} | {per_example / reference_time:.2f} | {per_example / step:.2f} | "
            f"{same:.2%} | {jaccard:.3f} |"
        )
        if scorer.quantized is not None:
            copy_of = scorer.quantized.copy
            refresh = statistics.median(timed(copy_of.refresh) for _ in range(5))
            recalibrate = statistics.median(timed(lambda: copy_of.recalibrate(inputs[0])) for _ in range(3))
            note = (
                f"int8 ({copy_of.engine} engine) re-quantizes its weights in {refresh * 1e3:.1f} ms and "
                f"recalibrates in {recalibrate * 1e3:.0f} ms, the configured scoring of "
                f"{refresh / reference_time:.0f} and {recalibrate / reference_time:.0f} examples"
            )
    return rows, note
