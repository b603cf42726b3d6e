"""One process: the selection rounds (rounds.py) and their exchange, strategies, scoring,
pipelined selection, the Engine, the epoch loop, the builders that turn a config into an
Engine, timing, traces and output files. Ray only where a run opts into a Ray actor for
pipelined scoring (pipeline.ActorBackend, imported when built).
"""
