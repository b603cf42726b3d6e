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

    def all_min(self, values: list[float]) -> list[float]:
        """Each of `values`' minimum over the ranks, in one collective."""
        return list(values)

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over the ranks of a host tensor (float64 sums counts exactly to 2**53)."""
        return tensor.clone()

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send `parts[r]` to rank r; what each rank sent this one, in rank order. The parts are host
        tensors of one dtype and one row shape, of any row counts."""
        return list(parts)

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
    """torch.distributed collectives of host tensors: on the default process group where it is gloo,
    on a gloo group beside it where it is nccl."""

    def __init__(self):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        backend = dist.get_backend()
        # The device of the ranks' own tensors (nccl moves only CUDA tensors; gloo only CPU ones).
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        # What these collectives carry is host data (payloads of ids, flags): over nccl each would be
        # copied to the GPU and back, a wait for the device at every exchange and step. A gloo group
        # beside it moves them where they are. Every rank makes it here, at the same point.
        self.group = dist.new_group(backend="gloo") if backend == "nccl" else None

    def all_gather(self, tensor: torch.Tensor, length_bound: int | None = None) -> list[torch.Tensor]:
        """Gather tensors of one dtype and different lengths, flattened to 1-D.

        They travel as bytes behind an 8-byte length, so byte payloads (images)
        and float64 ones share one path. With a known `length_bound` (in
        elements) one collective suffices; otherwise the lengths go first.
        """
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        data = flat.view(torch.uint8)
        if length_bound is None:
            size = torch.tensor([data.numel()])
            sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=self.group)
            bound = int(max(s.item() for s in sizes))
        else:
            bound = length_bound * flat.element_size()
        if data.numel() > bound:
            raise ValueError(f"payload of {data.numel()} bytes exceeds its bound of {bound}")
        padded = torch.zeros(8 + bound, dtype=torch.uint8)
        padded[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
        padded[8 : 8 + data.numel()] = data
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        result = []
        for received in gathered:
            length = int(received[:8].clone().view(torch.int64))
            result.append(received[8 : 8 + length].clone().view(flat.dtype))
        return result

    def all_true(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0])
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())

    def all_min(self, values: list[float]) -> list[float]:
        reduced = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(reduced, op=dist.ReduceOp.MIN, group=self.group)
        return reduced.tolist()

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        summed = tensor.detach().cpu().clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
        return summed

    def all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        # The row counts first (each rank learns what it will receive), then the rows in one call.
        sent = torch.tensor([len(part) for part in parts], dtype=torch.int64)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        rows = torch.cat([part.detach().cpu() for part in parts])
        arrived = rows.new_empty((int(received.sum()), *rows.shape[1:]))
        dist.all_to_all_single(arrived, rows, received.tolist(), sent.tolist(), group=self.group)
        return list(arrived.split(received.tolist()))

    def broadcast_object(self, value):
        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=self.group)
        return holder[0]

    def gather_object(self, value) -> list | None:
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, gathered, dst=0, group=self.group)
        return gathered
