"""SelectiveBackprop in a user's own loop: their model, loss and columns, in one process and on
thread-simulated ranks (tests/test_user_loop_ray.py runs it on 2 Ray Train gloo workers)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from raysb import BadBatchError, NonFiniteLossError, SelectiveBackprop
from raysb.core.keep_rule import LossHistory

from conftest import needs_fashion_mnist
from test_lockstep import run_ranks

pytestmark = needs_fashion_mnist

ROWS = 1200


@pytest.fixture(scope="module")
def table():
    """Real data as a user's table: Fashion-MNIST pooled to 49 features, a label, a row id."""
    from raysb.data import load_dataset

    data = load_dataset("fashion-mnist", "train")
    pixels = F.avg_pool2d(data.images[:ROWS].float() / 255, 4).flatten(1)
    return {"pixels": pixels, "label": data.labels[:ROWS], "row": torch.arange(ROWS)}


def smoothed_ce(model, batch):
    return F.cross_entropy(model(batch["pixels"]), batch["label"], reduction="none", label_smoothing=0.1)


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(49, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def dict_batches(table, epoch, size=50, rows=None):
    """One epoch of the user's data as dict batches, in an order fixed by the epoch."""
    rows = torch.arange(ROWS) if rows is None else rows
    order = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(epoch))]
    return [{name: column[part] for name, column in table.items()} for part in order.split(size)]


def train_epochs(sb, model, optimizer, table, epochs, first=0, check=None):
    trained = []
    for epoch in range(first, first + epochs):
        for batch in sb.batches(model, dict_batches(table, epoch)):
            assert len(batch) == sb.batch_size
            if check is not None:
                check(batch)
            loss = sb.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            trained.extend(batch["row"].tolist())
    return trained


def columns_match_their_rows(table):
    def check(batch):
        for name in ("pixels", "label"):
            assert torch.equal(batch[name], table[name][batch["row"]]), name

    return check


def test_selection_keeps_the_selectivity_asked_for_while_losses_do_not_trend(table):
    # While a model trains, each step lowers the losses scored next, so fresh losses rank
    # below the history and fewer are kept (0.156 here at lr 0.1; a plain loop of the
    # authors' algorithm keeps 0.153). With the weights fixed, CDF_R ranks are uniform.
    model = mlp()
    sb = SelectiveBackprop(smoothed_ce, batch_size=32, selectivity=0.25)
    train_epochs(sb, model, torch.optim.SGD(model.parameters(), lr=0.0), table, 3)
    assert sb.metrics()["kept_fraction"] == pytest.approx(0.25, abs=0.02)


def test_sb_in_a_plain_loop_trains_on_full_batches_of_the_users_columns_and_loses_nothing(table):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sb = SelectiveBackprop(smoothed_ce, batch_size=32, selectivity=0.25)
    trained = train_epochs(sb, model, optimizer, table, 3, check=columns_match_their_rows(table))
    metrics = sb.metrics()
    assert metrics["examples_considered"] == metrics["selection_forward_examples"] == 3 * ROWS
    # No kept example is lost: each is trained on once, or still waits for a full batch.
    assert metrics["examples_kept"] == metrics["backprop_examples"] + metrics["unused_kept_examples"]
    assert metrics["backprop_examples"] == len(trained) == 32 * metrics["optimizer_steps"]
    assert metrics["time_selection_s"] > 0 and metrics["time_train_forward_s"] > 0
    # Selection keeps the hard examples: the kept ones' loss under the final model is above the mean.
    with torch.no_grad():
        losses = smoothed_ce(model, table)
    last_epoch = torch.tensor(trained[-metrics["epoch_steps"] * 32 :])
    assert losses[last_epoch].mean() > losses.mean()


def test_tuple_batches_of_a_dataloader_are_named_by_position(table):
    loader = DataLoader(TensorDataset(table["pixels"], table["label"]), batch_size=40, shuffle=True)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sb = SelectiveBackprop(smoothed_ce, batch_size=16, selectivity=0.5, columns=["pixels", "label"])
    steps = 0
    for batch in sb.batches(model, loader):
        assert sorted(batch.keys()) == ["label", "pixels"] and len(batch) == 16
        loss = sb.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    assert steps == sb.metrics()["optimizer_steps"] > 0


