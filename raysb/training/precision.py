"""Training precision: the autocast of training and selection forwards, and fp16's gradient scaler.

`precision` is fp32, bf16 or fp16 autocast (weights stay fp32; matmuls and convolutions
run in the lower precision), or `auto`: bf16 on a GPU that supports it, fp32 elsewhere
(on this project's AVX2 CPUs bf16 autocast ran 12.7x slower than fp32, BENCHMARKS.md,
"bf16 re-examined"). fp16 adds a gradient scaler, whose state travels in checkpoints.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(name: str, device: torch.device) -> str:
    """The precision `name` means on `device` (`auto` chosen per device)."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
    if name != "auto":
        return name
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def autocast(precision: str, device: torch.device, cache: bool = True):
    """The context a forward runs in at `precision` (a resolved one); fp32 is a no-op. `cache=False`
    for a forward captured as a CUDA graph: the weights' low-precision copies that autocast caches
    would be freed at capture's end, while the graph still reads them (PyTorch's CUDA graph notes)."""
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def gradient_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """fp16's loss scaler; disabled (scale() and step() pass through) at other precisions."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
