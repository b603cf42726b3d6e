"""The shared CDF_R at 2 to 256 ranks (issue 28): how close, how costly, how it scales.

    python -m raysb.bench.cdf_load --ranks 2 8 32 64 128 256 --rounds 40 --processes 2 4 8
    python -m raysb.bench.cdf_load --ranks 2 4 8 --drop-replay

Ranks share CDF_R as a loss histogram merged in every round's exchange
(raysb.training.selection.merged_histogram). Integer counts sum exactly, so one rank's
histogram is simulated here by merging every rank's round into it, which is what every rank
does; each rank's losses come from its own distribution (shards differ: a rank-dependent
shift of the log-loss, `--shard-shift` 0.4 from the first rank to the last, 0 for shards drawn
alike) drifting down as training does, and with `--drop-at K` falling 20x at once at round K.
The first, a middle and the last rank's decisions are replayed. Per world size it reports:

- the Kolmogorov-Smirnov distance between the histogram a round ranks against and the
  exact CDF of the losses it counts (every rank's, of the rounds in its window), once the
  window is full;
- how often a keep decision (beta 2, the same random draws) differs from the one one process
  would make, ranking every rank's chunk in turn against the exact CDF of its last R losses
  (this chunk's last): for the histogram (as `MergedLossHistogram.ranks` ranks, the other ranks'
  chunks of this round estimated from the rank's own), and for the design it replaced (one Ray
  actor holding the last R losses, snapshots refreshed every 4 rounds and pinned a round behind),
  replayed here without Ray;
- the largest gap, over rounds, between the mean keep probability of the replayed ranks' losses
  ranked so and ranked as one process ranks them (what a 20x drop moves most);
- the milliseconds a rank spends binning its round, ranking a chunk and merging a round.

With `--drop-replay` it replays a 20x drop at the run defaults instead (`after_a_drop`): every
rank's chunk, one process against lockstep ranks, with the per-example draw and the fixed count
(`--batch-size b`: at each rank's b instead of 128 over the ranks).

With `--processes`, it also times the merge on real gloo process groups of that many
processes on this machine (more processes than cores share them, so those times are upper
bounds): the exchange's all-gather of a round with and without the bin indices it carries
for the histogram, and the separate all-reduce of the counts those replaced.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np
import torch

from raysb.core.histogram import LOSS_BINS, bin_indices, bin_magnitude_floors
from raysb.core.keep_rule import keep_from_ranks, keep_probabilities, percentile_ranks
from raysb.training.selection.merged_histogram import BIN_DTYPE, MergedLossHistogram

CHUNK, CAPACITY, BETA = 128, 1024, 2.0
# How far apart the ranks' shards are: the log-loss's shift from the first rank to the last.
SHARD_SHIFT = 0.4
# The replaced actor design's refresh interval and lag (its defaults).
ACTOR_SYNC_INTERVAL, ACTOR_LAG = 4, 1


def rank_losses(rng: np.random.Generator, rank: int, world: int, round_index: int, chunk: int,
                drop_at: int | None = None, shard_shift: float = SHARD_SHIFT) -> np.ndarray:
    shift = shard_shift * (rank / max(world - 1, 1) - 0.5) - 0.01 * round_index
    if drop_at is not None and round_index >= drop_at:
        shift -= math.log(20)
    return rng.lognormal(mean=shift, sigma=1.0, size=chunk).astype(np.float32)


def histogram_cdf(counts: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """The histogram's CDF at non-negative `points`: linear within a bin in a point's place between
    its bin's floor and the next bin's (the expected rank `histogram_ranks` gives it)."""
    floors = bin_magnitude_floors().double()
    ceilings = torch.cat([floors[1:], torch.tensor([math.inf], dtype=torch.float64)])
    magnitude_bins = bin_indices(points) - LOSS_BINS // 2
    low, high = floors[magnitude_bins], ceilings[magnitude_bins]
    place = ((points.double() - low) / (high - low)).clamp(0, 1)
    counts = counts.double()
    below = torch.cumsum(counts, 0) - counts
    bins = magnitude_bins + LOSS_BINS // 2
    return (below[bins] + place * counts[bins]) / counts.sum()


def ks_to_exact(counts: torch.Tensor, losses: torch.Tensor) -> float:
    """sup |H - F| over the losses' points, F their exact empirical CDF (checked at each step's both sides)."""
    ordered = torch.sort(losses.double()).values
    exact_after = torch.arange(1, len(ordered) + 1, dtype=torch.float64) / len(ordered)
    exact_before = exact_after - 1 / len(ordered)
    h = histogram_cdf(counts, ordered.float())
    return float(torch.maximum((h - exact_after).abs(), (h - exact_before).abs()).max())


def simulated_ranks(world: int) -> list[int]:
    """The ranks whose decisions are replayed: the first, a middle one and the last."""
    return sorted({0, world // 2, world - 1})


def simulate(world: int, rounds: int, chunk: int = CHUNK, capacity: int = CAPACITY, seed: int = 0,
             drop_at: int | None = None, shard_shift: float = SHARD_SHIFT) -> dict:
    rng = np.random.default_rng(seed)
    draws = torch.Generator().manual_seed(seed)
    watched = simulated_ranks(world)
    histograms = {rank: MergedLossHistogram(capacity, world_size=world, rank=rank) for rank in watched}
    recent: list[torch.Tensor] = []  # every round's global losses in rank order, for the exact CDFs
    actor_snapshot, actor_version = torch.empty(0), -1
    ks, histogram_flips, actor_flips, probability_gaps = [], [], [], []
    bin_seconds, rank_seconds, merge_seconds = [], [], []
    for round_index in range(rounds):
        losses = [torch.from_numpy(rank_losses(rng, rank, world, round_index, chunk, drop_at, shard_shift))
                  for rank in range(world)]
        if len(recent) * world * chunk >= capacity:  # once the window holds R losses, as after a run's start
            steps = len(histograms[0].steps)
            ks.append(ks_to_exact(histograms[0].window, torch.cat(recent[-steps:])))
        round_gaps = []
        for rank in watched:
            # What this rank decides this round, three ways, with the same draws.
            mine = losses[rank]
            ties, keeps = torch.rand(2, len(mine), generator=draws)
            # Exact: the last R losses of one process that ranked every rank's chunk in turn, this one's last.
            exact_history = torch.cat([*recent, *losses[: rank + 1]])[-capacity:]
            exact_ranks = percentile_ranks(exact_history, mine, ties)
            exact_keep = keep_from_ranks(exact_ranks, keeps, BETA)[0]
            histogram = histograms[rank]
            started = time.perf_counter()
            histogram.extend(mine)
            ranks = histogram.ranks(mine, ties)
            rank_seconds.append(time.perf_counter() - started)
            histogram.take_round()
            if recent:
                keep = keep_from_ranks(ranks, keeps, BETA)[0]
                histogram_flips.append(float((keep != exact_keep).float().mean()))
                round_gaps.append(float(keep_probabilities(ranks, BETA).mean()
                                        - keep_probabilities(exact_ranks, BETA).mean()))
            if actor_version >= 0:
                keep = keep_from_ranks(percentile_ranks(actor_snapshot, mine, ties), keeps, BETA)[0]
                actor_flips.append(float((keep != exact_keep).float().mean()))
        if round_gaps:
            probability_gaps.append(abs(statistics.mean(round_gaps)))
        if round_index % ACTOR_SYNC_INTERVAL == 0 and round_index - ACTOR_LAG >= 0:
            actor_version = round_index - ACTOR_LAG
            actor_snapshot = torch.cat(recent[: actor_version + 1])[-capacity:]
        started = time.perf_counter()
        bins = [bin_indices(rank_losses_).to(BIN_DTYPE) for rank_losses_ in losses]  # one chunk a rank: step 0
        bin_seconds.append((time.perf_counter() - started) / world)
        for histogram in histograms.values():  # = what every rank counts from the exchange
            started = time.perf_counter()
            histogram.merge(bins)
            merge_seconds.append(time.perf_counter() - started)
        recent.append(torch.cat(losses))
    return {
        "ranks": world,
        "losses_per_round": world * chunk,
        "window_steps": len(histograms[0].steps),
        "ks_mean": statistics.mean(ks),
        "ks_max": max(ks),
        "histogram_flips": statistics.mean(histogram_flips),
        "actor_flips": statistics.mean(actor_flips),
        "probability_gap_max": max(probability_gaps),
        "bin_ms": 1000 * statistics.median(bin_seconds),
        "rank_ms": 1000 * statistics.median(rank_seconds),
        "merge_ms": 1000 * statistics.median(merge_seconds),
    }


def after_a_drop(world: int, fixed_count: bool, seed: int = 0, exchanges: int = 12,
                 drop_at: int = 8, batch_size: int | None = None) -> list[tuple[float, float]]:
    """Per selection chunk step, the mean keep probability (the expected kept fraction) of one process's
    Selector and of `world` lockstep ranks at the run defaults (b = 128 over the ranks, s = 1/3: 3 chunks
    of 128 / world a rank between exchanges, R = 1024), fed the same losses (one process ranks every rank's
    chunk in turn), which fall 20x at once at the first chunk of exchange `drop_at`. `batch_size`: each
    rank's b instead (`--batch-size`)."""
    from raysb.config import TrainConfig
    from raysb.core.keep_rule import Selector

    spec = TrainConfig.from_dict({"workers": world, "batch_size": batch_size}).settings().selection.spec
    generator = torch.Generator().manual_seed(seed)
    one = Selector(beta=spec.beta, history_size=spec.history_size, seed=seed)
    histograms = [MergedLossHistogram(spec.history_size, world_size=world, rank=rank) for rank in range(world)]
    ranks = [Selector(beta=spec.beta, seed=seed + 1 + rank, history=history) for rank, history in enumerate(histograms)]
    means = []
    for exchange in range(exchanges):
        for _ in range(spec.rounds_per_exchange):
            chunks = [torch.empty(spec.selection_batch_size).exponential_(generator=generator)
                      / (20 if exchange >= drop_at else 1) for _ in range(world)]
            alone = torch.cat([one.kept_positions(chunk, fixed_count=fixed_count)[1] for chunk in chunks])
            together = torch.cat([rank.kept_positions(chunk, fixed_count=fixed_count)[1]
                                  for rank, chunk in zip(ranks, chunks)])
            means.append((float(alone.mean()), float(together.mean())))
        merged = [history.take_round() for history in histograms]
        for history in histograms:
            history.merge(merged)
    return means


