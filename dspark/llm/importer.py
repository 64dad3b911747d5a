"""Import a GGUF file into a folder the runtimes serve: ``model.onnx`` (+ ``model.onnx.data``, its
weights), ``tokenizer.json``, ``import.json`` (what it was made from, so an unchanged import is
skipped)."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from dspark.paths import project_root

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
TOKENIZER_FILE = "tokenizer.json"
STAMP_FILE = "import.json"
# Where `make setup` puts the demo model: next to the speculative model that serves it (a folder
# of its own at the top of model_repository/ would be taken by Triton for a model).
SMOLLM2_DIR = Path("model_repository") / "spec_lm" / "1" / "smollm2"
# Sources whose change makes an import stale.
_BUILDER_MODULES = ("gguf_model.py", "quant.py", "onnx_graph.py", "tokenizer.py", "taps.py")


def smollm2_dir() -> Path:
    return project_root() / SMOLLM2_DIR


def import_source(folder: str | Path) -> Path:
    """The GGUF an imported folder was made from (the kernel runtime and drafters read it)."""
    from dspark.errors import ConfigError

    stamp = Path(folder) / STAMP_FILE
    try:
        return Path(json.loads(stamp.read_text())["source"])
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError("source", f"cannot read the imported model's source GGUF: {exc}", stamp) from exc


@dataclass
class ImportResult:
    out_dir: Path
    skipped: bool
    seconds: float


def _stamp(gguf: Path, cache_dtype: str, accuracy_level: int) -> dict:
    here = Path(__file__).resolve().parent
    code = hashlib.sha256(b"".join((here / m).read_bytes() for m in _BUILDER_MODULES)).hexdigest()
    stat = gguf.stat()
    return {"source": str(gguf.resolve()), "source_bytes": stat.st_size,
            "source_mtime_ns": stat.st_mtime_ns, "builder_sha256": code,
            "cache_dtype": cache_dtype, "accuracy_level": accuracy_level}


def import_gguf(gguf: str | Path, out_dir: str | Path, cache_dtype: str = "float32",
                accuracy_level: int = 4, force: bool = False) -> ImportResult:
    """Write the decoder graph and tokenizer of ``gguf`` into ``out_dir``; skip when the folder
    already holds an import of the same file by the same code with the same settings."""
    from dspark.llm.gguf_model import GGUFModel
    from dspark.llm.onnx_graph import build_llama_onnx
    from dspark.llm.tokenizer import LlamaTokenizer
    import onnx

    start = time.perf_counter()
    gguf, out_dir = Path(gguf), Path(out_dir)
    stamp = _stamp(gguf, cache_dtype, accuracy_level) if gguf.is_file() else None
    stamp_path = out_dir / STAMP_FILE
    if not force and stamp and stamp_path.is_file() \
            and all((out_dir / f).is_file() for f in (MODEL_FILE, WEIGHTS_FILE, TOKENIZER_FILE)):
        try:
            if json.loads(stamp_path.read_text()) == stamp:
                return ImportResult(out_dir, True, time.perf_counter() - start)
        except ValueError:
            pass
    model = GGUFModel(gguf)  # refuses what it cannot import, before anything is written
    graph = build_llama_onnx(model, cache_dtype=cache_dtype, accuracy_level=accuracy_level)
    tokenizer = LlamaTokenizer.from_gguf(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp_path.unlink(missing_ok=True)  # a half-written import is never taken for a good one
    # weights in a separate file, which ORT memory-maps: untouched pages (most of the embedding
    # table) never become resident, and no second copy sits in the parsed protobuf
    for name in (MODEL_FILE, WEIGHTS_FILE):  # onnx appends to an existing data file
        (out_dir / name).unlink(missing_ok=True)
    onnx.save(graph, str(out_dir / MODEL_FILE), save_as_external_data=True, location=WEIGHTS_FILE,
              size_threshold=4096)
    tokenizer.save(out_dir / TOKENIZER_FILE)
    stamp_path.write_text(json.dumps(stamp, indent=1) + "\n")
    return ImportResult(out_dir, False, time.perf_counter() - start)
