"""A cap on how often one example is kept within a window of epochs, relative to a uniform draw.

With cap K, kept fraction s and window W, no example is kept in more than M = floor(K s W) of any W
consecutive epochs (raysb.core.selectivity.trained_at_most): a uniform draw of s keeps each example in
s W of them on average, so K bounds how far past that a keep rule may favour one. Built for the
over-fitting that follows when it does not (BENCHMARKS.md, "Selection that never loses": free-sb trained
a tenth of the examples 46 times or more where a uniform draw would have trained each 20 times).

Keeping an example in epoch e puts one more keep in the window [e - W + 1, e]: it is allowed when its
last M keeps do not all fall in that window, that is, when the oldest of them came at e - W or before.
So the cap holds M integers an example, not W flags, and a decision is one gather.
"""

from __future__ import annotations

import torch

from raysb.core.sample_index import SampleIndex
from raysb.core.transfer import to_host

# The epoch recorded for keeps that never happened: far enough back to lie outside every window.
_NEVER = -(2**30)


class TrainCap:
    def __init__(self, sample_ids: torch.Tensor, most: int, window: int):
        """A cap of `most` keeps in any `window` consecutive epochs for the examples `sample_ids`."""
        if most < 1 or window < 1:
            raise ValueError(f"a train cap keeps an example at most most >= 1 times in window >= 1 epochs, "
                             f"got {most} and {window}")
        self.index = SampleIndex(to_host(sample_ids))
        self.window = window
        # Each example's last `most` keep epochs, oldest first.
        self.last_kept = torch.full((sample_ids.numel(), most), _NEVER, dtype=torch.int64)

    def allowed(self, sample_ids: torch.Tensor, epoch: int) -> torch.Tensor:
        """Which of `sample_ids` may be kept in `epoch` without exceeding the cap."""
        oldest = self.last_kept[self.index.slots(sample_ids.cpu(), checked=False), 0]
        return oldest <= epoch - self.window

    def record(self, sample_ids: torch.Tensor, epoch: int) -> None:
        """`sample_ids` (each once) were kept in `epoch`."""
        slots = self.index.slots(sample_ids.cpu(), checked=False)
        kept = self.last_kept[slots]
        self.last_kept[slots] = torch.cat([kept[:, 1:], torch.full_like(kept[:, :1], epoch)], dim=1)

    def state_dict(self) -> dict:
        return {"last_kept": self.last_kept.clone()}

    def load_state_dict(self, state: dict) -> None:
        if state["last_kept"].shape != self.last_kept.shape:
            raise ValueError(f"this train cap holds {tuple(self.last_kept.shape)} keep epochs, the checkpoint's "
                             f"{tuple(state['last_kept'].shape)}: resume with the same data, train_cap and window")
        self.last_kept.copy_(state["last_kept"])
