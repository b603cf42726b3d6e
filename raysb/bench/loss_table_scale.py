"""What the loss table costs one rank as the training set grows, measured (issue 46, item 4):

    python -m raysb.bench.loss_table_scale --examples 1000000 10000000 --ranks 8 64 --out runs/loss-table

A replicated table (the default): every lockstep rank holds every example's recorded score
(raysb.training.selection.loss_table) and applies every rank's records, so per rank and epoch it
pays, whatever the rank count (a sharded one, `loss_table: sharded`: rank 0 of `ranks`, holding and
applying only the examples it owns, and deciding only those, every epoch decided as it starts):
- memory: the table's tensors (ids sorted with their rows, loss, epoch recorded), counted from
  their sizes and seen as the process's resident memory grow;
- applying N records: the host time of `LossTable.apply` over one epoch's records arriving in
  rounds of `ranks x chunk` (each round's exchange brings every rank's chunk), or where epochs are
  decided as they start, in one payload from each rank;
- receiving them: the exchange's padded payload (`RoundPayload.byte_bound`) of every round, or the
  epoch's unpadded payloads;
- deciding an epoch at its start from the recorded scores (issue 46, item 1): every example's
  CDF rank from the table's loss histogram and its keep draw, in one vectorized pass on this CPU.
One process, one thread, synthetic losses (log-normal: a trained model's spread over several bins).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from raysb.bench.reports import write_report
from raysb.core.histogram import histogram_ranks
from raysb.core.keep_rule import keep_from_ranks
from raysb.training.selection.exchange import RoundPayload
from raysb.training.selection.loss_table import RECORD_ROWS, LossTable
from raysb.training.selection.shard_summary import owning_ranks, records_by_owner

# A round's chunk on each rank (b = 128, one chunk a round) and the keep rule's beta (s = 1/3).
CHUNK = 128
BETA = 2.0
# (sharded, planned, to_owners) of each row: the replicated table chunk by chunk and planned, and the
# sharded one with its records sent to every rank (as before 2026-12-07) and to their owners alone.
LAYOUTS = ((False, False, False), (False, True, False), (True, True, False), (True, True, True))


def measure(examples: int, ranks: int, sharded: bool = False, planned: bool = False, to_owners: bool = False,
            seed: int = 0) -> dict:
    """One row: the table over `examples` ids (rank 0's share of them if `sharded`), one epoch of
    records applied as they arrive, and one epoch-start decision. Records arrive in rounds of
    `ranks x CHUNK` where epochs run chunk by chunk, and in one payload from each rank where they are
    decided as they start (`planned`: what a sharded table always is). A sharded table's records
    reach every rank (an all-gather), or with `to_owners` (what raysb does) only the rank that owns
    each: rank 0 then splits its own records by owner and applies the ones the ranks sent it."""
    draws = torch.Generator().manual_seed(seed)
    losses = torch.exp(torch.randn(examples, generator=draws))
    arrival = torch.randperm(examples, generator=draws)
    resident_before = _resident_bytes()
    table = LossTable(torch.arange(examples), distribution=True)
    if sharded:
        table.shard(0, ranks)
    held = sum(tensor.nbytes for tensor in (table.index.ids, table.index.rows, table.losses, table.recorded_epoch))

    payload = -(-examples // ranks) if planned else ranks * CHUNK
    payloads = arrival.split(payload)
    if to_owners:
        sent = payloads[0]  # rank 0's own records of the epoch, as every record of it travels
        sent_records = torch.cat([losses[sent].unsqueeze(0), torch.full((RECORD_ROWS - 1, sent.numel()), -1.0)])
        # What the ranks send rank 0, which it applies in one go.
        payloads = [torch.cat([ids[owning_ranks(ids, ranks) == 0] for ids in payloads])]
    started = time.perf_counter()
    if to_owners:  # what rank 0 does with its records before they travel
        records_by_owner(sent, sent_records, ranks)
    for ids in payloads:
        table.apply(ids, losses[ids])
    apply_s = time.perf_counter() - started
    resident = _resident_bytes() - resident_before

    started = time.perf_counter()
    # (A sharded rank ranks against every rank's counts summed, as many as its own: the same work.)
    held_losses = table.losses
    ranks_now = histogram_ranks(table.counts, held_losses, torch.rand(held_losses.numel(), generator=draws))
    kept, _ = keep_from_ranks(ranks_now, torch.rand(held_losses.numel(), generator=draws), BETA)
    kept_ids = table.index.ids[kept]  # the table's slots hold its ids in sorted order
    decide_s = time.perf_counter() - started
    kept_share = kept_ids.numel() / table.losses.numel()

    if planned:
        # Unpadded: each example's record (its id and RECORD_ROWS values, float64 each in the round payload,
        # raysb.training.selection.exchange.RoundPayload; to the owners, int64 and float32), each kept one's
        # id, weight and probability (float64 each); to the owners, only the records rank 0 owns.
        records = sum(ids.numel() for ids in payloads)
        record_bytes = 8 + RECORD_ROWS * 4 if to_owners else (1 + RECORD_ROWS) * 8
        received = round(records * record_bytes + examples * kept_share * 3 * 8)
    else:
        received = -(-examples // payload) * ranks * RoundPayload.byte_bound(CHUNK, None)
    return {
        "examples": examples, "ranks": ranks,
        "table": "sharded, to owners" if to_owners else "sharded" if sharded else "replicated",
        "epochs": "planned" if planned else "chunk by chunk", "table_bytes": held,
        "resident_bytes": resident, "apply_s": apply_s, "received_bytes": received, "decide_s": decide_s,
        "recorded": int(table.counts.sum()), "kept_share": kept_share,
    }


def report(rows: list[dict]) -> list[str]:
    lines = [
        f"One process, one thread; records arrive in rounds of ranks x {CHUNK}; the decision keeps with "
        f"P = CDF ** {BETA:g}.",
        "",
        "| examples | ranks | table | epochs | held (counted) | resident growth | apply an epoch's records "
        "| per record | received an epoch | epoch-start decision | kept |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['examples']:,} | {row['ranks']} | {row['table']} | {row['epochs']} | "
            f"{_megabytes(row['table_bytes'])} | "
            f"{_megabytes(row['resident_bytes'])} | {row['apply_s']:.2f} s | "
            f"{row['apply_s'] / row['examples'] * 1e9:.0f} ns | {_megabytes(row['received_bytes'])} | "
            f"{row['decide_s'] * 1e3:.0f} ms | {row['kept_share']:.3f} |"
        )
    return lines


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.0f} MB"


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysb.bench.loss_table_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--out", default="runs/loss-table")
    args = parser.parse_args(argv)
    if min(args.examples) < 1 or min(args.ranks) < 1:
        parser.error("--examples and --ranks must be >= 1")
    torch.set_num_threads(1)
    rows = [measure(examples, ranks, *layout) for examples in args.examples for ranks in args.ranks
            for layout in LAYOUTS]
    return write_report(Path(args.out), report(rows))


if __name__ == "__main__":
    raise SystemExit(main())
