"""`dspark bench shapes`: dspark's kernels on random-weight GGUFs of real model shapes (Llama 3.2
1B and 3B, Llama 3.1 8B; Q4_K blocks with Q6_K ``attn_v`` and head, as Q4_K_M files hold), for
what a pass costs, not for what a model says. Per shape: the cost of a pass by rows (1 row: plain
decoding; more: verification), plain decode tokens/s against the memory-bandwidth ceiling (bytes
read per token / this machine's measured read bandwidth) and against llama.cpp on the same file
when llama_cpp is installed, and for the 8B shape with the 1B shape as its draft, one draft-model
speculative step against the sum of its parts (4 draft rows one by one + one 5-row target pass)
and the pair's tokens/s at the acceptance it gets. Random weights make that acceptance
meaningless (the two models share only a vocabulary): read the pair's rows for cost only."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dspark.bench.results import BenchResult
from dspark.bench.table import Column

VOCAB = 128_256  # Llama 3's
# bytes per 256-weight super-block of the K-quants, and where its fp16 scales sit
K_QUANT_BYTES = {"Q2_K": 84, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_K_SCALES = {"Q2_K": (80, 82), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
DRAFT_DEPTH = 4


@dataclass(frozen=True)
class Shape:
    title: str
    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    n_kv_head: int
    head_dim: int
    tied: bool  # the head is the embedding
    vocab: int = VOCAB


SHAPES = {
    "1b": Shape("Llama 3.2 1B", 16, 2048, 8192, 32, 8, 64, tied=True),
    "3b": Shape("Llama 3.2 3B", 28, 3072, 8192, 24, 8, 128, tied=True),
    "8b": Shape("Llama 3.1 8B", 32, 4096, 14336, 32, 8, 128, tied=False),
}
DRAFT_OF = {"8b": "1b"}  # the draft-model pair measured


def random_k_blocks(rng: np.random.Generator, kind: str, shape: tuple[int, int], scale: float = 1.0) -> np.ndarray:
    """Random super-blocks of a K-quant type (uint8 ``[rows, bytes]`` for a ``(rows, columns)``
    matrix) whose fp16 scale fields are small finite numbers (``gguf`` quantizes only the legacy
    types): the weights they encode spread about ``scale / sqrt(columns)``."""
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows, cols // 256, K_QUANT_BYTES[kind]), dtype=np.uint8)
    spread = scale / np.sqrt(cols)
    # 6-bit sub-scales (Q4_K/Q5_K, ~32 on average) times 4/5-bit q; Q6_K: int8 scales times 6-bit q
    d = {"Q2_K": spread / 8 / 2, "Q4_K": spread / 32 / 4, "Q5_K": spread / 32 / 8, "Q6_K": spread / 64 / 16}[kind]
    for offset in _K_SCALES[kind]:
        values = (d * (0.5 + rng.random(blocks.shape[:2]))).astype(np.float16)
        blocks[:, :, offset:offset + 2] = values.view(np.uint8).reshape(blocks.shape[:2] + (2,))
    return blocks.reshape(rows, -1)


def _tensors(shape: Shape, n_layer: int) -> list[tuple[str, str, int, int]]:
    """(name, type, rows, columns) of every matrix, in file order; "F32" rows are vectors."""
    s = shape
    q, kv = s.n_head * s.head_dim, s.n_kv_head * s.head_dim
    out = [("token_embd.weight", "Q6_K" if s.tied else "Q4_K", s.vocab, s.hidden)]
    if not s.tied:
        out.append(("output.weight", "Q6_K", s.vocab, s.hidden))
    out.append(("output_norm.weight", "F32", 1, s.hidden))
    for i in range(n_layer):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", "F32", 1, s.hidden), (p + "ffn_norm.weight", "F32", 1, s.hidden),
                (p + "attn_q.weight", "Q4_K", q, s.hidden), (p + "attn_k.weight", "Q4_K", kv, s.hidden),
                (p + "attn_v.weight", "Q6_K", kv, s.hidden), (p + "attn_output.weight", "Q4_K", s.hidden, q),
                (p + "ffn_gate.weight", "Q4_K", s.ffn, s.hidden), (p + "ffn_up.weight", "Q4_K", s.ffn, s.hidden),
                (p + "ffn_down.weight", "Q4_K", s.hidden, s.ffn)]
    return out


def _nbytes(kind: str, rows: int, cols: int) -> int:
    return rows * cols * 4 if kind == "F32" else rows * cols // 256 * K_QUANT_BYTES[kind]


def bytes_per_token(shape: Shape, n_layer: Optional[int] = None) -> int:
    """Weight bytes one decode step reads: every block matrix and the head (not the embedding
    table of an untied model: one row of it)."""
    return sum(_nbytes(kind, rows, cols) for name, kind, rows, cols in _tensors(shape, n_layer or shape.n_layer)
               if name != "token_embd.weight" or shape.tied)


def write_shape_gguf(shape: Shape, path: Path, n_layer: Optional[int] = None, seed: int = 0) -> Path:
    """A random-weight GGUF of ``shape`` (``n_layer`` blocks, default the shape's), written one
    tensor at a time (an 8B file never sits in memory whole). Its vocabulary (Llama 3's size
    unless the shape says otherwise): two control tokens, the 256 byte tokens, then fillers."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from dspark.llm.tokenizer import _bytes_to_unicode

    n_layer = n_layer or shape.n_layer
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name(f"random {shape.title} shape")
    for add, value in ((writer.add_block_count, n_layer), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, shape.hidden), (writer.add_feed_forward_length, shape.ffn),
                       (writer.add_head_count, shape.n_head), (writer.add_head_count_kv, shape.n_kv_head),
                       (writer.add_rope_freq_base, 500000.0), (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_rope_dimension_count, shape.head_dim), (writer.add_key_length, shape.head_dim),
                       (writer.add_value_length, shape.head_dim)):
        add(value)
    tokens = ["<|begin_of_text|>", "<|end_of_text|>"] + list(_bytes_to_unicode().values())
    tokens += [f"<unused{i}>" for i in range(shape.vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (shape.vocab - 2))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    tensors = _tensors(shape, n_layer)
    for name, kind, rows, cols in tensors:
        if kind == "F32":
            writer.add_tensor_info(name, [cols], np.dtype(np.float32), cols * 4)
        else:
            nbytes = _nbytes(kind, rows, cols)
            writer.add_tensor_info(name, [rows, nbytes // rows], np.dtype(np.uint8), nbytes, raw_dtype=getattr(Q, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, kind, rows, cols in tensors:
        if kind == "F32":
            writer.write_tensor_data((1 + 0.1 * rng.standard_normal(cols)).astype(np.float32))
        else:
            scale = 8.0 if name == "token_embd.weight" else 2.0 if "attn_q" in name or "attn_k" in name else 1.0
            writer.write_tensor_data(random_k_blocks(rng, kind, (rows, cols), scale))
    writer.close()
    partial.replace(path)
    return path


def read_bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Bytes per second ``threads`` threads read from memory, each taking the maximum of a
    disjoint slice of a buffer larger than the caches (a reduction that keeps up with memory;
    numpy releases the GIL in it): the best of ``repeats``."""
    data = np.ones(mib << 17, np.uint64)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.max, args=(part,)) for part in parts]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, data.nbytes / (time.perf_counter() - started))
    return best


def _pair_step(target, draft, tokens: int) -> dict:
    """The draft-model pair at depth 4 (adaptive off): seconds per speculative step, tokens/s
    and accepted guesses per step, greedy from a short random prompt."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.proposers import standard_proposers
    from dspark.decoding.sampling import SamplingParams, SpeculativeParams
    from dspark.decoding.stats import DecodeStats

    engine = SpeculativeEngine(target, standard_proposers(draft))
    prompt = list(np.random.default_rng(1).integers(2, target.config.vocab, 16))
    stats = DecodeStats()
    spec = SpeculativeParams("draft", num_speculative_tokens=DRAFT_DEPTH, adaptive=False)
    started = time.perf_counter()
    out = [t for chunk in engine.generate(prompt, SamplingParams(max_tokens=tokens), spec, stats) for t in chunk]
    seconds = time.perf_counter() - started - stats.prefill_s
    return {"step_ms": 1e3 * seconds / max(stats.rounds, 1), "tokens_per_s": (len(out) - 1) / seconds,
            "accepted_per_step": stats.accepted / max(stats.rounds, 1)}


def run_shapes_bench(names: list[str], folder: Path, threads: int = 2, n_layer: Optional[int] = None,
                     rows_list: tuple[int, ...] = (1, 2, 4, 5, 8), repeats: int = 5, tokens: int = 32,
                     peer: bool = True, pair: bool = True, log: Callable[[str], None] = print,
                     shapes: dict[str, Shape] = SHAPES, draft_of: dict[str, str] = DRAFT_OF,
                     bandwidth_mib: int = 1024) -> BenchResult:
    """The measurements above for each shape in ``names`` (of ``shapes``; files written into
    ``folder`` when missing; ``n_layer`` cuts every shape to that many blocks, for a quick
    check); ``draft_of``: the draft shape of a target shape, for the pair's rows."""
    from dspark.bench.llm_kernels import KernelPeer, LlamaCppPeer, step_costs
    from dspark.bench.peers import llama_cpp
    from dspark.llm.kernel_runtime import KernelRuntime

    log(f"measuring read bandwidth ({threads} threads)")
    bandwidth = read_bandwidth(threads, bandwidth_mib)
    wanted = list(dict.fromkeys(names + [draft_of[n] for n in names if pair and n in draft_of]))
    runtimes, costs, rows, notes = {}, {}, [], []
    for name in wanted:
        shape = shapes[name]
        prompt = list(np.random.default_rng(0).integers(2, shape.vocab, 16))
        layers = n_layer or shape.n_layer
        path = folder / f"random-{name}-{layers}l-q4_k_m.gguf"
        if not path.is_file():
            log(f"writing {path} ({bytes_per_token(shape, layers) / 2**30:.2f} GiB of weights read per token)")
            write_shape_gguf(shape, path, layers)
        log(f"{shape.title} shape: loading and measuring")
        runtime = runtimes[name] = KernelRuntime(path, threads=threads, max_context=512)
        step_ms = costs[name] = step_costs({name: runtime}, [128], rows_list, repeats)[name]
        _, decode = KernelPeer(runtime).greedy(prompt, tokens)
        per_token = bytes_per_token(shape, layers)
        row = {"shape": shape.title, "layers": layers, "gib_per_token": per_token / 2**30,
               "decode_tokens_per_s": decode, "ceiling_tokens_per_s": bandwidth / per_token,
               "of_ceiling": decode * per_token / bandwidth}
        row.update({f"rows_{r}": step_ms[f"128/{r}"] / step_ms["128/1"] for r in rows_list if r > 1})
        row["pass_1_row_ms"] = step_ms["128/1"]
        if peer and llama_cpp.available():
            _, row["llama_cpp_tokens_per_s"] = LlamaCppPeer(path, threads, False).greedy(prompt, tokens)
            row["vs_llama_cpp"] = decode / row["llama_cpp_tokens_per_s"]
        if name in names:
            rows.append(row)
    if peer and not llama_cpp.available():
        notes.append("llama.cpp: not installed (make bench-deps), its columns are empty")
    for name in names:
        draft_name = draft_of.get(name)
        if not pair or draft_name is None:
            continue
        measured = _pair_step(runtimes[name], runtimes[draft_name], tokens)
        parts = DRAFT_DEPTH * costs[draft_name]["128/1"] + costs[name][f"128/{DRAFT_DEPTH + 1}"]
        rows.append({"shape": f"{shapes[name].title} + {shapes[draft_name].title} draft",
                     "layers": runtimes[name].config.n_layer, "pair_step_ms": measured["step_ms"],
                     "pair_parts_ms": parts, "pair_glue": measured["step_ms"] / parts,
                     "decode_tokens_per_s": measured["tokens_per_s"],
                     "accepted_per_step": measured["accepted_per_step"]})
    notes.append(f"random weights: for cost only (the pair's acceptance means nothing); read bandwidth "
                 f"{bandwidth / 1e9:.1f} GB/s with {threads} threads; passes at 128 cached rows, medians of "
                 f"{repeats}; pair: depth {DRAFT_DEPTH}, adaptive off, step = one draft chain + one verify pass")
    columns = [Column("shape"), Column("layers"), Column("gib_per_token", "GiB read per token", ".2f"),
               Column("decode_tokens_per_s", "tokens/s", ".2f"),
               Column("ceiling_tokens_per_s", "bandwidth ceiling tokens/s", ".2f"),
               Column("of_ceiling", "of ceiling", ".0%"),
               Column("llama_cpp_tokens_per_s", "llama.cpp tokens/s", ".2f"),
               Column("vs_llama_cpp", "vs llama.cpp", ".2f"),
               Column("pass_1_row_ms", "1-row pass ms", ".1f")]
    columns += [Column(f"rows_{r}", f"{r} rows", ".2f") for r in rows_list if r > 1]
    columns += [Column("pair_step_ms", "pair step ms", ".1f"), Column("pair_parts_ms", "its parts ms", ".1f"),
                Column("pair_glue", "step / parts", ".2f"), Column("accepted_per_step", "accepted per step", ".2f")]
    settings = {"shapes": names, "threads": threads, "n_layer": n_layer, "rows": list(rows_list),
                "repeats": repeats, "tokens": tokens, "folder": str(folder)}
    return BenchResult("shapes", settings, rows, columns, key_fields=["shape"], notes=notes)
