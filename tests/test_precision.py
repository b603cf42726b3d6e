"""Training precision: autocast for training, selection and evaluation forwards, fp16's gradient
scaler in checkpoints, and what `auto` means per device (GPU code paths, tested on the CPU)."""

import pytest
import torch
import torch.nn.functional as F
from test_data import make_dataset

from raysb import SelectiveBackprop
from raysb.config import TrainConfig
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine, device_settings
from raysb.training.precision import resolve_precision

CPU = torch.device("cpu")


def engine_for(**overrides):
    config = TrainConfig(model_options={"width": 8}, batch_size=8, lr_warmup_epochs=0, record_analysis=False,
                         device="cpu", **overrides)
    torch.manual_seed(0)
    return build_engine(config.settings(), MemoryShard(make_dataset(n=96, num_classes=4)), CPU)


def forward_dtypes(engine):
    """(train mode?, logits dtype) of every forward of the model's last layer."""
    seen = []
    last = list(engine.feed.scoring_model.modules())[-1]
    last.register_forward_hook(lambda module, inputs, output: seen.append((module.training, output.dtype)))
    return seen


def test_bf16_trains_scores_and_evaluates_under_autocast():
    engine = engine_for(precision="bf16", strategy="sb")
    seen = forward_dtypes(engine)
    engine.train_epoch(0)
    engine.evaluation.evaluate(make_dataset(n=32, num_classes=4, seed=1), 16)
    assert engine.counters.optimizer_steps > 0
    assert {dtype for _, dtype in seen} == {torch.bfloat16}
    assert {training for training, _ in seen} == {True, False}  # training, and scoring or evaluation


def test_selection_follows_the_training_precision_unless_told():
    engine = engine_for(precision="bf16", selection_precision="fp32", strategy="sb")
    seen = forward_dtypes(engine)
    engine.train_epoch(0)
    train = {dtype for training, dtype in seen if training}
    scoring = {dtype for training, dtype in seen if not training}
    assert train == {torch.bfloat16} and scoring == {torch.float32}


def test_fp32_is_the_plain_loop():
    engine = engine_for(precision="fp32", strategy="traditional")
    seen = forward_dtypes(engine)
    engine.train_epoch(0)
    assert {dtype for _, dtype in seen} == {torch.float32}
    assert not engine.step.scaler.is_enabled()


def test_fp16_scales_the_loss_and_its_scaler_travels_in_the_checkpoint():
    engine = engine_for(precision="fp16", strategy="sb")
    assert engine.step.scaler.is_enabled()
    engine.train_epoch(0)
    engine.step.scaler.update(new_scale=1024.0)  # as after an overflow halved it a few times
    shared = engine.shared_state_dict()
    assert shared["scaler"]["scale"] == 1024.0
    resumed = engine_for(precision="fp16", strategy="sb")
    resumed.load_state_dict(shared, engine.rank_state_dict())
    assert resumed.step.scaler.get_scale() == 1024.0
    # The resumed engine trains on: the scaler it restored steps the optimizer.
    before = [p.detach().clone() for p in resumed.model.parameters()]
    resumed.train_epoch(1)
    assert any(not torch.equal(a, b) for a, b in zip(before, resumed.model.parameters()))


def test_auto_is_bf16_on_a_gpu_that_has_it_and_fp32_elsewhere(monkeypatch):
    assert resolve_precision("auto", CPU) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert resolve_precision("auto", torch.device("cuda", 0)) == "fp32"
    assert resolve_precision("fp16", CPU) == "fp16"
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        resolve_precision("fp8", CPU)


def test_channels_last_and_selection_precision_are_resolved_for_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    defaults = TrainConfig().settings()
    gpu = device_settings(defaults.model, defaults.scoring, torch.device("cuda", 0))
    assert (gpu.precision, gpu.selection_precision, gpu.channels_last) == ("bf16", "bf16", True)
    cpu = device_settings(defaults.model, defaults.scoring, CPU)
    assert (cpu.precision, cpu.selection_precision, cpu.channels_last) == ("fp32", "fp32", False)
    told_to = TrainConfig(selection_precision="int8", channels_last=False).settings()
    told = device_settings(told_to.model, told_to.scoring, torch.device("cuda", 0))
    assert (told.selection_precision, told.channels_last) == ("int8", False)


def test_the_selection_forward_is_compiled_where_it_is_captured_on_a_gpu():
    # As the training step: inductor's kernels inside the graph on CUDA; a CPU captures and compiles nothing.
    def resolved(device: str, **keys):
        settings = TrainConfig(**keys).settings()
        on_device = device_settings(settings.model, settings.scoring, torch.device(device))
        return on_device.capture_selection, on_device.compile_selection

    assert resolved("cuda") == (True, True)
    assert resolved("cpu") == (False, False)
    assert resolved("cuda", capture_selection=False) == (False, False)
    assert resolved("cuda", compile_selection=False) == (True, False)
    # torch.compile's own CUDA graphs replace raysb's capture.
    assert resolved("cuda", compile_selection=True, selection_compile_mode="reduce-overhead") == (False, True)
    assert resolved("cpu", compile_selection=True) == (False, True)


def test_a_users_loop_scores_and_trains_at_the_precision_it_asks_for():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    seen = []

    def loss_fn(model, batch):
        logits = model(batch["x"])
        seen.append((model.training, logits.dtype))
        return F.cross_entropy(logits.float(), batch["y"], reduction="none")

    data = [{"x": torch.randn(16, 6), "y": torch.randint(0, 3, (16,))} for _ in range(8)]
    sb = SelectiveBackprop(loss_fn, batch_size=8, selectivity=0.5, precision="bf16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in sb.batches(model, data):
        loss = sb.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert sb.metrics()["optimizer_steps"] > 0
    assert {dtype for _, dtype in seen} == {torch.bfloat16}
    assert {training for training, _ in seen} == {True, False}
    with pytest.raises(ValueError, match="unknown precision 'half'"):
        SelectiveBackprop(loss_fn, batch_size=8, precision="half")
