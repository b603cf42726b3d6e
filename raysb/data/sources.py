"""Finding a split's files on disk or at a URI, downloading them when allowed, and explaining what to do when
neither works."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pyarrow.fs as pafs

from .dataset import DatasetNotFoundError

# Where pyarrow looks for credentials and endpoints, for the message when a URI cannot be read.
URI_SETTINGS = (
    "credentials and endpoint come from the environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
    "AWS_ENDPOINT_URL or an instance profile for s3://; GOOGLE_APPLICATION_CREDENTIALS or the VM's service "
    "account for gs://"
)


def is_uri(location: str | Path) -> bool:
    """Whether `location` names a filesystem by scheme (s3://, gs://, ...) rather than a local path."""
    return "://" in str(location)


def join_location(base: str | Path, name: str) -> str | Path:
    """`base`/`name`; in a URI's path, so a query such as ?region=... stays at the end."""
    if not is_uri(base):
        return Path(base).expanduser() / name
    parts = urlsplit(str(base))
    return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}"))


def torchvision_download(class_name: str, **options) -> Callable[[Path], object]:
    """A `fetch` for `locate` that downloads with torchvision's dataset class `class_name`.

    torchvision is imported only when a download runs: importing it loads torch._dynamo, about
    2 s of CPU in every process that reads a data set (each Ray Train worker, each CLI run).
    """

    def fetch(root: Path):
        import torchvision

        return getattr(torchvision.datasets, class_name)(root, download=True, **options)

    return fetch


def locate_uri(what: str, uri: str) -> str:
    """`uri`, once pyarrow's filesystems find a file or a folder of files there."""
    try:
        filesystem, path = pafs.FileSystem.from_uri(uri)
        found = filesystem.get_file_info(path).type != pafs.FileType.NotFound
    except ValueError as err:  # a scheme or URI that pyarrow's filesystems do not take
        raise DatasetNotFoundError(f"{what}: cannot read {uri}: {err}") from err
    except OSError as err:  # the store's answer: no access, no such endpoint, ...
        raise DatasetNotFoundError(f"{what}: cannot read {uri}: {err} ({URI_SETTINGS})") from err
    if not found:
        raise DatasetNotFoundError(
            f"{what} not found: nothing at {uri}.\nTo fix: pass --data-dir (data_dir= in Python) pointing at a "
            "folder with this file."
        )
    return uri


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
    include where their fetcher writes. Without a download, a ``data_dir`` (the user's --data-dir) that is
    no folder is named as such.
    """
    found = _first_complete(dirs, names, suffixes)
    if found is None and not download and data_dir is not None:
        check_data_dir(what, data_dir)
    if found is None and download and fetch is not None and data_dir is not None:
        try:
            fetch(data_dir)
        except Exception as err:  # torchvision raises several unrelated types for network and checksum failures
            raise DatasetNotFoundError(f"{what}: downloading into {data_dir} failed: {err}") from err
        found = _first_complete(dirs, names, suffixes)
    if found is None:
        raise DatasetNotFoundError(_not_found_message(what, dirs, names, suffixes, fetch, data_dir, download, install_hint))
    return found


def check_data_dir(what: str, data_dir: Path) -> None:
    """Refuse a --data-dir that is no folder, saying so: the files it should hold are not the problem."""
    if not data_dir.exists():
        raise DatasetNotFoundError(f"{what}: --data-dir {data_dir} does not exist")
    if not data_dir.is_dir():
        raise DatasetNotFoundError(f"{what}: --data-dir {data_dir} is a file; give the folder that holds the data")


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
    fixes = ([install_hint] if install_hint else []) + [
        "pass --data-dir (data_dir= in Python) pointing at a folder with these files"]
    if fetch is not None and download and data_dir is None:
        lines.append("--download was given, but downloading needs a folder to write into.")
        fixes = ["pass --data-dir (data_dir= in Python): the folder to download into (or one that holds these files)"]
    elif fetch is not None:
        fixes.append("allow downloading into --data-dir (--download, or download=True)")
    lines.append("To fix: " + "; or ".join(fixes) + ".")
    return "\n".join(lines)
