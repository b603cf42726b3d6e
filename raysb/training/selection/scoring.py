"""Selection forwards, and the options that make them cheaper than a training forward.

A selection pass only ranks losses, so it can give up exactness a training step
cannot: an int8 copy of the model on the CPU (raysb.training.selection.quantized), autocast
to bf16 or fp16 (made for GPUs; emulated and slow on most CPUs), channels-last memory format, and a
`torch.compile`d copy of the forward, and capture as a CUDA graph at the fixed selection batch
(raysb.training.cuda_graphs). Each is a config option;
`python -m raysb.bench --selection-variants` measures its speed and how much it
changes which examples are kept.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from raysb.training.cuda_graphs import CaptureRefused, GraphedFunction, Replay, first_line, replay_mode
from raysb.training.selection.quantized import FollowingQuantizedCopy

# Autocast dtypes; int8 runs a quantized copy of the model instead.
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": None}


# How a selection forward normalizes with BatchNorm (config `selection_batchnorm`): with the
# running statistics, the chunk's own, or the chunk's until the lr warmup ends and the running
# ones after it.
BATCHNORM_MODES = ("running", "batch", "running-after-warmup")
# torch.compile's modes for a compiled selection forward; reduce-overhead replays CUDA graphs.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


class SelectionScorer:
    """Per-example losses from a no-grad forward in eval mode; BatchNorm's running statistics untouched.

    `batchnorm="running"` normalizes with the running statistics (the authors' eval-mode
    scoring); `"batch"` with the chunk's own statistics, as the training forward does
    with its batch's, while the running statistics stay as they are; `"running-after-warmup"`
    with the chunk's until optimizer step `warmup_steps`, the running ones after it (they lag
    the weights most while the lr climbs).
    `scale` < 1 scores inputs downsampled by that factor (bilinear; Composer's `scale_factor`):
    a forward of about scale**2 the cost, on models that pool to a fixed size before their head.
    `capture` replays the forward as a CUDA graph at the first chunk's size (`CapturedScoring`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        precision: str = "fp32",
        channels_last: bool = False,
        compile: bool = False,
        refresh_steps: int = 1,
        batchnorm: str = "running",
        warmup_steps: int = 0,
        scale: float = 1.0,
        compile_mode: str = "default",
        capture: bool = False,
        replay: Replay | None = None,
    ):
        if batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"unknown selection_batchnorm {batchnorm!r}; choose one of {', '.join(BATCHNORM_MODES)}")
        if batchnorm != "running" and precision == "int8":
            raise ValueError("selection_precision int8 folds BatchNorm into its convolutions: use selection_batchnorm running")
        if not 0 < scale <= 1:
            raise ValueError(f"selection_scale must be in (0, 1], got {scale}")
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"unknown selection_compile_mode {compile_mode!r}; choose one of {', '.join(COMPILE_MODES)}")
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
        if precision == "int8" and capture:
            raise ValueError("capture_selection does not apply to selection_precision int8 (it scores on the CPU)")
        self.model = model
        self.device = device
        self.dtype = PRECISIONS[precision]
        self.channels_last = channels_last
        self.quantized = FollowingQuantizedCopy(model, refresh_steps) if precision == "int8" else None
        # The compiled forward shares the model's parameters, so it always scores with current weights.
        # Its shapes are static: a smaller chunk (an epoch's last) is padded to the largest seen,
        # so the forward compiles once instead of again for every new size.
        self.forward = model
        self.compiled = compile
        if self.quantized is not None:
            self.forward = self.quantized
        elif compile:
            self.forward = PlainIfUncompilable(
                torch.compile(model, dynamic=False, mode=None if compile_mode == "default" else compile_mode), model)
        self.scale = scale
        # Until this optimizer step, BatchNorm normalizes with the chunk's statistics (no step: never).
        self.chunk_statistics_until = {"running": 0, "batch": None, "running-after-warmup": warmup_steps}[batchnorm]
        norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
        self.batch_norms = norms if self.chunk_statistics_until != 0 else []
        # Padding would change a chunk's own statistics, so with those the last chunk compiles its own graph.
        self.static_rows = 0 if compile and not self.batch_norms else None
        self.captured = CapturedScoring(self.losses_of, device, replay or replay_mode(device)) if capture else None

    def new_epoch(self) -> None:
        """An epoch starts: an int8 copy re-measures its activation ranges on the next chunk."""
        if self.quantized is not None:
            self.quantized.recalibrate_next()

    def stats(self) -> dict:
        """What keeping an int8 copy in step, or capturing graphs, cost this scorer (rank 0's in a summary),
        and why its compiled forward was given up, if it was."""
        refused = {} if self.compile_refused is None else {"selection_compile_refused": self.compile_refused}
        if self.captured is not None:
            return {**self.captured.stats(), **refused}
        if self.quantized is None:
            return refused
        return {
            "int8_engine": self.quantized.copy.engine,
            "int8_recalibrations": self.quantized.recalibrations,
            "int8_refreshes": self.quantized.refreshes,
        }

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Losses of `inputs` under the weights of optimizer step `step` (an int8 copy follows them)."""
        self.model.eval()
        rows = len(inputs)
        if not rows and (self.quantized is not None or self.static_rows is not None):
            # A rank whose shard ran out still joins the round: nothing to calibrate or compile for.
            return torch.zeros(0, device=inputs.device)
        if self.static_rows is not None:
            self.static_rows = max(self.static_rows, rows)
            # Eval mode scores each example on its own, so padding rows change no real row's loss.
            inputs = _padded(inputs, self.static_rows)
            labels = _padded(labels, self.static_rows)
        inputs = self.prepared(inputs)
        if self.quantized is not None:
            self.quantized.prepare(inputs, step)
        norms = self.norms_at(step)
        if not rows and norms:
            return torch.zeros(0, device=inputs.device)  # no statistics in an empty chunk
        if self.captured is not None and rows:
            losses = self.captured(inputs, labels, norms)
            if losses is not None:
                return losses
        with torch.inference_mode():
            return self.losses_of(inputs, labels, norms)[:rows]

    def prepared(self, inputs: torch.Tensor) -> torch.Tensor:
        """`inputs` as the forward takes them: downsampled by `scale`, in channels-last where asked."""
        if self.scale < 1:
            inputs = F.interpolate(inputs, scale_factor=self.scale, mode="bilinear", align_corners=False)
        if self.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs

    def norms_at(self, step: int) -> list[_BatchNorm]:
        """The BatchNorm layers that normalize with the chunk's own statistics at optimizer step `step`."""
        return self.batch_norms if self.chunk_statistics_until is None or step < self.chunk_statistics_until else []

    def losses_of(self, inputs: torch.Tensor, labels: torch.Tensor, norms: list[_BatchNorm],
                  cache: bool = True) -> torch.Tensor:
        """The forward's per-example losses (under no autograd: the caller's), BatchNorm on `norms`
        normalizing with the chunk's statistics; `cache=False` for a captured forward (precision.autocast)."""
        with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None,
                            cache_enabled=cache), _chunk_statistics(norms):
            logits = self.forward(inputs)
        return F.cross_entropy(logits.float(), labels, reduction="none")

    @property
    def compile_refused(self) -> str | None:
        """Why the compiled forward gave way to the plain module, if it did."""
        return self.forward.refused if isinstance(self.forward, PlainIfUncompilable) else None


