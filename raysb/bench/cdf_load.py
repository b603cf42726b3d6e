"""The shared CDF_R at 2 to 256 ranks (issue 28): how close, how costly, how it scales.

    python -m raysb.bench.cdf_load --ranks 2 8 32 64 128 256 --rounds 40 --processes 2 4 8

Ranks share CDF_R as a loss histogram merged in every round's exchange
(raysb.training.selection.merged_histogram). Integer counts sum exactly, so one rank's
histogram is simulated here by merging every rank's round into it, which is what every rank
does; each rank's losses come from its own distribution (shards differ: a rank-dependent
shift of the log-loss, 0.4 from the first rank to the last) drifting down as training does,
and with `--drop-at K` falling 20x at once at round K. Per world size it reports:

- the Kolmogorov-Smirnov distance between the histogram a round ranks against and the
  exact CDF of the losses it counts (every rank's, of the rounds in its window), once the
  window is full;
- how often a keep decision (beta 2, the same random draws) differs from the one the exact
  CDF of the last R global losses, this round's included (all of this round's where it holds
  more than R), would make: for the histogram (as `MergedLossHistogram.ranks` ranks, this
  round's losses estimated from the rank's own), and for the design it replaced (one Ray actor holding the last R losses, snapshots
  refreshed every 4 rounds and pinned a round behind), replayed here without Ray;
- the largest gap, over rounds, between the mean keep probability of rank 0's losses ranked so
  and ranked by the exact CDF (what a 20x drop moves most);
- the seconds a rank spends binning its round.

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
# The replaced actor design's refresh interval and lag (its defaults).
ACTOR_SYNC_INTERVAL, ACTOR_LAG = 4, 1


def rank_losses(rng: np.random.Generator, rank: int, world: int, round_index: int, chunk: int,
                drop_at: int | None = None) -> np.ndarray:
    shift = 0.4 * (rank / max(world - 1, 1) - 0.5) - 0.01 * round_index
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


def simulate(world: int, rounds: int, chunk: int = CHUNK, capacity: int = CAPACITY, seed: int = 0,
             drop_at: int | None = None) -> dict:
    rng = np.random.default_rng(seed)
    draws = torch.Generator().manual_seed(seed)
    histogram = MergedLossHistogram(capacity, world * chunk, world_size=world)  # rank 0's
    window_rounds = histogram.window_rounds
    recent: list[torch.Tensor] = []  # every round's global losses, for the exact CDFs
    actor_snapshot, actor_version = torch.empty(0), -1
    ks, histogram_flips, actor_flips, probability_gaps, bin_seconds = [], [], [], [], []
    for round_index in range(rounds):
        losses = [torch.from_numpy(rank_losses(rng, rank, world, round_index, chunk, drop_at)) for rank in range(world)]
        everyone = torch.cat(losses)
        # What rank 0 decides this round, three ways, with the same draws.
        mine = losses[0]
        ties, keeps = torch.rand(2, len(mine), generator=draws)
        # Exact and fresh: the last R global losses, or this whole round's where it holds more.
        exact_history = torch.cat([*recent, everyone])[-max(capacity, len(everyone)):]
        exact_ranks = percentile_ranks(exact_history, mine, ties)
        exact_keep = keep_from_ranks(exact_ranks, keeps, BETA)[0]
        if len(recent) >= window_rounds:  # once the window holds R losses, as it does after a run's start
            ks.append(ks_to_exact(histogram.window, torch.cat(recent[-window_rounds:])))
        histogram.extend(mine)
        ranks = histogram.ranks(mine, ties)
        histogram.take_round()
        if recent:
            keep = keep_from_ranks(ranks, keeps, BETA)[0]
            histogram_flips.append(float((keep != exact_keep).float().mean()))
            probability_gaps.append(abs(float(keep_probabilities(ranks, BETA).mean()
                                              - keep_probabilities(exact_ranks, BETA).mean())))
        if round_index % ACTOR_SYNC_INTERVAL == 0 and round_index - ACTOR_LAG >= 0:
            actor_version = round_index - ACTOR_LAG
            actor_snapshot = torch.cat(recent[: actor_version + 1])[-capacity:]
        if actor_version >= 0:
            keep = keep_from_ranks(percentile_ranks(actor_snapshot, mine, ties), keeps, BETA)[0]
            actor_flips.append(float((keep != exact_keep).float().mean()))
        started = time.perf_counter()
        bins = [bin_indices(rank_losses_).to(BIN_DTYPE) for rank_losses_ in losses]
        bin_seconds.append((time.perf_counter() - started) / world)
        histogram.merge(bins)  # = what every rank counts from the exchange
        recent.append(everyone)
    return {
        "ranks": world,
        "losses_per_round": world * chunk,
        "window_rounds": window_rounds,
        "ks_mean": statistics.mean(ks),
        "ks_max": max(ks),
        "histogram_flips": statistics.mean(histogram_flips),
        "actor_flips": statistics.mean(actor_flips),
        "probability_gap_max": max(probability_gaps),
        "bin_ms": 1000 * statistics.median(bin_seconds),
    }


def time_merges(processes: int, repeats: int = 200) -> dict[str, float]:
    """Median ms, on a gloo group of `processes` local processes, of: the exchange's all-gather
    of a round (a third of CHUNK kept, 40 bytes each) without and with the round's bin indices
    (2 bytes a loss), and the separate all-reduce of the counts that the bins replaced."""
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
    collectives = {
        "gather": lambda: _all_gather(dist, round_bytes, processes),
        "gather_with_bins": lambda: _all_gather(dist, round_bytes + 2 * CHUNK, processes),
        "all_reduce": lambda: dist.all_reduce(torch.zeros(LOSS_BINS, dtype=torch.int32)),
    }
    times = {name: [] for name in collectives}
    for _ in range(repeats):
        for name, collective in collectives.items():  # interleaved, so all see the same machine
            dist.barrier()
            started = time.perf_counter()
            collective()
            times[name].append(1000 * (time.perf_counter() - started))
    if rank == 0:
        results.update({name: statistics.median(values) for name, values in times.items()})
    dist.destroy_process_group()


def _all_gather(dist, payload_bytes: int, processes: int) -> None:
    payload = torch.zeros(payload_bytes, dtype=torch.uint8)
    dist.all_gather([torch.empty_like(payload) for _ in range(processes)], payload)


def table(results: list[dict]) -> list[str]:
    lines = [
        f"| ranks | losses a round (R = {CAPACITY}) | window (rounds) | KS to the exact CDF, mean (max) | "
        "keep decisions unlike exact CDF_R's: histogram | the actor it replaced | "
        "mean keep probability's largest gap to exact CDF_R's, a round | binning ms a round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['ranks']} | {r['losses_per_round']:,} | {r['window_rounds']} | "
            f"{r['ks_mean']:.4f} ({r['ks_max']:.4f}) | {r['histogram_flips']:.2%} | {r['actor_flips']:.2%} | "
            f"{r['probability_gap_max']:.4f} | {r['bin_ms']:.3f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--drop-at", type=int, help="the losses fall 20x at once at this round")
    parser.add_argument("--processes", type=int, nargs="*", default=[],
                        help="also time the merge's collectives on gloo groups of these many local processes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = [simulate(world, args.rounds, drop_at=args.drop_at) for world in args.ranks]
    print("\n".join(table(results)))
    if args.processes:
        print(f"\n| gloo processes | the exchange's all-gather of a round, median ms | with its {CHUNK} losses' "
              f"bins (+{2 * CHUNK} B) | a separate all-reduce of the counts ({LOSS_BINS * 4 // 1024} KB) |\n"
              "|---|---|---|---|")
        for processes in args.processes:
            ms = time_merges(processes)
            print(f"| {processes} | {ms['gather']:.3f} | {ms['gather_with_bins']:.3f} | {ms['all_reduce']:.3f} |",
                  flush=True)
    return results


if __name__ == "__main__":
    main()
