"""A trained model's losses and errors on data it does not train on: test error and loss at each
epoch's end, and each example's loss where a strategy's side work needs it (held-out losses,
irreducible ones)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raysb.data import BatchTransform, ImageDataset
from raysb.data.streaming import StreamedSplit
from raysb.training.precision import autocast
from raysb.training.timing import PhaseTimer


class Evaluation:
    def __init__(self, model: torch.nn.Module, transform: BatchTransform, precision: str, device: torch.device,
                 timer: PhaseTimer):
        """`model`: the bare module (no DDP hooks, no collectives), run in eval mode and unaugmented."""
        self.model, self.transform, self.precision, self.device, self.timer = model, transform, precision, device, timer

    def evaluate(self, test_data: ImageDataset | StreamedSplit, batch_size: int) -> tuple[float, float]:
        """Test error and mean loss; timed as evaluation, so excluded from training time."""
        with self.timer.phase("evaluation"), torch.inference_mode():
            # Summed on the device, read once at the end: no host sync per batch.
            wrong = torch.zeros((), dtype=torch.int64, device=self.device)
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            for logits, labels in self.logits(test_data, batch_size):
                loss_sum += F.cross_entropy(logits, labels, reduction="sum")
                wrong += (logits.argmax(1) != labels).sum()
            return int(wrong) / len(test_data), float(loss_sum) / len(test_data)

    def example_losses(self, data: ImageDataset, batch_size: int) -> torch.Tensor:
        """Each of `data`'s examples' loss, without autograd, on the device."""
        with torch.inference_mode():
            return torch.cat([F.cross_entropy(logits, labels, reduction="none")
                              for logits, labels in self.logits(data, batch_size)])

    def logits(self, data: ImageDataset | StreamedSplit, batch_size: int):
        """Each batch of `data` as (fp32 logits, labels) on the device; the caller holds autograd off."""
        self.model.eval()
        for images, labels in data.batches(batch_size):
            images, labels = images.to(self.device), labels.to(self.device)
            with autocast(self.precision, self.device):
                logits = self.model(self.transform(images, None, train=False))
            yield logits.float(), labels
