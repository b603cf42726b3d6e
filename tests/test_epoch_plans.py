"""Epochs decided whole as they start (raysb.training.selection.rounds.WholeEpoch):
where they run, that they keep what the rounds keep, in full batches, losing no example, and that
lockstep ranks take the same steps and stop at the same one."""

import sys

import pytest
import torch
from test_data import make_dataset
from test_host_syncs import engine_config
from test_lockstep import run_ranks

from raysb.core.batch_former import Batch
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine
from raysb.training.selection.sources import WholeEpoch

EXAMPLES = 320
B = 16


def engine_for(strategy: str, plan_epochs: bool = True, shard=None, collective=None, **overrides):
    torch.manual_seed(0)
    config = engine_config(strategy, workers=None if collective is None else collective.world_size,
                           kept_per_chunk="random", **overrides)
    engine = build_engine(config.settings(), shard or MemoryShard(make_dataset(n=EXAMPLES, num_classes=4)), torch.device("cpu"),
                          collective=collective)
    engine.plan_epochs = plan_epochs
    return engine


def trained(engine, epochs: int, should_stop=None) -> dict:
    """Each epoch's trained ids (a tensor a step), and whether it was planned."""
    steps, planned = [], []
    step, epoch_of = engine.train_step, engine.rounds.epoch

    def recorded_step(batch):
        steps[-1].append(batch.sample_ids.clone())
        step(batch)

    def marked(epoch, source, *args, **kwargs):
        planned[-1] = isinstance(source, WholeEpoch)
        return epoch_of(epoch, source, *args, **kwargs)

    engine.train_step, engine.rounds.epoch = recorded_step, marked
    for epoch in range(epochs):
        steps.append([])
        planned.append(None)
        engine.train_epoch(epoch, should_stop)
    return {"steps": steps, "planned": planned}


@pytest.mark.parametrize("strategy, overrides, expected", [
    ("uniform", {}, [True] * 4),
    ("free-sb", {}, [True] * 4),
    ("infobatch", {"epochs": 8}, [True] * 4),  # its first epoch keeps everything, never scored
    ("stale-sb", {"staleness": 2}, [False, True, False, True]),  # passes score with a forward
    ("free-sb", {"score_refresh_epochs": 1}, [False] * 4),  # a refresh scores with a forward
    ("sb", {}, [False] * 4),
    ("traditional", {}, [True] * 4),
])
def test_an_epoch_is_planned_exactly_where_nothing_needs_a_forward_of_its_own(strategy, overrides, expected):
    assert trained(engine_for(strategy, **overrides), 4)["planned"] == expected


def test_a_planned_uniform_epoch_trains_the_ids_its_rounds_train_in_full_batches():
    planned, rounds = (trained(engine_for("uniform", plan_epochs=plan, selectivity=0.33), 4) for plan in (True, False))
    assert planned["planned"] == [True] * 4 and rounds["planned"] == [False] * 4
    for by_plan, by_rounds in zip(planned["steps"], rounds["steps"]):
        assert all(len(ids) == B for ids in by_plan)
        # The subset is a function of (seed, epoch): the same ids, in the same order, the same steps.
        assert torch.equal(torch.cat(by_plan), torch.cat(by_rounds))


