"""Host-to-device copies that do not make the host wait."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. A copy from ordinary (pageable) host memory to a GPU first waits
    for every kernel queued on the stream, so one per batch would stop the host from running
    ahead of the device; from pinned memory it is queued like a kernel."""
    if tensor.device == device or tensor.device.type != "cpu" or device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` on the host. From a GPU it waits for the device: raysb copies to the
    host only where it has waited already or must (an exchange's payload). On a CPU it still
    copies, so `raysb.bench.host_syncs` can count the copies a GPU would wait for."""
    return tensor.to("cpu", copy=True)