class PlainIfUncompilable:
    """A torch.compile'd forward that gives way to the plain module, for good, where torch.compile cannot
    compile it (the selection forward is compiled by default where it is captured): as a refused
    training capture trains uncompiled. An error of the model's own comes back from the plain module."""

    def __init__(self, compiled: Callable, plain: torch.nn.Module):
        self.compiled, self.plain = compiled, plain
        self.refused: str | None = None

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.refused is None:
            try:
                return self.compiled(inputs)
            except Exception as error:
                self.refused = f"{type(error).__name__}: {first_line(error)}"
        return self.plain(inputs)


class CapturedScoring:
    """Selection forwards replayed as CUDA graphs at the selection batch: one graph for each way
    BatchNorm normalizes (the chunk's statistics, or the running ones), captured at its first use.

    A chunk of another size runs eagerly, except a smaller one scored with running statistics, which
    is padded (each example is scored on its own then, so padding changes no real example's loss);
    with the chunk's statistics padding would change them. A forward that cannot be captured is
    scored eagerly from then on, its reason in `stats()`."""

    def __init__(self, losses: Callable, device: torch.device, replay: Replay):
        self.losses, self.device, self.replay = losses, device, replay
        self.rows: int | None = None
        self.graphs: dict[bool, tuple[GraphedFunction, dict]] = {}
        self.refused: str | None = None
        self.capture_seconds = 0.0

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, norms: list) -> torch.Tensor | None:
        """The losses of a chunk, replayed; None where the chunk runs eagerly."""
        rows = len(inputs)
        self.rows = self.rows or rows
        chunk_statistics = bool(norms)
        if self.refused is not None or rows > self.rows or (rows < self.rows and chunk_statistics):
            return None
        if rows < self.rows:
            inputs, labels = _padded(inputs, self.rows), _padded(labels, self.rows)
        if chunk_statistics not in self.graphs and not self._capture(inputs, labels, norms):
            return None
        graph, buffers = self.graphs[chunk_statistics]
        buffers["inputs"].copy_(inputs)
        buffers["labels"].copy_(labels)
        return graph()[:rows].clone()

    def _capture(self, inputs: torch.Tensor, labels: torch.Tensor, norms: list) -> bool:
        started = time.perf_counter()
        buffers = {"inputs": inputs.clone(), "labels": labels.clone()}

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return self.losses(buffers["inputs"], buffers["labels"], norms, cache=False)

        graph = GraphedFunction(forward, self.device, self.replay)
        try:
            graph.capture()
        except CaptureRefused as refused:
            self.refused = str(refused)
            return False
        finally:
            self.capture_seconds += time.perf_counter() - started
        self.graphs[bool(norms)] = graph, buffers
        return True

    def captured_graphs(self) -> list[GraphedFunction]:
        return [graph for graph, _ in self.graphs.values()]

    def stats(self) -> dict:
        stats = {"selection_graphs": len(self.graphs), "selection_capture_s": round(self.capture_seconds, 3)}
        if self.refused is not None:
            stats["selection_capture_refused"] = self.refused
        return stats


@contextlib.contextmanager
def _chunk_statistics(batch_norms: list[_BatchNorm]):
    """BatchNorm normalizes with the batch's statistics and leaves the running ones alone."""
    for norm in batch_norms:
        norm.train()
        norm.track_running_stats = False
    try:
        yield
    finally:
        for norm in batch_norms:
            norm.eval()
            norm.track_running_stats = True


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """`rows` with copies of its first row appended up to `count`."""
    missing = count - len(rows)
    return rows if not missing else torch.cat([rows, rows[:1].expand(missing, *rows.shape[1:])])
