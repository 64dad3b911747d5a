"""`dspark bench trace`'s bookkeeping: the interleaved order of the builds and the table's medians
and ratios against the build without probes."""
from __future__ import annotations

from dspark.bench.trace_overhead import BUILDS, LABELS, order, rows_of


def test_each_round_runs_every_build_once_and_the_first_turns():
    rounds = [order(r) for r in range(6)]
    assert all(sorted(r) == sorted(BUILDS) for r in rounds)
    assert [r[0] for r in rounds[:3]] == ["A", "B", "C"] and rounds[3] == rounds[0]


def test_the_rows_hold_medians_and_their_ratio_to_a():
    rows = rows_of("decode spec_lm", "tokens/s", {"A": [100.0, 90.0, 110.0], "B": [99.0, 98.0, 130.0],
                                                  "C": [95.0, 10.0, 96.0]})
    by_build = {row["build"]: row for row in rows}
    assert by_build[LABELS["A"]]["value"] == 100.0 and by_build[LABELS["A"]]["x_a"] == 1.0
    assert by_build[LABELS["B"]]["x_a"] == 0.99
    assert by_build[LABELS["C"]]["value"] == 95.0 and by_build[LABELS["C"]]["runs"] == 3
    assert by_build[LABELS["C"]]["samples"] == [95.0, 10.0, 96.0]
