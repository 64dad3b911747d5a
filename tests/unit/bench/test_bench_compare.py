"""`bench compare` on synthetic results: ratios, noise bands, targets, repeated runs, exit status."""
import json

import pytest
from click.testing import CliRunner

from dspark.bench.compare import compare, merge_runs, parse_targets
from dspark.bench.results import BenchResult, Metric
from dspark.cli.main import cli
from dspark.errors import ConfigError

METRICS = [Metric("qps", "higher"), Metric("p99_ms", "lower"), Metric("error_rate", "lower")]


def result(rows, benchmark="model") -> BenchResult:
    return BenchResult(benchmark, {"mode": "concurrency"}, rows, key_fields=["model", "level"], metrics=METRICS)


def row(level=1, qps=100.0, p99=10.0, error_rate=0.0, band=0.05, model="m"):
    return {"model": model, "level": level, "qps": qps, "p99_ms": p99, "error_rate": error_rate,
            "band": {"qps": band, "p99_ms": band}}


def verdicts(checks):
    return {(c.point, c.metric): c.verdict for c in checks}


def test_changes_inside_the_band_pass_and_outside_fail_in_the_bad_direction_only():
    base = result([row(1), row(4, qps=300, p99=20)])
    new = result([row(1, qps=104, p99=10.4), row(4, qps=240, p99=14)])  # level 4: 20% fewer req/s, p99 30% lower
    v = verdicts(compare(base, new, min_band=0.02))
    assert v[("model=m, level=1", "qps")] == "ok" and v[("model=m, level=1", "p99_ms")] == "ok"
    assert v[("model=m, level=4", "qps")] == "regression"
    assert v[("model=m, level=4", "p99_ms")] == "improved"


def test_the_band_is_the_root_sum_square_of_both_runs_bands_with_a_floor():
    checks = compare(result([row(band=0.03)]), result([row(band=0.04)]), min_band=0.02)
    assert {round(c.band, 4) for c in checks if c.metric != "error_rate"} == {0.05}
    checks = compare(result([row(band=0.0)]), result([row(band=0.0)]), min_band=0.02)
    assert {c.band for c in checks} == {0.02}
    # 6% slower p99 fails with a 5% band, passes with a 10% floor
    slow = result([row(p99=10.6, band=0.0)])
    assert verdicts(compare(result([row(band=0.0)]), slow, min_band=0.05))[("model=m, level=1", "p99_ms")] == "regression"
    assert verdicts(compare(result([row(band=0.0)]), slow, min_band=0.10))[("model=m, level=1", "p99_ms")] == "ok"


def test_an_error_rate_rising_from_zero_is_a_regression():
    v = verdicts(compare(result([row()]), result([row(error_rate=0.02)])))
    assert v[("model=m, level=1", "error_rate")] == "regression"


def test_targets_must_be_met_by_the_ratio():
    base = result([row(qps=100, p99=10, band=0.01)])
    better = result([row(qps=125, p99=8.5, band=0.01)])
    checks = compare(base, better, parse_targets(["qps=+20%", "p99=-10%"]))
    assert {c.metric: c.verdict for c in checks if c.target} == {"qps": "met", "p99_ms": "met"}
    short = result([row(qps=115, p99=9.5, band=0.01)])
    checks = compare(base, short, parse_targets(["qps=+20% p99=-10%"]))
    assert {c.metric: c.verdict for c in checks if c.target} == {"qps": "missed", "p99_ms": "missed"}
    assert all(c.failed for c in checks if c.target)


def test_bad_targets_and_unknown_metrics_are_named():
    with pytest.raises(ConfigError, match="'qps\\+20': expected METRIC=\\+N%"):
        parse_targets(["qps+20"])
    with pytest.raises(ConfigError, match="no metric 'tokens'.*qps, p99_ms, error_rate"):
        compare(result([row()]), result([row()]), parse_targets(["tokens=+5%"]))


def test_rows_match_on_the_key_fields_or_the_comparison_refuses():
    with pytest.raises(ConfigError, match="no row of NEW matches"):
        compare(result([row(model="a")]), result([row(model="b")]))
    checks = compare(result([row(model="a")]), result([row(model="b", p99=30)]), ignore_keys=["model"], min_band=0.02)
    assert verdicts(checks)[("level=1", "p99_ms")] == "regression"
    with pytest.raises(ConfigError, match="compare like with like"):
        compare(result([row()]), result([row()], benchmark="system"))


def test_repeated_runs_give_medians_and_the_spread_as_band():
    runs = [result([row(qps=q, band=0.01)]) for q in (90.0, 100.0, 110.0)]
    merged = merge_runs(runs, "runs")
    only = merged.rows[0]
    assert only["qps"] == 100.0 and only["runs"] == 3
    assert only["band"]["qps"] == pytest.approx(0.10)  # (110 - 90) / 2 / 100 > the runs' own 1%


