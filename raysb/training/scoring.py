"""Selection forwards, and the options that make them cheaper than a training forward.

A selection pass only ranks losses, so it can give up exactness a training step
cannot: an int8 copy of the model on the CPU (raysb.training.quantized), autocast
to bf16 or fp16 (made for GPUs; emulated and slow on most CPUs), channels-last memory format, and a
`torch.compile`d copy of the forward. Each is a config option;
`python -m raysb.bench --selection-variants` measures its speed and how much it
changes which examples are kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raysb.training.quantized import FollowingQuantizedCopy

# Autocast dtypes; int8 runs a quantized copy of the model instead.
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": None}


class SelectionScorer:
    """Per-example losses from a no-grad forward in eval mode (BatchNorm statistics untouched)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        precision: str = "fp32",
        channels_last: bool = False,
        compile: bool = False,
        refresh_steps: int = 1,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown selection precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
        if precision == "int8" and device.type != "cpu":
            raise ValueError(
                "selection_precision int8 scores on the CPU (PyTorch's x86 int8 kernels); on a GPU use fp16 or bf16"
            )
        if precision == "int8" and compile:
            raise ValueError(
                "compile_selection does not apply to selection_precision int8 (its copy is an FX graph already)"
            )
        self.model = model
        self.device = device
        self.dtype = PRECISIONS[precision]
        self.channels_last = channels_last
        self.quantized = FollowingQuantizedCopy(model, refresh_steps) if precision == "int8" else None
        # The compiled forward shares the model's parameters, so it always scores with current weights.
        self.forward = self.quantized if self.quantized is not None else torch.compile(model) if compile else model

    def new_epoch(self) -> None:
        """An epoch starts: an int8 copy re-measures its activation ranges on the next chunk."""
        if self.quantized is not None:
            self.quantized.recalibrate_next()

    def stats(self) -> dict:
        """What keeping an int8 copy in step cost this scorer (rank 0's in a summary); empty for other precisions."""
        if self.quantized is None:
            return {}
        return {
            "int8_engine": self.quantized.copy.engine,
            "int8_recalibrations": self.quantized.recalibrations,
            "int8_refreshes": self.quantized.refreshes,
        }

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Losses of `inputs` under the weights of optimizer step `step` (an int8 copy follows them)."""
        self.model.eval()
        if self.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        if self.quantized is not None:
            if len(inputs) == 0:  # a rank whose shard ran out still joins the round; nothing to calibrate on
                return torch.zeros(0, device=inputs.device)
            self.quantized.prepare(inputs, step)
        with torch.inference_mode(), torch.autocast(
            self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None
        ):
            logits = self.forward(inputs)
        return F.cross_entropy(logits.float(), labels, reduction="none")
