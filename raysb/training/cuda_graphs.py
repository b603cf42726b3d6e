"""Training steps and selection forwards replayed as CUDA graphs.

Every raysb training step trains exactly b examples (kept examples queue to full batches) and every
selection forward scores a fixed selection batch, so both have static shapes: each is captured once
as a CUDA graph and replayed, one launch where eager PyTorch makes hundreds. At small images those
launches are the step: ResNet-18 at 32x32 on an H200 took 12.0 ms a step eager at b512 and at b128,
the same time for a quarter of the work (BENCHMARKS.md, "Training at the GPU's speed").

A graph replays the kernels and addresses it captured. So inputs are copied into static buffers, the
lr is a device tensor the optimizer reads (written before each replay: a schedule never recaptures),
and the optimizer keeps its state in place (fused SGD or Adam). Capture needs a few warmup calls
first, which train; the step restores the model and optimizer afterwards, so the run trains exactly
the steps it would have trained eagerly.

On a CPU there are no graphs: `Replay.DIRECT` runs the same function on the same static buffers,
which is how the tests check the captured path against the eager step.
"""

from __future__ import annotations

import copy
import enum
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from raysb.core.label_doubt import ClassLogits
from raysb.training.precision import autocast

# Calls before capture: cuDNN and cuBLAS pick their algorithms and allocate workspaces, and a compiled
# forward compiles, outside the graph. PyTorch's own whole-network example warms up 3 times.
WARMUP_CALLS = 3


class Replay(enum.Enum):
    GRAPH = "graph"  # captured as a CUDA graph, replayed
    DIRECT = "direct"  # the same function on the same buffers, called (a CPU; the tests)


class CaptureRefused(Exception):
    """A function that could not be captured (a host sync in a model's forward, say): run it eagerly."""


class GraphedFunction:
    """`function()` over static buffers: captured on the first `__call__` after `WARMUP_CALLS` calls on
    a side stream (Replay.GRAPH), then replayed; with Replay.DIRECT, called each time."""

    def __init__(self, function: Callable[[], object], device: torch.device, replay: Replay):
        self.function, self.device, self.mode = function, device, replay
        self.outputs = None
        self._graph: torch.cuda.CUDAGraph | None = None

    @property
    def captured(self) -> bool:
        return self.outputs is not None

    def capture(self, before_capture: Callable[[], None] = lambda: None) -> None:
        """Warm up and capture; `before_capture` runs between the two (a training step restores its
        state there). Raises CaptureRefused, the graph discarded, where the function cannot be captured."""
        if self.mode is Replay.DIRECT:
            try:
                for _ in range(WARMUP_CALLS):
                    self.function()
                before_capture()
                self.outputs = self.function()
            except Exception as error:  # as a graph's capture refuses it
                raise CaptureRefused(f"{type(error).__name__}: {first_line(error)}") from error
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_CALLS):
                    self.function()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            before_capture()
            with torch.cuda.graph(graph):
                outputs = self.function()
        except Exception as error:  # whatever the function raised under capture: it cannot be replayed
            _settle(self.device)
            raise CaptureRefused(f"{type(error).__name__}: {first_line(error)}") from error
        self._graph, self.outputs = graph, outputs

    def __call__(self):
        """The function's outputs, after running it once more (a replay, or a call)."""
        if self.mode is Replay.GRAPH:
            self._graph.replay()
            return self.outputs
        self.outputs = self.function()
        return self.outputs


def capture_restoring(graph: GraphedFunction, changed: list[torch.Tensor]) -> str | None:
    """Capture `graph` with the tensors its function writes in place, `changed`, as they were before its
    warmup, and again after (a DIRECT capture runs the function once more; a graph's runs nothing):
    None, or why the function cannot be captured."""
    saved = [tensor.clone() for tensor in changed]

    def restore() -> None:
        for tensor, value in zip(changed, saved):
            tensor.copy_(value)

    try:
        graph.capture(before_capture=restore)
    except CaptureRefused as refused:
        return str(refused)
    finally:
        restore()
    return None


def replay_mode(device: torch.device) -> Replay:
    return Replay.GRAPH if device.type == "cuda" else Replay.DIRECT


