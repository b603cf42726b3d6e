"""A config key is declared once, in its section (raysb.core.settings): the flat record users write
(raysb.config.TrainConfig) and the sections are both derived from that declaration, so adding a key
touches its section and, where a resume may change it, RESUMABLE_KEYS (raysb.resume): two places."""

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import raysb
from raysb.config import SECTIONS, TrainConfig
from raysb.core.config_keys import declared

PACKAGE = Path(raysb.__file__).parent


def run_in_an_edited_copy(tmp_path: Path, edits: dict, script: str) -> dict:
    """What `script` prints last (JSON) when it runs against a copy of raysb edited by `edits`
    (file -> function of its text), after checking that the copy differs from raysb in those files alone."""
    copy = tmp_path / "raysb"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, edit in edits.items():
        (copy / name).write_text(edit((copy / name).read_text()))
    changed = [str(path.relative_to(copy)) for path in sorted(copy.rglob("*.py"))
               if path.read_text() != (PACKAGE / path.relative_to(copy)).read_text()]
    assert changed == sorted(edits)
    done = subprocess.run(
        [sys.executable, "-c", "import raysb\n" f"assert raysb.__file__.startswith({str(copy)!r})\n" + script],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_field_of_every_section_is_a_key_with_one_home_a_copy_of_one_or_derived():
    homes = {}
    for name, section in SECTIONS.items():
        for each in dataclasses.fields(section):
            declaration = declared(each)
            if declaration.home:
                assert declaration.record_name(each) not in homes, f"{name}.{each.name} is a second home"
                homes[declaration.record_name(each)] = f"{name}.{each.name}"
    record = {each.name for each in dataclasses.fields(TrainConfig)}
    copied = {declared(each).record_name(each) for section in SECTIONS.values() for each in dataclasses.fields(section)
              if not declared(each).home and not declared(each).derived}
    derived = {each.name for section in SECTIONS.values() for each in dataclasses.fields(section)
               if declared(each).derived}
    # The record holds every key with a home, and the built-in strategies' options (their cards').
    assert set(homes) <= record and copied <= set(homes)
    assert derived == set(TrainConfig().derived_values())


ADDED = "eval_from"
SCRIPT = f"""
import json
from pathlib import Path
from raysb.config import ConfigError, TrainConfig, parse_overrides
from raysb.resume import refuse_changes
from raysb.tune.sweep import parse_sweep

given = TrainConfig.from_dict(parse_overrides(["{ADDED}=3"]), source="--set")
try:
    TrainConfig.from_dict({{"{ADDED}": 0}}, source="test")
except ConfigError as error:
    refused = str(error)
try:
    refuse_changes(Path("run"), TrainConfig().to_dict(), given.to_dict())
    resumable = True
except ConfigError:
    resumable = False
parse_sweep({{"train": {{"{ADDED}": 2}}, "budget_s": 10}}, "sweep.yaml")
print(json.dumps({{
    "default": TrainConfig().{ADDED}, "given": given.{ADDED}, "section": given.settings().run.{ADDED},
    "refused": refused, "saved": given.saved_values()["{ADDED}"],
    "from_an_older_record": TrainConfig.from_dict({{"epochs": 2}}).{ADDED}, "resumable": resumable,
}}))
"""


def with_the_key_in_the_run_section(source: str) -> str:
    """settings.py with one line more: the new key, declared in RunSettings with its default and check."""
    run = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "RunSettings")
    first_field = next(node for node in run.body if isinstance(node, ast.AnnAssign))
    lines = source.splitlines(keepends=True)
    lines.insert(first_field.lineno - 1, f"    {ADDED}: int = key(1, check=_AT_LEAST_1)\n")
    return "".join(lines)


def test_a_new_key_is_one_line_in_its_section_and_one_name_in_resumable_keys(tmp_path):
    one_place = run_in_an_edited_copy(tmp_path, {"core/settings.py": with_the_key_in_the_run_section}, SCRIPT)
    assert one_place == {
        "default": 1, "given": 3, "section": 3, "refused": f"{ADDED} must be >= 1, got 0", "saved": 3,
        # An old run's config.yaml, made before the key, loads with its default.
        "from_an_older_record": 1,
        # A key is fixed on --resume until RESUMABLE_KEYS names it.
        "resumable": False,
    }
    two_places = run_in_an_edited_copy(tmp_path, {
        "core/settings.py": with_the_key_in_the_run_section,
        "resume.py": lambda source: source + f"RESUMABLE_KEYS = RESUMABLE_KEYS | {{{ADDED!r}}}\n",
    }, SCRIPT)
    assert two_places == {**one_place, "resumable": True}
