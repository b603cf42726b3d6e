"""GPU benchmark: raysb against the tuned plain PyTorch loop a GPU user already has.

    python -m raysb.bench.gpu --out runs/gpu-bench

For each model (ResNet18, WideResNet-16-8) and training batch (128, 512), one after
another in this one process: two independent plain loops (bf16 autocast, channels-last,
the data set and its pad-4 crop and flip on the device; they share no training code
with raysb), eager and captured (the model under `torch.compile(mode="reduce-overhead")`,
replayed as CUDA graphs: what a careful GPU user adds), then raysb Traditional, `uniform`, SB,
Stale-SB(3), free-sb and InfoBatch (`--strategies`) with the same optimizer, warmup and
augmentation, as raysb trains by default (on CUDA, its captured step), and with `--eager-too`
each again with capture off. The report gives seconds per epoch (epochs after the first), each
run's ratio to both plain loops, the cost-model ratio to Traditional from measured per-example pass
costs, bookkeeping's share, the final error, and the time to 1.0/1.1/1.2/1.4x the eager plain
loop's final error.

Data: `--dataset cifar10|svhn --data-dir DIR` where those files are; `--dataset
fashion-mnist` (real images, zero-padded to 32x32 and repeated to 3 channels, so every
pass costs what it would on CIFAR-10); otherwise a seeded synthetic CIFAR-shaped set
(class templates plus noise) written to Parquet beside the report, which is for timing,
not for accuracy claims (the report says so).
On a CPU it runs as a smoke test (`--smoke`: a small CNN on a few hundred images).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from raysb.api import train
from raysb.analysis.cost_model import cost_model_ratio
from raysb.bench.pass_costs import measure_pass_costs
from raysb.bench.reports import write_report
from raysb.config import TrainConfig, parse_overrides
from raysb.data import ImageDataset, load_dataset, write_parquet
from raysb.models import build_model
from raysb.training.timing import device_synchronizer

TARGETS = (1.0, 1.1, 1.2, 1.4)
MODELS = {"resnet18": ("resnet18", {}), "wrn-16-8": ("wideresnet", {"depth": 16, "widen_factor": 8})}
# raysb's runs after the plain loop, by label: (strategy, its settings).
STRATEGIES = {
    "traditional": ("traditional", {}),
    "uniform": ("uniform", {}),
    "sb": ("sb", {}),
    # The paper's keep rule on a GPU: each example by its own draw, whose count the host reads every round.
    "sb-random": ("sb", {"kept_per_chunk": "random"}),
    "stale-sb(3)": ("stale-sb", {"staleness": 3}),
    "free-sb": ("free-sb", {}),
    "infobatch": ("infobatch", {}),
}
# raysb with its training step and selection forward launched eagerly, not replayed as CUDA graphs.
EAGER = {"capture_training": False, "capture_selection": False}
# The recipe every run shares (the issue's first GPU measurements used it).
RECIPE = dict(lr=0.05, momentum=0.9, weight_decay=5e-4, crop_padding=4, horizontal_flip=True, lr_warmup_epochs=1.0)


@dataclass
class Run:
    """One run's per-epoch cumulative training seconds and test errors."""

    name: str
    wall_s: list[float]
    test_error: list[float]
    bookkeeping_s: float = 0.0
    bound: float | None = None

    @property
    def seconds_per_epoch(self) -> float:
        """Median epoch time, the first (warm-up, compilation) left out where there are more."""
        epochs = [b - a for a, b in zip([0.0, *self.wall_s], self.wall_s)]
        return statistics.median(epochs[1:] or epochs)

    def time_to(self, error: float) -> float | None:
        return next((wall for wall, e in zip(self.wall_s, self.test_error) if e <= error), None)


def synthetic_cifar(train_size: int, test_size: int, image_size: int, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """Ten smooth random class templates plus pixel noise and a brightness shift: learnable, not trivial."""
    generator = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.randn(10, 3, 8, 8, generator=generator), size=image_size, mode="bilinear")

    def split(size: int, offset: int) -> ImageDataset:
        labels = torch.randint(0, 10, (size,), generator=generator)
        noise = torch.randn(size, 3, image_size, image_size, generator=generator)
        shift = torch.randn(size, 1, 1, 1, generator=generator)
        images = (128 + 40 * templates[labels] + 60 * noise + 20 * shift).clamp(0, 255).to(torch.uint8)
        return ImageDataset(images, labels, torch.arange(offset, offset + size), 10,
                            (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))

    return split(train_size, 0), split(test_size, train_size)


