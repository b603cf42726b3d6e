"""The training loop: selection chunks -> kept examples -> full batches -> optimizer steps.

`Engine` owns one model replica and one shard of the data. It knows nothing of
Ray; a distributed run wraps the same engine on every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from raysb.batch_former import Batch, BatchFormer
from raysb.data import BatchTransform, ImageDataset
from raysb.schedules import learning_rate, schedule_progress
from raysb.selection import NonFiniteLossError, check_finite
from raysb.strategies import Strategy
from raysb.timing import PhaseTimer


@dataclass
class Counters:
    """Cumulative example and step counts of a run."""

    selection_forward_examples: int = 0
    train_forward_examples: int = 0
    backprop_examples: int = 0
    optimizer_steps: int = 0
    examples_considered: int = 0
    examples_kept: int = 0


@dataclass
class Schedule:
    name: str
    base_lr: float
    total_epochs: int
    milestones: list
    factor: float
    key: str


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        train_data: ImageDataset,
        transform: BatchTransform,
        schedule: Schedule,
        batch_size: int,
        selection_batch_size: int,
        prime_epochs: int,
        seed: int,
        device: torch.device,
    ):
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy
        self.data = train_data
        self.transform = transform
        self.schedule = schedule
        self.batch_size = batch_size
        self.chunk_size = strategy.chunk_size(batch_size, selection_batch_size)
        self.prime_epochs = prime_epochs
        self.device = device
        self.former = BatchFormer(batch_size)
        self.counters = Counters()
        self.timer = PhaseTimer(device)
        # Data order and augmentation draw from CPU generators so a seed gives
        # the same run on CPU and GPU; the draws are moved to the device.
        self.order_generator = torch.Generator().manual_seed(seed)
        self.augment_generator = torch.Generator().manual_seed(seed + 1)
        self._epoch = 0
        self._step_in_epoch = 0
        self._loss_sum = 0.0

    # -- ChunkContext: how strategies reach data and the model --------------------
    def sample_ids(self, positions: torch.Tensor) -> torch.Tensor:
        return self.data.sample_ids[positions]

    def load(self, positions: torch.Tensor) -> Batch:
        with self.timer.phase("data"):
            positions = positions.to(self.data.images.device)
            inputs = self.transform(self.data.images[positions], self.augment_generator, train=True)
            return Batch(self.data.sample_ids[positions], inputs, self.data.labels[positions])

    def score(self, batch: Batch) -> torch.Tensor:
        """Selection forward: eval mode so BatchNorm statistics are not moved by scoring."""
        with self.timer.phase("selection"):
            self.model.eval()
            with torch.inference_mode():
                losses = F.cross_entropy(self.model(batch.inputs), batch.labels, reduction="none")
            self.counters.selection_forward_examples += len(batch)
            check_finite(losses, self._where())
            return losses.float()

    # -- training -------------------------------------------------------------------
    def train_epoch(self, epoch: int, should_stop=lambda: False) -> bool:
        """Train one epoch; returns True if `should_stop` ended it early."""
        self._epoch, self._step_in_epoch, self._loss_sum = epoch, 0, 0.0
        self._epoch_considered = self._epoch_kept = self._epoch_steps = 0
        priming = epoch < self.prime_epochs
        with self.timer.phase("data"):
            order = torch.randperm(len(self.data), generator=self.order_generator)
        for positions in order.split(self.chunk_size):
            if priming:
                kept = self.load(positions)
            else:
                kept = self.strategy.choose(epoch, positions, self)
            self._epoch_considered += positions.numel()
            self._epoch_kept += len(kept)
            self.former.add(kept)
            while self.former.full_batches():
                self.train_step(self.former.pop())
                if should_stop():
                    self._close_epoch()
                    return True
        self._close_epoch()
        return False

    def _close_epoch(self) -> None:
        self.counters.examples_considered += self._epoch_considered
        self.counters.examples_kept += self._epoch_kept

    def train_step(self, batch: Batch) -> None:
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        with self.timer.phase("train_forward"):
            losses = F.cross_entropy(self.model(batch.inputs), batch.labels, reduction="none")
            loss = losses.mean() if batch.weights is None else (losses * batch.weights).mean()
            if not bool(torch.isfinite(loss)):
                raise NonFiniteLossError(f"training loss is {float(loss)} at {self._where()}")
        with self.timer.phase("backward"):
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        self.strategy.observe_training_losses(losses.detach())
        self.counters.train_forward_examples += len(batch)
        self.counters.backprop_examples += len(batch)
        self.counters.optimizer_steps += 1
        self._step_in_epoch += 1
        self._epoch_steps += 1
        self._loss_sum += float(loss.detach())

    def current_lr(self) -> float:
        s = self.schedule
        progress = schedule_progress(
            s.key, self._epoch, self.counters.backprop_examples, len(self.data)
        )
        return learning_rate(s.name, s.base_lr, progress, s.total_epochs, s.milestones, s.factor)

    def epoch_stats(self) -> dict[str, float]:
        return {
            "train_loss": self._loss_sum / self._epoch_steps if self._epoch_steps else float("nan"),
            "kept_fraction": self._epoch_kept / self._epoch_considered if self._epoch_considered else 0.0,
            "epoch_steps": self._epoch_steps,
        }

    def _where(self) -> str:
        return f"epoch {self._epoch + 1}, step {self._step_in_epoch + 1}"

    # -- evaluation -----------------------------------------------------------------
    def evaluate(self, test_data: ImageDataset, batch_size: int) -> tuple[float, float]:
        """Test error and mean loss; timed as evaluation, so excluded from training time."""
        with self.timer.phase("evaluation"):
            self.model.eval()
            wrong, loss_sum = 0, 0.0
            with torch.inference_mode():
                for start in range(0, len(test_data), batch_size):
                    images = test_data.images[start : start + batch_size].to(self.device)
                    labels = test_data.labels[start : start + batch_size].to(self.device)
                    logits = self.model(self.transform(images, None, train=False))
                    loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
                    wrong += int((logits.argmax(1) != labels).sum())
            return wrong / len(test_data), loss_sum / len(test_data)

    def counters_dict(self) -> dict[str, int]:
        return asdict(self.counters)
