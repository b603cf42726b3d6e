"""One CDF_R for every rank: a loss histogram merged by an all-reduce in each round's exchange.

Each rank bins the losses it ranks (raysb.core.histogram) into a round's counts; the lockstep
exchange sums every rank's counts with one all-reduce on the training process group (nccl on
GPUs), and each rank keeps the same window of the last rounds' global counts. Integer sums do
not depend on the order ranks arrive in, so every rank holds a bit-identical histogram with no
coordinator: the cost of a round is one all-reduce of LOSS_BINS counts, the same at 2 ranks
and at 256, and nothing leaves the device.

A round's losses are ranked against the window of the rounds before it, which holds at least
R losses once it is full (the last ceil(R / losses a round) rounds' global losses); the first
round of a run, with nothing merged yet, ranks against this rank's own losses.
"""

from __future__ import annotations

import math
import time
import zlib

import torch

from raysb.core.histogram import LOSS_BINS, bin_counts, bin_values, histogram_ranks
from raysb.training.collective import Collective


class MergedLossHistogram:
    """The loss-history interface `Selector` ranks against, shared by a worker group."""

    def __init__(self, capacity: int, losses_per_round: int, device: torch.device | str = "cpu"):
        """`losses_per_round`: the losses all ranks rank in one round (world size x selection chunk)."""
        if capacity < 1 or losses_per_round < 1:
            raise ValueError(f"history size R and losses a round must be >= 1, got {capacity} and {losses_per_round}")
        self.capacity = capacity
        self.window_rounds = math.ceil(capacity / losses_per_round)
        self.device = torch.device(device)
        self.pending = torch.zeros(LOSS_BINS, dtype=torch.int32, device=self.device)
        # The last window_rounds rounds' global counts (a ring) and their sum.
        self.rounds = torch.zeros(self.window_rounds, LOSS_BINS, dtype=torch.int64, device=self.device)
        self.window = torch.zeros(LOSS_BINS, dtype=torch.int64, device=self.device)
        self.merged_rounds = 0
        self.merge_seconds = 0.0

    def extend(self, losses: torch.Tensor) -> None:
        """Count this rank's round of losses; they join every rank's window at the round's merge."""
        self.pending += bin_counts(losses.to(self.device))

    def ranks(self, losses: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
        """Percentiles of `losses` in the window (in this rank's own counts while the window is empty)."""
        counts = torch.where(self.window.sum() > 0, self.window, self.pending)
        return histogram_ranks(counts, losses, tie_break)

    def merge(self, collective: Collective) -> None:
        """Sum every rank's round counts into the window: every rank calls this once a round."""
        started = time.perf_counter()
        merged = collective.all_reduce_sum(self.pending).to(self.device, torch.int64)
        slot = self.merged_rounds % self.window_rounds
        self.window += merged - self.rounds[slot]
        self.rounds[slot] = merged
        self.pending.zero_()
        self.merged_rounds += 1
        self.merge_seconds += time.perf_counter() - started

    def __len__(self) -> int:
        return int(self.window.sum())

    def values(self) -> torch.Tensor:
        """The window's losses at bin resolution (for `raysb report`'s CDF snapshots and probes)."""
        return torch.repeat_interleave(bin_values(self.device), self.window)

    def checksum(self) -> int:
        """CRC-32 of the window's counts: equal on every rank of a worker group."""
        return zlib.crc32(self.window.cpu().numpy().tobytes())

    def stats(self) -> dict:
        return {"merged_rounds": self.merged_rounds, "merge_seconds": self.merge_seconds,
                "window_rounds": self.window_rounds, "bytes_per_merge": LOSS_BINS * self.pending.element_size()}

    def state_dict(self) -> dict:
        return {"rounds": self.rounds.cpu(), "pending": self.pending.cpu(), "merged_rounds": self.merged_rounds,
                "merge_seconds": self.merge_seconds}

    def load_state_dict(self, state: dict) -> None:
        if state["rounds"].shape != self.rounds.shape:
            raise ValueError(
                f"checkpointed loss histogram holds {tuple(state['rounds'].shape)} round counts, this run keeps "
                f"{tuple(self.rounds.shape)} (R={self.capacity}); resume with the history size, selection batch "
                "and worker count it was made with"
            )
        self.rounds.copy_(state["rounds"])
        self.window.copy_(self.rounds.sum(0))
        self.pending.copy_(state["pending"])
        self.merged_rounds = int(state["merged_rounds"])
        self.merge_seconds = float(state["merge_seconds"])