def cifar_shaped_fashion_mnist(data_dir: str | None, folder: Path) -> Path:
    """Fashion-MNIST as 3x32x32 Parquet: each image zero-padded by 2 and its channel repeated."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        original = load_dataset("fashion-mnist", split, data_dir)
        images = F.pad(original.images, (2, 2, 2, 2)).repeat(1, 3, 1, 1).contiguous()
        write_parquet(ImageDataset(images, original.labels, original.sample_ids, 10, original.mean * 3, original.std * 3),
                      folder / f"{split}.parquet", encoding="raw")
    return folder


def plain_loop(model_name: str, options: dict, train_data: ImageDataset, test_data: ImageDataset,
               batch_size: int, epochs: int, device: torch.device, seed: int, captured: bool = False) -> Run:
    """The anchor: what a careful GPU user writes, with no raysb training code in it. `captured`: the
    model under torch.compile's reduce-overhead mode, its forward and backward replayed as CUDA
    graphs (on a CPU, where there are none, compiled by dynamo's eager backend: a smoke test)."""
    torch.manual_seed(seed)
    channels, size = train_data.images.shape[1], train_data.images.shape[2]
    model = build_model(model_name, 10, channels, size, **options).to(device).to(memory_format=torch.channels_last)
    trained = model
    if captured:
        on_gpu = device.type == "cuda"
        trained = torch.compile(model, mode="reduce-overhead" if on_gpu else None, backend="inductor" if on_gpu else "eager",
                                dynamic=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=RECIPE["lr"], momentum=RECIPE["momentum"],
                                weight_decay=RECIPE["weight_decay"])
    mean = torch.tensor(train_data.mean, device=device).view(1, -1, 1, 1) * 255
    std = torch.tensor(train_data.std, device=device).view(1, -1, 1, 1) * 255
    images, labels = train_data.images.to(device), train_data.labels.to(device)
    test_images, test_labels = test_data.images.to(device), test_data.labels.to(device)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    n, pad = len(labels), RECIPE["crop_padding"]
    warmup_examples = RECIPE["lr_warmup_epochs"] * n
    seen, wall, errors = 0, [], []
    for epoch in range(epochs):
        # raysb's default schedule: cosine over the epochs, stepped once an epoch.
        cosine = 0.5 * RECIPE["lr"] * (1 + math.cos(math.pi * epoch / epochs))
        device_synchronizer(device)()
        started = time.perf_counter()
        model.train()
        order = torch.randperm(n, device=device)
        for start in range(0, n - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            x = _crop_and_flip(images[index], pad)
            x = ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)
            for group in optimizer.param_groups:
                group["lr"] = cosine * min(1.0, (seen + batch_size) / warmup_examples)
            if captured:  # this step's graphs may overwrite the last step's outputs
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(trained(x), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += batch_size
        device_synchronizer(device)()
        wall.append((wall[-1] if wall else 0.0) + time.perf_counter() - started)
        errors.append(_test_error(model, test_images, test_labels, mean, std, bf16))
    name = "plain loop (bf16, channels-last, data on device)" if bf16 else "plain loop (fp32, data on device)"
    return Run(name.replace("plain loop", "plain loop, captured by torch.compile reduce-overhead") if captured else name,
               wall, errors)


def _crop_and_flip(images: torch.Tensor, pad: int) -> torch.Tensor:
    """A random pad-`pad` crop and a coin-flip mirror per image, as whole-batch gathers on the device."""
    count, channels, size, _ = images.shape
    device = images.device
    padded = F.pad(images, (pad,) * 4)
    dy, dx = torch.randint(0, 2 * pad + 1, (2, count, 1), device=device)
    rows = (torch.arange(size, device=device) + dy).view(count, 1, size, 1).expand(-1, channels, -1, size + 2 * pad)
    cropped = padded.gather(2, rows)
    cols = (torch.arange(size, device=device) + dx).view(count, 1, 1, size).expand(-1, channels, size, -1)
    cropped = cropped.gather(3, cols)
    flip = torch.rand(count, device=device) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1), cropped.flip(3), cropped)


