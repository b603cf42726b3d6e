"""Every shell command README.md and the site's pages show (their ```bash blocks), run on tiny data.

bash reads each block as a user's shell reads it (loops, variables, continued lines, `&&`, comments)
but can start nothing: every command it would run is recorded instead, so none runs unless this test
runs it (never `ray stop`, which ends every Ray process on the machine). Each recorded command is then
a test, in the page's order, in a scratch folder of the page's (the checkout's configs/ linked in):
- `raysb ...` and `python -m MODULE ...` run in this process, as `python -m` runs them, so torch is
  imported once for all of them; each must exit 0;
- on tiny data: SHRUNK's flags follow the command's own (argparse takes a flag's last value), TINY
  those of every `raysb train`, so what runs is the page's command with its data, epochs or budget
  cut and nothing else changed;
- what a command reads that its page did not make before it, GIVEN makes (a run folder, a folder of
  images), and a page's Python block that opens with `# NAME.py` is written to NAME.py first;
- NOT_RUN names the commands not run, each with why; a command that neither runs nor is named
  there fails. The one command shown that needs a GPU (scripts/gpu_session.sh) is a full-size table,
  so it is there too.
"""

import glob
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import needs_fashion_mnist
from doc_blocks import REPO, Block, documents, fenced_blocks
from test_inference import write_images

BASH = shutil.which("bash")
# Defined before the block runs: with PATH on an empty folder, every command bash would start
# reaches command_not_found_handle, and a venv's command (a path) the function of its name. A command
# is one write of its whole line: a block's background command (data.md's `moto_server ... &`) records
# while the next one does, and two writes each once interleaved into an empty line.
RECORDER = """
record() { local line; printf -v line '%q ' "$@"; printf '%s\\n' "$line" >> "$RECORD"; }
command_not_found_handle() { record "$@"; }
"""

TINY = ["--subset", "300", "--test-subset", "100", "--epochs", "1", "--batch-size", "32"]
# The same as config keys, for the benchmarks that train runs.
TINY_SET = ["--set", "subset=300", "--set", "test_subset=100", "--set", "batch_size=32"]
# Added after the command's own flags, the first entry that begins it. The tiny run a resume continues
# trained 1 epoch (a finished run is not resumed); a budget table is one seed at one budget; the host
# overhead over every strategy on the sizes tests/test_bench.py gives it.
SHRUNK = {
    "raysb train --out runs/x --resume": ["--epochs", "2"],
    "raysb train": TINY,
    "python -m raysb.bench --budgets": ["--budgets", "0.5", "--epochs", "1", "--seeds", "0", *TINY_SET],
    "python -m raysb.bench --pipeline-variants": ["--epochs", "1", *TINY_SET],
    "python -m raysb.bench --host-overhead": ["--examples", "256", "--batch-size", "8"],
}
ON_MOTO = ("moto's S3 server on this machine: tests/test_object_storage.py runs `raysb to-parquet` and `raysb train` "
           "against it")
# The first entry that begins a command says why it is not run.
NOT_RUN = {
    "bash scripts/setup.sh": "sets a machine up (apt-get, a fresh venv): CI's first step (.ci/run)",
    "python -m pytest": "the test suite itself",
    "python examples/": "tests/test_examples.py runs README's examples (40-100 s each)",
    "mkdocs serve": "serves the site until stopped: tests/test_docs.py builds it with --strict",
    "ray ": "starts or stops a Ray cluster: tests/test_ray_jobs.py runs README's Ray Jobs block on a cluster of its "
            "own and stops it by its processes (`ray stop` would end every Ray process on the machine)",
    "raysb tune tune_configs/smoke.yaml": "8 trials of 20 s on Ray Tune (2-4 minutes): tests/test_tune.py runs "
                                          "`raysb tune` on a tiny sweep, tests/test_sweep.py checks smoke.yaml's "
                                          "trials",
    "raysb pareto sweeps/smoke": "reads the smoke sweep, not run here",
    "raysb report sweeps/smoke/": "reads the smoke sweep, not run here",
    "raysb train --workers 2 --dataset parquet --data-dir /data/big": "/data/big stands for your own data set: "
                                                                       "tests/test_distributed.py streams Parquet "
                                                                       "on Ray Train workers",
    "raysb train --workers 2": "2 Ray Train workers, about 40 s of Ray's start-up on 2 cores: "
                               "tests/test_distributed.py runs `python -m raysb train --workers 2`",
    "raysb train --config configs/cifar10-wrn-sb.yaml": "downloads CIFAR-10 (170 MB) for a WideResNet",
    "pip install": "installs packages",
    "moto_server": ON_MOTO,
    "python -c": ON_MOTO,
    "raysb to-parquet --dataset fashion-mnist --subset 6000 --out s3://": ON_MOTO,
    "raysb train --dataset parquet --data-dir s3://": ON_MOTO,
    "...": "the page's shorthand for the command above with these flags changed",
    "python -m raysb.bench.launch_count": "tests/test_bench.py runs this command line (launch_count.main) on 128 "
                                          "examples at b = 8 over every strategy and variant, checking each row",
    "bash scripts/gpu_session.sh": "a GPU's whole budget table (ResNet-18 on CIFAR-shaped Fashion-MNIST, about 8 "
                                   "minutes on an H100) from Fashion-MNIST's files carried to .device/fmnist",
}