def test_cli_exit_status_follows_the_verdicts(tmp_path):
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    for i, q in enumerate((98.0, 100.0, 102.0)):
        result([row(qps=q, band=0.02)]).save(base_dir / f"run{i}.json")
    same = result([row(qps=101.0, p99=10.1, band=0.02)]).save(tmp_path / "same.json")
    slowed = result([row(qps=50.0, p99=25.0, band=0.02)]).save(tmp_path / "slowed.json")
    runner = CliRunner()
    ok = runner.invoke(cli, ["bench", "compare", str(base_dir), str(same)])
    assert ok.exit_code == 0, ok.output
    assert "PASS" in ok.output
    bad = runner.invoke(cli, ["bench", "compare", str(base_dir), str(slowed), "--json-out", str(tmp_path / "c.json")])
    assert bad.exit_code == 1, bad.output
    assert "FAIL" in bad.output and "p99_ms regression" in bad.output
    assert json.loads((tmp_path / "c.json").read_text())["failed"] == 2
    missed = runner.invoke(cli, ["bench", "compare", str(base_dir), str(same), "--target", "qps=+20%"])
    assert missed.exit_code == 1 and "qps missed" in missed.output


def test_cli_names_a_file_that_is_not_a_result(tmp_path):
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"rows": []}')
    out = CliRunner().invoke(cli, ["bench", "compare", str(bogus), str(bogus)])
    assert out.exit_code != 0 and "bogus.json: schema: not a dspark benchmark result" in out.output


def test_bounds_on_the_ratio_are_tolerances_and_bounds_on_the_value_need_no_base():
    from dspark.bench.compare import parse_target

    base = result([row(qps=100, p99=10, band=0.01)])
    worse = result([row(qps=97, p99=18, band=0.01)])  # 3% fewer req/s and 1.8x the p99: regressions
    checks = {c.metric: c for c in compare(base, worse, parse_targets(["qps>=0.97x", "p99<=2x"]))}
    assert checks["qps"].verdict == "met" and checks["p99_ms"].verdict == "met"
    checks = {c.metric: c for c in compare(base, worse, parse_targets(["qps>0.97x", "p99<=1.5x"]))}
    assert checks["qps"].verdict == "missed" and checks["p99_ms"].verdict == "missed"
    # a bound on NEW's own value: the ratio does not matter
    checks = {c.metric: c for c in compare(base, worse, parse_targets(["p99<20", "error_rate<=0"]))}
    assert checks["p99_ms"].verdict == "met" and checks["error_rate"].verdict == "met"
    assert verdicts(compare(base, worse, [parse_target("p99<15")]))[("model=m, level=1", "p99_ms")] == "missed"
    assert [str(t) for t in parse_targets(["qps=+20%, p99<=2x", "within_deadline>=0.995"])] == \
        ["qps=+20%", "p99<=2x", "within_deadline>=0.995"]
    with pytest.raises(ConfigError, match="'p99<=x': expected"):
        parse_targets(["p99<=x"])


def test_rows_of_one_result_compare_with_each_other(tmp_path):
    from dspark.bench.compare import parse_where, select

    one = result([row(model="fifo", p99=100.0), row(model="router", p99=30.0)])
    assert [r["model"] for r in select(one, {"model": "router"}).rows] == ["router"]
    assert len(select(one, {"level": "1"}).rows) == 2  # numbers match their text
    with pytest.raises(ConfigError, match="no row of the model result has model=lifo"):
        select(one, {"model": "lifo"})
    with pytest.raises(ConfigError, match="expected FIELD=VALUE"):
        parse_where(["model"])
    path = one.save(tmp_path / "one.json")
    args = ["bench", "compare", str(path), str(path), "--base-where", "model=fifo", "--new-where", "model=router",
            "--ignore-key", "model", "--target", "p99<=0.58x"]
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0 and "met" in out.output, out.output
    out = CliRunner().invoke(cli, args[:-1] + ["p99<=0.2x"])
    assert out.exit_code == 1 and "p99_ms missed (0.300x" in out.output, out.output


def test_two_single_runs_are_unsure_beyond_their_windows_band_unless_a_band_is_given(tmp_path):
    """Two runs of one model on a busy machine: windows agreed within 4 %, the runs' p99 2.95x apart."""
    base = result([row(p99=10.0, band=0.04)]).save(tmp_path / "base.json")
    again = result([row(p99=29.5, band=0.04)]).save(tmp_path / "again.json")
    default = CliRunner().invoke(cli, ["bench", "compare", str(base), str(again)])
    assert default.exit_code == 0, default.output
    assert "p99_ms" in default.output and "unsure" in default.output
    assert "NOTE: BASE and NEW are one run each: their bands are the spread of windows inside each run" in default.output
    judged = CliRunner().invoke(cli, ["bench", "compare", str(base), str(again), "--min-band", "50"])
    assert judged.exit_code == 1 and "p99_ms regression" in judged.output
    errors = result([row(error_rate=0.02, band=0.04)]).save(tmp_path / "errors.json")
    failing = CliRunner().invoke(cli, ["bench", "compare", str(base), str(errors)])
    assert failing.exit_code == 1 and "error_rate regression" in failing.output  # errors need no band
