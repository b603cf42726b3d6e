"""What `raysb report` needs from a run, recorded while it trains.

- how often each example was offered to the strategy and kept (selection_counts.parquet);
- the CDF_R history at each evaluated epoch (loss_cdf.parquet);
- every selection decision on a few tracked examples (tracked_examples.parquet);
- gradient probes at each evaluated epoch (gradient_similarity.parquet, see raysb.core.probes).

Counts and decisions accumulate on the device without host syncs, so recording
stays out of the step time. Ranks merge theirs (a collective) at checkpoints
and at the end, after which rank 0 holds the run's totals and writes the files.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from raysb.core.keep_rule import keep_decisions
from raysb.core.probes import gradient_similarity
from raysb.core.sample_index import SampleIndex
from raysb.training.collective import Collective

TRACKED_EXAMPLES = 16
PROBE_BATCHES = 4
# Columns of a tracked decision, in the order the per-epoch buffer holds them.
DECISION_COLUMNS = ("epoch", "optimizer_step", "sample_id", "loss", "percentile", "probability", "kept")


class SelectionTrace:
    def __init__(self, sample_ids: torch.Tensor, device: torch.device, seed: int, collective: Collective = Collective()):
        self.index = SampleIndex(sample_ids.to(device))
        self.collective = collective
        self.considered = torch.zeros(self.index.ids.numel(), dtype=torch.int64, device=device)
        self.kept = torch.zeros_like(self.considered)
        # A stream of its own: flip_labels draws from `seed` itself, and sharing its
        # permutation would make the tracked examples exactly the first flipped ones.
        picks = torch.randperm(self.index.ids.numel(), generator=torch.Generator().manual_seed(seed + 4))
        self.tracked_ids = self.index.ids[picks[:TRACKED_EXAMPLES].to(device)].sort().values
        self._pending_considered: list[torch.Tensor] = []
        self._pending_kept: list[torch.Tensor] = []
        self._pending_decisions: list[tuple] = []
        self.decisions = torch.empty(0, len(DECISION_COLUMNS), dtype=torch.float64)
        self.cdf_snapshots: list[tuple[int, torch.Tensor]] = []
        self.gradient_rows: list[dict] = []
        self.probe_generator = torch.Generator().manual_seed(seed + 3)

    # -- recording (every rank) -------------------------------------------------
    # Recording only queues references: it runs every selection round, where a
    # few tensor ops each would cost more than the selection math itself.
    # `close_epoch` folds a whole epoch in with a handful of vectorized ops.
    def record_chunk(self, considered_ids: torch.Tensor, kept_ids: torch.Tensor) -> None:
        self._pending_considered.append(considered_ids)
        self._pending_kept.append(kept_ids)

    def record_decisions(
        self,
        epoch: int,
        optimizer_step: int,
        sample_ids: torch.Tensor,
        losses: torch.Tensor,
        percentiles: torch.Tensor,
        probabilities: torch.Tensor,
        keep: torch.Tensor,
    ) -> None:
        """Keep decisions on a chunk; those on tracked examples are kept at `close_epoch`."""
        self._pending_decisions.append((epoch, optimizer_step, sample_ids, losses, percentiles, probabilities, keep))

    def close_epoch(self) -> None:
        for counts, pending in ((self.considered, self._pending_considered), (self.kept, self._pending_kept)):
            if pending:
                # Unchecked: these ids came out of this rank's shard, whose ids the index holds.
                slots = self.index.slots(torch.cat(pending), checked=False)
                counts.index_add_(0, slots, torch.ones_like(slots))
            pending.clear()
        if self._pending_decisions:
            self.decisions = torch.cat([self.decisions, self._tracked_decisions(self._pending_decisions)])
            self._pending_decisions.clear()

    def _tracked_decisions(self, pending: list[tuple]) -> torch.Tensor:
        """Rows (DECISION_COLUMNS) of the pending decisions on tracked examples, by (step, id)."""
        device = self.tracked_ids.device
        ids, *measures = (torch.cat([column.to(device) for column in columns]) for columns in zip(*(p[2:] for p in pending)))
        position = torch.searchsorted(self.tracked_ids, ids).clamp_max(self.tracked_ids.numel() - 1)
        tracked = self.tracked_ids[position] == ids
        epochs_and_steps = torch.tensor([p[:2] for p in pending], dtype=torch.float64).repeat_interleave(
            torch.tensor([len(p[2]) for p in pending]), dim=0
        )
        rows = torch.cat(
            [epochs_and_steps[tracked.cpu()], torch.stack([c[tracked].double() for c in (ids, *measures)], 1).cpu()], 1
        )
        order = sorted(range(len(rows)), key=lambda i: tuple(rows[i, 1:3].tolist()))
        return rows[order]

    # -- probes (the rank that writes outputs, at evaluated epochs) ---------------
    def snapshot_cdf(self, epoch: int, history: torch.Tensor) -> None:
        # A copy: `history` may be a view of the ring buffer that keeps changing.
        self.cdf_snapshots.append((epoch, history.detach().float().cpu().clone()))

    def probe_gradients(
        self,
        epoch: int,
        model: torch.nn.Module,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        history: torch.Tensor,
        beta: float,
        keep_floor: float,
        batch_size: int,
    ) -> None:
        """Gradient similarity on fixed training batches, kept as SB would keep them now.

        The subset is drawn from the run's current CDF_R without adding to it,
        with this trace's own generator, so probing never changes training.
        """
        model.eval()
        for probe_batch, (x, y) in enumerate(zip(inputs.split(batch_size), labels.split(batch_size))):
            with torch.no_grad():
                losses = F.cross_entropy(model(x), y, reduction="none").float()
            draws = torch.rand(2, len(y), generator=self.probe_generator).to(losses.device)
            keep = keep_decisions(history.to(losses.device), losses, draws[0], draws[1], beta, keep_floor)[0]
            kept_count = int(keep.sum())
            if kept_count == 0:
                continue
            random = torch.zeros_like(keep)
            random[torch.randperm(len(y), generator=self.probe_generator)[:kept_count].to(keep.device)] = True
            similarity = gradient_similarity(model, x, y, keep, random)
            self.gradient_rows.append(
                {"epoch": epoch, "probe_batch": probe_batch, "batch_size": len(y), "kept_count": kept_count, **similarity}
            )

    # -- merging and state ---------------------------------------------------------
    def merge_ranks(self) -> None:
        """Sum counts and collect tracked decisions on rank 0 (a collective: every rank calls it)."""
        counts = self.collective.all_gather(torch.stack([self.considered, self.kept]).cpu())
        decisions = self.collective.all_gather(self.decisions)
        if self.collective.rank == 0:
            total = torch.stack(counts).view(len(counts), 2, -1).sum(0)
            self.considered.copy_(total[0])
            self.kept.copy_(total[1])
            merged = torch.cat([d.view(-1, len(DECISION_COLUMNS)) for d in decisions])
            # Sorted by (epoch, step, id) so the table reads the same however many ranks wrote it.
            order = sorted(range(len(merged)), key=lambda i: tuple(merged[i, :3].tolist()))
            self.decisions = merged[order]
        else:
            self.considered.zero_()
            self.kept.zero_()
            self.decisions = self.decisions[:0]

    def state_dict(self) -> dict:
        return {
            "considered": self.considered.cpu(),
            "kept": self.kept.cpu(),
            "decisions": self.decisions,
            "cdf_snapshots": self.cdf_snapshots,
            "gradient_rows": self.gradient_rows,
            "probe_generator": self.probe_generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.considered.copy_(state["considered"])
        self.kept.copy_(state["kept"])
        self.decisions = state["decisions"]
        self.cdf_snapshots = list(state["cdf_snapshots"])
        self.gradient_rows = list(state["gradient_rows"])
        self.probe_generator.set_state(state["probe_generator"])

    # -- output ------------------------------------------------------------------------
    def write(self, folder: str | Path) -> list[Path]:
        folder = Path(folder)
        tables = {
            "selection_counts.parquet": pa.table(
                {
                    "sample_id": pa.array(self.index.ids.cpu().numpy()),
                    "considered": pa.array(self.considered.cpu().numpy().astype("int32")),
                    "kept": pa.array(self.kept.cpu().numpy().astype("int32")),
                }
            )
        }
        if self.cdf_snapshots:
            tables["loss_cdf.parquet"] = pa.table(
                {
                    "epoch": pa.array([e for e, h in self.cdf_snapshots for _ in range(h.numel())], pa.int32()),
                    "loss": pa.array(torch.cat([h for _, h in self.cdf_snapshots]).numpy()),
                }
            )
            tables["tracked_examples.parquet"] = _decision_table(self.decisions)
        if self.gradient_rows:
            tables["gradient_similarity.parquet"] = pa.Table.from_pylist(self.gradient_rows)
        for name, table in tables.items():
            pq.write_table(table, folder / name)
        return [folder / name for name in tables]


def _decision_table(decisions: torch.Tensor) -> pa.Table:
    columns = dict(zip(DECISION_COLUMNS, decisions.T.numpy()))
    return pa.table(
        {
            "epoch": pa.array(columns["epoch"].astype("int32")),
            "optimizer_step": pa.array(columns["optimizer_step"].astype("int64")),
            "sample_id": pa.array(columns["sample_id"].astype("int64")),
            "loss": pa.array(columns["loss"].astype("float32")),
            "percentile": pa.array(columns["percentile"].astype("float32")),
            "probability": pa.array(columns["probability"].astype("float32")),
            "kept": pa.array(columns["kept"].astype(bool)),
        }
    )
