"""The training step against the hardware: its time, FLOPs and achieved TFLOP/s, eager, compiled and captured.

    python -m raysb.bench.step_speed --model resnet18 --batch-sizes 512 128 \
        --modes eager default reduce-overhead graph default+graph --scoring 512 1024 --out runs/step-speed

The step every strategy shares once its batch is chosen (zero_grad, forward, per-example cross
entropy, backward, SGD with momentum; bf16 autocast and channels-last on CUDA, as raysb trains
there), on random CIFAR-shaped inputs, for each batch size and compile mode. Each row gives the
first step's seconds (the compile, for a compiled mode), the median of the timed steps (CUDA
events on a GPU, the wall clock on a CPU), the step's FLOPs counted by torch.utils.flop_counter
(forward and backward, once, in eager), the achieved TFLOP/s and its share of the device's
ceiling, measured here as a large matrix product in the step's precision: a datasheet peak is a
lead, not a measurement. Inputs rotate over several batches so the timing does not measure a cache.
The model is compiled as raysb's `compile_training` compiles it (the module, `dynamic=False`), with
the mode given; `--backend eager` runs dynamo without code generation (the CPU test's). `graph` is
raysb's captured step (raysb.training.cuda_graphs.CapturedStep: the whole step, fused SGD with a device
lr, one CUDA graph), `default+graph` the same around the module compiled in the default mode (its
kernels, fused by inductor, captured); on a CPU they run the same code without a graph.
`--scoring SIZES` adds the selection forward's cost per example at those selection batches (chunk
BatchNorm statistics, raysb's default), eager, captured (SelectionScorer's `capture`) and compiled
inside its graph (`compile_selection`, raysb's default on CUDA), beside the compiled, captured
training step's per example at the same batch (else the fastest step's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from raysb.bench.reports import write_report
from raysb.config import ConfigError
from raysb.models import build_model
from raysb.training.builders import resolve_device
from raysb.training.cuda_graphs import CapturedStep
from raysb.training.selection.scoring import SelectionScorer
from raysb.training.timing import device_synchronizer

MODES = ("eager", "default", "max-autotune", "reduce-overhead", "graph", "default+graph")
INPUT_SETS = 4


@dataclass
class StepSpeed:
    batch_size: int
    mode: str
    first_step_s: float
    step_ms: float
    gflop_per_step: float
    tflops: float
    share_of_ceiling: float


def matmul_ceiling_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """The device's achieved TFLOP/s on one large square matrix product, the median of a few."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    seconds = _timed(lambda: a @ b, device, warmup=2, repeats=5)
    return 2 * size**3 / seconds / 1e12


def step_flops(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, autocast: bool) -> int:
    """FLOPs of one training step's forward and backward (the optimizer's elementwise update aside)."""
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(inputs), labels, reduction="none").mean()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def measure(model_name: str, batch_size: int, mode: str, device: torch.device, steps: int, backend: str,
            ceiling_tflops: float) -> StepSpeed:
    on_gpu = device.type == "cuda"
    model = build_model(model_name, 10, 3, 32).to(device)
    if on_gpu:
        model = model.to(memory_format=torch.channels_last)
    generator = torch.Generator(device="cpu").manual_seed(0)
    batches = [(torch.randn(batch_size, 3, 32, 32, generator=generator).to(device),
                torch.randint(0, 10, (batch_size,), generator=generator).to(device)) for _ in range(INPUT_SETS)]
    if on_gpu:
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    flops = step_flops(model, *batches[0], autocast=on_gpu)
    compile_mode = mode.removesuffix("+graph")
    trained = model if compile_mode in ("eager", "graph") else torch.compile(
        model, mode=compile_mode, backend=backend, dynamic=False)
    graphed = mode.endswith("graph")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=graphed or None)
    turn = itertools.count()
    if graphed:
        captured = CapturedStep(trained, optimizer, "bf16" if on_gpu else "fp32", device)
        captured.set_lr(0.01)

        def step() -> None:
            captured(*batches[next(turn) % INPUT_SETS], None)
    else:
        def step() -> None:
            inputs, labels = batches[next(turn) % INPUT_SETS]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
                loss = F.cross_entropy(trained(inputs), labels, reduction="none").mean()
            loss.backward()
            optimizer.step()

    started = time.perf_counter()
    step()
    device_synchronizer(device)()
    first = time.perf_counter() - started
    seconds = _timed(step, device, warmup=3, repeats=steps)
    tflops = flops / seconds / 1e12
    return StepSpeed(batch_size, mode, first, seconds * 1e3, flops / 1e9, tflops, tflops / ceiling_tflops)


@dataclass
class ScoringSpeed:
    selection_batch: int
    captured: bool
    compiled: bool
    first_call_s: float
    us_per_example: float


