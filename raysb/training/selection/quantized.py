"""An int8 copy of a model for selection forwards on the CPU, kept in step with the float weights.

Built with PyTorch's FX graph-mode post-training static quantization (`prepare_fx`,
one calibration batch, `convert_fx`). FX rather than PT2E: PT2E's CPU speed comes
from an Inductor compile, which would have to run again after every weight
refresh, whereas FX's quantized modules take new weights in place
(`set_weight_bias`), so following training costs a few milliseconds.

A refresh re-quantizes the current float weights into the converted graph: each
convolution or linear layer that FX fused with the BatchNorm after it gets the
BatchNorm folded in again (eval-mode fold, as FX does), each unfused BatchNorm
gets its new statistics. Activation ranges come from the last calibration;
`recalibrate` converts a fresh copy of the observed graph, calibrated on a new batch
under the current weights, when they have drifted.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.fx
from torch import nn
from torch.ao.nn import quantized as quantized_nn
from torch.ao.nn.intrinsic import _FusedModule
from torch.ao.quantization import MinMaxObserver, QConfig, QConfigMapping, default_per_channel_weight_observer
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
# Their fused variants (ConvReLU2d, LinearReLU, ...) are subclasses.
_QUANTIZED_WEIGHTED = (quantized_nn.Conv1d, quantized_nn.Conv2d, quantized_nn.Conv3d, quantized_nn.Linear)
_QUANTIZED_NORMS = (quantized_nn.BatchNorm2d, quantized_nn.BatchNorm3d)
# What a model layer with weights becomes: float in the observed graph, int8 in the converted one.
_FOLLOWED = (*_QUANTIZED_WEIGHTED, *_QUANTIZED_NORMS, *_NORMS, *_WEIGHTED)


def int8_engine() -> str:
    """The quantized engine for this CPU: fbgemm-based `x86` where AVX-512 gives int8 dot products,
    `onednn` otherwise (measured faster on AVX2-only CPUs: BENCHMARKS.md, "int8 selection")."""
    return "x86" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "onednn"


def _qconfig(engine: str) -> QConfig:
    # MinMax rather than the default histogram observer for activations: calibration then
    # costs one plain forward, which matters because it happens mid-run. fbgemm needs
    # reduce_range to keep its int16 accumulation from saturating; onednn does not.
    return QConfig(
        activation=MinMaxObserver.with_args(reduce_range=engine != "onednn"),
        weight=default_per_channel_weight_observer,
    )


class QuantizationError(ValueError):
    """The model cannot be scored in int8 (not FX-traceable, or has layers a refresh cannot follow)."""


def folded_norms(model: nn.Module) -> dict[str, str]:
    """{conv or linear name: name of the BatchNorm that FX fuses into it} (a BatchNorm whose only input
    is that layer's output, and that layer has no other user)."""
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as error:  # noqa: BLE001 - tracing fails in many ways; the user needs only which model
        raise QuantizationError(
            f"int8 selection needs a model torch.fx can trace ({type(model).__name__}: {error}); "
            "use selection_precision fp32 or bf16"
        ) from error
    modules = dict(model.named_modules())
    folds = {}
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], _NORMS):
            continue
        source = node.args[0]
        if (
            isinstance(source, torch.fx.Node)
            and source.op == "call_module"
            and isinstance(modules[source.target], _WEIGHTED)
            and len(source.users) == 1
        ):
            folds[source.target] = node.target
    return folds


