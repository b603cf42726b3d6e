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
from raysb.training.builders import build_engine, device_settings, resolve_device, scorer_options
from raysb.training.precision import autocast
from raysb.training.scoring import SelectionScorer
from raysb.training.timing import device_synchronizer


def measure_pass_costs(config: TrainConfig, repeats: int = 20) -> dict[str, float]:
    """Seconds per example of a training forward (F), backward+step (B) and selection forward (F_sel).

    F_sel is the configured selection forward (`selection_precision`, `channels_last`,
    `compile_selection`), without an int8 copy's refreshes: the selection-variants
    table gives their cost."""
    device = resolve_device(config.device)
    train_data, _, _ = prepare_data(config)
    channels, height, _ = train_data.images.shape[1:]
    model = build_model(config.model, train_data.num_classes, channels, height, **config.model_options)
    model = model.to(device)
    settings = device_settings(config, device)
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scorer = SelectionScorer(model, device, **scorer_options(config, settings))
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
            with autocast(settings.precision, device):
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
    return {
        "F": statistics.median(forward),
        "B": statistics.median(backward),
        "F_sel": statistics.median(selection),
    }


def _seconds(fn, sync) -> float:
    """Wall seconds of `fn()`, with the device synchronized before and after."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


SELECTION_VARIANTS = {
    "fp32": {},
    "int8": {"precision": "int8"},
    "bf16": {"precision": "bf16"},
    # Weights and inputs stored in bf16 rather than autocast; measured only, not a run option.
    "bf16-weights": {"channels_last": True, "cast": torch.bfloat16},
    "fp16": {"precision": "fp16"},
    "channels-last": {"channels_last": True},
    "compile": {"compile": True},
}


def compare_selection_variants(config: TrainConfig, variants: list[str], repeats: int = 10) -> list[str]:
    """Each cheap-selection option's forward cost and how much it changes which examples are kept.

    The model trains `config.epochs` epochs of plain SGD and the variants are measured
    after the first, the middle and the last, so that losses spread as they do early,
    midway and late in a run. Agreement compares keep decisions with fp32's under the
    same uniform draws, ranking both against the same fp32 history of R losses. An int8
    copy is calibrated on the first measured chunk at each point, as a run recalibrates
    at each epoch's start; its refresh and recalibration costs are listed below the table.
    """
    from raysb.data.shards import MemoryShard

    device = resolve_device(config.device)
    train_data, _, _ = prepare_data(config)
    engine = build_engine(TrainConfig.from_dict({**config.to_dict(), "strategy": "traditional"}),
                          MemoryShard(train_data), device)
    transform = BatchTransform(train_data.mean, train_data.std)
    size = config.selection_spec().selection_batch_size
    chunks = [torch.randperm(len(train_data), generator=torch.Generator().manual_seed(i))[:size] for i in range(8)]
    inputs = [transform(train_data.images[c].to(device), None, train=False) for c in chunks]
    labels = [train_data.labels[c].to(device) for c in chunks]
    points = sorted({1, max(1, config.epochs // 2), config.epochs})
    lines = [
        f"Selection forward variants ({config.model}, selection batch {size}, device {device}, "
        f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"measured after epochs {', '.join(map(str, points))} of plain SGD on {len(train_data)} examples):",
        "",
        "| after epoch | variant | F_sel us/example | vs fp32 | keep decisions equal to fp32 "
        "| kept-set Jaccard vs fp32 |",
        "|---|---|---|---|---|---|",
    ]
    notes = []
    for epoch in range(config.epochs):
        engine.train_epoch(epoch)
        if epoch + 1 in points:
            rows, note = _variant_rows(engine.scoring_model, device, variants, inputs, labels, config, repeats)
            lines += [f"| {epoch + 1} {row}" for row in rows]
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


def _variant_rows(model, device, variants, inputs, labels, config, repeats) -> tuple[list[str], str]:
    from raysb.core.selection import keep_decisions

    size = len(inputs[0])
    sync = device_synchronizer(device)
    timed = partial(_seconds, sync=sync)
    generator = torch.Generator().manual_seed(0)
    draws = torch.rand(size * len(inputs), generator=generator)
    ties = torch.rand(size * len(inputs), generator=generator)
    rows, note = [], ""
    reference_losses, reference_keep, reference_time = None, None, None
    for name in variants:
        options = dict(SELECTION_VARIANTS[name])
        cast = options.pop("cast", None)
        scored = copy.deepcopy(model).to(dtype=cast)
        if options.get("channels_last"):
            scored = scored.to(memory_format=torch.channels_last)
        try:
            scorer = SelectionScorer(scored, device, **options)
        except ValueError as error:
            rows.append(f"| {name} | skipped: {error} | | | |")
            continue
        score = scorer if cast is None else _casting(scorer, cast)
        for x, y in zip(inputs[:2], labels[:2]):  # warm-up; compilation, or int8 calibration on the first chunk
            score(x, y)
        timings = [timed(lambda: score(x, y)) / size for _ in range(repeats) for x, y in zip(inputs, labels)]
        losses = torch.cat([score(x, y) for x, y in zip(inputs, labels)]).cpu()
        per_example = statistics.median(timings)
        if reference_losses is None:
            reference_losses, reference_time = losses, per_example
        history = reference_losses[-config.history_size :]
        keep = keep_decisions(history, losses, ties, draws, config.beta)[0]
        if reference_keep is None:
            reference_keep = keep
        same, jaccard = decision_agreement(reference_keep, keep)
        rows.append(
            f"| {name} | {per_example * 1e6:.0f} | {per_example / reference_time:.2f} | {same:.2%} | {jaccard:.3f} |"
        )
        if scorer.quantized is not None:
            copy_of = scorer.quantized.copy
            refresh = statistics.median(timed(copy_of.refresh) for _ in range(5))
            recalibrate = statistics.median(timed(lambda: copy_of.recalibrate(inputs[0])) for _ in range(3))
            note = (
                f"int8 ({copy_of.engine} engine) re-quantizes its weights in {refresh * 1e3:.1f} ms and "
                f"recalibrates in {recalibrate * 1e3:.0f} ms, the fp32 scoring of "
                f"{refresh / reference_time:.0f} and {recalibrate / reference_time:.0f} examples"
            )
    return rows, note
