"""The documentation site builds, and README is its front door.

The site (mkdocs.yml, pages under docs/) is built with `mkdocs build --strict`, as a user's
`.venv/bin/mkdocs serve` builds it: a broken link, a missing anchor, a page left out of the
navigation or an API reference to a name that does not exist fails the build, and so this test.
README stays short and links into the site's pages.
"""

import os
import re
import subprocess
import sys
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
