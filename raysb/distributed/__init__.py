"""The Ray layer: the cluster (connect, watch, capacity), the driver (launch), each Ray Train
rank's run (worker) and its checkpoints, the console relay and chaos (injected faults).
"""