def test_stale_sb_needs_an_id_column_and_scores_only_in_its_selection_epochs(table):
    with pytest.raises(ValueError, match="id_column"):
        SelectiveBackprop(smoothed_ce, batch_size=32, strategy="stale-sb", staleness=2)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sb = SelectiveBackprop(smoothed_ce, batch_size=32, strategy="stale-sb", staleness=2, id_column="row")
    scored = []
    for epoch in range(3):
        train_epochs(sb, model, optimizer, table, 1, first=epoch)
        scored.append(sb.metrics()["selection_forward_examples"])
    assert scored == [ROWS, ROWS, 2 * ROWS]
    assert sb.metrics()["examples_kept"] == sb.metrics()["backprop_examples"] + sb.metrics()["unused_kept_examples"]


def test_free_sb_in_a_plain_loop_scores_nothing_and_keeps_s_of_each_later_epoch(table):
    with pytest.raises(ValueError, match="id_column"):
        SelectiveBackprop(smoothed_ce, batch_size=32, strategy="free-sb")
    with pytest.raises(ValueError, match="raysb train --strategy infobatch"):
        SelectiveBackprop(smoothed_ce, batch_size=32, strategy="infobatch", id_column="row")
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sb = SelectiveBackprop(smoothed_ce, batch_size=32, strategy="free-sb", selectivity=1 / 3, id_column="row")
    kept = []
    for epoch in range(3):
        train_epochs(sb, model, optimizer, table, 1, first=epoch, check=columns_match_their_rows(table))
        kept.append(sb.metrics()["kept_fraction"])
    assert kept[0] == 1.0  # nothing trained on yet: every example is kept
    assert all(abs(fraction - 1 / 3) < 0.04 for fraction in kept[1:]), kept
    assert sb.metrics()["selection_forward_examples"] == 0


def test_a_scoring_function_of_its_own_decides_what_is_kept(table):
    # Scores that rank examples by row id: selection must keep the high rows, whatever their loss.
    by_row = lambda model, batch: batch["row"].float()  # noqa: E731
    model = mlp()
    sb = SelectiveBackprop(smoothed_ce, batch_size=16, beta=3.0, score_fn=by_row)
    trained = train_epochs(sb, model, torch.optim.SGD(model.parameters(), lr=0.1), table, 1)
    assert sum(trained) / len(trained) > 0.7 * ROWS


def test_kath18_trains_one_batch_per_presample(table):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sb = SelectiveBackprop(smoothed_ce, batch_size=16, selectivity=0.5, strategy="kath18")
    assert sb.chunk_size == 32
    train_epochs(sb, model, optimizer, table, 1)
    assert sb.metrics()["optimizer_steps"] == ROWS // 32 + 1


def nan_model(model, batch):
    return model(batch["pixels"]).sum(1) * float("nan")


@pytest.mark.parametrize(
    "loss_fn, batches, error, message",
    [
        (lambda model, batch: smoothed_ce(model, batch).mean(), None, BadBatchError, r"one loss per example, shape \(32,\)"),
        (smoothed_ce, lambda b: [{"pixels": c["pixels"]} for c in b], BadBatchError, "has no column 'label'"),
        (smoothed_ce, lambda b: [{**c, "label": c["label"][:-1]} for c in b], BadBatchError,
         "different lengths: pixels 50, label 49"),
        (nan_model, None, NonFiniteLossError, "selection losses are not finite at epoch 1, round 1"),
        (smoothed_ce, lambda b: [(c["pixels"], c["label"]) for c in b], BadBatchError, "give dict batches"),
        (smoothed_ce, lambda b: [{**c, "label": c["label"].tolist()} for c in b], BadBatchError,
         "'label' of batch 1 is a list, not a tensor"),
        (smoothed_ce, lambda b: b[:2] + [{**b[2], "label": b[2]["label"].float()}], BadBatchError,
         "batch 3 has columns .*label: float32"),
    ],
    ids=["scalar-loss", "missing-column", "unequal-lengths", "nan", "not-a-dict", "not-a-tensor", "dtype-changed"],
)
def test_bad_input_is_a_clear_error(request, table, loss_fn, batches, error, message):
    batches = batches or (lambda b: b)
    named = ["pixels", "label"] if request.node.callspec.id == "missing-column" else None
    sb = SelectiveBackprop(loss_fn, batch_size=32, columns=named)
    model = mlp()
    with pytest.raises(error, match=message):
        for batch in sb.batches(model, batches(dict_batches(table, 0))):
            sb.loss(model, batch).backward()


