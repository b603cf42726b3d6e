"""Selection forwards and their cheaper variants: same losses (or nearly), BatchNorm untouched."""

import pytest
import torch
import torch.nn.functional as F
from test_data import make_dataset

from raysb.config import ConfigError, TrainConfig
from raysb.data.shards import MemoryShard
from raysb.models import build_model
from raysb.training.builders import build_engine
from raysb.training.scoring import SelectionScorer


def model_and_batch():
    torch.manual_seed(0)
    model = build_model("small-cnn", 10, 3, 8, width=8)
    with torch.no_grad():  # non-trivial BatchNorm statistics, as mid-training
        model.train()
        model(torch.randn(256, 3, 8, 8) * 2 + 1)
    return model, torch.randn(64, 3, 8, 8), torch.randint(0, 10, (64,))


def test_fp32_scorer_is_the_eval_mode_loss_and_leaves_batchnorm_alone():
    model, x, y = model_and_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = SelectionScorer(model, torch.device("cpu"))(x, y)
    model.eval()
    with torch.no_grad():
        expected = F.cross_entropy(model(x), y, reduction="none")
    assert torch.allclose(losses, expected)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_channels_last_and_bf16_barely_change_the_losses():
    model, x, y = model_and_batch()
    reference = SelectionScorer(model, torch.device("cpu"))(x, y)
    last = model.to(memory_format=torch.channels_last)
    assert torch.allclose(SelectionScorer(last, torch.device("cpu"), channels_last=True)(x, y), reference, atol=1e-5)
    bf16 = SelectionScorer(model, torch.device("cpu"), precision="bf16")(x, y)
    assert bf16.dtype == torch.float32
    assert torch.allclose(bf16, reference, rtol=0.05, atol=0.05)
    # the ranking selection depends on is nearly unchanged
    assert (bf16.argsort().argsort() - reference.argsort().argsort()).abs().float().mean() < 2


def test_unknown_precisions_are_clear_config_errors():
    with pytest.raises(ConfigError, match="unknown selection_precision 'fp8'"):
        TrainConfig(selection_precision="fp8")
    with pytest.raises(ConfigError, match="unknown precision 'fp64'; choose one of auto, fp32, bf16, fp16"):
        TrainConfig(precision="fp64")
