"""Pipelined selection: score chunks ahead of training on a copy of the model.

Selective-Backprop's selection forward sits on the training step's critical
path. Here a scorer with its own copy of the model works `depth` chunks ahead
of the trainer, which only picks up finished losses. The copy is refreshed
every `sync_every` optimizer steps, so a chunk's losses come from weights a
few steps old: `staleness_steps` says how many, on average, and
`wait_seconds` how long training still waited for a score.

Two backends share the protocol:
- `thread`: a background thread in the training process (torch releases the
  GIL, so on CPU it runs on a core of its own; on a GPU it scores on a side
  CUDA stream);
- `actor`: a Ray actor with its own CPUs or GPU, e.g. a second device.

Chunks are scored in the order they are submitted, and a weight refresh is
queued between them, so which weights score which chunk depends only on the
step count, never on timing: a pipelined run is reproducible.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from raysb.core.batch_former import Batch
from raysb.training.selection.scoring import SelectionScorer


class Backend:
    """Where the model copy lives; scores come back as `(losses, version)` from a result callable."""

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError

    def score(self, inputs: torch.Tensor, labels: torch.Tensor) -> Callable[[], tuple[torch.Tensor, int]]:
        raise NotImplementedError

    def new_epoch(self) -> None:
        """Tell the scorer, in queue order, that the chunks after this belong to a new epoch."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _ModelCopy:
    """The scorer's model and the version (optimizer step) of its weights."""

    def __init__(self, model: torch.nn.Module, make_scorer: Callable[[torch.nn.Module], SelectionScorer]):
        self.model = model
        self.scorer = make_scorer(model)
        self.version = -1

    def load(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state)
        self.version = version

    def score(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.scorer(inputs, labels, self.version), self.version


class ThreadBackend(Backend):
    def __init__(self, model: torch.nn.Module, device: torch.device, make_scorer):
        self.copy = _ModelCopy(copy.deepcopy(model), make_scorer)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raysb-selection")

    def load_weights(self, state, version):
        # `state` is already a snapshot; the copy happens in queue order on the thread.
        self.executor.submit(self._on_stream, self.copy.load, state, version)

    def new_epoch(self):
        self.executor.submit(self.copy.scorer.new_epoch)

    def score(self, inputs, labels):
        if self.stream is not None:
            # The side stream must not read inputs before the training stream has written them.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        future = self.executor.submit(self._on_stream, self.copy.score, inputs, labels)

        def result():
            losses, version = future.result()
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            return losses, version

        return result

    def _on_stream(self, work, *args):
        if self.stream is None:
            return work(*args)
        with torch.cuda.stream(self.stream):
            return work(*args)

    def close(self):
        self.executor.shutdown(wait=True)


class ScoringActor:
    """The Ray actor behind the `actor` backend (a model copy on its own CPUs or GPU)."""

    def __init__(self, model: torch.nn.Module, scorer_options: dict, threads: int):
        torch.set_num_threads(threads)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.device = device
        self.copy = _ModelCopy(
            model.to(device), lambda m: SelectionScorer(m, device, **scorer_options)
        )

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.copy.load(state, version)

    def new_epoch(self) -> None:
        self.copy.scorer.new_epoch()

    def score(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        losses, version = self.copy.score(inputs.to(self.device), labels.to(self.device))
        return losses.cpu(), version


class ActorBackend(Backend):
    # A scoring actor that died, or whose node did, must fail the rank, not hang it.
    TIMEOUT_S = 120.0

    def __init__(self, model: torch.nn.Module, device: torch.device, scorer_options: dict, cpus: float, gpus: float):
        import ray

        self.ray = ray
        self.device = device
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Beside its rank where that node has room: the chunks it scores then never cross the network.
        beside = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        actor_class = ray.remote(ScoringActor).options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=beside)
        self.actor = actor_class.remote(copy.deepcopy(model).cpu(), scorer_options, max(1, int(cpus)))

    def load_weights(self, state, version):
        self.actor.load_weights.remote({k: v.cpu() for k, v in state.items()}, version)

    def new_epoch(self):
        self.actor.new_epoch.remote()

    def score(self, inputs, labels):
        reference = self.actor.score.remote(inputs.cpu(), labels.cpu())

        def result():
            try:
                losses, version = self.ray.get(reference, timeout=self.TIMEOUT_S)
            except (self.ray.exceptions.RayError, TimeoutError) as error:
                raise RuntimeError(
                    f"the scoring actor did not answer within {self.TIMEOUT_S:g}s ({type(error).__name__})"
                ) from error
            return losses.to(self.device), version

        return result

    def close(self):
        self.ray.kill(self.actor)


@dataclass
class _Pending:
    chunk: Any
    batch: Batch
    result: Callable[[], tuple[torch.Tensor, int]]


class PipelinedSelection:
    """The trainer's side: submit chunks ahead, refresh the copy, collect losses and statistics."""

    def __init__(self, backend: Backend, depth: int, sync_every: int):
        if depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {depth}")
        if sync_every < 1:
            raise ValueError(f"pipeline_sync_every must be >= 1, got {sync_every}")
        self.backend = backend
        self.depth = depth
        self.sync_every = sync_every
        self.version = None
        self._pending: deque[_Pending] = deque()
        self.scored_chunks = 0
        self.staleness_steps_sum = 0
        self.max_staleness_steps = 0
        self.wait_seconds = 0.0
        self.syncs = 0

    def sync(self, model: torch.nn.Module, step: int) -> None:
        """Refresh the copy if it is `sync_every` steps behind (always on first use)."""
        if self.version is not None and step - self.version < self.sync_every:
            return
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.backend.load_weights(state, step)
        self.version = step
        self.syncs += 1

    def new_epoch(self) -> None:
        self.backend.new_epoch()

    def submit(self, chunk, batch: Batch) -> None:
        self._pending.append(_Pending(chunk, batch, self.backend.score(batch["inputs"], batch["labels"])))

    def batch_for(self, chunk) -> Batch | None:
        """The batch submitted for `chunk` (already loaded and augmented), if it is next in line."""
        if self._pending and self._pending[0].chunk is chunk:
            return self._pending[0].batch
        return None

    def losses_for(self, batch: Batch, step: int) -> torch.Tensor | None:
        """Losses of `batch` if it is the next submitted one; None means score it now."""
        if not self._pending or self._pending[0].batch is not batch:
            return None
        pending = self._pending.popleft()
        started = time.perf_counter()
        losses, version = pending.result()
        self.wait_seconds += time.perf_counter() - started
        staleness = step - version
        self.scored_chunks += 1
        self.staleness_steps_sum += staleness
        self.max_staleness_steps = max(self.max_staleness_steps, staleness)
        return losses

    def release(self, chunk) -> None:
        """Forget `chunk` if the strategy did not use its score (e.g. Kath18 before its gate opens)."""
        if self._pending and self._pending[0].chunk is chunk:
            self._pending.popleft()

    def discard(self) -> None:
        """Drop chunks submitted but never trained on (an epoch or a run stopped early)."""
        while self._pending:
            self._pending.popleft().result()

    def stats(self) -> dict[str, float]:
        return {
            "pipeline_scored_chunks": self.scored_chunks,
            "pipeline_mean_staleness_steps": self.staleness_steps_sum / self.scored_chunks
            if self.scored_chunks
            else 0.0,
            "pipeline_max_staleness_steps": self.max_staleness_steps,
            "pipeline_wait_s": self.wait_seconds,
            "pipeline_weight_syncs": self.syncs,
        }

    def close(self) -> None:
        self.discard()
        self.backend.close()
