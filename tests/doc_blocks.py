"""The fenced blocks of README.md and of the site's pages, read out of the documents by the tests that
run them, so a document and its test cannot drift: tests/test_doc_commands.py runs every shell block,
tests/test_examples.py and tests/test_ray_jobs.py two of README's, tests/test_docs.py checks the pages."""

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# A fence may be indented (a block inside a list item); its closing fence is indented alike.
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)


def site_pages() -> list[Path]:
    """The site's own pages: docs/ less the folders mkdocs.yml keeps out of it."""
    excluded = ("benchmarks", "report")
    return [page for page in (REPO / "docs").rglob("*.md") if page.relative_to(REPO / "docs").parts[0] not in excluded]


def documents() -> list[Path]:
    """README and the site's pages, in a fixed order."""
    return [README, *sorted(site_pages())]


@dataclass(frozen=True)
class Block:
    page: Path
    # Of its opening fence, counted from 1.
    line: int
    language: str
    text: str

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[str]:
        """Its lines as a shell reads them: continued lines joined, blank ones left out."""
        return [line.strip() for line in self.text.replace("\\\n", " ").splitlines() if line.strip()]


def fenced_blocks(page: Path, language: str = "bash") -> list[Block]:
    """The blocks of `page` fenced as `language`, in order."""
    text = page.read_text()
    return [Block(page, text.count("\n", 0, found.start()) + 1, found.group(2), found.group(3))
            for found in FENCE.finditer(text) if found.group(2) == language]


def block_after(page: Path, heading: str, language: str = "bash") -> Block:
    """The first `language` block after the first occurrence of `heading` in `page`."""
    text = page.read_text()
    line = text.count("\n", 0, text.index(heading)) + 1
    return next(block for block in fenced_blocks(page, language) if block.line > line)
