"""Count the operations that make the host wait for an accelerator, on any device.

On a GPU, reading a tensor's value on the host (`.item()`, `bool(t)`, `float(t)`,
`.tolist()`) or an op whose output size depends on the data (`nonzero`, a boolean
mask index, `masked_select`, `unique`) blocks until every queued kernel has run.
`torch.cuda.set_sync_debug_mode` reports them on a GPU only; `HostSyncCounter` sees
the same aten operations through a dispatch mode, so the count can be tested on a
CPU, where nothing waits.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose result the host must wait for: a value read, or an output sized by the data.
SYNCING_OPS = {
    "aten._local_scalar_dense",  # .item(), bool(), float(), int()
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
}


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter() as syncs: ...`; then `syncs.total` and `syncs.by_op`."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in SYNCING_OPS or (name == "aten.index" and _has_mask(args)):
            self.by_op[name if name != "aten.index" else "aten.index (boolean mask)"] += 1
        return func(*args, **(kwargs or {}))


def _has_mask(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices or ())
