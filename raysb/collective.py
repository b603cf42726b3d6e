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
        """Gather 1-D tensors of different lengths.

        With a known `length_bound` one collective suffices (each payload padded
        to it, its true length in front); otherwise the lengths go first.
        """
        tensor = tensor.reshape(-1).to(self.device)
        if length_bound is None:
            size = torch.tensor([tensor.numel()], device=self.device)
            sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
            dist.all_gather(sizes, size)
            length_bound = int(max(s.item() for s in sizes))
        if tensor.numel() > length_bound:
            raise ValueError(f"payload of {tensor.numel()} exceeds its bound {length_bound}")
        padded = torch.zeros(length_bound + 1, dtype=tensor.dtype, device=self.device)
        padded[0] = tensor.numel()
        padded[1 : tensor.numel() + 1] = tensor
        gathered = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return [g[1 : int(g[0].item()) + 1].cpu() for g in gathered]

    def all_true(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def broadcast_object(self, value):
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]