def _test_error(model, images, labels, mean, std, bf16: bool) -> float:
    model.eval()
    wrong = torch.zeros((), dtype=torch.int64, device=images.device)
    with torch.inference_mode(), torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=bf16):
        for start in range(0, len(labels), 1024):
            x = ((images[start : start + 1024].float() - mean) / std).contiguous(memory_format=torch.channels_last)
            wrong += (model(x).argmax(1) != labels[start : start + 1024]).sum()
    return int(wrong) / len(labels)


def raysb_run(name: str, strategy: str, extra: dict, data: dict, model_name: str, options: dict,
              batch_size: int, epochs: int, seed: int, out: Path, overrides: dict, costs: dict) -> Run:
    """`costs`: pass costs measured so far, by what they depend on (the model, b and how it runs), filled here."""
    config = TrainConfig.from_dict({
        **data, **RECIPE, **overrides, **extra, "model": model_name, "model_options": options, "strategy": strategy,
        "batch_size": batch_size, "epochs": epochs, "seed": seed, "record_analysis": False, "out": str(out),
        "overwrite": True,  # the benchmark's own folder: running it again replaces its runs
    })
    result = train(config, log=lambda line: print(line) if "captured" in line else None)
    rows = result.metrics
    key = (model_name, batch_size, config.selection_spec().selection_batch_size, config.capture_training,
           config.capture_selection, config.compile_training)
    if key not in costs:
        costs[key] = measure_pass_costs(config)
    bound = cost_model_ratio(strategy, costs[key], config.selectivity, config.staleness)
    how = result.summary["precision"] + (", captured" if result.summary["captured_training"] else "")
    return Run(f"raysb {name} ({how})", [r["wall_s"] for r in rows],
               [r["test_error"] for r in rows], result.summary["time_breakdown_s"]["bookkeeping"], bound)


def budget_lines(label: str, model_name: str, options: dict, train_data: ImageDataset, test_data: ImageDataset,
                 data: dict, batch_size: int, epochs: int, multiples: list[float], names: list[str],
                 device: torch.device, seed: int, out: Path, overrides: dict, costs: dict) -> list[str]:
    """raysb's runs `names` under time budgets of `multiples` x the captured plain loop's time for
    `epochs` epochs (its epochs after the first, the compile left out), against the captured plain
    loop at `epochs` and at 2 x `epochs`, each decayed to its own end: how little of the plain loop's
    2x time each needs to reach its 2x error. raysb's budgets count its capture and compile."""
    anchors = [plain_loop(model_name, options, train_data, test_data, batch_size, count, device, seed, captured=True)
               for count in (epochs, 2 * epochs)]
    for anchor in anchors:
        _print_run(label, batch_size, anchor)
    unit = anchors[0].seconds_per_epoch * epochs
    target = anchors[1].test_error[-1]
    lines = [f"### Time budgets against the captured plain loop, {label}, b{batch_size}", "",
             f"1x = the captured plain loop's {epochs} epochs, {unit:.1f} s (its compile left out). Its final error: "
             f"{anchors[0].test_error[-1]:.2%} at 1x, {target:.2%} at 2x ({2 * unit:.1f} s). Each raysb run is given "
             "the time budget, its capture and compile counted in it, its lr decayed to the budget's end.", "",
             "| run | " + " | ".join(f"{m:g}x" for m in multiples) + " | least share of the plain loop's 2x time "
             "reaching its 2x error |", "|---|" + "---|" * (len(multiples) + 1)]
    for name in names:
        strategy, extra = STRATEGIES[name.split(" ")[0]]
        extra = {**extra, **(EAGER if name.endswith(" eager") else {}),
                 **({"compile_training": False} if name.endswith(" uncompiled") else {})}
        errors = []
        for multiple in multiples:
            run = raysb_run(f"{name} at {multiple:g}x", strategy, {**extra, "time_budget": multiple * unit}, data,
                            model_name, options, batch_size, 100 * epochs, seed,
                            out / f"{label}-b{batch_size}-budgets" / f"{name.replace(' ', '-')}-{multiple:g}x",
                            overrides, costs)
            _print_run(label, batch_size, run)
            errors.append(run.test_error[-1])
        reached = [m for m, error in zip(multiples, errors) if error <= target]
        least = f"{min(reached) / 2:.2f} (at {min(reached):g}x)" if reached else "not within the budgets"
        lines.append(f"| raysb {name} | " + " | ".join(f"{error:.2%}" for error in errors) + f" | {least} |")
    return lines + [""]


