"""One process, no Ray: scoring, pipelined selection, strategies, batching policies,
the Engine, the epoch loop, the builders that turn a config into an Engine, timing,
traces and output files.
"""