def drop_table(worlds: list[int], seeds: int = 3, batch_size: int | None = None) -> list[str]:
    """`after_a_drop` at each world size, both keep rules: the drop's exchange chunk by chunk (seed 0)
    and the largest gap in any chunk over `seeds` seeds (the first exchange, filling R, left out)."""
    lines = ["| ranks | keep rule | the drop's 3 chunks: one process / ranks (seed 0) | largest gap in a chunk, "
             f"{seeds} seeds | mean gap before the drop / in the drop's exchange and after |", "|---|---|---|---|---|"]
    for world in worlds:
        for fixed_count in (False, True):
            runs = [after_a_drop(world, fixed_count, seed, batch_size=batch_size) for seed in range(seeds)]
            drop = 8 * 3
            gaps = [[abs(alone - together) for alone, together in run[3:]] for run in runs]
            before = statistics.mean(gap for run in gaps for gap in run[: drop - 3])
            after = statistics.mean(gap for run in gaps for gap in run[drop - 3 :])
            chunks = " ".join(f"{alone:.3f} / {together:.3f}," for alone, together in runs[0][drop : drop + 3])
            lines.append(f"| {world} | {'fixed count' if fixed_count else 'per-example draw'} | {chunks[:-1]} | "
                         f"{max(max(run) for run in gaps):.3f} | {before:.4f} / {after:.4f} |")
    return lines