def selection_batch_lines(data: dict, model_name: str, options: dict, batch_size: int,
                          sizes: list[int]) -> list[str]:
    """Per-example cost of the selection forward at each selection batch, beside a training step's."""
    lines = [f"### Selection batch, {model_name}, training batch {batch_size}", "",
             "| selection batch | F_sel us/example | F us/example | B us/example | F_sel / (F+B) |", "|---|---|---|---|---|"]
    for size in sizes:
        config = TrainConfig.from_dict({**data, "model": model_name, "model_options": options, "strategy": "sb",
                                        "batch_size": batch_size, "selection_batch_size": size})
        costs = measure_pass_costs(config)
        lines.append(f"| {size} | {costs['F_sel'] * 1e6:.1f} | {costs['F'] * 1e6:.1f} | {costs['B'] * 1e6:.1f} | "
                     f"{costs['F_sel'] / (costs['F'] + costs['B']):.2f} |")
        print(lines[-1], flush=True)
    return lines + [""]


def report_lines(title: str, runs: list[Run]) -> list[str]:
    """`runs`: the eager plain loop, the captured plain loop, then raysb's runs, Traditional first."""
    plain, captured, traditional = runs[0], runs[1], runs[2]
    error = plain.test_error[-1]
    labels = [f"{m:g}x" for m in TARGETS]
    lines = [
        f"### {title}",
        "",
        f"Time to m x E, E = the eager plain loop's final error {error:.2%}; in brackets, the eager plain loop's "
        "time to it over the run's.",
        "",
        "| run | s/epoch | vs plain loop | vs captured plain loop | vs raysb traditional (cost-model bound) | "
        "bookkeeping | final error | " + " | ".join(f"to {label}" for label in labels) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(labels),
    ]
    for run in runs:
        total = run.wall_s[-1]
        anchor = run in (plain, captured)
        vs_traditional = "" if anchor else (
            f"{run.seconds_per_epoch / traditional.seconds_per_epoch:.2f} ({run.bound:.2f})"
        )
        cells = []
        for m in TARGETS:
            reached = run.time_to(m * error)
            plain_reached = plain.time_to(m * error)
            cells.append("–" if reached is None else
                         f"{reached:.1f} s ({plain_reached / reached:.2f}x)" if plain_reached else f"{reached:.1f} s")
        lines.append(
            f"| {run.name} | {run.seconds_per_epoch:.2f} | {run.seconds_per_epoch / plain.seconds_per_epoch:.2f} | "
            f"{run.seconds_per_epoch / captured.seconds_per_epoch:.2f} | {vs_traditional} | "
            f"{'' if anchor else f'{run.bookkeeping_s / total:.1%}'} | "
            f"{run.test_error[-1]:.2%} | " + " | ".join(cells) + " |"
        )
    return lines + [""]


