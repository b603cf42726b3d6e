"""SB's fixed-count keep rule as one graph a round (raysb.training.selection.keep_rule_graph).

On a CPU the graph's function runs on its static buffers (Replay.DIRECT): these tests hold it to
the eager rule decision for decision, as the ring fills and wraps, across a chunk of another size,
a restored state and a changed rule; where CUDA is present the same tests replay real graphs.
"""

import pytest
import torch

from raysb.api import train
from raysb.config import TrainConfig
from raysb.core.keep_rule import LossHistory, Selector, filled_percentile_ranks, percentile_ranks
from raysb.training import cuda_graphs
from raysb.training.cuda_graphs import CaptureRefused, replay_mode
from raysb.training.selection.keep_rule_graph import KeepRuleGraph, capture_keep_rule
from raysb.training.selection.merged_histogram import MergedLossHistogram
from raysb.training.selection.strategies.sb import SBStrategy

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ROWS, R = 24, 64


def chunks(count: int, seed: int, rows: int = ROWS, device="cpu") -> list[torch.Tensor]:
    """Losses with many ties (rounded to tenths), as late in training."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(rows, generator=generator).mul(3).round(decimals=1).to(device) for _ in range(count)]


def selector_pair(device, **rule):
    eager = Selector(beta=1.0, history_size=R, seed=5, device=device, **rule)
    graphed = Selector(beta=1.0, history_size=R, seed=5, device=device, **rule)
    graph = KeepRuleGraph(graphed, ROWS, torch.device(device), replay_mode(torch.device(device)))
    graphed.captured_rule = graph
    return eager, graphed, graph


def observed(selector: Selector) -> list:
    seen = []
    selector.observer = lambda ids, losses, ranks, probabilities, keep: seen.append(
        (ranks.clone(), probabilities.clone(), keep.clone()))
    return seen


def assert_same_state(eager: Selector, graphed: Selector) -> None:
    mine, theirs = graphed.state_dict(), eager.state_dict()
    assert torch.equal(mine["history"]["values"], theirs["history"]["values"])
    assert (mine["history"]["size"], mine["history"]["next"]) == (theirs["history"]["size"], theirs["history"]["next"])
    assert torch.equal(mine["generator"], theirs["generator"])
    assert (mine["examples_seen"], mine["examples_kept"]) == (theirs["examples_seen"], theirs["examples_kept"])


def decide(selector: Selector, losses: torch.Tensor):
    return selector.kept_positions(losses, torch.arange(len(losses)), fixed_count=True)


@pytest.mark.parametrize("device", DEVICES)
def test_the_graph_decides_as_the_eager_rule_as_the_ring_fills_and_wraps(device):
    eager, graphed, graph = selector_pair(device, keep_floor=0.05)
    seen_eager, seen_graphed = observed(eager), observed(graphed)
    for index, losses in enumerate(chunks(9, seed=1, device=device)):  # 9 x 24 losses wrap R = 64 three times
        kept_eager, p_eager = decide(eager, losses)
        kept_graphed, p_graphed = decide(graphed, losses)
        assert torch.equal(kept_graphed.sort().values, kept_eager.sort().values), index
        assert len(kept_graphed) == round(ROWS / 2)  # beta 1: s = 1/2 of every chunk, exactly
        torch.testing.assert_close(p_graphed, p_eager, rtol=0, atol=0 if device == "cpu" else 1e-6)
        assert_same_state(eager, graphed)
    for (ranks_e, _, keep_e), (ranks_g, _, keep_g) in zip(seen_eager, seen_graphed):
        torch.testing.assert_close(ranks_g, ranks_e, rtol=0, atol=0 if device == "cpu" else 1e-6)
        assert torch.equal(keep_g, keep_e)
    assert graph.captures == 1


@pytest.mark.parametrize("device", DEVICES)
def test_the_per_example_draw_on_the_device_decides_as_the_eager_rule(device):
    # The paper's rule as SB's round graph runs it (raysb.training.selection.round_graph): the same ring
    # writes, ranks, P (with a floor and a mixed strength) and keep mask as the eager rule, from draws
    # the same generator makes in the same order, as the ring fills and wraps.
    eager, graphed = (Selector(beta=1.0, history_size=R, seed=5, device=device, keep_floor=0.05) for _ in range(2))
    eager.strength = graphed.strength = 0.8
    rule = KeepRuleGraph(graphed, ROWS, torch.device(device), replay_mode(torch.device(device)))
    draws = torch.zeros(2, ROWS, device=device)
    for index, losses in enumerate(chunks(9, seed=6, device=device)):
        keep_eager, p_eager = eager.keep_mask_and_probabilities(losses, checked=True)
        rule.sync_cursor()
        draws.uniform_(generator=graphed.generator)
        keep_graphed, p_graphed = rule.decide_each(losses, draws, rule.constants(None))
        rule.follow()
        graphed.examples_seen += ROWS
        assert torch.equal(keep_graphed, keep_eager), index
        torch.testing.assert_close(p_graphed, p_eager, rtol=0, atol=0 if device == "cpu" else 1e-6)
        assert_same_state(eager, graphed)
    assert 0 < graphed.examples_kept < 9 * ROWS


@pytest.mark.parametrize("device", DEVICES)
def test_a_chunk_of_another_size_a_restored_state_and_a_new_rule_keep_the_graph_in_step(device):
    eager, graphed, graph = selector_pair(device)
    first, second = chunks(4, seed=2, device=device), chunks(3, seed=3, device=device)
    for losses in first[:2]:
        decide(eager, losses), decide(graphed, losses)
    short = chunks(1, seed=4, rows=10, device=device)[0]  # an epoch's last chunk: decided eagerly
    assert torch.equal(decide(graphed, short)[0], decide(eager, short)[0])
    for losses in first[2:]:  # the graph picks the ring up where the eager rule left it
        assert torch.equal(decide(graphed, losses)[0], decide(eager, losses)[0])
    assert_same_state(eager, graphed)
    saved = eager.state_dict()
    decide(graphed, second[0])  # moves the graph's ring on; the restore below puts it back
    graphed.load_state_dict(saved)
    graphed.beta, eager.beta = 2.0, 2.0  # a kept-fraction schedule's next epoch: captured again
    graphed.strength, eager.strength = 0.5, 0.5
    for losses in second:
        kept_graphed, p_graphed = decide(graphed, losses)
        kept_eager, p_eager = decide(eager, losses)
        assert torch.equal(kept_graphed, kept_eager) and len(kept_graphed) == round(ROWS / 3)
        torch.testing.assert_close(p_graphed, p_eager, rtol=0, atol=0 if device == "cpu" else 1e-6)
    assert_same_state(eager, graphed)
    assert graph.captures == 2


def test_ranks_against_a_partly_filled_ring_are_the_filled_slots_percentiles():
    slots = torch.tensor([0.3, 0.1, 0.3, 0.9, 7.0, 7.0])  # the last two not yet written: whatever they hold
    losses, ties = torch.tensor([0.3, 0.05, 1.0, 0.1]), torch.tensor([0.5, 0.2, 0.9, 1.0])
    expected = percentile_ranks(slots[:4], losses, ties)
    # By hand: 0.3 has one below and two equal, 1 + 0.5 * 2 of 4; 0.05 none; 1.0 all four; 0.1 one equal.
    assert expected.tolist() == pytest.approx([0.5, 0.0, 1.0, 0.25])
    assert torch.equal(filled_percentile_ranks(slots, torch.tensor(4), losses, ties), expected)


def test_only_a_fixed_count_against_a_ranks_own_ring_is_captured():
    def strategy(fixed: bool, history=None) -> SBStrategy:
        return SBStrategy(Selector(beta=1.0, history_size=R, history=history), fixed_count=fixed)

    cpu = torch.device("cpu")
    captured = strategy(True)
    capture_keep_rule(captured, ROWS, cpu, replay_mode(cpu))
    assert isinstance(captured.selector.captured_rule, KeepRuleGraph)
    drawn = strategy(False)  # the paper's per-example draw: a count only a host read knows
    capture_keep_rule(drawn, ROWS, cpu, replay_mode(cpu))
    assert drawn.selector.captured_rule is None
    merged = strategy(True, MergedLossHistogram(R, device=cpu))  # lockstep ranks rank against every rank's scores
    capture_keep_rule(merged, ROWS, cpu, replay_mode(cpu))
    assert merged.selector.captured_rule is None
    too_big = strategy(True)  # a chunk of R or more would overwrite slots it writes
    capture_keep_rule(too_big, R, cpu, replay_mode(cpu))
    assert too_big.selector.captured_rule is None
    with pytest.raises(ValueError, match="fewer than R = 64"):
        KeepRuleGraph(Selector(beta=1.0, history_size=R), R, cpu, replay_mode(cpu))
    assert isinstance(captured.selector.history, LossHistory)


@pytest.mark.slow
def test_a_stale_sb_run_with_the_graph_trains_as_the_eager_rule_and_resumes(tmp_path, cifar_shaped_dir, monkeypatch):
    # Stale-SB's selection passes decide with the captured rule alone (SB's rounds are captured whole:
    # tests/test_round_graph.py); staleness 2 makes epochs 1 and 3 passes, epoch 2 ranks recorded losses.
    replays = []
    decide_graph = KeepRuleGraph.__call__

    def counted(self, losses, draws, count):
        decided = decide_graph(self, losses, draws, count)
        replays.append(decided is not None)
        return decided

    monkeypatch.setattr(KeepRuleGraph, "__call__", counted)
    base = dict(dataset="parquet", data_dir=cifar_shaped_dir, strategy="stale-sb", staleness=2,
                kept_per_chunk="fixed", batch_size=32, model_options={"width": 8}, record_analysis=False,
                progress_seconds=0, device="cpu", lr_schedule="static", capture_selection=True)

    def run(name: str, epochs: int, **extra):
        return train(TrainConfig(**base, epochs=epochs, out=str(tmp_path / name), **extra), log=lambda line: None)

    with monkeypatch.context() as eager_only:
        eager_only.setattr("raysb.training.builders.capture_keep_rule", lambda *args: None)
        eager = run("eager", 3)
    assert not replays
    graphed = run("graph", 3)
    # Every whole chunk of the two passes decided by the graph; at most a pass's last, shorter one eagerly.
    assert replays.count(True) >= 6 and replays.count(False) <= 2
    for eager_row, graph_row in zip(eager.metrics, graphed.metrics, strict=True):
        assert graph_row["backprop_examples"] == eager_row["backprop_examples"]
        assert graph_row["train_loss"] == eager_row["train_loss"]
    # Resumed after 2 epochs, the ring's state from the checkpoint: the third epoch as the straight run's.
    run("resumed", 2)
    resumed = run("resumed", 3, resume=True)
    assert resumed.metrics[-1]["train_loss"] == graphed.metrics[-1]["train_loss"]
    assert resumed.summary["final_test_error"] == graphed.summary["final_test_error"]
    assert graphed.summary["keep_rule_graphs"] == 1 and "keep_rule_graphs" not in eager.summary
    assert "round_graphs" not in graphed.summary


def test_a_rule_the_device_refuses_to_capture_decides_eagerly_with_its_state_as_it_was(monkeypatch):
    def refused(self, before_capture=lambda: None):
        for _ in range(cuda_graphs.WARMUP_CALLS):
            self.function()  # the warmup writes the ring, as a real capture's does, before it fails
        raise CaptureRefused("RuntimeError: operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.GraphedFunction, "capture", refused)
    eager, graphed, graph = selector_pair("cpu")
    for losses in chunks(4, seed=6):
        assert torch.equal(decide(graphed, losses)[0], decide(eager, losses)[0])
    assert_same_state(eager, graphed)
    assert graph.stats() == {"keep_rule_graphs": 0,
                             "keep_rule_capture_refused": "RuntimeError: operation not permitted when stream is capturing"}