def time_merges(processes: int, repeats: int = 200) -> dict[str, float]:
    """Median ms, on a gloo group of `processes` local processes, of: the exchange's all-gather
    of a round (a third of CHUNK kept, 40 bytes each) without and with the round's bin indices
    (BIN_DTYPE's bytes a loss), the separate all-reduce of the counts that the bins replaced, and a
    round of raysb's lockstep exchange."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Manager().dict()
    port = 29500 + os.getpid() % 1000
    mp.spawn(_merge_rank, args=(processes, repeats, port, results), nprocs=processes, join=True)
    return dict(results)


def _merge_rank(rank: int, processes: int, repeats: int, port: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=processes)
    round_bytes = CHUNK // 3 * 40
    exchange_round, next_chunks = _lockstep_round(rank, processes)
    collectives = {
        "gather": lambda: _all_gather(dist, round_bytes, processes),
        "gather_with_bins": lambda: _all_gather(dist, round_bytes + BIN_DTYPE.itemsize * CHUNK, processes),
        "all_reduce": lambda: dist.all_reduce(torch.zeros(LOSS_BINS, dtype=torch.int32)),
        "exchange": exchange_round,
    }
    times = {name: [] for name in collectives}
    for _ in range(repeats):
        for name, collective in collectives.items():  # interleaved, so all see the same machine
            if name == "exchange":
                next_chunks()  # binned before the exchange, as selection does: not its cost
            dist.barrier()
            started = time.perf_counter()
            collective()
            times[name].append(1000 * (time.perf_counter() - started))
    if rank == 0:
        results.update({name: statistics.median(values) for name, values in times.items()})
    dist.destroy_process_group()


def _lockstep_round(rank: int, processes: int):
    """One round of raysb's lockstep exchange at the defaults (3 chunks of CHUNK scored, a batch of
    CHUNK kept a rank), its histogram's merge included, and what bins the round's chunks before it."""
    from raysb.core.batch_former import Batch
    from raysb.training.collective import TorchCollective
    from raysb.training.selection.exchange import LockstepExchange

    histogram = MergedLossHistogram(CAPACITY, world_size=processes, rank=rank)
    exchange = LockstepExchange(TorchCollective(), CHUNK, Batch, chunk_size=3 * CHUNK, histogram=histogram)
    generator = torch.Generator().manual_seed(rank)

    def exchanged() -> None:
        exchange.exchange(Batch(torch.randint(0, 10**6, (CHUNK,), generator=generator)), False, None, False)
        while exchange.step_ready():
            exchange.next_step()

    def chunks() -> None:
        for _ in range(3):
            histogram.extend(torch.rand(CHUNK, generator=generator))

    return exchanged, chunks


def _all_gather(dist, payload_bytes: int, processes: int) -> None:
    payload = torch.zeros(payload_bytes, dtype=torch.uint8)
    dist.all_gather([torch.empty_like(payload) for _ in range(processes)], payload)


def table(results: list[dict]) -> list[str]:
    lines = [
        f"| ranks | losses a round (R = {CAPACITY}) | window (steps) | KS to the exact CDF, mean (max) | "
        "keep decisions unlike one process's: histogram | the actor it replaced | "
        "mean keep probability's largest gap to one process's, a round | binning, ranking, merging ms a round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['ranks']} | {r['losses_per_round']:,} | {r['window_steps']} | "
            f"{r['ks_mean']:.4f} ({r['ks_max']:.4f}) | {r['histogram_flips']:.2%} | {r['actor_flips']:.2%} | "
            f"{r['probability_gap_max']:.4f} | {r['bin_ms']:.3f}, {r['rank_ms']:.3f}, {r['merge_ms']:.3f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--drop-at", type=int, help="the losses fall 20x at once at this round")
    parser.add_argument("--shard-shift", type=float, default=SHARD_SHIFT,
                        help="how far apart the ranks' shards are (log-loss shift, first rank to last); 0: drawn "
                             "alike, as the default shuffled shards are")
    parser.add_argument("--drop-replay", action="store_true",
                        help="instead: replay a 20x drop of the losses at the run defaults, per chunk, one process "
                             "against lockstep ranks (at each --ranks), both keep rules")
    parser.add_argument("--batch-size", type=int, help="with --drop-replay: each rank's b (default: 128 over the ranks)")
    parser.add_argument("--processes", type=int, nargs="*", default=[],
                        help="also time the merge's collectives on gloo groups of these many local processes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.drop_replay:
        print("\n".join(drop_table(args.ranks, batch_size=args.batch_size)))
        return []
    results = [simulate(world, args.rounds, drop_at=args.drop_at, shard_shift=args.shard_shift)
               for world in args.ranks]
    print("\n".join(table(results)))
    if args.processes:
        print(f"\n| gloo processes | the exchange's all-gather of a round, median ms | with its {CHUNK} losses' "
              f"bins (+{BIN_DTYPE.itemsize * CHUNK} B) | a separate all-reduce of the counts ({LOSS_BINS * 4 // 1024} KB) | "
              "raysb's lockstep exchange of a round, its histogram's merge included |\n|---|---|---|---|---|")
        for processes in args.processes:
            ms = time_merges(processes)
            print(f"| {processes} | {ms['gather']:.3f} | {ms['gather_with_bins']:.3f} | {ms['all_reduce']:.3f} | "
                  f"{ms['exchange']:.3f} |", flush=True)
    return results


if __name__ == "__main__":
    main()