def run(argv: list[str]) -> int:
    """`raysb ...` (raysb.cli's entry point, as `python -m raysb`) or `python -m MODULE ...`, in this process."""
    name = argv[0].removeprefix(".venv/bin/")
    if name == "raysb":
        module, args = "raysb", argv[1:]
    else:
        assert name == "python" and argv[1] == "-m", f"no rule runs {shlex.join(argv)}: add one, or NOT_RUN's why"
        module, args = argv[2], argv[3:]
    started_as, threads = sys.argv, torch.get_num_threads()
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as ended:
        return ended.code or 0
    finally:
        # A benchmark sets torch's threads for its own process, which here is the suite's.
        sys.argv = started_as
        torch.set_num_threads(threads)
    return 0


def train(out: str, *flags: str):
    def make():
        assert run(["raysb", "train", *flags, "--out", out, *TINY]) == 0, f"making {out}"

    return make


def photos():
    write_images(Path("photos"), torch.randint(0, 256, (3, 1, 28, 28), dtype=torch.uint8), [0, 1, 2])


# What pages read without making it first, made where it is missing.
GIVEN = {
    "runs/x": train("runs/x", "--strategy", "sb"),
    "runs/trad": train("runs/trad", "--strategy", "traditional"),
    # With what `raysb report`'s figures read.
    "runs/sb": train("runs/sb", "--strategy", "sb", "--record-analysis"),
    "runs/stale": train("runs/stale", "--strategy", "stale-sb"),
    "photos": photos,
}


def recorded_commands(block: Block) -> list[list[str]]:
    """The commands bash would start for `block`, each as its arguments after bash expanded them."""
    stand_ins = "".join(f'function {path} {{ record {path} "$@"; }}\n'
                        for path in sorted(set(re.findall(r"\.venv/bin/[\w.-]+", block.text))))
    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "record"
        record.touch()
        (Path(folder) / "empty").mkdir()
        # HOME is `~` itself, so a path under it reads as the page wrote it.
        read = subprocess.run([BASH, "-c", RECORDER + stand_ins + block.text + "\nwait\n"], cwd=folder, timeout=60,
                              env={"PATH": str(Path(folder) / "empty"), "RECORD": str(record), "HOME": "~"},
                              capture_output=True, text=True)
        assert read.returncode == 0, f"bash cannot read {block.where()}: {read.stderr}"
        return [shlex.split(line) for line in record.read_text().splitlines()]


def shown(argv: list[str]) -> str:
    """The command as the rules name it: a venv's command by its name alone."""
    return " ".join([argv[0].removeprefix(".venv/bin/"), *argv[1:]])


def first_rule(rules: dict, command: str):
    return next((value for start, value in rules.items() if command.startswith(start)), None)


COMMANDS = [(block, argv) for page in documents() for block in fenced_blocks(page) for argv in recorded_commands(block)]


def to_run(commands: list) -> list:
    """Those not in NOT_RUN, each once, where it is first shown (README repeats some of the pages')."""
    first = {}
    for block, argv in commands:
        if first_rule(NOT_RUN, shown(argv)) is None:
            first.setdefault(shown(argv), (block, argv))
    return list(first.values())


RUN = to_run(COMMANDS)


def test_every_rule_names_a_command_the_documents_show():
    """So a command that left the documents leaves the lists here too."""
    commands = [shown(argv) for _, argv in COMMANDS]
    for start in [*NOT_RUN, *SHRUNK]:
        assert any(command.startswith(start) for command in commands), f"no command begins {start!r}"
    # The two benchmarks that loop over every strategy, which once failed on one the table gained (rho-loss):
    # the host overhead's runs here, the launch count's in tests/test_bench.py (NOT_RUN).
    ran = [shown(argv) for _, argv in RUN]
    assert "python -m raysb.bench --host-overhead" in ran


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    """Each page's scratch folder, made on first use."""
    made = {}

    def of(page: Path) -> Path:
        if page not in made:
            folder = made[page] = tmp_path_factory.mktemp(page.stem)
            (folder / "configs").symlink_to(REPO / "configs")
            for block in fenced_blocks(page, "python"):
                named = re.match(r"# (\w+\.py)\b", block.text)
                if named:
                    (folder / named.group(1)).write_text(block.text)
        return made[page]

    return of


def make_what_it_reads(argv: list[str]) -> None:
    """GIVEN's folders that `argv` names and that are not yet there, unless it makes them: the --out of a new run."""
    fresh_run = argv[1:2] == ["train"] and "--resume" not in argv
    for before, argument in zip(argv, argv[1:]):
        folder = argument.rstrip("/")
        if folder in GIVEN and not Path(folder).exists() and not (fresh_run and before == "--out"):
            GIVEN[folder]()


def expanded(argv: list[str]) -> list[str]:
    """bash expanded each glob as it recorded the command, before the folders the glob names were made."""
    return [match for argument in argv for match in (sorted(glob.glob(argument)) or [argument])]


@pytest.mark.slow  # 1-2 minutes in all on 2 cores
@needs_fashion_mnist
# runpy runs a module afresh as __main__, as a new `python -m` process would, where the suite imported it before.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
@pytest.mark.parametrize("block, argv", RUN, ids=[f"{block.where()} {shown(argv)}"[:100] for block, argv in RUN])
def test_the_command_runs_on_tiny_data(block, argv, workspaces, monkeypatch):
    monkeypatch.chdir(workspaces(block.page))
    make_what_it_reads(argv)
    assert run(expanded([*argv, *(first_rule(SHRUNK, shown(argv)) or [])])) == 0