def test_a_planned_epoch_steps_with_the_lr_its_rounds_give_where_they_keep_the_same_examples():
    # uniform keeps the same ids in the same order planned or chunk by chunk (above). The lr a step
    # sees follows the examples its steps reach: the same at every step, however the epoch was decided
    # (a proportional estimate drifted up to 2.2% from it). An epoch-keyed cosine, moving every step.
    lrs = {}
    for plan in (True, False):
        engine = engine_for("uniform", plan_epochs=plan, selectivity=0.33, epochs=4, lr_schedule="cosine")
        seen, step = [], engine.train_step

        def recorded_step(batch, engine=engine, seen=seen, step=step):
            seen.append(engine.schedule.lr())
            step(batch)

        engine.train_step = recorded_step
        for epoch in range(4):
            engine.train_epoch(epoch)
        lrs[plan] = seen
    assert len(lrs[True]) == len(lrs[False]) > 4 * (EXAMPLES // 3 // B) - 4
    assert lrs[True] == lrs[False]
    assert len(set(lrs[True])) > 8  # it moves within epochs, not once an epoch


@pytest.mark.parametrize("plan_epochs", [True, False], ids=["planned", "rounds"])
@pytest.mark.parametrize("schedule_key", ["epoch", "backprop"])
def test_two_ranks_at_one_processs_global_batch_step_with_its_lr_warmup_included(schedule_key, plan_epochs):
    """Two lockstep ranks at b = 8 take the steps one process takes at b = 16, each at the lr one process
    steps with, an epoch decided as it starts or round by round. Two bugs this caught: the warmup and a
    backprop-keyed schedule counted a rank's own trained examples against the whole training set (2
    workers warmed up twice as slowly, 4 workers' lr stood at a quarter of one process's through their
    first epochs); and on lockstep ranks a planned epoch's epoch-keyed lr stood still through the epoch
    (its progress was measured in a chunk's examples instead of the epoch's), so a 3-epoch run's last
    epoch trained at 0.23 of the peak lr where one process decays to 0."""
    settings = dict(epochs=3, lr_warmup_epochs=1.0, lr_schedule="cosine", lr_schedule_key=schedule_key,
                    plan_epochs=plan_epochs)

    def lrs_of(engine) -> list[float]:
        seen, step = [], engine.train_step

        def recorded_step(batch):
            seen.append(engine.schedule.lr())
            step(batch)

        engine.train_step = recorded_step
        for epoch in range(3):
            engine.train_epoch(epoch)
        return seen

    alone = lrs_of(engine_for("traditional", batch_size=16, **settings))

    def rank_body(collective):
        shard = MemoryShard(make_dataset(n=EXAMPLES, num_classes=4), lambda order: order[collective.rank::2])
        return lrs_of(engine_for("traditional", shard=shard, collective=collective, batch_size=8, **settings))

    together = run_ranks(2, rank_body)
    assert len(alone) == 3 * EXAMPLES // 16 and together[0] == together[1]
    assert together[0] == pytest.approx(alone, rel=1e-6)


@pytest.mark.parametrize("strategy", ["free-sb", "infobatch", "stale-sb"])
def test_a_planned_epoch_keeps_the_share_its_rounds_keep_and_loses_no_example(strategy):
    overrides = {"staleness": 4} if strategy == "stale-sb" else {"epochs": 8} if strategy == "infobatch" else {}
    engines = {plan: engine_for(strategy, plan_epochs=plan, **overrides) for plan in (True, False)}
    runs = {plan: trained(engine, 4) for plan, engine in engines.items()}
    assert runs[True]["planned"][1:] == [True] * 3 and not any(runs[False]["planned"])
    for plan, engine in engines.items():
        counters = engine.counters
        # Kept = backpropagated + still queued: a plan's examples short of a batch wait for the next epoch.
        assert counters.examples_kept == counters.backprop_examples + engine.rounds.queued()
        assert all(len(ids) == B for epoch in runs[plan]["steps"] for ids in epoch)
    kept = {plan: sum(len(ids) for epoch in run["steps"][1:] for ids in epoch) for plan, run in runs.items()}
    # 960 decisions: independent draws put the two within a few standard deviations (about 15).
    assert abs(kept[True] - kept[False]) <= 64, kept


def test_a_stop_vote_ends_a_planned_epoch_before_the_step_it_is_cast_at_and_counts_only_what_ran():
    engine = engine_for("uniform", selectivity=0.5)
    engine.train_epoch(0)
    before = engine.counters.optimizer_steps
    stopped = engine.train_epoch(1, lambda epoch, step: step == 3)
    assert stopped and engine.counters.optimizer_steps - before == 3
    assert engine.counters.examples_kept == engine.counters.backprop_examples + engine.rounds.queued()
    assert engine.rounds.epoch_share(EXAMPLES, 1) == pytest.approx(3 / (EXAMPLES // 2 // B))


@pytest.mark.parametrize("strategy", ["uniform", "free-sb", "infobatch"])
def test_lockstep_ranks_plan_their_shards_take_equal_steps_and_stop_together(strategy):
    world = 2

    def rank(collective):
        data = make_dataset(n=EXAMPLES, num_classes=4)
        engine = engine_for(strategy, shard=MemoryShard(data, lambda order: order[collective.rank::world]),
                            collective=collective, epochs=8)
        # Only rank 0's vote counts: rank 1 votes to stop at once and is outvoted.
        vote = (lambda epoch, step: epoch == 3 and step == 2) if collective.rank == 0 else (lambda epoch, step: True)
        run = trained(engine, 4, vote)
        return run, engine.rounds.stop_requested, engine.counters, engine.rounds.queued(), engine.strategy.loss_table()

    results = run_ranks(world, rank)
    (first, stop_0, counters_0, queued_0, table_0), (second, stop_1, counters_1, queued_1, table_1) = results
    assert first["planned"] == second["planned"] and first["planned"][1:] == [True] * 3
    assert [len(epoch) for epoch in first["steps"]] == [len(epoch) for epoch in second["steps"]]
    assert stop_0 and stop_1 and len(first["steps"][3]) == 2
    # Ranks train different examples and hold one queue; each example a step trained is on one rank only.
    for mine, theirs in zip(first["steps"][1], second["steps"][1]):
        assert not set(mine.tolist()) & set(theirs.tolist())
    assert queued_0 == queued_1
    kept = counters_0.examples_kept + counters_1.examples_kept
    assert kept == counters_0.backprop_examples + counters_1.backprop_examples + queued_0
    if table_0 is not None:
        # Every rank's recorded losses reached every rank by the epoch's end.
        assert torch.equal(table_0.losses, table_1.losses)


# -- a sharded loss table ----------------------------------------------------------------------------
def sharded_ranks(strategy: str, trained_epochs: int, world: int = 2, **overrides):
    """Each thread-rank's engine after `trained_epochs` epochs, its loss table sharded, and what it trained."""

    def rank(collective):
        data = make_dataset(n=EXAMPLES, num_classes=4)
        engine = engine_for(strategy, shard=MemoryShard(data, lambda order: order[collective.rank::world]),
                            collective=collective, loss_table="sharded", **overrides)
        return engine, trained(engine, trained_epochs)

    return run_ranks(world, rank)


def test_sharded_ranks_each_hold_and_decide_their_own_examples_against_the_whole_sets_scores():
    # Doubt off: these random images' labels cannot be learnt, so `auto` doubts most of them once the
    # ranks train at one process's lr (by the fourth epoch), and a doubted score leaves the distribution.
    (first, run_0), (second, run_1) = sharded_ranks("free-sb", 4, selectivity=0.33, label_doubt="off")
    tables = [first.strategy.loss_table(), second.strategy.loss_table()]
    # Each rank holds the examples whose id is its rank mod 2, every one recorded by now.
    for rank, table in enumerate(tables):
        assert torch.equal(table.index.ids, torch.arange(rank, EXAMPLES, 2)) and not table.losses.isnan().any()
    # The distribution each decided against is both halves', summed.
    whole = tables[0].counts + tables[1].counts
    assert torch.equal(first.strategy.scores.frozen, second.strategy.scores.frozen)
    assert first.strategy.scores.frozen.sum() == EXAMPLES
    assert run_0["planned"] == run_1["planned"] == [True] * 4
    assert [len(epoch) for epoch in run_0["steps"]] == [len(epoch) for epoch in run_1["steps"]]
    kept = sum(len(ids) for epoch in run_0["steps"][1:] + run_1["steps"][1:] for ids in epoch)
    assert abs(kept / (3 * EXAMPLES) - 0.33) < 0.05, kept
    # Nothing lost: kept = backpropagated + queued, over both ranks.
    counters = [first.counters, second.counters]
    assert sum(c.examples_kept for c in counters) == sum(c.backprop_examples for c in counters) + first.rounds.queued()
    assert whole.sum() == EXAMPLES


def test_a_sharded_infobatch_prunes_below_the_whole_sets_mean():
    (first, _), (second, _) = sharded_ranks("infobatch", 3, epochs=8)
    tables = [first.strategy.loss_table(), second.strategy.loss_table()]
    for rank, table in enumerate(tables):
        assert torch.equal(table.index.ids, torch.arange(rank, EXAMPLES, 2)) and not table.losses.isnan().any()
    # Both ranks pruned epoch 2 below one threshold: the mean of every example's score as it began,
    # summed from both halves.
    assert first.strategy._threshold == second.strategy._threshold
    total, count = tables[0].owner.part("loss_sum_and_count").tolist()
    assert count == EXAMPLES and float(first.strategy._threshold) == pytest.approx(total / count, rel=1e-6)


@pytest.mark.parametrize("overrides, refused", [
    (dict(strategy="sb"), "applies to the strategies that decide every epoch from their loss table"),
    (dict(strategy="free-sb", workers=None), "set workers"),
    (dict(strategy="free-sb", plan_epochs=False), "which plan_epochs=false does not"),
    (dict(strategy="free-sb", score_refresh_epochs=2), "which score_refresh_epochs does not"),
])
def test_a_sharded_table_is_refused_where_an_epoch_would_look_up_anothers_examples(overrides, refused):
    from raysb.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=refused):
        TrainConfig(**{"workers": 2, "loss_table": "sharded", **overrides})


def batch_route(strategy: str) -> dict[str, set[str]]:
    """The raysb functions a batch is handed to in an epoch of `strategy` (its second), from the
    batch the context loads to the step that trains on it, by file; Batch's and the queue's own
    helpers (raysb/core/batch_former.py) aside."""
    engine = engine_for(strategy)
    engine.train_epoch(0)
    route: dict[str, set[str]] = {}

    def handed_a_batch(frame, event, arg):
        code = frame.f_code
        if event != "call" or "/raysb/" not in code.co_filename or code.co_filename.endswith("batch_former.py"):
            return
        arguments = [frame.f_locals.get(name) for name in code.co_varnames[:code.co_argcount]]
        if any(isinstance(argument, Batch) for argument in arguments):
            route.setdefault(code.co_filename.split("/raysb/")[1], set()).add(code.co_qualname)

    sys.setprofile(handed_a_batch)
    try:
        engine.train_epoch(1)
    finally:
        sys.setprofile(None)
    return route


@pytest.mark.parametrize("strategy, functions, files", [("sb", 12, 8), ("free-sb", 8, 6)])
def test_a_batch_passes_few_functions_in_few_files_from_loading_to_its_step(strategy, functions, files):
    # docs/concepts/architecture.md: the route of a batch. The strategy decides on ids and scores and never
    # sees a batch; the rounds load, score, take the kept rows and queue them; the engine trains. Each file
    # on it is one part: the round's source (its selection forward), the feed's score, the exchange, the
    # engine, its step, the rounds' loss, their loss reads, the strategy's look at the training losses.
    route = batch_route(strategy)
    assert sum(len(names) for names in route.values()) <= functions, route
    assert len(route) <= files, route
    assert not any(file.startswith("training/selection/strategies/") and file != "training/selection/strategies/base.py"
                   for file in route), route
