"""`dspark bench router` end to end on the real server it starts (short: one 3 s overload at 2x)."""
import json

from click.testing import CliRunner

from dspark.bench.results import load
from dspark.cli.main import cli


def test_a_short_router_bench_protects_diamond_and_writes_its_result(tmp_path):
    out = CliRunner().invoke(cli, ["bench", "router", "--skip-overhead", "--bursty-s", "0", "--overload", "2",
                                   "--overload-s", "3", "--repeat", "1", "--capacity-s", "3", "--capacity-rounds", "1", "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    result = load(tmp_path / "result.json")
    assert result.benchmark == "router" and result.key_fields == ["scenario", "mode", "tier"]
    rows = {(r["scenario"], r["mode"], r["tier"]): r for r in result.rows}
    capacity = rows[("capacity", "direct", "all")]["qps"]
    assert 0 < capacity < 110  # 2 instances x 20 ms: 100 req/s at best
    routed = rows[("capacity", "router", "all")]  # the same closed loop through the router, tiers in the mix
    assert routed["qps"] > 0 and routed["x_direct"] == routed["qps"] / capacity  # its target is the bench's
    fifo, router = ({t: rows[("overload 2x", mode, t)] for t in ("diamond", "gold", "standard", "all")}
                    for mode in ("fifo", "router"))
    # the same seeded arrivals went to both, about 2x capacity for 3 s
    assert [fifo[t]["sent"] for t in fifo] == [router[t]["sent"] for t in router]
    assert 3 * 2 * capacity * 0.6 < router["all"]["sent"] < 3 * 2 * capacity * 1.4
    # FIFO's queue grows for 3 s in front of every tier; the router serves diamond first (how much
    # sooner is the benchmark's target, printed below, not this test's)
    assert router["diamond"]["p99_ms"] < fifo["diamond"]["p99_ms"]
    errors = {mode: {t: rows[("overload 2x", mode, t)]["errors"] for t in ("diamond", "gold", "standard")}
              for mode in ("fifo", "router")}
    assert router["all"]["unexplained"] == 0 and fifo["all"]["unexplained"] == 0, errors
    assert router["all"]["goodput_x"] > 0.5 and fifo["all"]["triton_queue_ms"] > router["all"]["triton_queue_ms"]
    assert router["diamond"]["router_p99_ms_at_most"] > 0  # the router's own histogram was read
    assert "p99_ms<=2x" in out.output and "goodput>=0.97x" in out.output and "qps>=0.95x" in out.output  # the targets
    timeline = json.loads((tmp_path / "result.json").read_text())["series"]["timeline"]
    assert set(timeline) == {"overload 2x / fifo", "overload 2x / router"}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["router_goodput.png", "router_latency.png"]