def _print_run(label: str, batch_size: int, run: Run) -> None:
    """Each run's figures as soon as it ends, so a long benchmark cut short still says what it measured."""
    print(f"{label} b{batch_size} | {run.name} | {run.seconds_per_epoch:.2f} s/epoch | epoch ends (s): "
          + " ".join(f"{wall:.1f}" for wall in run.wall_s) + " | test error: "
          + " ".join(f"{error:.3f}" for error in run.test_error), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysb.bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES),
                        help="raysb's runs after the plain loop (traditional first: ratios are to it)")
    parser.add_argument("--dataset", choices=["cifar10", "svhn", "fashion-mnist"],
                        help="cifar10 and svhn need --data-dir; default: synthetic")
    parser.add_argument("--data-dir", help="where the dataset's files are")
    parser.add_argument("--train-size", type=int, default=50_000, help="synthetic data: training examples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a train config key for every raysb run (e.g. compile_training=true)")
    parser.add_argument("--eager-too", action="store_true",
                        help="run each strategy again with capture off (capture_training and capture_selection false)")
    parser.add_argument("--budgets", type=float, nargs="*", default=[],
                        help="also run --budget-runs under these multiples of the captured plain loop's --epochs time")
    parser.add_argument("--budget-runs", nargs="+", default=["free-sb"],
                        help="raysb runs for --budgets: a strategy label, with ' eager' (capture off) or ' uncompiled'")
    parser.add_argument("--selection-batches", type=int, nargs="*", default=[],
                        help="also measure the selection forward's per-example cost at these selection batches")
    parser.add_argument("--out", default="runs/gpu-bench")
    parser.add_argument("--smoke", action="store_true",
                        help="a CPU check that everything runs: a small CNN, 256 16x16 images, 2 epochs")
    args = parser.parse_args(argv)
    if args.strategies[0] != "traditional":
        parser.error("--strategies must start with traditional: the report's ratios are to it")
    for name in args.budget_runs:
        if name.split(" ")[0] not in STRATEGIES or name.split(" ")[1:] not in ([], ["eager"], ["uncompiled"]):
            parser.error(f"--budget-runs {name!r}: a strategy of {', '.join(STRATEGIES)}, then ' eager' or "
                         "' uncompiled' or nothing")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = {"small-cnn": ("small-cnn", {"width": 8})} if args.smoke else {m: MODELS[m] for m in args.models}
    batch_sizes = [32] if args.smoke else args.batch_sizes
    epochs = 2 if args.smoke else args.epochs
    if args.dataset == "fashion-mnist":
        data = {"dataset": "parquet", "data_dir": str(cifar_shaped_fashion_mnist(args.data_dir, out / "fashion-mnist-32"))}
        note = ("Data: Fashion-MNIST (60,000 train / 10,000 test), zero-padded to 32x32 and repeated to 3 channels: "
                "real images, CIFAR-shaped, so every pass costs what it would on CIFAR-10.")
    elif args.dataset:
        if not args.data_dir:
            parser.error("--dataset needs --data-dir (where its files are)")
        data = {"dataset": args.dataset, "data_dir": args.data_dir}
        note = f"Data: {args.dataset} from {args.data_dir}."
    else:
        train_size, image_size = (256, 16) if args.smoke else (args.train_size, 32)
        train_set, test_set = synthetic_cifar(train_size, max(64, train_size // 5), image_size, args.seed)
        folder = out / "synthetic-data"
        folder.mkdir(exist_ok=True)
        write_parquet(train_set, folder / "train.parquet", encoding="raw")
        write_parquet(test_set, folder / "test.parquet", encoding="raw")
        data = {"dataset": "parquet", "data_dir": str(folder)}
        note = (f"Data: synthetic, seeded (seed {args.seed}), CIFAR-shaped ({train_size} train / {len(test_set)} test, "
                f"3x{image_size}x{image_size}, 10 classes): for timing, not for accuracy claims.")
    train_data = load_dataset(data["dataset"], "train", data["data_dir"])
    test_data = load_dataset(data["dataset"], "test", data["data_dir"])
    overrides = parse_overrides(args.set)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test: timings mean nothing)"
    lines = [f"## raysb vs a plain PyTorch loop on {name}", "", note,
             "Times are training only: evaluation, and raysb's checkpoint writes (timed on their own), are left out.",
             f"torch {torch.__version__}; {epochs} epochs; command: python -m raysb.bench.gpu "
             + " ".join(sys.argv[1:] if argv is None else argv), ""]
    results, costs = {}, {}
    for label, (model_name, options) in models.items():
        if args.selection_batches:
            lines += selection_batch_lines(data, model_name, options, batch_sizes[-1], args.selection_batches)
        for b in batch_sizes:
            runs = []
            for captured in (False, True):
                runs.append(plain_loop(model_name, options, train_data, test_data, b, epochs, device, args.seed,
                                       captured))
                _print_run(label, b, runs[-1])
            modes = [("", {})] + ([(" eager", EAGER)] if args.eager_too else [])
            for name in args.strategies:
                for suffix, mode in modes:
                    strategy, extra = STRATEGIES[name]
                    runs.append(raysb_run(name + suffix, strategy, {**extra, **mode}, data, model_name, options, b,
                                          epochs, args.seed, out / f"{label}-b{b}" / (name + suffix.replace(" ", "-")),
                                          overrides, costs))
                    _print_run(label, b, runs[-1])
            lines += report_lines(f"{label}, b{b}", runs)
            if args.budgets:
                lines += budget_lines(label, model_name, options, train_data, test_data, data, b, epochs, args.budgets,
                                      args.budget_runs, device, args.seed, out, overrides, costs)
            results[f"{label}-b{b}"] = [asdict(run) for run in runs]
            print("\n".join(lines[-len(runs) - 7:]), flush=True)
            write_report(out, lines, echo=False)  # each table as it is made: a call cut short keeps the finished ones
    write_report(out, lines, echo=False)
    (out / "runs.json").write_text(json.dumps(results, indent=1))
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
