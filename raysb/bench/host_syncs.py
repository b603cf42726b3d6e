"""Count the operations that make the host wait for an accelerator, on any device.

On a GPU, reading a tensor's value on the host (`.item()`, `bool(t)`, `float(t)`,
`.tolist()`), copying it to the host (`raysb.core.transfer.to_host`), or an op whose output
size depends on the data (`nonzero`, a boolean mask index, `masked_select`, `unique`)
blocks until every queued kernel has run. `torch.cuda.set_sync_debug_mode` reports them on
a GPU only; `HostSyncCounter` sees the same aten operations through a dispatch mode, so the
count can be tested on a CPU, where nothing waits.

Which tensors would live on the accelerator: `device_tensors` names them (a model's
parameters, the data a shard holds on the device, selection state kept there), and every
tensor computed from one of them is one too. Only operations on those count: the host's own
bookkeeping (a chunk's positions, a loss table on the host, a payload the exchange parses)
waits for nothing. Without `device_tensors`, every tensor counts as a device tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

# aten ops whose result the host must wait for: a value read, or an output sized by the data.
SYNCING_OPS = {
    "aten._local_scalar_dense",  # .item(), bool(), float(), int()
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
}
# raysb.core.transfer.to_host's copy: on a GPU, the copy of a device tensor to the host.
HOST_COPY = "aten._to_copy"


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter(device_tensors) as syncs: ...`; then `syncs.total` and `syncs.by_op`."""

    def __init__(self, device_tensors: Iterable[torch.Tensor] | None = None):
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.tracks_devices = device_tensors is not None
        self._on_device = WeakTensorKeyDictionary()
        for tensor in device_tensors or ():
            self._on_device[tensor] = True

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        from_device = not self.tracks_devices or any(tensor in self._on_device for tensor in inputs)
        to_host = name == HOST_COPY and kwargs.get("device") == torch.device("cpu")
        if from_device and (name in SYNCING_OPS or to_host or (name == "aten.index" and _has_mask(args))):
            self.by_op[name if name != "aten.index" else "aten.index (boolean mask)"] += 1
        result = func(*args, **kwargs)
        if self.tracks_devices and from_device and not to_host:
            for output in tree_leaves(result):
                if isinstance(output, torch.Tensor):
                    self._on_device[output] = True
        return result


def engine_device_tensors(engine) -> list[torch.Tensor]:
    """What a raysb image trainer keeps on its device: the model's weights and buffers, the
    optimizer's state, the shard's data, and the selection state kept beside the model."""
    from raysb.training.collective import bare_module

    tensors = [*bare_module(engine.model).parameters(), *bare_module(engine.model).buffers()]
    tensors += [value for state in engine.step.optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor)]
    data = getattr(engine.shard, "data", None)
    if data is not None:
        tensors += [data.images, data.labels, data.sample_ids]
    return tensors + engine.strategy.device_tensors()


def _has_mask(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices or ())
