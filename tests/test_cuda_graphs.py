"""The training step and the selection forward captured as CUDA graphs (raysb.training.cuda_graphs).

On a CPU the captured path runs its function on its static buffers without a graph (Replay.DIRECT):
these tests check that path against the eager step exactly, and the run's logic around it (one
capture a run, refusals in one line, checkpoints, budgets). Where CUDA is present, the same tests
run the real graphs (`scripts/gpu_session.sh` runs this file on a lent GPU).
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from raysb.api import train
from raysb.core.label_doubt import ClassLogits
from raysb.config import TrainConfig
from raysb.models import build_model
from raysb.training import cuda_graphs
from raysb.training.cuda_graphs import CapturedStep, CaptureRefused
from raysb.training.selection.scoring import SelectionScorer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def data_dir(cifar_shaped_dir):
    return cifar_shaped_dir


@pytest.fixture(autouse=True)
def exact_float32(monkeypatch):
    """fp32 convolutions and matrix products in fp32, not TF32: a graph and eager launches may pick
    different algorithms, and TF32's rounding (about 1e-3) would hide what the tests compare."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    matmul = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(matmul)


def run_config(data_dir, out, **values) -> TrainConfig:
    defaults = dict(dataset="parquet", data_dir=data_dir, batch_size=32, model_options={"width": 8},
                    record_analysis=False, progress_seconds=0, out=str(out))
    return TrainConfig(**{**defaults, **values})


def eager_step(model, optimizer, inputs, labels, weights, lr, clip):
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    losses = F.cross_entropy(logits, labels, reduction="none")
    loss = (losses * weights).mean() if weights is not None else losses.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return losses.detach(), loss.detach(), ClassLogits.of(logits, labels)


def twin_models(device, optimizer="sgd"):
    torch.manual_seed(0)
    model = build_model("resnet18", 10, 3, 16).to(device)
    twin = copy.deepcopy(model)
    make = {
        "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4, fused=True),
        "adam": functools.partial(torch.optim.Adam, lr=1e-3, weight_decay=5e-4, fused=True),
    }[optimizer]
    return model, make(model.parameters()), twin, make(twin.parameters())


def assert_same(actual, expected, device):
    if device == "cpu":  # the same kernels on the same values
        assert torch.equal(actual, expected)
    else:  # a graph may pick other cuDNN algorithms than eager launches
        torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_captured_step_trains_as_the_eager_step_from_its_first_step(device, optimizer):
    # Capture trains warmup steps; the step puts the model and a fresh optimizer back, so its first
    # replay is the run's first step. lr, weights and batches change from step to step.
    model, model_optimizer, twin, twin_optimizer = twin_models(device, optimizer)
    captured = CapturedStep(twin, twin_optimizer, "fp32", torch.device(device), grad_clip_norm=1.0)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        inputs = torch.randn(8, 3, 16, 16, generator=generator).to(device)
        labels = torch.randint(0, 10, (8,), generator=generator).to(device)
        weights = torch.rand(8, generator=generator).to(device) if step % 2 else None
        lr = 0.1 / (step + 1)
        expected_losses, expected_loss, expected_logits = eager_step(model, model_optimizer, inputs, labels, weights,
                                                                      lr, clip=1.0)
        captured.set_lr(lr)
        losses, loss, logits = captured(inputs, labels, weights)
        assert_same(losses, expected_losses, device)
        assert_same(loss, expected_loss, device)
        # The training forward's logits, whose margins are the label-doubt signal, come out of the graph as
        # eager ones do.
        assert_same(logits.logits, expected_logits.logits, device)
        assert torch.equal(logits.labels, expected_logits.labels)
    for (name, expected), actual in zip(model.state_dict().items(), twin.state_dict().values()):
        assert_same(actual, expected, device), name
    assert captured.captures == 1


def test_the_captured_steps_outputs_are_its_own_copies():
    # A replay overwrites the graph's outputs: what a step returned must not change with the next.
    model, _, twin, optimizer = twin_models("cpu")
    captured = CapturedStep(twin, optimizer, "fp32", torch.device("cpu"))
    captured.set_lr(0.1)
    first, first_loss, first_logits = captured(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)), None)
    kept, kept_loss, kept_logits = first.clone(), first_loss.clone(), first_logits.logits.clone()
    captured(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)), None)
    assert torch.equal(first, kept) and torch.equal(first_loss, kept_loss)
    assert torch.equal(first_logits.logits, kept_logits)


class HostSyncNet(torch.nn.Module):
    """A network whose forward asks the host about its data: no CUDA graph can hold that."""

    def __init__(self):
        super().__init__()
        self.body = build_model("small-cnn", 10, 3, 16, width=8)

    def forward(self, x):
        if x.abs().sum().item() > 0:  # a host sync, and control flow on its answer
            return self.body(x)
        return self.body(x) * 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph's capture refuses host syncs; a CPU has none")
