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
`recalibrate` rebuilds the graph on a new batch when they have drifted.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.fx
from torch import nn
from torch.ao.nn import quantized as quantized_nn
from torch.ao.quantization import MinMaxObserver, QConfig, QConfigMapping, default_per_channel_weight_observer
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
# Their fused variants (ConvReLU2d, LinearReLU, ...) are subclasses.
_QUANTIZED_WEIGHTED = (quantized_nn.Conv1d, quantized_nn.Conv2d, quantized_nn.Conv3d, quantized_nn.Linear)
_QUANTIZED_NORMS = (quantized_nn.BatchNorm2d, quantized_nn.BatchNorm3d)


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
    """An int8 FX graph of `model`, built by `recalibrate`, that follows its float weights through `refresh`."""

    def __init__(self, model: nn.Module, engine: str | None = None):
        self.engine = engine or int8_engine()
        if self.engine not in torch.backends.quantized.supported_engines:
            raise QuantizationError(f"this PyTorch build has no {self.engine!r} quantized engine")
        # Process-wide in PyTorch; every int8 copy in a process uses the same engine.
        torch.backends.quantized.engine = self.engine
        self.qconfig = _qconfig(self.engine)
        self.source = model
        # Where FX would fuse; each build checks which of these it did.
        self.folds = folded_norms(model)
        self.graph = None

    def recalibrate(self, inputs: torch.Tensor) -> None:
        """Trace, calibrate activation ranges on `inputs` and convert, from the current float weights."""
        was_training = self.source.training
        float_copy = copy.deepcopy(self.source).eval()
        self.source.train(was_training)
        with warnings.catch_warnings():
            # FX quantization warns that it is in maintenance mode; it is still what lets weights refresh in place.
            warnings.simplefilter("ignore")
            observed = prepare_fx(float_copy, QConfigMapping().set_global(self.qconfig), (inputs[:1],))
            with torch.no_grad():
                observed(inputs)
            self.graph = convert_fx(observed)
        self.graph.eval()
        self._targets = self._refresh_targets()

    def _refresh_targets(self) -> list[tuple[nn.Module, nn.Module, nn.Module | None]]:
        """(converted module, float layer, folded BatchNorm or None) for every module holding weights."""
        source_modules = dict(self.source.named_modules())
        converted = dict(self.graph.named_modules())
        # A BatchNorm FX did not fuse is still a layer of the graph: it must not be folded as well.
        folds = {layer: norm for layer, norm in self.folds.items() if norm not in converted}
        folded = set(folds.values())
        targets, covered = [], set()
        for name, module in converted.items():
            if isinstance(module, (*_QUANTIZED_WEIGHTED, *_QUANTIZED_NORMS, *_NORMS)):
                if name not in source_modules:
                    raise QuantizationError(f"int8 selection cannot match quantized layer {name!r} to the model's")
                norm = source_modules[folds[name]] if name in folds else None
                targets.append((module, source_modules[name], norm))
                covered.update({name, folds.get(name)})
        for name, module in source_modules.items():
            holds_state = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if holds_state and name not in covered and name not in folded:
                raise QuantizationError(
                    f"int8 selection cannot follow the weights of {name!r} ({type(module).__name__}); "
                    "use selection_precision fp32 or bf16"
                )
        return targets

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantize the current float weights (and BatchNorm statistics) into the converted graph."""
        for target, layer, norm in self._targets:
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
            target.set_weight_bias(self._quantize_weight(weight.detach()), None if bias is None else bias.detach())

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
