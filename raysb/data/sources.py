"""Finding a split's files on disk, downloading them when allowed, and explaining what to do when neither works."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from .dataset import DatasetNotFoundError


def locate(
    what: str,
    dirs: Sequence[Path],
    names: Sequence[str],
    *,
    suffixes: Sequence[str] = ("",),
    fetch: Callable[[Path], None] | None = None,
    data_dir: Path | None = None,
    download: bool = False,
    install_hint: str | None = None,
) -> list[Path]:
    """Paths of ``names`` from the first of ``dirs`` that holds all of them.

    Each name may appear with any of ``suffixes`` (first match wins). If no directory has the full set and
    ``download`` is true, ``fetch(data_dir)`` is called once and the search repeated: the callers' ``dirs``
    include where their fetcher writes.
    """
    found = _first_complete(dirs, names, suffixes)
    if found is None and download and fetch is not None and data_dir is not None:
        try:
            fetch(data_dir)
        except Exception as err:  # torchvision raises several unrelated types for network and checksum failures
            raise DatasetNotFoundError(f"{what}: downloading into {data_dir} failed: {err}") from err
        found = _first_complete(dirs, names, suffixes)
    if found is None:
        raise DatasetNotFoundError(_not_found_message(what, dirs, names, suffixes, fetch, data_dir, download, install_hint))
    return found


def _first_complete(dirs: Sequence[Path], names: Sequence[str], suffixes: Sequence[str]) -> list[Path] | None:
    for directory in dirs:
        paths = [next((p for s in suffixes if (p := directory / (name + s)).exists()), None) for name in names]
        if all(paths):
            return paths
    return None


def _not_found_message(
    what: str,
    dirs: Sequence[Path],
    names: Sequence[str],
    suffixes: Sequence[str],
    fetch: Callable[[Path], None] | None,
    data_dir: Path | None,
    download: bool,
    install_hint: str | None,
) -> str:
    variants = "" if tuple(suffixes) == ("",) else "[" + "|".join(s for s in suffixes if s) + "]"
    files = ", ".join(n + variants for n in names)
    lines = [f"{what} not found."]
    if dirs:
        lines.append("Looked for:\n" + "\n".join(f"  in {d}: {files}" for d in dirs))
    else:
        lines.append(f"Looked for {files}, but no data_dir was given.")
    fixes = ([install_hint] if install_hint else []) + ["pass --data-dir pointing at a folder with these files"]
    if fetch is not None and download and data_dir is None:
        lines.append("--download was given, but downloading needs a folder to write into.")
        fixes = ["pass --data-dir: the folder to download into (or one that holds these files)"]
    elif fetch is not None:
        fixes.append("allow downloading into --data-dir (--download, or download=True)")
    lines.append("To fix: " + "; or ".join(fixes) + ".")
    return "\n".join(lines)
