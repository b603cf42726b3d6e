"""Every example command README.md lists, read out of README and run as a user runs it.

Each runs in a subprocess from a scratch folder (its outputs and Ray Train's run folders
start empty) with its own private Ray instance, under a timeout, so an example that would
hang on a 2-core machine fails here instead.
"""

import re
import subprocess
from pathlib import Path

import pytest

from conftest import RAY_TRAIN_TEST_ENV, needs_fashion_mnist
from doc_blocks import README, REPO, block_after

pytestmark = pytest.mark.slow

EXAMPLES = sorted(path.name for path in (REPO / "examples").glob("*.py"))


def readme_example_commands() -> list[str]:
    block = block_after(README, "Three examples run as they are")
    return [command for command in block.commands() if command.startswith(".venv/bin/python examples/")]


COMMANDS = readme_example_commands()


def test_readme_runs_every_example_with_its_defaults():
    assert sorted(f"{example}" for example in EXAMPLES) == sorted(
        {command.split()[1].removeprefix("examples/") for command in COMMANDS}
    )
    for example in EXAMPLES:
        assert f".venv/bin/python examples/{example}" in COMMANDS, f"{example} with its defaults"


def run_example(command: str, folder: Path) -> str:
    """The example's console: what it wrote to stdout, then to stderr."""
    (folder / "examples").symlink_to(REPO / "examples")
    (folder / ".venv").symlink_to(REPO / ".venv")
    env_free_of_ray_address = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), **RAY_TRAIN_TEST_ENV}
    done = subprocess.run(
        ["bash", "-c", command], cwd=folder, env=env_free_of_ray_address, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


def number_after(label: str, text: str) -> float:
    return float(re.search(label + r"\s*([0-9.]+)", text).group(1))


# The lines each example prints with its defaults, and no more: the tabular one rank 0's lines at
# epochs 5 and 8 (--print-every 5, --epochs 8) and the result; the CNN 3 epochs and the result; the
# sweep a header and 4 trials. Ray's worker output once made the tabular one's 141 lines, 118 of
# them ANSI-coloured (BENCHMARKS.md, "The console").
CONSOLE_LINES = {"tabular_ray_train": 3, "fashion_mnist_cnn": 4, "tune_sweep": 5}


@needs_fashion_mnist
@pytest.mark.parametrize("command", COMMANDS)
def test_readme_example_command_finishes_and_learns(command, tmp_path):
    out = run_example(command, tmp_path)
    example = command.split()[1].removeprefix("examples/").removesuffix(".py")
    assert "\x1b" not in out and len(out.splitlines()) <= CONSOLE_LINES[example], out[-3000:]
    if "tabular_ray_train" in command:
        # Predicting the mean gives an RMSE of one target standard deviation.
        assert number_after("final test RMSE", out) < 0.85 * number_after(r"target std", out)
        backprop, considered = map(int, re.search(r"(\d+) of (\d+) examples backpropagated", out).groups())
        assert 0.2 * considered < backprop < 0.7 * considered  # beta 1 keeps about half
    elif "fashion_mnist_cnn" in command:
        # The run's closing line (its epoch lines come first): chance is 90%.
        assert number_after(r"done in \d+s: test error", out) < 30
        backprop, considered = map(int, re.search(r"(\d+) of (\d+) examples backpropagated", out).groups())
        assert backprop < 0.5 * considered
    else:
        rows = [line.split() for line in out.splitlines() if re.match(r"\s+[13] +[12] ", line)]
        assert sorted((row[0], row[1]) for row in rows) == [("1", "1"), ("1", "2"), ("3", "1"), ("3", "2")]
        assert "Pareto" in out and all(float(row[2].rstrip("%")) < 70 for row in rows)