def test_a_loss_that_fails_in_training_is_a_clear_error(table):
    scored = []

    def fails_with_grad(model, batch):
        if torch.is_grad_enabled():
            raise KeyError("logits")
        scored.append(len(batch))
        return smoothed_ce(model, batch)

    sb = SelectiveBackprop(fails_with_grad, batch_size=8)
    model = mlp()
    with pytest.raises(BadBatchError, match="loss_fn raised KeyError in training: 'logits'"):
        for batch in sb.batches(model, dict_batches(table, 0)):
            sb.loss(model, batch)
    assert scored  # it scored before it trained


@pytest.mark.parametrize("strategy", ["sb", "stale-sb"])
def test_state_dict_resumes_exactly_in_one_process(table, tmp_path, strategy):
    def fresh():
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sb = SelectiveBackprop(smoothed_ce, batch_size=24, selectivity=0.33, strategy=strategy,
                               staleness=2 if strategy == "stale-sb" else None, id_column="row",
                               selection_batch_size=100)
        return model, optimizer, sb

    straight_model, optimizer, sb = fresh()
    straight = train_epochs(sb, straight_model, optimizer, table, 3)
    straight_metrics = sb.metrics()

    model, optimizer, sb = fresh()
    first = train_epochs(sb, model, optimizer, table, 2)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sb": sb.state_dict()},
               tmp_path / "checkpoint.pt")
    running = sb.batches(model, dict_batches(table, 2))
    next(running)
    with pytest.raises(RuntimeError, match="between epochs"):
        sb.state_dict()
    running.close()

    model, optimizer, sb = fresh()
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sb.load_state_dict(state["sb"])
    resumed = train_epochs(sb, model, optimizer, table, 1, first=2)
    assert first + resumed == straight
    for a, b in zip(model.parameters(), straight_model.parameters()):
        assert torch.equal(a, b)
    counts = ("examples_kept", "backprop_examples", "selection_forward_examples", "optimizer_steps")
    assert {k: sb.metrics()[k] for k in counts} == {k: straight_metrics[k] for k in counts}


