"""Every SIMD path of GELU(LayerNorm(x)), forced through DSPARK_SIMD, against one float64 reference."""
import numpy as np
import pytest

from dspark.kernels.dispatch import HIDE_ENV, ISAS, SIMD_ENV, available_isas, dispatch_report
from dspark.kernels.fused import ln_gelu, reference_ln_gelu

AVAILABLE = available_isas()


def _case(rows: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (3 * rng.standard_normal((rows, d)) + 0.5).astype(np.float32)
    gamma = (1 + 0.5 * rng.standard_normal(d)).astype(np.float32)
    beta = rng.standard_normal(d).astype(np.float32)
    return x, gamma, beta


@pytest.mark.parametrize("isa", AVAILABLE)
@pytest.mark.parametrize("d", [1, 7, 8, 17, 64, 768, 1000])
@pytest.mark.parametrize("gelu", ["erf", "tanh"])
def test_each_available_path_matches_float64(monkeypatch, isa, d, gelu):
    monkeypatch.setenv(SIMD_ENV, isa)
    x, gamma, beta = _case(5, d)
    out, path = ln_gelu(x, gamma, beta, gelu=gelu)
    assert path == isa
    ref = reference_ln_gelu(x, gamma, beta, gelu=gelu)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6 * max(1.0, np.abs(ref).max()))


def test_paths_agree_with_each_other(monkeypatch):
    x, gamma, beta = _case(33, 300, seed=3)
    results = {}
    for isa in AVAILABLE:
        monkeypatch.setenv(SIMD_ENV, isa)
        results[isa] = ln_gelu(x, gamma, beta)[0]
    for isa, out in results.items():
        np.testing.assert_allclose(out, results["scalar"], rtol=1e-5, atol=5e-6, err_msg=isa)


def test_report_lists_build_and_run_time_support(monkeypatch):
    monkeypatch.delenv(SIMD_ENV, raising=False)
    report = dispatch_report()
    assert "scalar" in report.compiled and "scalar" in report.supported
    assert set(report.supported) <= set(ISAS)
    assert report.chosen == report.best == AVAILABLE[-1]
    assert "OpenBLAS" in report.blas


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_forcing_a_path_this_cpu_lacks_is_refused(monkeypatch, isa):
    """DSPARK_SIMD_HIDE makes this CPU lack the ISA (it may lack it anyway); forcing it is refused."""
    monkeypatch.setenv(HIDE_ENV, isa)
    monkeypatch.setenv(SIMD_ENV, isa)
    x, gamma, beta = _case(2, 16)
    with pytest.raises(ValueError, match=f"DSPARK_SIMD={isa}: this CPU or OS cannot run the {isa} fused kernels"):
        ln_gelu(x, gamma, beta)
    report = dispatch_report()
    assert report.chosen.startswith("error: DSPARK_SIMD") and isa not in report.supported


def test_hiding_isas_moves_the_automatic_choice_down(monkeypatch):
    monkeypatch.delenv(SIMD_ENV, raising=False)
    monkeypatch.setenv(HIDE_ENV, "avx512,avx2,scalar")  # scalar cannot be hidden
    x, gamma, beta = _case(3, 40)
    out, path = ln_gelu(x, gamma, beta)
    assert path == "scalar" and dispatch_report().supported == ["scalar"]
    np.testing.assert_allclose(out, reference_ln_gelu(x, gamma, beta), rtol=1e-5, atol=2e-6 * max(1.0, np.abs(out).max()))
    monkeypatch.setenv(HIDE_ENV, "avx512")
    assert ln_gelu(x, gamma, beta)[1] == ("avx2" if "avx2" in AVAILABLE else "scalar")


def test_unknown_override_names_the_variable(monkeypatch):
    monkeypatch.setenv(SIMD_ENV, "sse9")
    x, gamma, beta = _case(2, 16)
    with pytest.raises(ValueError, match="DSPARK_SIMD=sse9: expected one of auto, scalar, avx2, avx512"):
        ln_gelu(x, gamma, beta)
