"""One CDF_R for every rank: a loss histogram merged from each round's exchange.

Each rank bins the losses it ranks (raysb.core.histogram); the round's bin indices (2 bytes a
loss) travel in the lockstep exchange's all-gather beside the kept ids, and every rank counts
all ranks' indices into the same window of the last rounds' global counts. Integer counts do
not depend on the order ranks arrive in, so every rank holds a bit-identical histogram with no
coordinator and no collective of its own. (The all-reduce of the LOSS_BINS counts this replaced
was a second collective every round: on 2 CPU workers 5.8-6.3 ms a step against 0.4 for
counting the bins, BENCHMARKS.md, "The shared CDF_R at 2 to 256 ranks".)

The window holds the last ceil(R / losses a round) rounds' global losses, at least R once it is
full. A round's losses are ranked against the window as the round's merge will leave it: the
round's own losses in, as one process's CDF_R holds the chunk it ranks (the authors add a batch's
losses to the history before ranking it), and as many of the oldest round's out. A rank knows
only its own share of the round before the exchange: where the window holds two rounds or more
it counts its own losses world_size times over (every rank's shard is drawn alike); where a
round's global losses fill the window alone (world_size x the losses a rank ranks between two
exchanges >= R), that estimate would be this rank's losses and nothing else, so they count once.
At the defaults (b = 128, s = 1/3: 3 selection chunks of 128 a rank between exchanges, R = 1024)
that is from 3 ranks on (tests/test_histogram.py). Fed the same losses as one process's Selector
(which ranks every rank's chunk in turn; exponential losses, 5 seeds), 2, 3, 4 and 8 ranks keep
within 0.01 of it while the losses drift. When they fall 20x at once, the exchange of the drop
lags: 2 ranks keep up to 0.13 less for 5 chunks, and 3 to 8 ranks keep 0.007-0.05 of each chunk
of that exchange where one process keeps 0.04-0.34 (4 ranks: 0.011, 0.022 and 0.037 against
0.055, 0.241 and 0.332), all within 0.01 again from the next exchange. Only an exchange before
deciding could bring the round's other losses (BENCHMARKS.md, "Selection that never loses").
"""

from __future__ import annotations

import math
import time
import zlib

import torch

from raysb.core.histogram import LOSS_BINS, bin_indices, bin_values, counts_of_bins, histogram_ranks
from raysb.core.transfer import to_device

# Bin indices travel as int16: LOSS_BINS fits.
BIN_DTYPE = torch.int16


class MergedLossHistogram:
    """The loss-history interface `Selector` ranks against, shared by a worker group."""

    def __init__(self, capacity: int, losses_per_round: int, device: torch.device | str = "cpu", world_size: int = 1):
        """`losses_per_round`: the losses all `world_size` ranks rank between two merges, which come
        with the lockstep exchanges (`SelectionSpec.losses_per_exchange`); a "round" here is one merge."""
        if capacity < 1 or losses_per_round < 1 or world_size < 1:
            raise ValueError(f"history size R, losses a round and world size must be >= 1, got {capacity}, "
                             f"{losses_per_round} and {world_size}")
        self.capacity = capacity
        self.world_size = world_size
        self.window_rounds = math.ceil(capacity / losses_per_round)
        self.device = torch.device(device)
        # This rank's round so far: its counts (what it ranks against before the first merge)
        # and its bin indices (what the exchange carries).
        self.pending = torch.zeros(LOSS_BINS, dtype=torch.int32, device=self.device)
        self.pending_bins: list[torch.Tensor] = []
        # The last window_rounds rounds' global counts (a ring) and their sum.
        self.rounds = torch.zeros(self.window_rounds, LOSS_BINS, dtype=torch.int64, device=self.device)
        self.window = torch.zeros(LOSS_BINS, dtype=torch.int64, device=self.device)
        self.merged_rounds = 0
        self.merged_losses = 0
        self.merge_seconds = 0.0

    def extend(self, losses: torch.Tensor) -> None:
        """Count this rank's round of losses; they join every rank's window at the round's merge."""
        bins = bin_indices(losses.to(self.device).reshape(-1))
        self.pending += counts_of_bins(bins, self.pending.dtype)
        self.pending_bins.append(bins.to(BIN_DTYPE))

    def ranks(self, losses: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
        """Percentiles of `losses` in the window as this round's merge will leave it (see above)."""
        weight = self.world_size if self.window_rounds > 1 else 1
        this_round = weight * self.pending.double()
        oldest = self.rounds[self.merged_rounds % self.window_rounds].double()
        # As many of the oldest round's losses out as this round's come in; on the device, no host read.
        leaving = (this_round.sum() / oldest.sum().clamp_min(1)).clamp(max=1)
        return histogram_ranks(self.window.double() - leaving * oldest + this_round, losses, tie_break)

    def take_round(self) -> torch.Tensor:
        """This rank's round as bin indices (int16, where they were counted), for the exchange to
        carry: it copies them to the host with the round's kept examples."""
        bins = torch.cat(self.pending_bins) if self.pending_bins else torch.empty(0, dtype=BIN_DTYPE, device=self.device)
        self.pending_bins = []
        return bins

    def merge(self, round_bins: list[torch.Tensor]) -> None:
        """Count every rank's round (bin indices, from the exchange) into the window: every rank
        calls this once a round, with the same indices, in any order."""
        started = time.perf_counter()
        bins = to_device(torch.cat(round_bins), self.device)
        if not bins.numel():
            # No rank ranked a loss (Stale-SB between its passes): the window keeps its rounds.
            return
        self.merged_losses += bins.numel()
        merged = counts_of_bins(bins)
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
                "window_rounds": self.window_rounds,
                "bytes_received": self.merged_losses * BIN_DTYPE.itemsize}

    def state_dict(self) -> dict:
        return {"rounds": self.rounds.cpu(), "pending": self.pending.cpu(),
                "pending_bins": [bins.cpu() for bins in self.pending_bins],
                "merged_rounds": self.merged_rounds, "merged_losses": self.merged_losses,
                "merge_seconds": self.merge_seconds}

    def load_state_dict(self, state: dict) -> None:
        if state["rounds"].shape != self.rounds.shape:
            raise ValueError(
                f"checkpointed loss histogram holds {tuple(state['rounds'].shape)} round counts, this run keeps "
                f"{tuple(self.rounds.shape)} (R={self.capacity}); resume with the history size, selection batch, "
                "selectivity and worker count it was made with (a distributed run made before 2026-11-26, when "
                "ranks merged after every selection batch, cannot be resumed)"
            )
        self.rounds.copy_(state["rounds"])
        self.window.copy_(self.rounds.sum(0))
        self.pending.copy_(state["pending"])
        self.pending_bins = [bins.to(self.device) for bins in state.get("pending_bins", [])]
        self.merged_rounds = int(state["merged_rounds"])
        self.merged_losses = int(state.get("merged_losses", 0))
        self.merge_seconds = float(state["merge_seconds"])
