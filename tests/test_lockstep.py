"""The lockstep exchange and the shared CDF, with ranks simulated by threads."""

import threading

import pytest
import torch

from raysb.core.batch_former import Batch
from raysb.core.columns import pack_columns, schema_of
from raysb.core.errors import BadBatchError, NonFiniteLossError
from raysb.core.keep_rule import LossHistory
from raysb.training.selection.exchange import Carried, LockstepExchange, RoundPayload
from raysb.training.collective import Collective
from raysb.training.selection.loss_table import LossTable


class ThreadCollective(Collective):
    """Collectives among threads of one process, through a barrier."""

    def __init__(self, rank: int, world_size: int, shared: dict):
        self.rank, self.world_size, self.shared = rank, world_size, shared

    def all_gather(self, tensor, length_bound=None):
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = tensor.clone()
        barrier.wait()
        gathered = list(slots)
        barrier.wait()
        return gathered

    def all_true(self, flag):
        return all(bool(t[0]) for t in self.all_gather(torch.tensor([float(flag)])))

    def all_min(self, values):
        return torch.stack(self.all_gather(torch.tensor(values, dtype=torch.float64))).min(0).values.tolist()

    def all_sum(self, tensor):
        return torch.stack(self.all_gather(tensor)).sum(0)

    def all_to_all(self, parts):
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = [part.clone() for part in parts]
        barrier.wait()
        received = [sent[self.rank] for sent in slots]
        barrier.wait()
        return received

    def broadcast_object(self, value):
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = value
        barrier.wait()
        received = slots[0]
        barrier.wait()
        return received


def batch_of(ids: torch.Tensor) -> Batch:
    return Batch(ids, {"inputs": ids.float().unsqueeze(1), "labels": ids % 10})


def round_of(exchange, kept, stop_vote, error, last_chunk) -> list[Batch]:
    """One round's exchange, then the batches it made ready on this rank."""
    exchange.exchange(kept, stop_vote, error, last_chunk)
    batches = []
    while not exchange.stop_requested and exchange.step_ready():
        batches.append(exchange.next_step())
    return batches


def run_ranks(world, target):
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world)}
    results, errors = [None] * world, []

    def body(rank):
        try:
            results[rank] = target(ThreadCollective(rank, world, shared))
        except Exception as error:  # surfaced to the test below
            errors.append(error)
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    hung = any(t.is_alive() for t in threads)
    if hung:  # free the ranks waiting at the barrier, so a hang fails the test and the session ends
        shared["barrier"].abort()
    assert not hung, "a rank hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world", [3, 8])
def test_skewed_ranks_take_equal_steps_and_lose_nothing(world):
    b, rounds, chunk = 8, 40, 32
    # One busy rank, one nearly idle, the rest in between (at 8 ranks one keeps nothing, one everything).
    keep_rates = [0.9, 0.05, 0.3, 0.6, 0.0, 0.15, 1.0, 0.45][:world]

    def rank_body(collective):
        rank = collective.rank
        generator = torch.Generator().manual_seed(rank)
        exchange = LockstepExchange(collective, b, load_ids=batch_of)
        kept_ids, trained = [], []
        for round_index in range(rounds):
            ids = torch.arange(chunk) + 10_000 * rank + chunk * round_index
            keep = torch.rand(chunk, generator=generator) < keep_rates[rank]
            kept_ids.extend(ids[keep].tolist())
            for batch in round_of(exchange, batch_of(ids[keep]), False, None, False):
                assert len(batch) == b
                trained.append(batch.sample_ids.tolist())
        return kept_ids, trained, exchange.queue.columns["ids"].tolist()

    results = run_ranks(world, rank_body)
    steps = [len(trained) for _, trained, _ in results]
    assert len(set(steps)) == 1 and steps[0] > 0
    all_kept = sorted(i for kept, _, _ in results for i in kept)
    all_trained = [i for _, trained, _ in results for batch in trained for i in batch]
    remainder = results[0][2]
    assert all(r[2] == remainder for r in results), "every rank holds the same queue"
    assert len(remainder) < world * b
    assert sorted(all_trained + remainder) == all_kept  # nothing dropped, nothing twice
    # the idle rank trained on examples the busy rank kept
    assert any(i < 10_000 for batch in results[1][1] for i in batch)