class QuantizedCopy:
    """An int8 FX graph of `model`, built by `recalibrate`, that follows its float weights through `refresh`.

    The model is traced once, here, into an observed template that each recalibration
    copies: an FX trace patches `torch.nn.Module.__call__` process-wide, so a trace on the
    pipeline's selection thread would route the training thread's forwards into the tracer.
    """

    def __init__(self, model: nn.Module, engine: str | None = None):
        self.engine = engine or int8_engine()
        if self.engine not in torch.backends.quantized.supported_engines:
            raise QuantizationError(f"this PyTorch build has no {self.engine!r} quantized engine")
        # Process-wide in PyTorch; every int8 copy in a process uses the same engine.
        torch.backends.quantized.engine = self.engine
        self.qconfig = _qconfig(self.engine)
        self.source = model
        folds = folded_norms(model)
        with warnings.catch_warnings():
            # FX quantization warns that it is in maintenance mode; it is still what lets weights refresh in place.
            warnings.simplefilter("ignore")
            # Example inputs only serve standalone modules, which this qconfig never makes.
            self.template = prepare_fx(copy.deepcopy(model).eval(), QConfigMapping().set_global(self.qconfig), ())
        in_graph = dict(self.template.named_modules())
        # A BatchNorm FX did not fuse is still a layer of the graph: it must not be folded as well.
        self.folds = {layer: norm for layer, norm in folds.items() if norm not in in_graph}
        self._follow(self.template)  # fails here, at start, on layers it cannot follow
        self.graph = None
        self._targets = []  # the converted graph's, from the first recalibration on

    def recalibrate(self, inputs: torch.Tensor) -> None:
        """Measure activation ranges on `inputs` under the current float weights, and convert."""
        observed = copy.deepcopy(self.template)
        self._write_weights(self._follow(observed))
        with torch.no_grad():
            observed(inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.graph = convert_fx(observed)
        self.graph.eval()
        self._targets = self._follow(self.graph)

    def _follow(self, graph: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module | None]]:
        """(module of `graph`, float layer, folded BatchNorm or None) for every model layer holding weights."""
        in_graph = dict(graph.named_modules())
        folded = set(self.folds.values())
        targets = []
        for name, layer in self.source.named_modules():
            holds_state = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
            if not holds_state or name in folded:
                continue
            target = in_graph.get(name)
            if isinstance(target, _FusedModule):  # the observed graph: the float layer inside an eval-mode fusion
                target = target[0]
            if not isinstance(target, _FOLLOWED):
                raise QuantizationError(
                    f"int8 selection cannot follow the weights of {name!r} ({type(layer).__name__}); "
                    "use selection_precision fp32 or bf16"
                )
            norm = self.source.get_submodule(self.folds[name]) if name in self.folds else None
            targets.append((target, layer, norm))
        return targets

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantize the current float weights (and BatchNorm statistics) into the converted graph."""
        self._write_weights(self._targets)

    @torch.no_grad()
    def _write_weights(self, targets: list[tuple[nn.Module, nn.Module, nn.Module | None]]) -> None:
        for target, layer, norm in targets:
            if isinstance(target, (*_QUANTIZED_NORMS, *_NORMS)):
                for key in ("weight", "bias", "running_mean", "running_var"):
                    getattr(target, key).copy_(getattr(layer, key))
                continue
            weight, bias = layer.weight.detach(), layer.bias
            if norm is not None:
                fuse = fuse_linear_bn_weights if isinstance(layer, nn.Linear) else fuse_conv_bn_weights
                weight, bias = fuse(
                    weight, bias, norm.running_mean, norm.running_var, norm.eps, norm.weight, norm.bias
                )
            bias = None if bias is None else bias.detach()
            if isinstance(target, _QUANTIZED_WEIGHTED):
                target.set_weight_bias(self._quantize_weight(weight.detach()), bias)
            else:
                target.weight.copy_(weight)
                if bias is not None:
                    target.bias.copy_(bias)

    def _quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        observer = self.qconfig.weight()
        observer(weight)
        scale, zero_point = observer.calculate_qparams()
        return torch.quantize_per_channel(weight, scale, zero_point.to(torch.int64), observer.ch_axis, observer.dtype)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.graph(inputs)


# Activation ranges move fast while a model leaves its initialization and then settle,
# while a single optimizer step already changes a few percent of keep decisions
# (BENCHMARKS.md, "int8 selection"): so weights are re-quantized often (every
# `refresh_steps`), activation ranges re-measured at steps 1, 2, 4, ... up to
# RECALIBRATE_EVERY, every RECALIBRATE_EVERY steps after that, and at each epoch's start.
RECALIBRATE_EVERY = 256


def next_recalibration(step: int) -> int:
    """The first scheduled recalibration after a recalibration at optimizer step `step`."""
    if step < RECALIBRATE_EVERY:
        return 1 << step.bit_length()
    return (step // RECALIBRATE_EVERY + 1) * RECALIBRATE_EVERY


class FollowingQuantizedCopy:
    """A QuantizedCopy kept in step with training on a schedule that depends only on the optimizer step.

    Which weights and ranges score a chunk depend only on the steps and the epoch starts,
    so a run resumed at an epoch boundary (where the copy is rebuilt anyway) scores
    exactly as the uninterrupted one.
    """

    def __init__(self, model: nn.Module, refresh_steps: int = 1):
        if refresh_steps < 1:
            raise ValueError(f"selection_refresh_steps must be >= 1, got {refresh_steps}")
        self.copy = QuantizedCopy(model)
        self.refresh_steps = refresh_steps
        self.recalibrate_pending = True
        self.refreshed_at = self.recalibrate_at = 0
        self.refreshes = self.recalibrations = 0

    def recalibrate_next(self) -> None:
        """Re-measure activation ranges on the next chunk (called at each epoch's start)."""
        self.recalibrate_pending = True

    def prepare(self, inputs: torch.Tensor, step: int) -> None:
        """Bring the copy up to `step` as the schedule says, calibrating on `inputs` if it is due."""
        if self.recalibrate_pending or step >= self.recalibrate_at:
            self.copy.recalibrate(inputs)
            self.recalibrate_pending = False
            self.recalibrate_at = next_recalibration(step)
            self.refreshed_at = step
            self.recalibrations += 1
        elif step - self.refreshed_at >= self.refresh_steps:
            self.copy.refresh()
            self.refreshed_at = step
            self.refreshes += 1

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.copy(inputs)