def measure_scoring(model_name: str, rows: int, captured: bool, compiled: bool, device: torch.device, repeats: int,
                    backend: str = "inductor") -> ScoringSpeed:
    """The selection forward's time per example at a selection batch of `rows`, as raysb scores by
    default (chunk BatchNorm statistics, the training precision, channels-last on CUDA), `compiled` by
    torch.compile with `backend` as `compile_selection` compiles it."""
    on_gpu = device.type == "cuda"
    model = build_model(model_name, 10, 3, 32).to(device)
    if on_gpu:
        model = model.to(memory_format=torch.channels_last)
    if compiled:
        model = torch.compile(model, dynamic=False, backend=backend)
    scorer = SelectionScorer(model, device, precision="bf16" if on_gpu else "fp32", channels_last=on_gpu,
                             batchnorm="batch", capture=captured)
    generator = torch.Generator(device="cpu").manual_seed(1)
    chunks = [(torch.randn(rows, 3, 32, 32, generator=generator).to(device),
               torch.randint(0, 10, (rows,), generator=generator).to(device)) for _ in range(INPUT_SETS)]
    turn = itertools.count()

    def score() -> None:
        scorer(*chunks[next(turn) % INPUT_SETS])

    started = time.perf_counter()
    score()
    device_synchronizer(device)()
    first = time.perf_counter() - started
    return ScoringSpeed(rows, captured, compiled, first,
                        _timed(score, device, warmup=3, repeats=repeats) / rows * 1e6)


def _timed(work, device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of `work`, after `warmup` calls: device events on a GPU, the host clock elsewhere."""
    for _ in range(warmup):
        work()
    device_synchronizer(device)()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def report_lines(model_name: str, device: torch.device, ceiling: float, rows: list[StepSpeed],
                 scoring: list[ScoringSpeed]) -> list[str]:
    precision = "bf16 autocast, channels-last" if device.type == "cuda" else "fp32"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"{model_name} training step on {name} ({precision}); ceiling {ceiling:.1f} TFLOP/s "
        "(a large matrix product in the step's precision, measured here).",
        "",
        "| batch | mode | first step s (compile) | step ms | GFLOP a step | TFLOP/s | share of the ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row.batch_size} | {row.mode} | {row.first_step_s:.1f} | {row.step_ms:.2f} | "
                     f"{row.gflop_per_step:.1f} | {row.tflops:.2f} | {row.share_of_ceiling:.1%} |")
    if scoring:
        lines += ["", "Selection forward (chunk BatchNorm statistics), per example, over the compiled, captured "
                  "training step's per example at the same batch (`default+graph`; the fastest step's where that "
                  "batch was not measured; issue 68's target at 512: at most 0.40):", "",
                  "| selection batch | captured | compiled | first call s | us/example | over the step's us/example |",
                  "|---|---|---|---|---|---|"]
        fastest = min(row.step_ms * 1e3 / row.batch_size for row in rows) if rows else float("nan")
        step_us = {row.batch_size: row.step_ms * 1e3 / row.batch_size for row in rows if row.mode == "default+graph"}
        for row in scoring:
            against = step_us.get(row.selection_batch, fastest)
            lines.append(f"| {row.selection_batch} | {'yes' if row.captured else 'no'} | "
                         f"{'yes' if row.compiled else 'no'} | {row.first_call_s:.1f} | {row.us_per_example:.2f} | "
                         f"{row.us_per_example / against:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysb.bench.step_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[512, 128])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=30, help="timed steps a row, after the first and a warmup")
    parser.add_argument("--scoring", type=int, nargs="*", default=[],
                        help="also time the selection forward at these selection batches, eager and captured")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (eager: no code generation)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="runs/step-speed")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    try:
        device = resolve_device(args.device)
    except ConfigError as error:
        parser.error(str(error))
    on_gpu = device.type == "cuda"
    ceiling = matmul_ceiling_tflops(device, torch.bfloat16 if on_gpu else torch.float32, 8192 if on_gpu else 1024)
    rows = []
    for batch_size in args.batch_sizes:
        for mode in args.modes:
            torch._dynamo.reset()  # each mode compiles its own graphs, and its time is its own
            row = measure(args.model, batch_size, mode, device, args.steps, args.backend, ceiling)
            print(f"b {row.batch_size} {row.mode}: {row.step_ms:.2f} ms a step, {row.tflops:.2f} TFLOP/s "
                  f"({row.share_of_ceiling:.1%}), first step {row.first_step_s:.1f} s", flush=True)
            rows.append(row)
    scoring = []
    for size in args.scoring:
        for captured, compiled in ((False, False), (True, False), (True, True)):
            torch._dynamo.reset()
            row = measure_scoring(args.model, size, captured, compiled, device, args.steps, args.backend)
            print(f"scoring {size}{' captured' if captured else ''}{' compiled' if compiled else ''}: "
                  f"{row.us_per_example:.2f} us an example, first call {row.first_call_s:.1f} s", flush=True)
            scoring.append(row)
    write_report(Path(args.out), report_lines(args.model, device, ceiling, rows, scoring))
    (Path(args.out) / "rows.json").write_text(json.dumps({"steps": [asdict(row) for row in rows],
                                                          "scoring": [asdict(row) for row in scoring]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