class StepState:
    """A copy of everything a training step changes (weights, buffers, optimizer state, RNG), put back
    in place: the captured graph keeps the addresses it was captured with."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.model, self.optimizer, self.device = model, optimizer, device
        with torch.no_grad():
            self.tensors = [(t, t.detach().clone()) for t in _model_tensors(model)]
            self.optimizer_state = {
                id(param): {key: value.clone() for key, value in state.items() if isinstance(value, torch.Tensor)}
                for param, state in optimizer.state.items()
            }
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
            for param, state in self.optimizer.state.items():
                saved = self.optimizer_state.get(id(param), {})
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        continue
                    # State the warmup created is a fresh optimizer's: zeros (SGD's momentum buffer
                    # starts as the first gradient, 0 * momentum + g; Adam's moments and step at 0).
                    value.copy_(saved[key]) if key in saved else value.zero_()
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def _model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


class CapturedStep:
    """The whole training step as one graph: forward, per-example loss, weighted mean, backward,
    gradient clipping and the optimizer's update, at a fixed batch of `batch_size` examples.

    `capture` with the first batch (or the first `__call__` does); `set_lr` before each step;
    `__call__(inputs, labels, weights)` trains on them and returns the per-example losses, the
    loss it backpropagated and the logits (views of one copy: the next replay overwrites the
    graph's own). `weights` None is a plain mean."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: str,
        device: torch.device,
        grad_clip_norm: float | None = None,
        replay: Replay | None = None,
    ):
        self.model, self.optimizer, self.precision, self.device = model, optimizer, precision, device
        self.grad_clip_norm = grad_clip_norm
        self.mode = replay or replay_mode(device)
        # The lr every update reads once captured: a device tensor the optimizer holds in place of its float.
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self._buffers: dict[str, torch.Tensor] | None = None
        # Whether the weights buffer holds the plain mean's ones: a strategy without weights writes it once.
        self._unit_weights = False
        self._graph: GraphedFunction | None = None
        self.captures = 0
        self.capture_seconds = 0.0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def captured_graphs(self) -> list[GraphedFunction]:
        return [self._graph] if self._graph is not None else []

    def set_lr(self, lr: float) -> None:
        self.lr.fill_(lr)

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor,
                 weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, ClassLogits]:
        if self._graph is None:
            self.capture(inputs, labels, weights)
        buffers = self._buffers
        buffers["inputs"].copy_(inputs)
        buffers["labels"].copy_(labels)
        if weights is not None:
            buffers["weights"].copy_(weights)
            self._unit_weights = False
        elif not self._unit_weights:
            buffers["weights"].fill_(1.0)
            self._unit_weights = True
        # One copy of the graph's packed outputs (the next replay overwrites them), viewed apart.
        outputs = self._graph().clone()
        rows = len(labels)
        losses, loss, logits = outputs[1:rows + 1], outputs[0], outputs[rows + 1:].view(rows, -1)
        return losses, loss, ClassLogits(logits, labels)

    def invalidate(self) -> None:
        """The model or optimizer state was replaced (a checkpoint loaded): capture again at the next step."""
        self._graph, self._buffers = None, None

    def capture(self, inputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Capture the step for batches shaped as these (warmup steps, then the model and optimizer
        as they were); raises CaptureRefused, everything as it was, where it cannot be captured."""
        started = time.perf_counter()
        self._unit_weights = weights is None
        self._buffers = {
            "inputs": inputs.detach().clone(),
            "labels": labels.detach().clone(),
            "weights": (weights.detach().float().clone() if weights is not None
                        else torch.ones(len(labels), device=labels.device)),
        }
        graph = GraphedFunction(self._step, self.device, self.mode)
        state = StepState(self.model, self.optimizer, self.device)
        floats = [float(group["lr"]) for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        try:
            graph.capture(before_capture=state.restore)
        except CaptureRefused:
            state.restore()
            for group, lr in zip(self.optimizer.param_groups, floats):
                group["lr"] = lr
            self._buffers = None
            raise
        finally:
            if self.mode is Replay.GRAPH:
                torch.cuda.synchronize(self.device)
            self.capture_seconds += time.perf_counter() - started
        self._graph = graph
        self.captures += 1
        if self.mode is Replay.DIRECT:
            # DIRECT's capture ran the step it would replay (outputs for this batch, trained once):
            # undo it, so that __call__'s first replay is the step, as a graph's is.
            state.restore()

    def _step(self) -> tuple[torch.Tensor, ...]:
        buffers = self._buffers
        # Gradients are written, not added to: captured, backward allocates them in the graph's pool.
        self.optimizer.zero_grad(set_to_none=True)
        # Scoring leaves the module in eval mode; the mode a graph is captured in is the one it replays.
        if not all(module.training for module in self.model.modules()):
            self.model.train()
        with autocast(self.precision, self.device, cache=False):
            logits = self.model(buffers["inputs"])
        losses = F.cross_entropy(logits.float(), buffers["labels"], reduction="none")
        loss = (losses * buffers["weights"]).mean()
        loss.backward()
        if self.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        self.optimizer.step()
        # Packed as [loss, losses, logits] so that a step's outputs leave the graph in one copy.
        return torch.cat([loss.detach().view(1), losses.detach(), logits.detach().float().flatten()])


def timing_copy(model: torch.nn.Module, precision: str, device: torch.device, compiled: bool = False) -> CapturedStep:
    """A captured step on a copy of `model` (fused SGD, its lr 0; compiled as a run's is where
    `compiled`): what timing a run's captured step needs, leaving the run's own model, optimizer and
    graphs as they were."""
    copy_ = copy.deepcopy(model).train()
    trained = torch.compile(copy_, dynamic=False) if compiled else copy_
    step = CapturedStep(trained, torch.optim.SGD(copy_.parameters(), lr=0.0, momentum=0.9, fused=True), precision,
                        device)
    step.set_lr(0.0)
    return step


def _settle(device: torch.device) -> None:
    """Wait for the device after a failed capture, whose own error may resurface here once."""
    try:
        torch.cuda.synchronize(device)
    except RuntimeError:
        pass


def first_line(error: Exception) -> str:
    """An error's message as one line, for a summary's reason."""
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"
