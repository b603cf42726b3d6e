import pytest
import torch

from raysb.core.batch_former import Batch, BatchFormer


def chunk(ids: list[int]) -> Batch:
    ids_t = torch.tensor(ids, dtype=torch.int64)
    return Batch(ids_t, {"inputs": ids_t.float().unsqueeze(1), "labels": ids_t % 10})


def test_batches_are_exactly_b_and_no_example_is_lost_or_repeated():
    generator = torch.Generator().manual_seed(0)
    former = BatchFormer(batch_size=7)
    added, emitted, next_id = [], [], 0
    for _ in range(50):
        size = int(torch.randint(0, 20, (1,), generator=generator))
        ids = list(range(next_id, next_id + size))
        next_id += size
        added.extend(ids)
        former.add(chunk(ids))
        while former.full_batches():
            batch = former.pop()
            assert len(batch) == 7
            # inputs and labels travel with their ids
            assert torch.equal(batch["inputs"].squeeze(1).long(), batch.sample_ids)
            assert torch.equal(batch["labels"], batch.sample_ids % 10)
            emitted.extend(batch.sample_ids.tolist())
    remainder = former.drain()
    assert len(former) == 0
    leftover = remainder.sample_ids.tolist() if remainder is not None else []
    assert len(leftover) < 7
    assert emitted + leftover == added  # FIFO: nothing dropped, duplicated or reordered


def test_pop_refuses_a_partial_batch():
    former = BatchFormer(batch_size=4)
    former.add(chunk([1, 2, 3]))
    assert former.full_batches() == 0
    with pytest.raises(IndexError, match="only 3 examples queued"):
        former.pop()


def test_weights_default_to_one_when_mixed():
    former = BatchFormer(batch_size=4)
    former.add(chunk([1, 2]))
    weighted = chunk([3, 4])
    weighted.weights = torch.tensor([0.5, 2.0])
    former.add(weighted)
    assert former.pop().weights.tolist() == [1.0, 1.0, 0.5, 2.0]


def test_keep_probabilities_travel_with_their_examples_and_unselected_ones_are_nan():
    former = BatchFormer(batch_size=3)
    former.add(chunk([1, 2]))  # e.g. the remainder of a plain-SGD epoch
    selected = chunk([3, 4, 5])
    selected.keep_probabilities = torch.tensor([0.5, 0.25, 1.0])
    former.add(selected)
    first, rest = former.pop(), former.drain()
    assert first.sample_ids.tolist() == [1, 2, 3]
    assert first.keep_probabilities[:2].isnan().all() and first.keep_probabilities[2] == 0.5
    assert rest.keep_probabilities.tolist() == [0.25, 1.0]


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="batch size must be >= 1"):
        BatchFormer(0)
