"""One dispatcher chooses the path of every kernel family (the fused layer, the llama kernels, the
GemmEx shim): the same override rules, the same DSPARK_SIMD_HIDE, the same refusal sentences."""
import pytest

from dspark._ext import fused, llama
from dspark.runtimes.accel import gemm


def fused_info():
    return fused.simd_info()


def llama_info():
    return llama.isa_info()


def gemm_info():
    report = gemm.kernel_report()
    return {"compiled": report.compiled, "supported": report.supported, "chosen": report.chosen}


X86 = "scalar, avx2, avx512"
FAMILIES = [  # (report, override variable, family's word in sentences, its paths)
    (fused_info, "DSPARK_SIMD", "fused", X86),
    (llama_info, "DSPARK_SIMD", "llama", X86),
    (gemm_info, "DSPARK_GEMM_SIMD", "GemmEx", "convert, avx512bf16, amx"),
]


@pytest.mark.parametrize("report,env,word,names", FAMILIES)
def test_every_family_forces_hides_and_refuses_alike(monkeypatch, report, env, word, names):
    portable = names.split(", ")[0]
    monkeypatch.delenv("DSPARK_SIMD", raising=False)
    monkeypatch.delenv("DSPARK_GEMM_SIMD", raising=False)
    monkeypatch.delenv("DSPARK_SIMD_HIDE", raising=False)
    info = report()
    assert portable in info["compiled"] and portable in info["supported"]
    assert set(info["supported"]) <= set(info["compiled"])
    for path in info["supported"]:  # every path this CPU runs can be forced
        monkeypatch.setenv(env, path)
        chosen = report()["chosen"]
        assert not chosen.startswith("error"), chosen
    best = info["supported"][-1]
    if best != portable:  # hidden, the best path is refused by name and auto falls back
        monkeypatch.setenv("DSPARK_SIMD_HIDE", best)
        monkeypatch.setenv(env, best)
        hidden = report()
        assert best not in hidden["supported"]
        assert hidden["chosen"] == (f"error: {env}={best}: this CPU or OS cannot run the {best} {word} kernels "
                                    f"(best here: {hidden['supported'][-1]})")
        monkeypatch.setenv(env, "auto")
        assert not report()["chosen"].startswith("error")
    monkeypatch.setenv(env, "sse9")
    assert report()["chosen"] == f"error: {env}=sse9: expected one of auto, {names}"


def test_the_python_isa_names_are_the_c_dispatchers_table():
    """One ISA name table: dspark.kernels.dispatch.ISAS is isa_dispatch.c's dspark_isa_names, in order."""
    import re

    from dspark.kernels.dispatch import ISAS
    from dspark.paths import project_root

    source = (project_root() / "cython_ext" / "common" / "isa_dispatch.c").read_text()
    table = re.search(r"dspark_isa_names\[DSPARK_ISA_COUNT\]\s*=\s*\{([^}]*)\}", source)
    assert table and tuple(re.findall(r'"(\w+)"', table.group(1))) == ISAS
