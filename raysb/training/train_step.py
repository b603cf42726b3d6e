"""A training step on one rank: forward, backward and update, eager or captured as one CUDA graph.

`TrainingStep` owns the model replica being trained, its optimizer, fp16's gradient scaler and the
gradient clip; the selection rounds (raysb.training.selection.rounds) give it the loss to
backpropagate and count the step. It knows nothing of data, selection or schedules: the lr is
handed to each step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raysb.core.batch_former import Batch
from raysb.core.label_doubt import ClassifiedLosses, ClassLogits
from raysb.training.collective import bare_module
from raysb.training.cuda_graphs import CapturedStep, CaptureRefused
from raysb.training.precision import autocast, gradient_scaler
from raysb.training.selection.rounds import SelectionRounds


class TrainingStep:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str,
                 device: torch.device, grad_clip_norm: float | None = None, *, capture: bool = False,
                 uncompiled_model: torch.nn.Module | None = None, capture_refused: str | None = None):
        """`precision`: the training forward's (raysb.training.precision; a resolved one).
        `grad_clip_norm`: the largest gradient norm a step applies (None: no clipping).
        `capture`: every step runs as one CUDA graph (raysb.training.cuda_graphs; the optimizer must
        be fused), captured at the first; a model that cannot be captured trains eagerly, with a
        notice. `uncompiled_model`: where `model` is compiled only to be captured, the module without
        compiling, captured instead where the compiled one is refused. `capture_refused`: why a
        capture asked for cannot be (a setting a graph cannot hold): the run trains eagerly and says
        so as it starts (`notices`)."""
        self.model, self.optimizer, self.precision, self.device = model, optimizer, precision, device
        self.grad_clip_norm = grad_clip_norm
        self.scaler = gradient_scaler(precision, device)
        # The forward's autocast context, entered every step: made once (fp32's is a no-op).
        self.autocast = autocast(precision, device)
        self.captured_step = CapturedStep(model, optimizer, precision, device, grad_clip_norm) if capture else None
        self.uncompiled_model = uncompiled_model
        self.capture_refused: str | None = None
        # Lines for the run's console on how the device trains (a refused capture).
        self.notices: list[str] = []
        if capture_refused is not None:
            self._refuse_capture(capture_refused)

    def __call__(self, batch: Batch, lr: float, rounds: SelectionRounds) -> None:
        """One step on `batch` at `lr`: its loss from `rounds` (which agree, read and count it)."""
        if self.captured_step is not None and self._captured(batch, rounds):
            self.captured_step.set_lr(lr)
            rounds.whole_step(batch, self._replayed)
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.autocast:
            loss = rounds.loss(self.model, batch)
        with rounds.timer.phase("backward"):
            self.optimizer.zero_grad(set_to_none=True)
            # Without fp16 the scaler is off: scale() and step() are the plain backward and step.
            self.scaler.scale(loss).backward()
            if self.grad_clip_norm is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16's scaled ones
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def _captured(self, batch: Batch, rounds: SelectionRounds) -> bool:
        """Whether `batch` trains as the captured step: captured at the first step (timed as a training
        step, so a time budget counts it), which, where the model cannot be captured, trains eagerly
        from then on and says why."""
        with rounds.timer.phase("train_step"):
            return self.ensure_captured(batch["inputs"], batch["labels"], batch.weights)

    def ensure_captured(self, inputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None) -> bool:
        """Whether the step is captured, capturing it for batches shaped as these where it is not yet."""
        step = self.captured_step
        if step is None or step.captured:
            return step is not None
        try:
            step.capture(inputs, labels, weights)
            return True
        except CaptureRefused as refused:
            reason = str(refused)
        if self.uncompiled_model is not None:
            # The compile was raysb's choice, not the user's: capture the plain module instead.
            self.model, self.uncompiled_model = self.uncompiled_model, None
            self.captured_step = CapturedStep(self.model, self.optimizer, self.precision, self.device,
                                              self.grad_clip_norm)
            try:
                self.captured_step.capture(inputs, labels, weights)
                self.notices.append(f"raysb: training step captured without torch.compile (compiled: {reason})")
                return True
            except CaptureRefused as refused:
                reason = f"compiled: {reason}; uncompiled: {refused}"
        self._refuse_capture(reason)
        return False

    def _refuse_capture(self, reason: str) -> None:
        self.captured_step, self.capture_refused = None, reason
        self.notices.append(f"raysb: training step not captured as a CUDA graph ({reason}): training eagerly")

    def _replayed(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, ClassLogits]:
        return self.captured_step(batch["inputs"], batch["labels"], batch.weights)

    @property
    def compiled(self) -> bool:
        return hasattr(self.model, "_orig_mod")  # torch.compile's wrapper (raysb.training.collective.bare_module)

    def capture_stats(self) -> dict:
        """How the training step ran, for the run's summary."""
        step = self.captured_step
        stats = {"captured_training": step is not None and step.captured, "compiled_training": self.compiled}
        if step is not None:
            stats.update(training_captures=step.captures, training_capture_s=round(step.capture_seconds, 3))
        if self.capture_refused is not None:
            stats["training_capture_refused"] = self.capture_refused
        return stats

    # -- checkpointing: the part every rank holds alike, and the buffers each rank moves its own way --
    def shared_state_dict(self) -> dict:
        optimizer = self.optimizer.state_dict()
        for group in optimizer["param_groups"]:  # a captured step's lr is a device tensor: saved as a float
            group["lr"] = float(group["lr"])
        return {"model": bare_module(self.model).state_dict(), "optimizer": optimizer,
                "scaler": self.scaler.state_dict()}

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers, on the CPU: DDP broadcasts rank 0's only at the start of each training
        forward, which then moves every rank's BatchNorm statistics by its own batch; selection scores
        in eval mode with those statistics, so a rank restored with rank 0's would keep other examples
        than it did."""
        return {name: buffer.detach().cpu().clone() for name, buffer in bare_module(self.model).named_buffers()}

    def load_state_dict(self, shared: dict, buffers: dict[str, torch.Tensor]) -> None:
        model = bare_module(self.model)
        model.load_state_dict(shared["model"])
        self.optimizer.load_state_dict(shared["optimizer"])
        if self.captured_step is not None:
            self.captured_step.invalidate()  # the optimizer's state tensors are new ones
        self.scaler.load_state_dict(shared["scaler"])
        with torch.no_grad():
            for name, value in buffers.items():
                model.get_buffer(name).copy_(value)


def image_loss(keeps_margins: bool):
    """The training loss of raysb's image models (one cross-entropy per example), with the logits'
    margins where the strategy's loss table keeps them (`LossTable.tracks_margins`)."""
    return _cross_entropy_with_margins if keeps_margins else _cross_entropy


def _cross_entropy(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    columns = batch.columns
    return F.cross_entropy(model(columns["inputs"]), columns["labels"], reduction="none")


def _cross_entropy_with_margins(model: torch.nn.Module, batch: Batch) -> ClassifiedLosses:
    # The margins come from the logits this forward computes anyway: each trained example's signal of a
    # wrong label costs no forward, and the step no operation (the table computes them at its flush).
    columns = batch.columns
    logits = model(columns["inputs"])
    return ClassifiedLosses(F.cross_entropy(logits, columns["labels"], reduction="none"),
                            ClassLogits.of(logits, columns["labels"]))
