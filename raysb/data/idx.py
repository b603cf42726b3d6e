"""Parser for the IDX format (http://yann.lecun.com/exdb/mnist/), gzip-compressed or not."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from .dataset import DataError

# Third byte of the magic number -> element type. IDX stores multi-byte values big-endian.
_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: Path) -> np.ndarray:
    """The array stored in an IDX file, in native byte order; DataError naming the file if it is malformed."""
    try:
        with (gzip.open(path) if path.suffix == ".gz" else open(path, "rb")) as f:
            raw = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise DataError(f"{path}: corrupt or truncated gzip stream ({err})") from err

    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise DataError(f"{path}: not an IDX file (magic number {raw[:4].hex() or 'missing'})")
    dtype, ndim = _DTYPES[raw[2]], raw[3]
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header_size})")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header_size + dtype.itemsize * int(np.prod(shape))
    if len(raw) != expected:
        raise DataError(
            f"{path}: IDX header promises shape {shape} ({expected} bytes) but the file has {len(raw)} bytes"
            + (" (truncated)" if len(raw) < expected else "")
        )
    # astype copies, which also makes the array writable (frombuffer over bytes is read-only).
    return np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(shape).astype(dtype.newbyteorder("="))
