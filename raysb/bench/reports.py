"""Where a benchmark's report goes: `report.md` in its --out folder, and the console."""

from __future__ import annotations

from pathlib import Path


def write_report(out: Path, lines: list[str], echo: bool = True, name: str = "report.md") -> int:
    """`lines` as `out/name` (the folder made if missing), echoed unless `echo` is False; 0, a CLI's exit."""
    report = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(report + "\n")
    if echo:
        print(report)
    return 0
