"""The command line of a benchmark that measures one epoch of each strategy and tables the rows."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from raysb.bench.reports import write_report
from raysb.config import ConfigError
from raysb.core.strategy_table import STRATEGIES
from raysb.training.builders import resolve_device


def per_strategy_main(
    argv: list[str] | None,
    prog: str,
    doc: str,
    measure: Callable[[str, torch.device, int, int], object],
    report_lines: Callable[[torch.device, int, list], list[str]],
    describe: Callable[[object], str],
    default_out: str,
    default_examples: int,
    variants: tuple[str, ...] = (),
) -> int:
    """Parse --strategies, --examples, --batch-size, --device and --out; `measure(strategy, device,
    examples, batch_size)` each strategy (a dataclass row, `describe`d as it ends); write
    `report_lines(device, batch_size, rows)` and the rows as rows.json to --out. `variants`: labels
    `measure` takes besides the strategies' names (a strategy with settings of its own), measured by default."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", choices=[*STRATEGIES, *variants], default=[*STRATEGIES, *variants])
    parser.add_argument("--examples", type=int, default=default_examples, help="synthetic CIFAR-shaped training examples")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ConfigError as error:
        parser.error(str(error))
    rows = []
    for strategy in args.strategies:
        rows.append(measure(strategy, device, args.examples, args.batch_size))
        print(f"{strategy}: {describe(rows[-1])}", flush=True)
    write_report(Path(args.out), report_lines(device, args.batch_size, rows))
    (Path(args.out) / "rows.json").write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return 0
