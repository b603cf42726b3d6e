"""Side-by-side benchmark: per-example pass costs, then strategies trained in one process.

    python -m raysb.bench --epochs 3 --strategies traditional sb stale-sb --out runs/bench

Prints a markdown report (also written to OUT/report.md): F, B and F_sel per
example, then each strategy's per-epoch time as a ratio to Traditional next to
the cost-model bound of ../shared/GUIDE.md section 8, its time split (with SB's
bookkeeping share) and error, then each strategy's time to 1.0x, 1.1x, 1.2x and
1.4x Traditional's final error. With `--seeds 0 1 2` every strategy runs once
per seed and the report ends with each strategy's median speedup over seeds,
in measured wall-clock and in time modelled from the measured per-example costs
and each run's example counts (free of the machine's timing noise).
`--budgets 0.25 0.5 1` trains Traditional for --epochs first, then every strategy
once per seed with a time budget of each fraction of that run's training time, every
schedule keyed to its budget, and reports final errors against the `uniform` baseline
(raysb.bench.budgets).
`--api-overhead` compares SB in a user's own loop (raysb.SelectiveBackprop) with
raysb's trainer per step, in one process or on `--workers N`.
Ratios are only meaningful within one report: the runs share one machine, one
process and one stretch of time.
"""
