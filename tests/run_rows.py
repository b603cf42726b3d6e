"""Metrics rows compared across runs: everything but the clock."""


def untimed(rows: list[dict]) -> list[dict]:
    """`rows` without wall-clock columns (`wall_s`, `time_*_s`), which differ between any two runs."""
    return [{k: v for k, v in row.items() if not (k.startswith("time_") or k == "wall_s")} for row in rows]
