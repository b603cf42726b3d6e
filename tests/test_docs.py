"""The documentation site builds, and README is its front door.

The site (mkdocs.yml, pages under docs/) is built with `mkdocs build --strict`, as a user's
`.venv/bin/mkdocs serve` builds it: a broken link, a missing anchor, a page left out of the
navigation or an API reference to a name that does not exist fails the build, and so this test.
README stays short and links into the site's pages.
"""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from doc_blocks import REPO, site_pages

README = (REPO / "README.md").read_text()
MKDOCS = Path(sys.executable).parent / "mkdocs"
README_LINES_AT_MOST = 250

needs_mkdocs = pytest.mark.skipif(
    not MKDOCS.exists(), reason="mkdocs is not installed (pip install -e '.[dev]', as scripts/setup.sh does)"
)


@needs_mkdocs
@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    # The API reference holds the public names' docstrings.
    reference = (site / "reference" / "own-loop" / "index.html").read_text()
    assert "SelectiveBackprop" in reference and "per_example_loss" in reference
    assert "raysb.api.train" in (site / "reference" / "train" / "index.html").read_text()
    # A page's link to a repository file outside the site reaches a copy of it.
    assert (site / "repository" / "BENCHMARKS.md").read_text() == (REPO / "BENCHMARKS.md").read_text()
    # The benchmark run folders under docs/ stay out of the site.
    assert not (site / "benchmarks").exists() and not (site / "report").exists()
    # The config keys' page holds the table the hook makes from the keys' declarations: each key's row once.
    keys_page = (site / "reference" / "config-keys" / "index.html").read_text()
    assert {key: keys_page.count(f"<td><code>{key}</code></td>") for key in config_keys()} == dict.fromkeys(config_keys(), 1)


def test_readme_is_short_and_links_into_the_site():
    assert len(README.splitlines()) <= README_LINES_AT_MOST
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#[^)\s]*)?\)", README))
    assert {"docs/getting-started.md", "docs/guides/choose-a-strategy.md", "docs/reference/index.md",
            "docs/benchmark-results.md", "docs/changelog.md"} <= linked
    assert [link for link in linked if not (REPO / link).is_file()] == []
    assert ".venv/bin/mkdocs serve" in README


def test_every_site_page_is_in_the_navigation_and_names_no_issue():
    navigation = (REPO / "mkdocs.yml").read_text()
    for page in site_pages():
        name = page.relative_to(REPO / "docs").as_posix()
        assert f" {name}" in navigation, f"{name} is not in mkdocs.yml's nav"
        # Issue numbers mean nothing to a user.
        assert not re.search(r"\bissues? \d+", page.read_text(), re.I), f"{name} names an issue number"
    assert not re.search(r"\bissues? \d+", README, re.I)


def config_reference():
    """scripts/config_reference.py, which makes the config keys' table as the site is built."""
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config_keys() -> list[str]:
    """Every key TrainConfig takes."""
    from raysb.config import TrainConfig

    return [field.name for field in dataclasses.fields(TrainConfig)]


def first_cells(table: str) -> list[str]:
    """The first cell of each row of the Markdown tables in `table`, header and rule rows left out."""
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    return [row.split(" | ")[0].removeprefix("| ") for row in rows if not row.startswith(("| key |", "| flag |"))]


def test_every_config_key_has_one_row_in_the_reference_that_says_what_it_does():
    """A key declared without a comment above it (and no flag's help) fails the site's build and this test."""
    table = config_reference().config_key_table()
    assert Counter(cell.strip("`") for cell in first_cells(table)) == Counter(config_keys())
    for row in table.splitlines()[2:]:
        assert row.split(" | ")[-1].strip(" |"), row
    assert not re.search(r"\bissues? \d+", table, re.I)
    page = (REPO / "docs" / "reference" / "config-keys.md").read_text()
    assert config_reference().PLACEHOLDER in page


def test_every_flag_of_raysb_train_has_one_row_in_the_command_line_guide():
    """Every flag of `raysb train` (raysb/cli.py) is the subject of exactly one row of the guide's table,
    and every flag the table names is one `raysb train` takes."""
    flags = [flag for flag, _ in config_reference().train_flags().values()]
    page = (REPO / "docs" / "guides" / "command-line.md").read_text()
    named = Counter(flag for cell in first_cells(page) for flag in re.findall(r"`(--[a-z-]+)", cell))
    assert named == Counter(flags)


def github_anchors(markdown: str) -> list[tuple[str, str]]:
    """Each heading of `markdown` outside its fenced blocks, with the anchor GitHub gives it: lower case,
    punctuation but hyphens and underscores dropped, each space a hyphen, a repeated anchor numbered."""
    headings, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            headings.append(line)
    seen, anchors = Counter(), []
    for heading in headings:
        anchor = re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")
        anchors.append((heading, anchor if not seen[anchor] else f"{anchor}-{seen[anchor]}"))
        seen[anchor] += 1
    return anchors


def test_every_benchmark_study_has_one_row_in_the_archive():
    """BENCHMARKS.md's studies (its `## ` sections) each have one row of docs/benchmark-archive.md, found by
    the anchor its title links: a new study without a row, or a row whose study is gone, fails."""
    studies = [anchor for heading, anchor in github_anchors((REPO / "BENCHMARKS.md").read_text())
               if heading.startswith("## ")]
    rows = [line for line in (REPO / "docs" / "benchmark-archive.md").read_text().splitlines()
            if line.startswith("| [")]
    linked = [re.findall(r"\]\(\.\./BENCHMARKS\.md#([^)\s]+)\)", row) for row in rows]
    assert [len(anchors) for anchors in linked] == [1] * len(rows), "each row links one study"
    assert Counter(anchor for anchors in linked for anchor in anchors) == Counter(studies)
    assert len(studies) >= 36
    assert github_anchors("## Ray Jobs against a local `ray start --head` cluster\n## The paper's CDF_R (1, 2)\n"
                          "```\n## not a heading\n```\n## The paper's CDF_R (1, 2)\n") == [
        ("## Ray Jobs against a local `ray start --head` cluster", "ray-jobs-against-a-local-ray-start---head-cluster"),
        ("## The paper's CDF_R (1, 2)", "the-papers-cdf_r-1-2"), ("## The paper's CDF_R (1, 2)", "the-papers-cdf_r-1-2-1")]