def thread_rank_run(collective, table, bad_rank=None, ids_only=False):
    """A user's loop on one thread-simulated rank: rank r holds rows r::2, rank 0 a third more.
    `ids_only`: every rank holds the whole table, so kept examples cross ranks as ids."""
    rank = collective.rank
    rows = torch.arange(rank, ROWS, 2)
    rows = rows if rank == 0 else rows[: len(rows) * 3 // 4]
    extra = {
        "pixels": table["pixels"], "label": table["label"], "row": table["row"],
        "weights": table["row"].to(torch.float16) / 7,
        "mask": torch.stack([table["row"] % 2 == 0, table["row"] % 3 == 0], 1),
        "tokens": torch.stack([table["row"], -table["row"]], 1).to(torch.int32),
    }
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(model, batch):
        losses = smoothed_ce(model, batch)
        return losses * float("nan") if rank == bad_rank else losses

    # No history given: ranks of a world > 1 share one CDF_R, merged in every round's exchange.
    sb = SelectiveBackprop(loss_fn, batch_size=16, selectivity=0.33, collective=collective, id_column="row",
                           table=extra if ids_only else None)
    trained, steps = [], []
    for epoch in range(2):
        for batch in sb.batches(model, dict_batches(extra, epoch, size=37, rows=rows)):
            for name, column in extra.items():
                assert torch.equal(batch[name], column[batch["row"]]), name
            loss = sb.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            trained.extend(batch["row"].tolist())
        steps.append(sb.metrics()["optimizer_steps"])
    return trained, steps, sb.metrics(), sb.rounds.strategy.selector.history


@pytest.mark.parametrize("ids_only", [False, True], ids=["columns-travel", "ids-travel"])
def test_ranks_with_unequal_data_take_equal_steps_and_every_kept_example_arrives_whole(table, ids_only):
    results = run_ranks(2, lambda collective: thread_rank_run(collective, table, ids_only=ids_only))
    (trained_0, steps_0, metrics_0, cdf_0), (trained_1, steps_1, metrics_1, cdf_1) = results
    assert steps_0 == steps_1 and steps_0[-1] > 0
    assert len(cdf_0) > 0 and cdf_0.checksum() == cdf_1.checksum(), "both ranks rank against one CDF_R"
    assert len(trained_0) == len(trained_1) == 16 * steps_0[-1]
    kept = metrics_0["examples_kept"] + metrics_1["examples_kept"]
    # The queue left over is the same on every rank: count it once.
    assert kept == len(trained_0) + len(trained_1) + metrics_0["unused_kept_examples"]
    assert metrics_0["unused_kept_examples"] == metrics_1["unused_kept_examples"] < 2 * 16
    # Rank 0 holds a third more examples: once rank 1's run out, rank 0's kept ones cross, so rank 1
    # trains some of rank 0's (even) rows. How many each rank keeps is not compared: each thread's
    # model starts from draws of the one RNG both threads share, in whichever order they run
    # (rank 1 kept 321 to rank 0's 249 once).
    assert any(row % 2 == 0 for row in trained_1)
    # Ids, weights and keep probabilities (40 bytes an example) or every column of the kept examples.
    per_step = metrics_0["lockstep_exchange_kb_per_step"]
    assert per_step < 2.5 if ids_only else per_step > 6.0
    assert metrics_0["histogram_kb_per_step"] > 0 and metrics_0["histogram_merge_ms_per_step"] >= 0
    # At s = 0.33 ranks exchange every 3 chunks of 16 (about a batch kept a rank), at the same
    # rounds: rank 0's chunks set the epoch's rounds, rounded up to a whole exchange.
    rounds_per_epoch = math.ceil(len(range(0, ROWS, 2)) / 16)
    assert metrics_0["lockstep_rounds"] == metrics_1["lockstep_rounds"] == 2 * math.ceil(rounds_per_epoch / 3)


def test_free_sb_on_ranks_shares_every_ranks_training_losses(table):
    """Each rank records the training losses of the examples it trained on; the exchange carries them,
    so both ranks hold one table of every example's last training loss, and rank 0 ranks scores of
    examples rank 1 trained on."""
    def rank_body(collective):
        model, part = mlp(), torch.arange(collective.rank, ROWS, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sb = SelectiveBackprop(smoothed_ce, batch_size=16, selectivity=0.33, collective=collective, id_column="row",
                               strategy="free-sb", table=table)
        kept = []
        for epoch in range(3):
            for batch in sb.batches(model, dict_batches(table, epoch, size=40, rows=part)):
                loss = sb.loss(model, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            kept.append(sb.metrics()["kept_fraction"])
        return kept, sb.rounds.strategy.loss_table(), sb.metrics()

    (kept_0, table_0, metrics_0), (kept_1, table_1, metrics_1) = run_ranks(2, rank_body)
    assert table_0.checksum() == table_1.checksum()
    recorded = ~torch.isnan(table_0.lookup(torch.arange(ROWS)))
    assert bool(recorded.all())  # every example trained in the first epoch, on whichever rank
    assert kept_0[0] == kept_1[0] == 1.0 and all(abs(k - 0.33) < 0.08 for k in kept_0[1:] + kept_1[1:])
    assert metrics_0["selection_forward_examples"] == metrics_1["selection_forward_examples"] == 0


def test_a_table_that_does_not_hold_the_batches_ids_is_a_clear_error(table):
    model = mlp()
    sb = SelectiveBackprop(smoothed_ce, batch_size=16, id_column="row", table={k: v[:100] for k, v in table.items()})
    with pytest.raises(BadBatchError, match="the table has rows 0 to 99"):
        for _ in sb.batches(model, dict_batches(table, 0, size=37)):
            pass
    with pytest.raises(ValueError, match="name the id column"):
        SelectiveBackprop(smoothed_ce, batch_size=16, table=table)


def test_a_nan_on_one_rank_stops_every_rank_with_the_error(table):
    def rank_body(collective):
        try:
            thread_rank_run(collective, table, bad_rank=1)
        except NonFiniteLossError as error:
            return str(error)

    messages = run_ranks(2, rank_body)
    assert messages[0].startswith("rank 1 stopped the run: ") and "selection losses are not finite" in messages[0]
    assert messages[0].endswith(messages[1])


def test_a_batch_missing_a_column_on_one_rank_stops_every_rank_in_the_same_round(table):
    def rank_body(collective):
        model = mlp()
        sb = SelectiveBackprop(smoothed_ce, batch_size=16, collective=collective, history=LossHistory(1024),
                               columns=["pixels", "label"])
        batches = dict_batches(table, 0, size=40)
        if collective.rank == 1:  # rank 1's third batch lost its labels
            batches[2] = {"pixels": batches[2]["pixels"]}
        steps = 0
        try:
            for batch in sb.batches(model, batches):
                sb.loss(model, batch).backward()
                steps += 1
        except BadBatchError as error:
            return str(error), steps, sb.metrics()["selection_forward_examples"], sb.rounds.exchange.rounds

    (message_0, steps_0, scored_0, exchanges_0), (message_1, steps_1, scored_1, exchanges_1) = run_ranks(2, rank_body)
    assert message_1 == "epoch 1: batch 3 has no column 'label' (it has: pixels)"
    assert message_0 == "rank 1 stopped the run: " + message_1
    # Both stopped at the exchange after that batch, with the same steps; rank 1 scored nothing
    # after it, rank 0 at most the rest of that exchange's rounds (3 chunks of 16 an exchange here).
    assert exchanges_0 == exchanges_1 and steps_0 == steps_1
    assert 16 <= scored_0 - scored_1 <= 3 * 16


def test_loss_on_a_batch_the_data_gave_says_which_batches_it_takes(table):
    sb = SelectiveBackprop(smoothed_ce, batch_size=16)
    with pytest.raises(TypeError, match="sb.loss takes the batches sb.batches"):
        sb.loss(mlp(), {"pixels": table["pixels"][:16], "label": table["label"][:16]})


def test_selection_schedules_of_your_own_with_unbiased_weights_set_each_epochs_fraction_and_resume_exactly(
        table, tmp_path):
    from raysb import scheduled_selectivity, scheduled_strength

    epochs = 4
    share = [0.5 * (1 + math.cos(math.pi * epoch / epochs)) for epoch in range(epochs)]  # the user's cosine

    def fresh():
        model = mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.1), SelectiveBackprop(
            smoothed_ce, batch_size=32, strategy="free-sb", selectivity=0.25, id_column="row",
            selection_weights="unbiased")

    heaviest = {}

    def run(model, optimizer, sb, first, last):
        kept = []
        for epoch in range(first, last):
            for batch in sb.batches(model, dict_batches(table, epoch),
                                    selectivity=scheduled_selectivity("lr", 0.25, share[epoch]),
                                    selection_strength=scheduled_strength("lr", share[epoch])):
                assert epoch == 0 or batch.weights is not None  # epoch 0 keeps everything: P = 1, weight 1
                if batch.weights is not None:
                    heaviest[epoch] = max(heaviest.get(epoch, 0.0), float(batch.weights.max()))
                loss = sb.loss(model, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            kept.append(sb.metrics()["kept_fraction"])
        return kept

    model, optimizer, sb = fresh()
    kept = run(model, optimizer, sb, 0, epochs)
    expected = [scheduled_selectivity("lr", 0.25, s) for s in share]
    assert kept[0] == 1.0 and all(abs(k - s) < 0.05 for k, s in zip(kept[1:], expected[1:])), (kept, expected)
    # Epoch 2 (w = 1/2, s = 0.625): P >= (1 - w) s = 0.3125 and mean(P) <= w + 0.3125, so no weight
    # passes 2.6; at full strength the easiest examples' P = p^0.6 would weigh up to the cap, 10.
    assert 1.0 < heaviest[2] < 2.6, heaviest
    with pytest.raises(ValueError, match=r"selectivity must be in \(0, 1\]"):
        next(sb.batches(model, dict_batches(table, 0), selectivity=0))
    with pytest.raises(ValueError, match=r"selection_strength must be in \[0, 1\]"):
        next(sb.batches(model, dict_batches(table, 0), selection_strength=1.5))

    model, optimizer, sb = fresh()
    run(model, optimizer, sb, 0, 2)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sb": sb.state_dict()}
    model, optimizer, sb = fresh()
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sb.load_state_dict(state["sb"])
    assert run(model, optimizer, sb, 2, epochs) == kept[2:]
    with pytest.raises(ValueError, match="selection_weights unbiased only applies to strategy free-sb, not sb"):
        SelectiveBackprop(smoothed_ce, batch_size=32, selection_weights="unbiased")
