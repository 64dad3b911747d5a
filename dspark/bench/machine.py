"""The machine a benchmark ran on, and its theoretical fp32 FMA peak.

Every result records the CPU model, the instruction sets the kernels care about, the usable cores
and the clock; "% of peak" columns divide by ``cores x clock x fp32 FLOP per cycle``, where FLOP
per cycle comes from the widest FMA the CPU runs and how many of those units a core of that family
has. The basis is stated in the result (``peak_basis``), so a reader can redo the arithmetic.
Turbo clocks above the base clock, or an FMA-unit count the table gets wrong for a SKU, show up as
shares above 100%: override with ``DSPARK_CPU_GHZ`` and ``DSPARK_FLOP_PER_CYCLE`` when you know better.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from dspark.paths import project_root

CLOCK_ENV = "DSPARK_CPU_GHZ"
FLOP_ENV = "DSPARK_FLOP_PER_CYCLE"
# Flags recorded in every result: what the kernels and the GemmEx shim dispatch on.
ISA_FLAGS = ("sse4_2", "avx", "fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    vendor: str
    family: int
    isa: tuple[str, ...]
    cores: int                # CPUs this process may run on
    clock_ghz: float
    clock_source: str
    fp32_flop_per_cycle: int  # per core
    peak_basis: str
    memory_gib: float
    python: str

    @property
    def cpu_class(self) -> str:
        return cpu_class(self.vendor, self.family, self.isa)

    def fp32_peak_gflops(self, cores: int | None = None) -> float:
        """cores x clock x FLOP/cycle; ``cores`` defaults to all usable ones (a 1-thread
        benchmark compares with one core's peak)."""
        return (cores or self.cores) * self.clock_ghz * self.fp32_flop_per_cycle

    def describe(self) -> str:
        return (f"{self.cpu_model} ({self.cpu_class}), "
                f"{self.cores} cores at {self.clock_ghz:.2f} GHz ({self.clock_source}); fp32 peak "
                f"{self.fp32_peak_gflops(1):.1f} GFLOP/s per core = {self.peak_basis}")

    def to_json(self) -> dict:
        data = asdict(self)
        data["fp32_peak_gflops_per_core"] = round(self.fp32_peak_gflops(1), 1)
        return data


def cpu_class(vendor: str, family: int, isa: Sequence[str]) -> str:
    """The core generation and what the kernels dispatch on, in a few words: a model name such
    as "AMD EPYC" does not tell a Zen 3 (AVX2) from a Zen 4 or Zen 5 (AVX-512 VNNI/BF16)."""
    if "avx512f" not in isa:
        simd = "AVX2" if "avx2" in isa else "no AVX2"
    else:
        extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"),
                                          ("avx512_fp16", "FP16")) if flag in isa]
        simd = "AVX-512" + (f" {'/'.join(extras)}" if extras else "") + (" + AMX" if "amx_int8" in isa else "")
    generation = None
    if vendor == "AuthenticAMD":
        generation = {0x17: "Zen 2", 0x19: "Zen 4" if "avx512f" in isa else "Zen 3", 0x1A: "Zen 5"}.get(family)
    return f"{generation}: {simd}" if generation else simd


def _cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def flop_per_cycle(vendor: str, family: int, flags: set[str]) -> tuple[int, str]:
    """fp32 FLOP per cycle per core from the widest FMA and the family's FMA units, and why."""
    if "avx512f" in flags and vendor == "GenuineIntel":
        return 64, "2 FMA units x 16 fp32 lanes (AVX-512) x 2 FLOP (Intel server core; 1-unit SKUs reach half)"
    if "avx512f" in flags and vendor == "AuthenticAMD" and family >= 0x1A:
        return 64, "2 FMA units x 16 fp32 lanes (AVX-512, Zen 5 full-width) x 2 FLOP"
    if "avx512f" in flags:
        return 32, "2 FMA units x 8 fp32 lanes (AVX-512 run as 2 x 256-bit, Zen 4) x 2 FLOP"
    if "fma" in flags and "avx2" in flags:
        return 32, "2 FMA units x 8 fp32 lanes (AVX2+FMA) x 2 FLOP"
    if "avx" in flags:
        return 16, "1 add + 1 multiply unit x 8 fp32 lanes (AVX, no FMA)"
    return 8, "1 add + 1 multiply unit x 4 fp32 lanes (SSE)"


def _clock(fields: dict[str, str]) -> tuple[float, str]:
    override = os.environ.get(CLOCK_ENV)
    if override:
        return float(override), f"${CLOCK_ENV}"
    base = Path("/sys/devices/system/cpu/cpu0/cpufreq/base_frequency")
    if base.is_file():
        return int(base.read_text()) / 1e6, "base_frequency (cpufreq)"
    match = re.search(r"@\s*([\d.]+)\s*GHz", fields.get("model name", ""))
    if match:
        return float(match.group(1)), "base clock in the model name"
    if "cpu MHz" in fields:
        return float(fields["cpu MHz"]) / 1000, "cpu MHz in /proc/cpuinfo (nominal in a VM)"
    return 1.0, f"unknown (set {CLOCK_ENV})"


def detect(cpuinfo_text: str | None = None) -> Machine:
    """This machine (or the one a /proc/cpuinfo text describes, for tests)."""
    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo_text = ""
    fields = _cpuinfo(cpuinfo_text)
    flags = set(fields.get("flags", "").split())
    vendor = fields.get("vendor_id", platform.processor() or "unknown")
    family = int(fields.get("cpu family", "0") or 0)
    per_cycle, basis = flop_per_cycle(vendor, family, flags)
    if os.environ.get(FLOP_ENV):
        per_cycle, basis = int(os.environ[FLOP_ENV]), f"${FLOP_ENV}"
    clock, source = _clock(fields)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory = 0.0
    return Machine(
        cpu_model=fields.get("model name", platform.processor() or "unknown CPU"), vendor=vendor,
        family=family, isa=tuple(f for f in ISA_FLAGS if f in flags), cores=cores, clock_ghz=clock,
        clock_source=source, fp32_flop_per_cycle=per_cycle,
        peak_basis=f"{clock:.2f} GHz x {per_cycle} FLOP/cycle ({basis})",
        memory_gib=round(memory, 1), python=platform.python_version())


@lru_cache(maxsize=1)
def this_machine() -> Machine:
    return detect()


def git_revision(root: Path | None = None) -> dict:
    """The commit the code ran at, and whether the tree had changes (``dirty``)."""
    root = root or project_root()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": bool(status.strip()) if commit else None}
