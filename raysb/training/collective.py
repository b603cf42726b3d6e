"""The few collectives lockstep training needs, for one process or torch.distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Collective:
    """World of one: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_gather(self, tensor: torch.Tensor, length_bound: int | None = None) -> list[torch.Tensor]:
        return [tensor]

    def all_true(self, flag: bool) -> bool:
        return flag

    def broadcast_object(self, value):
        return value

    def gather_object(self, value) -> list | None:
        """Every rank's `value`, in rank order, on rank 0 (None elsewhere)."""
        return [value]


def found_collective() -> Collective:
    """torch.distributed's group where one is running (Ray Train ranks), else a world of one."""
    if dist.is_available() and dist.is_initialized():
        return TorchCollective()
    return Collective()


def bare_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside torch.compile's and DistributedDataParallel's wrappers (scoring, evaluation
    and checkpoints use it)."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


class TorchCollective(Collective):
    """torch.distributed collectives on the default process group (gloo or nccl)."""

    def __init__(self):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # nccl moves only CUDA tensors; gloo only CPU ones.
        backend = dist.get_backend()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def all_gather(self, tensor: torch.Tensor, length_bound: int | None = None) -> list[torch.Tensor]:
        """Gather tensors of one dtype and different lengths, flattened to 1-D.

        They travel as bytes behind an 8-byte length, so byte payloads (images)
        and float64 ones share one path. With a known `length_bound` (in
        elements) one collective suffices; otherwise the lengths go first.
        """
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        data = flat.view(torch.uint8)
        if length_bound is None:
            size = torch.tensor([data.numel()], device=self.device)
            sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
            dist.all_gather(sizes, size)
            bound = int(max(s.item() for s in sizes))
        else:
            bound = length_bound * flat.element_size()
        if data.numel() > bound:
            raise ValueError(f"payload of {data.numel()} bytes exceeds its bound of {bound}")
        padded = torch.zeros(8 + bound, dtype=torch.uint8)
        padded[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
        padded[8 : 8 + data.numel()] = data
        padded = padded.to(self.device)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        result = []
        for received in gathered:
            received = received.cpu()
            length = int(received[:8].clone().view(torch.int64))
            result.append(received[8 : 8 + length].clone().view(flat.dtype))
        return result

    def all_true(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def broadcast_object(self, value):
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def gather_object(self, value) -> list | None:
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, gathered, dst=0)
        return gathered
