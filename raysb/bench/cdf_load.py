"""Load test of the shared CDF_R (issue 28, item 1): one loss-history actor, 2 to 256 ranks.

    python -m raysb.bench.cdf_load --ranks 2 8 32 64 128 256 --rounds 40

Simulated ranks are raysb's own `SharedLossHistory` clients, one thread each in this
process, meeting once a round as the lockstep exchange makes them, so every push and
snapshot request is the one a Ray Train rank makes. Each
rank's losses come from its own distribution (shards differ: a rank-dependent shift of
the log-loss, 0.4 from the first rank to the last) drifting down as training does. Per
world size it reports the rounds per second one actor sustained with every rank pushing
(pushes/s = ranks x that), the seconds a rank spent in the client per round (its push,
and every `sync_interval` rounds a snapshot wait), the snapshot staleness in rounds, and
the Kolmogorov-Smirnov distance between the snapshot a rank ranks against and the exact
CDF of all ranks' losses of the rounds that snapshot stands for. Driver and actor share
this machine's cores, so rounds/s is a floor for the actor alone.
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time

import numpy as np
import torch

CHUNK, CAPACITY, SYNC_INTERVAL, LAG = 128, 1024, 4, 1


def rank_losses(rng: np.random.Generator, rank: int, world: int, round_index: int, chunk: int) -> np.ndarray:
    shift = 0.4 * (rank / max(world - 1, 1) - 0.5) - 0.01 * round_index
    return rng.lognormal(mean=shift, sigma=1.0, size=chunk).astype(np.float32)


def ks_distance(sample: np.ndarray, reference: np.ndarray) -> float:
    """sup |F_sample - F_reference| over both samples' points (exact for empirical CDFs)."""
    sample, reference = np.sort(np.asarray(sample)), np.sort(np.asarray(reference))
    points = np.concatenate([sample, reference])
    below_sample = np.searchsorted(sample, points, side="right") / len(sample)
    below_reference = np.searchsorted(reference, points, side="right") / len(reference)
    return float(np.abs(below_sample - below_reference).max())


def load_test(world: int, rounds: int, chunk: int = CHUNK, capacity: int = CAPACITY, seed: int = 0) -> dict:
    import ray

    from raysb.distributed.loss_history import LossHistoryActor, SharedLossHistory

    actor = LossHistoryActor.remote(world, capacity)
    ray.get(actor.stats.remote())
    clients = [SharedLossHistory(actor, rank, capacity, SYNC_INTERVAL, LAG) for rank in range(world)]
    rng = np.random.default_rng(seed)
    losses = [[rank_losses(rng, rank, world, r, chunk) for rank in range(world)] for r in range(rounds)]
    # The exact CDF a snapshot of version v stands for: the last `capacity` losses would be all
    # ranks' of the last ceil(capacity / (world * chunk)) rounds if every rank counted alike.
    window = math.ceil(capacity / (world * chunk))
    errors: list[float] = []
    # Ranks meet once a round, as the lockstep exchange makes them.
    lockstep = threading.Barrier(world)

    def rank_run(rank: int) -> None:
        client = clients[rank]
        for round_index in range(rounds):
            client.extend(torch.from_numpy(losses[round_index][rank]))
            version = client.snapshot_version
            if rank == 0 and round_index % SYNC_INTERVAL == 0 and version >= window - 1:
                exact = np.concatenate([np.concatenate(losses[v]) for v in range(version - window + 1, version + 1)])
                errors.append(ks_distance(client.snapshot.numpy(), exact))
            lockstep.wait()

    threads = [threading.Thread(target=rank_run, args=(rank,)) for rank in range(world)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    stats = [client.stats() for client in clients]
    ray.kill(actor)
    return {
        "ranks": world,
        "rounds_per_s": rounds / elapsed,
        "pushes_per_s": rounds * world / elapsed,
        "client_ms_per_round": 1000 * statistics.mean(s["actor_seconds"] / s["rounds"] for s in stats),
        "staleness_rounds": statistics.mean(s["mean_staleness_rounds"] for s in stats),
        "losses_per_round": world * chunk,
        "ks_mean": statistics.mean(errors) if errors else float("nan"),
        "ks_max": max(errors) if errors else float("nan"),
    }


def table(results: list[dict]) -> list[str]:
    lines = [
        f"| ranks | losses a round (R = {CAPACITY}) | rounds/s | pushes/s | client ms a round | staleness (rounds) "
        "| KS to the exact CDF, mean (max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['ranks']} | {r['losses_per_round']:,} | {r['rounds_per_s']:.1f} | {r['pushes_per_s']:.0f} | "
            f"{r['client_ms_per_round']:.2f} | {r['staleness_rounds']:.2f} | {r['ks_mean']:.3f} ({r['ks_max']:.3f}) |"
        )
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)

    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = []
    for world in args.ranks:
        results.append(load_test(world, args.rounds))
        print(table(results)[-1], flush=True)
    print("\n".join(table(results)))
    return results


if __name__ == "__main__":
    main()
