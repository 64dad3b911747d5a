"""The USDT probes dspark's compiled modules carry (provider "dspark"): the one table of their
names, arguments and modules. docs/trace.md's table is made from it (`python -m
dspark.trace.probes`), and tests/unit/trace/test_probe_table.py checks it against the notes of
the built .so files, so a probe cannot change without the table."""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

PROVIDER = "dspark"


MAX_ARGS = 6  # bpftrace reads arg0..arg5 of a USDT probe on x86-64


@dataclass(frozen=True)
class Probe:
    name: str
    module: str  # the file in dspark/_ext/ that carries it (a prefix of its name)
    args: tuple[str, ...]  # arg0, arg1, ... in order; "name:str" is a C string (bpftrace: str(argN))
    fires: str

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(arg.split(":")[0] for arg in self.args)


PROBES: list[Probe] = [
    Probe("step_begin", "llama", ("rows", "cached_rows", "segments", "logit_rows", "isa:str"),
          "a llama forward pass starts (rows: new rows over all segments; isa: the kernel path)"),
    Probe("step_end", "llama", ("rows", "status"), "the forward pass ends (status 0, or -1: no memory)"),
    Probe("prefill_chunk", "llama", ("rows", "cached_rows"), "a forward pass that reads prompt rows only (no logits)"),
    Probe("gemm_begin", "libhcblas", ("m", "n", "k"), "a GemmEx call starts"),
    Probe("gemm_end", "libhcblas", ("m", "n", "k", "types", "algo", "status"),
          "a GemmEx call returns (types: A, B, C and compute type, a byte each from the low one; "
          "status: the shim's status code)"),
    Probe("pool_alloc", "pool", ("requested", "chunk", "in_use", "reserved", "largest_free"),
          "the BFC pool hands out a chunk (bytes; fragmentation: free bytes outside largest_free)"),
    Probe("pool_free", "pool", ("freed", "in_use", "reserved", "largest_free"), "a chunk goes back to the pool"),
    Probe("pool_grow", "pool", ("arena", "reserved", "arenas"), "the pool maps a new arena"),
    Probe("fused_begin", "fused", ("rows", "d", "n", "isa:str", "packed"), "a fused LayerNorm+GELU+MatMul starts"),
    Probe("fused_end", "fused", ("rows", "status"), "the fused layer ends"),
    Probe("request_start", "probes", ("model:str", "method:str", "prompt_tokens"), "a generate request starts decoding"),
    Probe("request_end", "probes", ("model:str", "method:str", "output_tokens", "rounds", "draft_us", "verify_us"),
          "a generate request ends (rounds: target passes after the prompt, as the metrics count them)"),
    Probe("queue_wait", "probes", ("model:str", "wait_us"), "a request leaves the model's worker queue"),
    Probe("verify_batch", "probes", ("requests", "rows", "us"), "one target pass over the rows of one or more requests"),
    Probe("accept_begin", "probes", ("rows",), "a round's acceptance (sampling, cache update) starts"),
    Probe("spec_round", "probes", ("proposed", "accepted", "rows"),
          "a speculative round is committed (one per dspark_speculative_target_passes_total)"),
    Probe("stream_begin", "probes", ("bytes",), "a streamed piece is sent"),
    Probe("stream_end", "probes", ("bytes",), "the send returned"),
    Probe("route", "probes", ("router:str", "tier:str", "lane:str", "version", "wait_us"),
          "the QoS router sends a request to a version (lane: queued or inline)"),
    Probe("rollout_step", "probes", ("model:str", "step", "kind:str", "percent_x100"), "a rollout step starts"),
]

BY_NAME = {probe.name: probe for probe in PROBES}
EXT_DIR = Path(__file__).resolve().parent.parent / "_ext"


def probe_notes(path: Path) -> dict[str, int]:
    """The dspark probes in an ELF file's stapsdt notes (`readelf -n`): name -> argument count."""
    out = subprocess.run(["readelf", "-n", "--wide", str(path)], capture_output=True, text=True, check=True).stdout
    return parse_notes(out)


def parse_notes(readelf_output: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for block in readelf_output.split("stapsdt")[1:]:
        provider = re.search(r"Provider: (\S+)", block)
        name = re.search(r"Name: (\S+)", block)
        args = re.search(r"Arguments:(.*)", block)
        if provider and name and provider.group(1) == PROVIDER:
            found[name.group(1)] = len(args.group(1).split()) if args else 0
    return found


def module_file(module: str, ext_dir: Path = EXT_DIR) -> Path | None:
    """The built file of a module in dspark/_ext/ (llama -> llama.cpython-*.so)."""
    matches = sorted(ext_dir.glob(f"{module}.*so")) + sorted(ext_dir.glob(f"{module}.so"))
    return matches[0] if matches else None


def markdown_table() -> str:
    rows = ["| probe | module | arguments (arg0, arg1, ...) | fires when |", "|---|---|---|---|"]
    rows += [f"| `dspark:{p.name}` | `{p.module}` | {', '.join(p.args)} | {p.fires} |" for p in PROBES]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
