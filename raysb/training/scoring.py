"""Selection forwards, and the options that make them cheaper than a training forward.

A selection pass only ranks losses, so it can give up exactness a training step
cannot: autocast to bf16 (CPU or GPU) or fp16 (GPU), channels-last memory
format, and a `torch.compile`d copy of the forward. Each is a config option;
`python -m raysb.bench --selection-variants` measures its speed and how much it
changes which examples are kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class SelectionScorer:
    """Per-example losses from a no-grad forward in eval mode (BatchNorm statistics untouched)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        precision: str = "fp32",
        channels_last: bool = False,
        compile: bool = False,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown selection precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
        if precision == "fp16" and device.type != "cuda":
            raise ValueError("selection_precision fp16 needs a CUDA device; use bf16 on the CPU")
        self.model = model
        self.device = device
        self.dtype = PRECISIONS[precision]
        self.channels_last = channels_last
        # The compiled forward shares the model's parameters, so it always scores with current weights.
        self.forward = torch.compile(model) if compile else model

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        if self.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode(), torch.autocast(
            self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None
        ):
            logits = self.forward(inputs)
        return F.cross_entropy(logits.float(), labels, reduction="none")
