"""Which examples of each selection chunk get a backward pass.

A strategy sees the epoch one chunk at a time and returns the examples to
queue for training. It reaches data and the model only through `ChunkContext`,
so it does not care whether it runs in one process or on a Ray Train rank.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from raysb.core.batch_former import Batch
from raysb.core.kath18 import VarianceReductionGate, default_tau_threshold, importance_sample
from raysb.core.sample_index import SampleIndex
from raysb.core.selection import Selector, check_finite
from raysb.core.spec import SelectionSpec


class ChunkContext(Protocol):
    """A chunk is opaque to strategies (row positions or streamed examples, see
    raysb.data.shards): they only index it with a mask or a slice and hand it back."""

    def sample_ids(self, chunk) -> torch.Tensor:
        """Stable ids of the chunk's examples."""

    def load(self, chunk) -> Batch:
        """Gather and augment the chunk's examples."""

    def score(self, batch: Batch) -> torch.Tensor:
        """Per-example losses from a selection forward pass (no autograd)."""


class Strategy:
    """What every strategy answers; each of the five below implements `choose`."""

    name: str
    # The CDF_R selector, for strategies that have one.
    selector: Selector | None = None

    def chunk_size(self, batch_size: int, selection_batch_size: int) -> int:
        return selection_batch_size

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        """The examples of `chunk` to queue for training, loaded (and scored where it needs scores)."""
        raise NotImplementedError

    def scores_whole_chunks(self, epoch: int) -> bool:
        """Whether `choose` loads and scores every chunk of `epoch` whole (so they can be scored ahead)."""
        return False

    def observe_training_losses(self, losses: torch.Tensor) -> None:
        """Losses of the last training step (free signal some strategies use)."""

    def loss_table(self) -> "LossTable | None":
        """Per-example losses that must be shared across ranks, if the strategy keeps any."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Traditional(Strategy):
    """Traditional SGD: every example, every epoch."""

    name = "traditional"

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        return ctx.load(chunk)


class SBStrategy(Strategy):
    """Score every example each epoch; keep it with probability CDF_R(loss) ** beta."""

    name = "sb"

    def __init__(self, selector: Selector):
        self.selector = selector

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        batch = ctx.load(chunk)
        return self._keep(batch, ctx.score(batch))

    def _keep(self, batch: Batch, losses: torch.Tensor) -> Batch:
        """The kept part of `batch`, carrying the probabilities it was kept with."""
        # The round checked these losses finite when it scored them.
        keep, probabilities = self.selector.decide(losses, batch.sample_ids, checked=True)
        batch.keep_probabilities = probabilities.to(batch.device)
        return batch.take(keep)

    def scores_whole_chunks(self, epoch: int) -> bool:
        return True

    def state_dict(self) -> dict:
        return {"selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.selector.load_state_dict(state["selector"])


class LossTable:
    """The last selection loss of every example, keyed by stable sample id.

    Built over a known training set, or empty (a user's own data), growing as
    ids are first recorded.
    """

    def __init__(self, sample_ids: torch.Tensor | None = None, device: torch.device | str = "cpu"):
        sample_ids = torch.empty(0, dtype=torch.int64) if sample_ids is None else sample_ids
        self.device = device
        self.index = SampleIndex(sample_ids.to(device))
        self.losses = torch.full((sample_ids.numel(),), float("nan"), device=device)
        # Records not yet sent to other ranks (see raysb.training.exchange.LockstepExchange).
        self._unshared: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(self, sample_ids: torch.Tensor, losses: torch.Tensor, share: bool = True) -> None:
        slots, held = self.index.find(sample_ids)
        if not bool(held.all()):
            self._grow(sample_ids[~held.to(sample_ids.device)])
            slots = self.index.slots(sample_ids, checked=False)
        self.losses[slots] = losses.to(self.losses)
        if share:
            self._unshared.append((sample_ids.detach().cpu(), losses.detach().float().cpu()))

    def take_unshared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Records made since the last call, for the other ranks' copies of the table."""
        ids = torch.cat([i for i, _ in self._unshared]) if self._unshared else torch.empty(0, dtype=torch.int64)
        losses = torch.cat([l for _, l in self._unshared]) if self._unshared else torch.empty(0)
        self._unshared = []
        return ids, losses

    def _grow(self, new_ids: torch.Tensor) -> None:
        old_ids, old_losses = self.index.ids, self.losses
        self.index = SampleIndex(torch.cat([old_ids, torch.unique(new_ids.to(old_ids.device))]))
        self.losses = torch.full((self.index.ids.numel(),), float("nan"), device=old_losses.device)
        self.losses[self.index.slots(old_ids, checked=False)] = old_losses

    def lookup(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """Stale losses; NaN where an example was never scored."""
        if not self.index.ids.numel():
            return torch.full((sample_ids.numel(),), float("nan"), device=self.losses.device)
        slots, held = self.index.find(sample_ids)
        return torch.where(held, self.losses[slots], torch.full_like(self.losses[slots], float("nan")))

    def state_dict(self) -> dict:
        return {"ids": self.index.ids.cpu(), "losses": self.losses.cpu()}

    def load_state_dict(self, state: dict) -> None:
        """A table built over a training set takes only a checkpoint of that set; an empty one takes any."""
        if self.index.ids.numel() and not torch.equal(state["ids"], self.index.ids.cpu()):
            raise ValueError("checkpointed stale-loss table covers a different training set")
        self.index = SampleIndex(state["ids"].to(self.device))
        self.losses = state["losses"].to(self.device).clone()


class StaleSBStrategy(SBStrategy):
    """Stale-SB(n): selection passes every n-th epoch, recorded losses reused in between.

    In the epochs between selection passes, examples are chosen from their
    recorded loss before any data is loaded, so only kept examples are
    gathered and augmented. An example that was never scored (it joined after
    the last selection pass) is scored now rather than guessed.
    """

    name = "stale-sb"

    def __init__(self, selector: Selector, staleness: int, table: LossTable, first_epoch: int = 0):
        super().__init__(selector)
        if staleness < 1:
            raise ValueError(f"staleness n must be >= 1, got {staleness}")
        self.staleness = staleness
        self.table = table
        self.first_epoch = first_epoch

    def is_selection_epoch(self, epoch: int) -> bool:
        return (epoch - self.first_epoch) % self.staleness == 0

    def scores_whole_chunks(self, epoch: int) -> bool:
        return self.is_selection_epoch(epoch)

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        ids = ctx.sample_ids(chunk)
        if self.is_selection_epoch(epoch):
            losses = None
        else:
            losses = self.table.lookup(ids)
            if bool(torch.isnan(losses).any()):
                losses = None  # an unscored example: score the chunk like a selection pass
        if losses is None:
            batch = ctx.load(chunk)
            losses = ctx.score(batch)
            self.table.record(ids, losses)
            return self._keep(batch, losses)
        # Reusing epochs-old losses is the method here, not a delay to correct:
        # weighting them by fresh probabilities made seed 0 end at 59.4% (19.6% when
        # only its selection epochs are corrected; BENCHMARKS.md, "Stability").
        # Recorded losses were checked finite when they were scored, here or on their rank.
        keep = self.selector.keep_mask(losses, ids, checked=True)
        return ctx.load(chunk[keep.to(chunk.device)])

    def loss_table(self) -> LossTable:
        return self.table

    def state_dict(self) -> dict:
        return {**super().state_dict(), "table": self.table.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.table.load_state_dict(state["table"])


class Kath18Strategy(Strategy):
    """Importance sampling baseline: each chunk of B = b / selectivity yields one batch of b."""

    name = "kath18"

    def __init__(
        self,
        batch_size: int,
        selectivity: float,
        seed: int,
        tau_threshold: float | None = None,
        reweight: bool = False,
        device: torch.device | str = "cpu",
    ):
        self.batch_size = batch_size
        self.presample_size = max(batch_size + 1, round(batch_size / selectivity))
        threshold = tau_threshold or default_tau_threshold(self.presample_size, batch_size)
        self.gate = VarianceReductionGate(threshold)
        self.reweight = reweight
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def chunk_size(self, batch_size: int, selection_batch_size: int) -> int:
        return self.presample_size

    def scores_whole_chunks(self, epoch: int) -> bool:
        return self.gate.open

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        if not self.gate.open:
            # Chunks arrive shuffled, so the head of one is a uniform sample.
            return ctx.load(chunk[: self.batch_size])
        batch = ctx.load(chunk)
        scores = ctx.score(batch)
        self.gate.update(scores)
        draw, weights = importance_sample(scores, self.batch_size, self.generator)
        chosen = batch.take(draw)
        if self.reweight:
            chosen.weights = weights
        return chosen

    def observe_training_losses(self, losses: torch.Tensor) -> None:
        if not self.gate.open:
            check_finite(losses, "training")
            self.gate.update(losses)

    def state_dict(self) -> dict:
        return {"gate": self.gate.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gate.load_state_dict(state["gate"])
        self.generator.set_state(state["generator"])


class UniformStrategy(Strategy):
    """RS2 (Okanovic et al., 2023): each epoch trains on a fresh uniform random subset of
    round(s * N) examples, drawn without replacement across epochs until every example has
    been used, then from a new permutation. No scoring forward at all: the baseline that SB's
    scoring must beat.

    Epoch e's subset is slice [e*k, (e+1)*k) of an endless stream of seeded permutations
    of the training set's ids, a pure function of (seed, epoch): every rank agrees on it
    without talking, and a resumed run draws exactly what it would have.
    """

    name = "uniform"

    def __init__(self, sample_ids: torch.Tensor | None, selectivity: float, seed: int):
        if sample_ids is None:
            raise ValueError("strategy uniform draws from the whole training set: it needs the set's sample ids")
        self.ids = sample_ids.cpu()
        self.per_epoch = max(1, round(selectivity * self.ids.numel()))
        self.seed = seed
        self._epoch, self._chosen = None, None

    def epoch_subset(self, epoch: int) -> torch.Tensor:
        """The ids epoch `epoch` trains on."""
        total = self.ids.numel()
        start, stop = epoch * self.per_epoch, (epoch + 1) * self.per_epoch
        parts = []
        for cycle in range(start // total, (stop - 1) // total + 1):
            order = torch.randperm(total, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + cycle))
            begin, end = max(start - cycle * total, 0), min(stop - cycle * total, total)
            parts.append(self.ids[order[begin:end]])
        return torch.cat(parts)

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        if epoch != self._epoch:
            self._epoch, self._chosen = epoch, SampleIndex(self.epoch_subset(epoch))
        # On the host, where a memory shard's ids and positions are: no round waits on the device.
        _, chosen = self._chosen.find(ctx.sample_ids(chunk).cpu())
        return ctx.load(chunk[chosen.to(chunk.device)])


def _selector(spec: SelectionSpec, history, device) -> Selector:
    return Selector(beta=spec.beta, history_size=spec.history_size, seed=spec.seed, device=device, history=history,
                    keep_floor=spec.keep_floor)


# The strategy registry: raysb.config.STRATEGIES names the same strategies (what a config
# knows of each); these build them. Each builder takes (spec, shared CDF_R or None,
# the training set's sample ids or None, device).
STRATEGY_BUILDERS: dict[str, Callable[..., Strategy]] = {
    "traditional": lambda spec, history, sample_ids, device: Traditional(),
    "sb": lambda spec, history, sample_ids, device: SBStrategy(_selector(spec, history, device)),
    "stale-sb": lambda spec, history, sample_ids, device: StaleSBStrategy(
        _selector(spec, history, device), spec.staleness, LossTable(sample_ids, device), first_epoch=spec.first_epoch
    ),
    "kath18": lambda spec, history, sample_ids, device: Kath18Strategy(
        spec.batch_size, spec.selectivity, spec.seed, spec.kath18_tau_threshold, spec.kath18_reweight, device
    ),
    "uniform": lambda spec, history, sample_ids, device: UniformStrategy(sample_ids, spec.selectivity, spec.seed),
}


def build_strategy(
    spec: SelectionSpec,
    *,
    history=None,
    sample_ids: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> Strategy:
    """The strategy `spec.strategy` names; `history` is a shared CDF_R (raysb.training.merged_histogram).

    Stale-SB's loss table covers `sample_ids` when the training set is known, or grows as
    examples are first scored.
    """
    if spec.strategy not in STRATEGY_BUILDERS:
        raise ValueError(f"unknown strategy {spec.strategy!r}; choose one of {', '.join(STRATEGY_BUILDERS)}")
    return STRATEGY_BUILDERS[spec.strategy](spec, history, sample_ids, device)
