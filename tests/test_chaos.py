"""Chaos specs: what each event means, and clear errors for ones that do not parse."""

import json

import pytest

from raysb.chaos_spec import ChaosEvent, parse_chaos
from raysb.config import ConfigError, TrainConfig
from raysb.distributed.chaos import ChaosRunner, committed_epoch


def test_events_parse_into_points_ranks_and_commit_waits():
    events = parse_chaos("kill-worker@2, kill-worker@3:7:rank0:committed,kill-worker@1:checkpoint,nan@3")
    assert events == [
        ChaosEvent(0, "kill-worker", 2),
        ChaosEvent(1, "kill-worker", 3, round=7, rank=0, after_commit=True),
        ChaosEvent(2, "kill-worker", 1, at_checkpoint=True),
        ChaosEvent(3, "nan", 3),
    ]
    # Default: the last rank acts.
    assert [d.acting_rank(world=4) for d in events] == [3, 0, 3, 3]


@pytest.mark.parametrize("spec", [
    "kill-worker", "kill-worker@0", "explode@2", "nan@2:3", "kill-histogram@2",
    "kill-worker@2:3:checkpoint", "kill-worker@2:soon",
])
def test_bad_specs_are_config_errors_that_name_the_event(spec):
    with pytest.raises(ConfigError, match="chaos event"):
        TrainConfig.from_dict({"chaos": spec})


def test_each_event_fires_once_and_a_commit_wait_reads_last_checkpoint(tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr("raysb.distributed.chaos.os._exit", lambda status: fired.append("kill"))
    runner = ChaosRunner("kill-worker@2:3:rank0,kill-worker@3:0:rank0:committed", str(tmp_path), 0, 2, 1,
                         fired.append)
    runner.before_round(2, 2, 10)
    assert fired == []
    runner.before_round(2, 3, 10)
    runner.before_round(2, 3, 10)  # a restarted group meets it again
    assert fired.count("kill") == 1 and ChaosEvent(0, "kill-worker", 2).marker(tmp_path).exists()
    assert committed_epoch(tmp_path) == 0
    (tmp_path / "last_checkpoint.json").write_text(json.dumps({"epoch": 2, "path": "x"}))
    runner.before_round(3, 0, 10)  # epoch 2's checkpoint is committed
    assert fired.count("kill") == 2


def test_soak_draws_faults_at_distinct_points_that_parse():
    import random

    from raysb.bench.soak import _draw_faults, _point
    from raysb.config import TrainConfig

    config = TrainConfig.from_dict(dict(strategy="sb", epochs=2, batch_size=32, workers=2))
    draw = random.Random(0)
    for _ in range(50):
        faults = _draw_faults(draw, config, 4)
        points = [_point(fault) for fault in faults]
        assert len(set(points)) == 4
        assert all(1 <= epoch <= 2 for epoch, _, _ in points)
