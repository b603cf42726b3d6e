"""The benchmark's side-by-side modes on a tiny real Fashion-MNIST subset."""

import pytest

from raysb.bench import compare_config_variants, cost_model_ratio
from conftest import needs_fashion_mnist


def test_cost_model_ratios_follow_the_guide():
    costs = {"F": 1.0, "B": 2.0, "F_sel": 1.0}
    assert cost_model_ratio("traditional", costs, 1 / 3, 1) == 1.0
    assert cost_model_ratio("sb", costs, 1 / 3, 1) == pytest.approx(2 / 3)  # (1 + 1) / 3: at most 1.5x
    assert cost_model_ratio("stale-sb", costs, 1 / 3, 3) == pytest.approx(4 / 9)  # (1/3 + 1) / 3: 2.25x


@needs_fashion_mnist
def test_config_variants_run_each_override_set_and_count_rounds(tmp_path):
    base = dict(dataset="fashion-mnist", subset=1024, test_subset=200, epochs=1, batch_size=64,
                strategy="sb", model_options={"width": 4}, record_analysis=False)
    lines = compare_config_variants(base, ["selection_batch_size=64", "selection_batch_size=256,history_size=2048"],
                                    tmp_path)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[0] for row in rows] == ["selection_batch_size=64", "selection_batch_size=256,history_size=2048"]
    assert [row[6] for row in rows] == ["16", "4"]  # selection rounds: 1024 examples / selection batch
    assert rows[0][4] == "1.00"  # epoch ratios are relative to the first variant
    assert (tmp_path / "selection_batch_size-256_history_size-2048" / "summary.json").is_file()
