import math
import re

import pytest
import torch

from raysb.cli import main
from raysb.core.importance_sampling import (
    VarianceReductionGate,
    default_tau_threshold,
    importance_sample,
    variance_reduction,
)
from raysb.core.schedules import learning_rate, schedule_progress, warmup_factor

from conftest import needs_fashion_mnist


def test_variance_reduction_is_one_for_uniform_scores_and_grows_with_concentration():
    assert float(variance_reduction(torch.ones(100))) == pytest.approx(1.0)
    # g = (1, 0, ..., 0): ||g-u||^2 = 1 - 1/n, ||g||^2 = 1 -> tau = sqrt(n)
    one_hot = torch.zeros(16)
    one_hot[3] = 5.0
    assert float(variance_reduction(one_hot)) == pytest.approx(4.0)
    skewed = torch.tensor([1.0, 1.0, 1.0, 9.0])
    assert 1.0 < float(variance_reduction(skewed)) < 2.0


def test_default_threshold_is_kath18_break_even():
    assert default_tau_threshold(384, 128) == pytest.approx((384 + 384) / 384)


def test_importance_sampling_follows_scores_and_weights_unbias():
    scores = torch.tensor([1.0, 3.0, 0.0, 6.0])
    generator = torch.Generator().manual_seed(0)
    draw, weights = importance_sample(scores, 20000, generator)
    frequencies = torch.bincount(draw, minlength=4).float() / 20000
    assert frequencies.tolist() == pytest.approx([0.1, 0.3, 0.0, 0.6], abs=0.015)
    assert weights[draw == 3][0] == pytest.approx(1 / (4 * 0.6))
    # E[1 / (B p)] = (examples with p > 0) / B: the zero-score one is never drawn.
    assert weights.mean() == pytest.approx(3 / 4, abs=0.02)


def test_gate_opens_only_after_sustained_concentration_and_only_when_read():
    gate = VarianceReductionGate(threshold=1.5)
    gate.update(torch.ones(64))
    gate.refresh()
    assert not gate.open
    peaked = torch.zeros(64)
    peaked[:2] = 1.0
    for _ in range(30):
        gate.update(peaked)
    assert not gate.open  # tau passed the threshold on the device; the host learns it at the next read
    gate.refresh()
    assert gate.open


def test_step_and_accelerated_schedules():
    lr = lambda name, p: learning_rate(name, 0.1, p, 200, [60, 120, 160], 0.2)
    assert lr("step", 59.9) == pytest.approx(0.1)
    assert lr("step", 60) == pytest.approx(0.02)
    assert lr("step", 165) == pytest.approx(0.1 * 0.2**3)
    assert lr("accelerated", 48) == pytest.approx(0.02)
    assert lr("accelerated", 47.9) == pytest.approx(0.1)
    assert lr("static", 150) == pytest.approx(0.1)
    assert learning_rate("cosine", 0.1, 0.0, 10) == pytest.approx(0.1)
    assert learning_rate("cosine", 0.1, 5.0, 10) == pytest.approx(0.05)
    assert learning_rate("cosine", 0.1, 10.0, 10) == pytest.approx(0.0, abs=1e-12)


def test_warmup_ramps_over_backpropagated_examples_then_holds():
    # One epoch of 1000 examples in batches of 100: ten steps from lr/10 to lr.
    factors = [warmup_factor(step * 100, 100, 1000, 1.0) for step in range(12)]
    assert factors[0] == pytest.approx(0.1)
    assert factors[4] == pytest.approx(0.5)
    assert factors[9:] == [1.0, 1.0, 1.0]
    assert warmup_factor(0, 100, 1000, 0.0) == 1.0


def test_backprop_keyed_progress_counts_backpropagated_examples():
    # SB with 1/3 selectivity after 3 epochs has backpropagated one epoch's worth.
    assert schedule_progress("backprop", epoch=3, backprop_examples=20000, train_size=60000) == pytest.approx(
        1 / 3
    )
    assert schedule_progress("epoch", epoch=3, backprop_examples=20000, train_size=60000) == 3.0
    with pytest.raises(ValueError, match="unknown lr_schedule_key"):
        schedule_progress("steps", 0, 0, 1)
    with pytest.raises(ValueError, match="unknown lr_schedule"):
        learning_rate("exponential", 0.1, 0, 1)
    assert math.isfinite(learning_rate("cosine", 0.1, 50.0, 10))


@needs_fashion_mnist
def test_a_backprop_keyed_schedule_that_ends_above_its_end_says_so(tmp_path, capsys):
    # The shipped Stale-SB config keys its cosine to backpropagated examples, as the authors' code does:
    # at s = 1/3 a run ends a third of the way along it. Run for 3 epochs it ended at lr 0.0384 and
    # said nothing.
    small = ["--epochs", "3", "--subset", "600", "--test-subset", "100", "--batch-size", "32", "--set",
             "model_options.width=4", "--set", "collapse_patience=0", "--progress-seconds", "0"]
    assert main(["train", "--config", "configs/fashion-mnist-stale-sb.yaml", *small, "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    note = re.search(r"raysb: note: lr_schedule_key backprop keys the schedule to backpropagated examples, as the "
                     r"authors' code does: this run backpropagated (\d\.\d\d) epochs' worth of its schedule's 3 and "
                     r"ended at lr ([0-9.]+), above the schedule's end; lr_schedule_key epoch ends it with the run", out)
    assert note and 0.8 < float(note[1]) < 1.6 and float(note[2]) > 0.01, out[-1500:]
    # Keyed to epochs, the same run ends at 0 and has nothing to say.
    assert main(["train", "--config", "configs/fashion-mnist-stale-sb.yaml", *small, "--set", "lr_schedule_key=epoch",
                 "--out", str(tmp_path / "epoch")]) == 0
    assert "raysb: note: lr_schedule_key" not in capsys.readouterr().out
