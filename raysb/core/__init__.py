"""Selective-Backprop's math, pure torch: no I/O, no Ray, no torch.distributed.

Selection (CDF_R percentiles, keep probabilities, staleness weights), Kath18
importance sampling, the batch former, learning-rate schedules, sample indexes,
gradient probes, and every strategy's card (strategy_table.py). Everything above builds on these.
"""
