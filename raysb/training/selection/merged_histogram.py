"""One CDF_R for every rank: a loss histogram merged from each round's exchange.

Each rank bins the losses it ranks (raysb.core.histogram); the round's bin indices (4 bytes a
loss, with the place of its selection chunk in the round) travel in the lockstep exchange's
all-gather beside the kept ids, and every rank counts all ranks' indices into the same last
chunk steps' global counts (a step: every rank's chunk of the same place in the round). Integer
counts do not depend on the order ranks arrive in, so every rank holds a bit-identical history
with no coordinator and no collective of its own. (The all-reduce of the LOSS_BINS counts this
replaced was a second collective every round: on 2 CPU workers 5.8-6.3 ms a step against 0.4 for
counting the bins, BENCHMARKS.md, "The shared CDF_R at 2 to 256 ranks".)

A chunk is ranked against what one process's CDF_R would hold had it ranked every rank's chunk in
turn, step by step and rank by rank (the authors add a batch's losses to the history before
ranking it): the last R losses of that sequence, this chunk's last. Of them, the steps merged at
earlier exchanges are known exactly, the oldest one in part. The steps since, every other rank's
chunks, reach this rank only at the next exchange: each is estimated by this rank's own chunk of
the same step (every rank's shard is drawn alike, and lockstep ranks score a step with the same
weights), world_size times for the earlier steps, 1 + rank times for this step. Before, a rank
counted its round's own losses once (from 3 ranks at the defaults) or world_size times against
whole exchanges' windows, so right after the losses fell 20x it ranked its new low losses
against the old high ones: 4 ranks kept 0.01-0.04 of each chunk of the drop's exchange where
one process keeps 0.07-0.34 (BENCHMARKS.md, "Many ranks keep what one process keeps").
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch

from raysb.core.histogram import LOSS_BINS, bin_indices, bin_values, counts_of_bins, histogram_ranks
from raysb.core.transfer import to_device

# What travels for each loss: its step (its chunk's place in the rank's round) and its bin, as
# step * LOSS_BINS + bin.
BIN_DTYPE = torch.int32


class MergedLossHistogram:
    """The loss-history interface `Selector` ranks against, shared by a worker group."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu", world_size: int = 1, rank: int = 0):
        if capacity < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"history size R and world size must be >= 1 and rank in [0, world size), got "
                             f"{capacity}, {world_size} and {rank}")
        self.capacity = capacity
        self.world_size = world_size
        self.rank = rank
        self.device = torch.device(device)
        # This rank's chunks since the last merge: their counts, loss counts (host) and step and bin
        # indices (what the exchange carries).
        self.own: list[torch.Tensor] = []
        self.own_sizes: list[int] = []
        self.pending_keys: list[torch.Tensor] = []
        # The merged steps, newest first, as few as hold R losses: their global counts and loss
        # counts, and all their counts summed.
        self.steps: list[torch.Tensor] = []
        self.step_sizes: list[int] = []
        self.window = torch.zeros(LOSS_BINS, dtype=torch.int64, device=self.device)
        self.merged_rounds = 0
        self.merged_losses = 0
        self.merge_seconds = 0.0

    def extend(self, losses: torch.Tensor) -> None:
        """Count this rank's chunk of losses; they join every rank's history at the round's merge."""
        bins = bin_indices(losses.to(self.device).reshape(-1))
        self.pending_keys.append((bins + len(self.own) * LOSS_BINS).to(BIN_DTYPE))
        self.own.append(counts_of_bins(bins))
        self.own_sizes.append(bins.numel())

    def ranks(self, losses: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
        """Percentiles of `losses` in the last R losses one process would hold at this rank's newest
        chunk (see above); on the device, no host read (the weights are the host's loss counts)."""
        return histogram_ranks(self._last_losses(), losses, tie_break)

    def _last_losses(self) -> torch.Tensor:
        """The counts of one process's last R losses, newest first: this rank's newest chunk for
        itself and the ranks before it, its earlier chunks for every rank, then the merged steps."""
        need = float(self.capacity)
        window = torch.zeros(LOSS_BINS, dtype=torch.float64, device=self.device)
        for place, (counts, size) in enumerate(zip(reversed(self.own), reversed(self.own_sizes))):
            taken = _taken(need, size, 1 + self.rank if place == 0 else self.world_size)
            if taken:
                window += taken * counts
                need -= taken * size
        # The merged steps whole, less the oldest ones R has no room for (few: the steps hold about R).
        whole = 0
        while need > 0 and whole < len(self.steps) and self.step_sizes[whole] <= need:
            need -= self.step_sizes[whole]
            whole += 1
        if not whole:
            return window + (need / self.step_sizes[0]) * self.steps[0] if need > 0 and self.steps else window
        window += self.window
        if whole < len(self.steps):
            window -= (1 - max(need, 0) / self.step_sizes[whole]) * self.steps[whole]
        for counts in self.steps[whole + 1:]:
            window -= counts
        return window

    def take_round(self) -> torch.Tensor:
        """This rank's round as step and bin indices (BIN_DTYPE, where they were counted), for the
        exchange to carry: it copies them to the host with the round's kept examples."""
        keys = torch.cat(self.pending_keys) if self.pending_keys else torch.empty(0, dtype=BIN_DTYPE, device=self.device)
        self.pending_keys = []
        return keys

    def merge(self, round_keys: list[torch.Tensor]) -> None:
        """Count every rank's round (step and bin indices, from the exchange) into the steps: every
        rank calls this once a round, with the same indices, in any order."""
        started = time.perf_counter()
        self._own_merged()
        # On the host, in numpy (a microsecond an operation where torch's dispatch costs several):
        # the exchange brought the indices there.
        keys = np.concatenate([keys.cpu().reshape(-1).numpy() for keys in round_keys] or [np.empty(0, np.int32)])
        if not keys.size:
            # No rank ranked a loss (Stale-SB between its passes): the history keeps its steps.
            return
        self.merged_losses += keys.size
        steps = int(keys.max()) // LOSS_BINS + 1
        counts = np.bincount(keys, minlength=steps * LOSS_BINS).reshape(steps, LOSS_BINS)
        sizes = counts.sum(1).tolist()
        self.window += to_device(torch.from_numpy(counts.sum(0)), self.device)
        counts = to_device(torch.from_numpy(counts), self.device)
        for place in range(steps):
            if sizes[place]:
                self.steps.insert(0, counts[place])
                self.step_sizes.insert(0, sizes[place])
        # As few steps as hold R losses once the newest of them is left out of the sum.
        while len(self.steps) > 1 and sum(self.step_sizes[:-1]) >= self.capacity:
            self.window -= self.steps.pop()
            self.step_sizes.pop()
        self.merged_rounds += 1
        self.merge_seconds += time.perf_counter() - started

    def _own_merged(self) -> None:
        self.own, self.own_sizes = [], []

    def __len__(self) -> int:
        return int(self.window.sum())

    def values(self) -> torch.Tensor:
        """The merged steps' losses at bin resolution (for `raysb report`'s CDF snapshots and probes)."""
        return torch.repeat_interleave(bin_values(self.device), self.window)

    def checksum(self) -> int:
        """CRC-32 of the merged steps' counts: equal on every rank of a worker group."""
        return zlib.crc32(self.window.cpu().numpy().tobytes())

    def stats(self) -> dict:
        return {"merged_rounds": self.merged_rounds, "merge_seconds": self.merge_seconds,
                "window_steps": len(self.steps),
                "bytes_received": self.merged_losses * BIN_DTYPE.itemsize}

    def state_dict(self) -> dict:
        def stacked(counts: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(counts).cpu() if counts else torch.zeros(0, LOSS_BINS, dtype=torch.int64)

        return {"capacity": self.capacity, "steps": stacked(self.steps), "step_sizes": list(self.step_sizes),
                "own": stacked(self.own), "own_sizes": list(self.own_sizes),
                "pending_keys": [bins.cpu() for bins in self.pending_keys],
                "merged_rounds": self.merged_rounds, "merged_losses": self.merged_losses,
                "merge_seconds": self.merge_seconds}

    def load_state_dict(self, state: dict) -> None:
        if "steps" not in state:
            raise ValueError(
                "this checkpoint's loss histogram was saved by raysb before 2026-11-30, when ranks merged whole "
                "exchanges instead of chunk steps; a distributed run made before then cannot be resumed"
            )
        if state["capacity"] != self.capacity:
            raise ValueError(f"checkpointed loss histogram holds R={state['capacity']}, this run keeps "
                             f"R={self.capacity}: resume with the history size it was made with")
        self.steps = [counts.to(self.device) for counts in state["steps"]]
        self.step_sizes = [int(size) for size in state["step_sizes"]]
        self.window = sum(self.steps, torch.zeros(LOSS_BINS, dtype=torch.int64, device=self.device))
        self.own = [counts.to(self.device) for counts in state["own"]]
        self.own_sizes = [int(size) for size in state["own_sizes"]]
        self.pending_keys = [bins.to(self.device) for bins in state["pending_keys"]]
        self.merged_rounds = int(state["merged_rounds"])
        self.merged_losses = int(state.get("merged_losses", 0))
        self.merge_seconds = float(state["merge_seconds"])


def _taken(need: float, size: int, copies: int) -> float:
    """How many times a chunk of `size` losses counts, up to `copies`, in the `need` losses left to R."""
    if size <= 0 or need <= 0:
        return 0.0
    return min(float(copies), need / size)