def test_a_host_sync_in_the_forward_refuses_capture_and_leaves_the_model_as_it_was():
    device = torch.device("cuda")
    model = HostSyncNet().to(device)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    captured = CapturedStep(model, optimizer, "fp32", device)
    with pytest.raises(CaptureRefused, match="RuntimeError|AcceleratorError|CUDA"):
        captured.capture(torch.randn(8, 3, 16, 16, device=device), torch.randint(0, 10, (8,), device=device), None)
    assert not captured.captured
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(isinstance(group["lr"], float) for group in optimizer.param_groups)
    # and the eager step still trains
    eager_step(model, optimizer, torch.randn(8, 3, 16, 16, device=device),
               torch.randint(0, 10, (8,), device=device), None, 0.1, clip=10.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batchnorm", ["batch", "running"])
def test_captured_scoring_scores_as_eager_scoring_and_pads_a_short_chunk_only_with_running_statistics(
        device, batchnorm):
    torch.manual_seed(0)
    model = build_model("small-cnn", 10, 3, 8, width=8).to(device)
    with torch.no_grad():  # non-trivial BatchNorm statistics, as mid-training
        model.train()
        model(torch.randn(256, 3, 8, 8, device=device) * 2 + 1)
    eager = SelectionScorer(model, torch.device(device), batchnorm=batchnorm)
    captured = SelectionScorer(model, torch.device(device), batchnorm=batchnorm, capture=True)
    before = copy.deepcopy(model.state_dict())
    for rows in (32, 32, 20):  # an epoch's last chunk is short
        inputs, labels = torch.randn(rows, 3, 8, 8, device=device), torch.randint(0, 10, (rows,), device=device)
        assert_same(captured(inputs, labels), eager(inputs, labels), device) if rows == 32 or batchnorm == "batch" \
            else torch.testing.assert_close(captured(inputs, labels), eager(inputs, labels))
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    # One graph; the short chunk padded into it with running statistics, scored eagerly with its own.
    assert captured.stats()["selection_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_one_capture_a_run_whatever_kept_counts_evaluation_and_the_lr_do(tmp_path, data_dir, device):
    # free-sb keeps another count each epoch; evaluation and the scorer switch the module to eval;
    # the cosine lr changes every step: none of it recaptures. The capture is a training step's time.
    config = run_config(data_dir, tmp_path / "run", strategy="free-sb", epochs=3, device=device, capture_training=True)
    summary = train(config, log=lambda line: None).summary
    assert summary["captured_training"] and summary["training_captures"] == 1
    assert 0 < summary["training_capture_s"] <= summary["time_breakdown_s"]["train_step"]
    assert summary["time_breakdown_s"]["backward"] == 0  # every step replayed whole


def test_a_compiled_captured_step_compiles_once(tmp_path, data_dir, monkeypatch):
    # Dynamo's guards and recompiles with the backend that runs anywhere ("eager"): the compiled
    # module inside the captured step sees one shape and one mode all run long.
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()  # the process's count: other tests compile too
    config = run_config(data_dir, tmp_path / "run", strategy="uniform", epochs=3, device="cpu",
                        capture_training=True, compile_training=True)
    summary = train(config, log=lambda line: None).summary
    assert summary["captured_training"] and summary["training_captures"] == 1
    assert summary["compiled_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_captured_run_trains_as_an_eager_one(tmp_path, data_dir, device):
    # On a CPU, SB: the same losses make the same keep draws. A GPU's graph may round apart from its
    # eager kernels, and a draw on a rounded loss can differ: Traditional, where no draw depends on one.
    # On a GPU, fp32 and uncompiled on both sides: the same arithmetic, launched two ways.
    base = dict(strategy="sb" if device == "cpu" else "traditional", epochs=2, device=device, precision="fp32",
                compile_training=False)
    tolerance = {"rel": 1e-5} if device == "cpu" else {"rel": 1e-3}
    runs = {}
    for captured in (False, True):
        result = train(run_config(data_dir, tmp_path / str(captured), **base, capture_training=captured,
                                  capture_selection=captured), log=lambda line: None)
        runs[captured] = (result.metrics, torch.load(tmp_path / str(captured) / "best_model.pt"))
    for eager_row, captured_row in zip(runs[False][0], runs[True][0]):
        assert captured_row["backprop_examples"] == eager_row["backprop_examples"]
        assert captured_row["kept_fraction"] == eager_row["kept_fraction"]
        assert captured_row["train_loss"] == pytest.approx(eager_row["train_loss"], **tolerance)
    for name, value in runs[False][1].items():  # foreach and fused SGD round apart by a few ulps
        torch.testing.assert_close(runs[True][1][name], value, rtol=1e-4 if device == "cpu" else 1e-3, atol=1e-5)


def test_a_model_that_cannot_be_captured_trains_eagerly_and_the_run_says_why_in_one_line(tmp_path, data_dir,
                                                                                         monkeypatch):
    def refused(self, before_capture=lambda: None):
        for _ in range(cuda_graphs.WARMUP_CALLS):
            self.function()  # the warmup trains, as a real capture's does, before it fails
        raise CaptureRefused("RuntimeError: operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.GraphedFunction, "capture", refused)
    lines = []
    base = dict(strategy="traditional", epochs=2, device="cpu")
    summary = train(run_config(data_dir, tmp_path / "refused", **base, capture_training=True), log=lines.append).summary
    notices = [line for line in lines if "not captured" in line]
    assert notices == ["raysb: training step not captured as a CUDA graph (RuntimeError: operation not permitted "
                       "when stream is capturing): training eagerly"]
    assert not summary["captured_training"] and "operation not permitted" in summary["training_capture_refused"]
    # Nothing of the failed warmup stays: the run is the eager run (fused SGD's rounding apart).
    eager = train(run_config(data_dir, tmp_path / "eager", **base, capture_training=False), log=lambda line: None)
    assert summary["final_test_error"] == eager.summary["final_test_error"]
    refused_model = torch.load(tmp_path / "refused" / "best_model.pt")
    for name, value in torch.load(tmp_path / "eager" / "best_model.pt").items():
        torch.testing.assert_close(refused_model[name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("setting, reason", [
    ({"staleness_correction": "always"}, "staleness_correction weighs each batch"),
    ({"precision": "fp16"}, "fp16's gradient scaler"),
])
def test_a_setting_a_graph_cannot_hold_trains_eagerly_and_says_so_as_the_run_starts(tmp_path, data_dir, setting,
                                                                                    reason):
    lines = []
    config = run_config(data_dir, tmp_path / "run", strategy="sb", epochs=1, device="cpu", capture_training=True,
                        **setting)
    summary = train(config, log=lines.append).summary
    assert not summary["captured_training"] and reason in summary["training_capture_refused"]
    notices = [line for line in lines if "not captured" in line]
    assert len(notices) == 1 and reason in notices[0] and notices[0].endswith("training eagerly")
    assert lines.index(notices[0]) < next(i for i, line in enumerate(lines) if line.startswith("epoch"))


@pytest.mark.parametrize("device", DEVICES)
def test_a_resumed_captured_run_continues_as_the_straight_one(tmp_path, data_dir, device):
    # A static lr, so that the run of 2 epochs that is resumed for a third steps as the run of 3 does.
    # The checkpoint's optimizer state replaces the captured one's tensors: the step captures again.
    base = dict(strategy="free-sb", device=device, capture_training=True, lr_schedule="static")
    straight = train(run_config(data_dir, tmp_path / "straight", **base, epochs=3), log=lambda line: None)
    train(run_config(data_dir, tmp_path / "resumed", **base, epochs=2), log=lambda line: None)
    resumed = train(run_config(data_dir, tmp_path / "resumed", **base, epochs=3, resume=True), log=lambda line: None)
    # (A GPU's backward sums in no fixed order: the same run twice differs in the last bits.)
    assert resumed.metrics[-1]["train_loss"] == pytest.approx(straight.metrics[-1]["train_loss"],
                                                              rel=1e-6 if device == "cpu" else 1e-3)
    assert resumed.summary["final_test_error"] == straight.summary["final_test_error"]
    # The checkpoint stores the lr a float, as before graphs: older runs resume, and newer ones elsewhere.
    checkpoint = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)
    assert all(type(group["lr"]) is float for group in checkpoint["engine"]["optimizer"]["param_groups"])


def test_a_compile_raysb_chose_that_capture_refuses_is_dropped_for_the_plain_module(tmp_path, data_dir, monkeypatch):
    # On CUDA raysb compiles the step it captures unless told otherwise; where the compiled module
    # cannot be captured (a graph break that syncs, say), the plain module is captured instead.
    from raysb.training import builders

    monkeypatch.setattr(builders, "compiles_training", lambda model, captured, device: captured)  # as on CUDA
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    real_capture = cuda_graphs.GraphedFunction.capture

    def refuses_compiled(self, before_capture=lambda: None):
        if hasattr(self.function.__self__.model, "_orig_mod"):
            raise CaptureRefused("RuntimeError: operation not permitted when stream is capturing")
        return real_capture(self, before_capture)

    monkeypatch.setattr(cuda_graphs.GraphedFunction, "capture", refuses_compiled)
    lines = []
    summary = train(run_config(data_dir, tmp_path / "run", strategy="traditional", epochs=1, device="cpu",
                               capture_training=True), log=lines.append).summary
    assert summary["captured_training"] and not summary["compiled_training"]
    assert [line for line in lines if "torch.compile" in line] == [
        "raysb: training step captured without torch.compile (compiled: RuntimeError: operation not permitted when "
        "stream is capturing)"]