def example_columns(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Columns of several dtypes and row shapes, each derived from the id, so a test can check they arrived whole."""
    return {
        "images": (ids.view(-1, 1, 1, 1) % 251).to(torch.uint8).expand(-1, 1, 2, 3).contiguous(),
        "labels": ids % 10,
        "mask": torch.stack([ids % 2 == 0, ids % 3 == 0], dim=1),
        "weight": (ids % 7).to(torch.float16) / 4,
        "tokens": torch.stack([ids, -ids, ids * 3], dim=1).to(torch.int32),
    }


def carried_batch(ids: torch.Tensor) -> Batch:
    columns = example_columns(ids)
    return Batch(ids, {"inputs": columns["images"].float(), "labels": columns["labels"]})


def test_streamed_ranks_with_unequal_chunk_counts_end_the_epoch_together():
    """Streamed shards: examples, not ids, travel; a rank out of chunks joins the remaining rounds empty."""
    world, b, chunk = 2, 4, 8
    chunks_per_rank = [6, 3]

    def load(ids, columns):
        expected = example_columns(ids)
        assert set(columns) == set(expected)
        for name, column in columns.items():
            assert column.dtype == expected[name].dtype and torch.equal(column, expected[name]), name
        return carried_batch(ids)

    def no_gathering_by_id(ids):
        raise AssertionError("a streamed rank cannot gather examples by id")

    carried = Carried(schema_of(example_columns(torch.arange(1))), lambda kept: example_columns(kept.sample_ids), load)

    def rank_body(collective):
        rank = collective.rank
        exchange = LockstepExchange(collective, b, load_ids=no_gathering_by_id, chunk_size=chunk, carried=carried)
        kept, trained, rounds = [], [], 0
        mine = [torch.arange(chunk) + 1000 * rank + chunk * i for i in range(chunks_per_rank[rank])]
        while True:
            ids = mine[rounds][: 3 + rank] if rounds < len(mine) else torch.empty(0, dtype=torch.int64)
            rounds += 1
            kept.extend(ids.tolist())
            for batch in round_of(exchange, carried_batch(ids), False, None, rounds >= len(mine)):
                trained.extend(batch.sample_ids.tolist())
            if exchange.epoch_finished:
                return kept, trained, rounds, exchange.queue.columns["ids"].tolist()

    results = run_ranks(world, rank_body)
    assert [r[2] for r in results] == [6, 6], "both ranks end the epoch on the same round"
    assert len(results[0][1]) == len(results[1][1]) > 0
    all_kept = sorted(i for r in results for i in r[0])
    assert sorted(results[0][1] + results[1][1] + results[0][3]) == all_kept


def test_keep_probabilities_reach_the_rank_that_trains_the_example():
    """Rank 1 keeps nothing and trains on what rank 0 kept; the staleness weights need each one's q."""
    world, b = 2, 4

    def rank_body(collective):
        exchange = LockstepExchange(collective, b, load_ids=batch_of)
        ids = torch.arange(2 * b) if collective.rank == 0 else torch.arange(0)
        kept = batch_of(ids)
        kept.keep_probabilities = (ids + 1).float() / 10
        return [
            (batch.sample_ids.tolist(), batch.keep_probabilities.tolist())
            for batch in round_of(exchange, kept, False, None, False)
        ]

    results = run_ranks(world, rank_body)
    assert [ids for ids, _ in results[1]] == [[4, 5, 6, 7]]
    assert results[1][0][1] == pytest.approx([0.5, 0.6, 0.7, 0.8])
    assert results[0][0][1] == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_round_payload_round_trips_examples_within_its_bound():
    ids = torch.tensor([5, 9, 2**40])
    columns = example_columns(ids)
    schema = schema_of(columns)
    payload = RoundPayload(
        kept_ids=ids, kept_weights=torch.tensor([1.0, 0.5, 2.0]),
        kept_probabilities=torch.tensor([0.25, float("nan"), 1.0]), scored_ids=torch.tensor([7]),
        scored_records=torch.tensor([[0.25], [-1.5], [3.0], [4.0]]), stop_vote=True, last_chunk=True, kept_columns=columns,
        error_code=2, error_message="batch 3 has no column 'label' — a message that travels",
    )
    packed = payload.pack(schema)
    assert packed.dtype == torch.uint8 and packed.numel() <= RoundPayload.byte_bound(3, schema)
    back = RoundPayload.unpack(packed, schema)
    assert back.kept_ids.tolist() == ids.tolist() and back.kept_weights.tolist() == [1.0, 0.5, 2.0]
    for name, column in columns.items():
        assert back.kept_columns[name].dtype == column.dtype and torch.equal(back.kept_columns[name], column), name
    assert back.kept_probabilities[[0, 2]].tolist() == [0.25, 1.0] and back.kept_probabilities[1].isnan()
    # A record's loss, margin, predicted and given label travel together.
    assert back.scored_ids.tolist() == [7] and back.scored_records.tolist() == [[0.25], [-1.5], [3.0], [4.0]]
    assert (back.stop_vote, back.last_chunk) == (True, True)
    assert (back.error_code, back.error_message) == (2, payload.error_message)
    empty = RoundPayload.unpack(RoundPayload(ids[:0], *(torch.empty(0),) * 3, torch.empty(4, 0), False, False,
                                             kept_columns={n: c[:0] for n, c in columns.items()}).pack(schema), schema)
    assert {name: tuple(c.shape) for name, c in empty.kept_columns.items()} == {
        name: (0, *shape) for name, (_, shape) in schema.items()
    }


def test_columns_that_do_not_match_the_schema_are_clear_errors():
    columns = example_columns(torch.arange(4))
    schema = schema_of(columns)
    with pytest.raises(ValueError, match="do not match the schema"):
        pack_columns({k: v for k, v in columns.items() if k != "mask"}, schema)
    with pytest.raises(ValueError, match="different numbers of rows"):
        pack_columns({**columns, "labels": columns["labels"][:3]}, schema)
    with pytest.raises(ValueError, match="'weight' is torch.float32"):
        pack_columns({**columns, "weight": columns["weight"].float()}, schema)


@pytest.mark.parametrize("world", [2, 8])
def test_stop_vote_of_rank_zero_stops_every_rank_in_the_same_round(world):
    def rank_body(collective):
        exchange = LockstepExchange(collective, 4, load_ids=batch_of)
        for round_index in range(10):
            ids = torch.arange(8) + 100 * round_index + 10_000 * collective.rank
            # only rank 0's clock counts; the others vote stop early and are ignored
            vote = round_index >= 5 if collective.rank == 0 else round_index >= 1
            list(round_of(exchange, batch_of(ids), vote, None, False))
            if exchange.stop_requested:
                return round_index
        return None

    assert run_ranks(world, rank_body) == [5] * world


@pytest.mark.parametrize("world", [2, 8])
def test_an_error_on_one_rank_stops_all_ranks_without_a_hang(world):
    def rank_body(collective):
        exchange = LockstepExchange(collective, 4, load_ids=batch_of)
        error = NonFiniteLossError("losses are NaN at epoch 1, step 3") if collective.rank == 1 else None
        try:
            list(round_of(exchange, batch_of(torch.arange(8) + 100 * collective.rank), False, error, False))
        except NonFiniteLossError as raised:
            return str(raised)

    # Every rank raises the same kind of error, with the message of the rank that hit it.
    messages = run_ranks(world, rank_body)
    assert messages[1] == "losses are NaN at epoch 1, step 3"
    assert messages[:1] + messages[2:] == ["rank 1 stopped the run: losses are NaN at epoch 1, step 3"] * (world - 1)


@pytest.mark.parametrize("world", [2, 8])
def test_a_failed_training_step_on_one_rank_raises_on_every_rank(world):
    def rank_body(collective):
        exchange = LockstepExchange(collective, 4, load_ids=batch_of)
        error = BadBatchError("loss_fn raised KeyError") if collective.rank == 0 else None
        try:
            exchange.agree(error)
        except BadBatchError as raised:
            return str(raised)

    assert run_ranks(world, rank_body) == ["loss_fn raised KeyError"] + ["rank 0 stopped the run: loss_fn raised KeyError"] * (world - 1)


@pytest.mark.parametrize("world", [2, 8])
def test_stale_losses_reach_every_rank(world):
    ids = torch.arange(40)

    def rank_body(collective):
        table = LossTable(ids, shared=True)
        exchange = LockstepExchange(collective, 4, load_ids=batch_of, loss_table=table)
        mine = ids[collective.rank :: world]
        table.record(mine, mine.float() / 10)
        table.flush()  # where the rounds read the training losses
        list(round_of(exchange, batch_of(mine[:0]), False, None, True))
        return table.lookup(ids)

    for losses in run_ranks(world, rank_body):
        assert losses.tolist() == pytest.approx((ids.float() / 10).tolist())


@pytest.mark.parametrize("world", [2, 8])
def test_a_sharded_tables_records_reach_their_owner_alone_and_the_last_rank_to_record_wins(world):
    ids = torch.arange(40)

    def rank_body(collective):
        table = LossTable(ids, shared=True)
        table.shard(collective.rank, world)
        exchange = LockstepExchange(collective, 4, load_ids=batch_of, loss_table=table)
        # Overlapping spans: most ids are recorded by two ranks, each its own loss.
        recorded = ids[(torch.arange(20) + 5 * collective.rank) % 40]
        table.record(recorded, recorded.float() / 10 + collective.rank)
        table.flush()
        list(round_of(exchange, batch_of(ids[:0]), False, None, True))
        return table.index.ids, table.lookup(table.index.ids)

    last_rank = {}
    for rank in range(world):  # applied in rank order: the last rank that recorded an id wins
        for sample_id in ((torch.arange(20) + 5 * rank) % 40).tolist():
            last_rank[sample_id] = rank
    for rank, (held, losses) in enumerate(run_ranks(world, rank_body)):
        assert torch.equal(held, ids[ids % world == rank])
        expected = [i / 10 + last_rank[i] if i in last_rank else float("nan") for i in held.tolist()]
        assert losses.tolist() == pytest.approx(expected, nan_ok=True)


def test_records_are_split_by_owner_in_record_order_and_come_back_as_they_went():
    from raysb.training.selection.loss_table import RECORD_ROWS
    from raysb.training.selection.shard_summary import records_by_owner, records_of_rows

    ids = torch.tensor([7, 2, 4, 9, 2, 12])
    records = torch.arange(RECORD_ROWS * 6, dtype=torch.float32).reshape(RECORD_ROWS, 6)
    parts = records_by_owner(ids, records, 3)
    assert [records_of_rows(part)[0].tolist() for part in parts] == [[9, 12], [7, 4], [2, 2]]
    back_ids, back_records = records_of_rows(torch.cat(parts))
    order = [3, 5, 0, 2, 1, 4]
    assert torch.equal(back_ids, ids[order]) and torch.equal(back_records, records[:, order])


@pytest.mark.parametrize("world", [2, 8])
def test_ranks_with_different_losses_share_one_percentile_function(world):
    from raysb.training.selection.merged_histogram import MergedLossHistogram

    probe = torch.linspace(0, 5, 50)
    tie_break = torch.full_like(probe, 0.5)

    def rank_body(collective):
        rank = collective.rank
        history = MergedLossHistogram(256, world_size=world, rank=rank)
        generator = torch.Generator().manual_seed(rank)
        local = LossHistory(256)
        views = []
        for _ in range(12):
            # rank 0 sees hard examples, the others easy ones
            losses = torch.rand(64, generator=generator) * (4.0 if rank == 0 else 0.5)
            history.extend(losses)
            local.extend(losses)
            history.merge(collective.all_gather(history.take_round()))  # what every round's exchange does
            views.append(history.ranks(probe, tie_break))
        return views, local.ranks(probe, tie_break), history.checksum(), len(history)

    results = run_ranks(world, rank_body)
    views0, local0, sum0, size0 = results[0]
    for views, _, checksum, size in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(views0, views)) and (checksum, size) == (sum0, size0)
    # The steps that hold R = 256: the last two of 2 ranks' 64 losses, the last of 8 ranks'.
    assert size0 == max(256, world * 64)
    assert not torch.equal(local0, results[1][1]), "private histories would disagree"


