"""`dspark info` kernel lines and the two kernel benchmarks, run small."""
import json

from click.testing import CliRunner

from dspark.cli.main import cli
from dspark.kernels.dispatch import dispatch_report


def test_info_reports_dispatch_blas_and_numa():
    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    report = dispatch_report()
    assert f"built for {', '.join(report.compiled)}" in result.output
    assert f"chosen: {report.chosen}" in result.output
    assert "GEMM          scipy-openblas32" in result.output
    assert "NUMA          " in result.output and "node0" in result.output


def test_info_shows_the_override(monkeypatch):
    monkeypatch.setenv("DSPARK_SIMD", "scalar")
    result = CliRunner().invoke(cli, ["info"])
    assert "chosen: scalar (DSPARK_SIMD=scalar)" in result.output


def test_bench_kernels_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "k.json"
    result = CliRunner().invoke(cli, ["bench", "kernels", "--shape", "4x64x128", "--shape", "2x32x16",
                                      "--rounds", "5", "--blocks", "32/12/64/24", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "LayerNormalization + com.microsoft.Gelu + Gemm" in result.output
    assert "openblas x ORT" in result.output and "% FMA peak" in result.output
    data = json.loads(out.read_text())
    assert data["schema"] == "dspark-bench" and data["benchmark"] == "micro/fused"
    assert data["settings"]["packed_blocks"] == {"kc": 32, "mc": 12, "nc": 64, "mb": 24}
    assert [(r["rows"], r["d"], r["n"]) for r in data["rows"]] == [(4, 64, 128), (2, 32, 16)]
    assert all(r["fused_max_rel_err"] < 1e-5 and r["fused_ms"] > 0 and r["openblas_ms"] > 0
               for r in data["rows"])
    # % of the theoretical FMA peak of one core: GFLOP/s over cores x clock x FLOP/cycle, below 100%
    peak = data["machine"]["fp32_peak_gflops_per_core"]
    assert all(abs(r["share_of_fma_peak"] - r["fused_gflops"] / peak) < 0.01 and r["share_of_fma_peak"] < 1
               for r in data["rows"])


def test_bench_kernels_names_bad_blocks():
    result = CliRunner().invoke(cli, ["bench", "kernels", "--shape", "2x32x16", "--blocks", "32/x"])
    assert result.exit_code != 0 and "'32/x': expected KC/MC/NC/MB" in result.output


def test_bench_kernels_names_a_bad_shape():
    result = CliRunner().invoke(cli, ["bench", "kernels", "--shape", "16x768"])
    assert result.exit_code != 0 and "'16x768': expected ROWSxDxN" in result.output


def test_bench_pool_writes_json(tmp_path):
    out = tmp_path / "p.json"
    result = CliRunner().invoke(cli, ["bench", "pool", "--steps", "150", "--seeds", "1",
                                      "--rounds", "5", "--weights", str(tmp_path / "absent.npz"),
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert {r["allocator"] for r in rows if r["part"] == "trace"} == {"best_fit", "first_fit", "np.empty"}
    assert {r["allocator"] for r in rows if r["part"] == "request loop"} == {"pool", "pool+hugepages", "np.empty"}
    assert {r["allocator"] for r in rows if r["part"] == "model load"} == {"with pool", "without pool"}
    assert all(r["req_per_s"] > 0 for r in rows if r["part"] == "request loop")


def test_bench_gemm_covers_every_kernel_path_this_cpu_runs(tmp_path):
    from dspark.runtimes.accel.gemm import kernel_report

    out = tmp_path / "g.json"
    result = CliRunner().invoke(cli, ["bench", "gemm", "--size", "64", "--rounds", "2", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    rows = {r["candidate"]: r for r in json.loads(out.read_text())["rows"]}
    assert {f"shim int8 [{p}]" for p in kernel_report().supported} <= set(rows)
    assert all(r["max_rel_err"] == 0 for name, r in rows.items() if "int8" in name)
    assert all(r["max_rel_err"] < 1e-2 for r in rows.values())


def test_bench_micro_lists_and_runs_registered_benchmarks(tmp_path):
    listed = CliRunner().invoke(cli, ["bench", "micro", "--list"])
    assert listed.exit_code == 0
    assert {line.split()[0] for line in listed.output.splitlines()} == {"fused", "fused-blocks", "sgemm", "pool", "gemm"}
    missing = CliRunner().invoke(cli, ["bench", "micro", "nope"])
    assert missing.exit_code != 0 and "no micro benchmark 'nope'" in missing.output
