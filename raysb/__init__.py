"""raysb: Selective-Backprop training on Ray.

Train with the CLI (`raysb train ...`), with `raysb.train(TrainConfig(...))`,
or add selection to your own loop with `Selector` and `BatchFormer`.
"""

__version__ = "0.1.0"

from raysb.batch_former import Batch, BatchFormer
from raysb.selection import NonFiniteLossError, Selector

__all__ = ["Batch", "BatchFormer", "NonFiniteLossError", "Selector", "TrainConfig", "train"]


def __getattr__(name):
    # The trainer pulls in models and data loaders; keep `import raysb` light for
    # users who only want the selection API.
    if name == "train":
        from raysb.run import train

        return train
    if name == "TrainConfig":
        from raysb.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'raysb' has no attribute {name!r}")