def test_the_exchange_merges_the_histogram_even_in_a_round_that_fails():
    """A rank whose round failed still sends its losses' bins, so every rank's histogram stays the same."""
    from raysb.training.selection.merged_histogram import MergedLossHistogram

    def rank_body(collective):
        history = MergedLossHistogram(64, world_size=2, rank=collective.rank)
        exchange = LockstepExchange(collective, 4, batch_of, histogram=history)
        history.extend(torch.rand(8) + collective.rank)
        error = BadBatchError("broken batch") if collective.rank == 1 else None
        with pytest.raises(BadBatchError):
            round_of(exchange, batch_of(torch.arange(0)), False, error, False)
        return len(history), history.stats()["merged_rounds"], history.checksum()

    (size0, rounds0, sum0), (size1, rounds1, sum1) = run_ranks(2, rank_body)
    assert (size0, rounds0) == (size1, rounds1) == (16, 1) and sum0 == sum1


def test_over_nccl_the_exchange_travels_on_a_gloo_group_without_touching_the_gpu(tmp_path, monkeypatch):
    """An nccl worker group's collectives carry host payloads on a gloo group of their own, so no
    exchange copies them to the GPU and back. Here a world of one, its backend reported as nccl."""
    import torch.distributed as dist

    from raysb.training.collective import TorchCollective

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        collective = TorchCollective()
        assert collective.group is not None and collective.device == torch.device("cuda", 0)
        payload = torch.arange(5, dtype=torch.float64)
        assert [t.tolist() for t in collective.all_gather(payload)] == [payload.tolist()]
        assert collective.all_true(True) and not collective.all_true(False)
        assert collective.broadcast_object({"a": 1}) == {"a": 1}
    finally:
        dist.destroy_process_group()
