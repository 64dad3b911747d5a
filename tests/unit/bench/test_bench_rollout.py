"""`bench rollout`'s measures from a controller's recorded events, and its result's rows."""
from types import SimpleNamespace

import pytest

from dspark.bench.compare import compare, parse_targets
from dspark.bench.rollout import COLUMNS, METRICS, measure, summary_rows
from dspark.bench.results import BenchResult


def at(seconds: float) -> str:
    return f"2026-01-01T00:00:{seconds:06.3f}+00:00"


def recorded(outcome: str, events: list[tuple[float, str, str]], finished: float):
    """A finished rollout and its events as the state store returns them (times in seconds)."""
    rollout = SimpleNamespace(id=1, semver="1.1.0", outcome=outcome, started=at(0), finished=at(finished),
                              reason="p99 2.1x" if outcome != "promoted" else None)
    return rollout, [{"at": at(seconds), "kind": kind, "message": message} for seconds, kind, message in events]


def test_times_of_a_promoted_and_a_rolled_back_rollout():
    promoted = measure(*recorded("promoted", [
        (2.0, "route", "shadow 30%"), (3.5, "analysis", "ok"), (4.0, "route", "canary 25%"),
        (6.0, "route", "promoted: 100% on version 2")], finished=11.0))
    assert promoted["to_full_traffic_s"] == pytest.approx(6.0) and promoted["total_s"] == pytest.approx(11.0)
    rolled = measure(*recorded("rolled_back", [
        (2.0, "route", "shadow 30%"), (2.5, "analysis", "ok"), (3.0, "analysis", "breach"),
        (3.1, "rollback", "p99 2.1x"), (4.0, "analysis", "after")], finished=8.6))
    assert rolled["to_detect_s"] == pytest.approx(1.1)      # from the first route to the decision
    assert rolled["intervals_to_detect"] == 2               # analyses up to the decision only
    assert rolled["to_roll_back_s"] == pytest.approx(5.5)
    assert rolled["outcome"] == "rolled_back" and rolled["reason"] == "p99 2.1x"


def test_summary_rows_take_medians_maxima_and_the_totals_that_must_be_zero():
    rollouts = [{"kind": "good", "outcome": "promoted", "to_full_traffic_s": t, "total_s": t + 5} for t in (9.0, 10.0, 14.0)]
    rollouts += [{"kind": "slow", "outcome": "rolled_back", "to_detect_s": 1.0, "intervals_to_detect": 2,
                  "to_roll_back_s": 5.0},
                 {"kind": "error", "outcome": "promoted", "to_full_traffic_s": 8.0, "total_s": 13.0}]  # missed one
    rows = {r["measure"]: r for r in summary_rows(rollouts, client_requests=1000, failed_requests=3)}
    assert rows["to_full_traffic_s"]["median"] == pytest.approx(9.5) and rows["to_full_traffic_s"]["max"] == 14.0
    assert rows["to_full_traffic_s"]["count"] == 4 and rows["to_detect_s"]["count"] == 1
    assert rows["failed_requests"]["total"] == 3 and rows["failed_requests"]["count"] == 1000
    assert rows["not_as_injected"]["total"] == 1
    # two runs compare row by row: more failed requests is a regression
    before = BenchResult("rollout", {}, summary_rows(rollouts, 1000, 0), COLUMNS, ["measure"], METRICS)
    after = BenchResult("rollout", {}, summary_rows(rollouts, 1000, 3), COLUMNS, ["measure"], METRICS)
    verdicts = {(c.point, c.metric): c.verdict for c in compare(before, after)}
    assert verdicts[("measure=failed_requests", "total")] == "regression"
    assert verdicts[("measure=to_full_traffic_s", "median")] == "ok"
    checks = compare(after, after, parse_targets(["total<=0"]))
    assert {c.point: c.verdict for c in checks if c.target} == {"measure=failed_requests": "missed",
                                                    "measure=not_as_injected": "missed"}
    assert "failed client requests" in after.table()
