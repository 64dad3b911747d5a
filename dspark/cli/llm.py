"""`dspark llm ...`: the real LLM (dspark/llm): import a GGUF file into a servable folder."""
from __future__ import annotations

from pathlib import Path

import click

from dspark.errors import ConfigError


@click.group()
def llm() -> None:
    """Real LLMs from GGUF files (llama architecture)."""


@llm.command(name="import")
@click.argument("gguf", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--cache-dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="KV cache type in the graph (ORT's CPU attention casts a float16 cache on every call).")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=4, show_default=True,
              help="MatMulNBits accuracy_level: 4 = int8 activations (fastest here), 0/1 = float.")
@click.option("--force", is_flag=True, help="Rebuild even when OUT_DIR holds an import of the same file.")
def import_(gguf: Path, out_dir: Path, cache_dtype: str, accuracy_level: int, force: bool) -> None:
    """Turn GGUF (llama architecture; F32/F16/BF16/Q8_0/Q4_0/Q4_1 weights) into OUT_DIR/model.onnx
    and OUT_DIR/tokenizer.json."""
    from dspark.llm.importer import import_gguf

    try:
        result = import_gguf(gguf, out_dir, cache_dtype=cache_dtype, accuracy_level=accuracy_level,
                             force=force)
    except ConfigError as error:
        raise click.ClickException(str(error)) from None
    verb = "up to date" if result.skipped else f"imported in {result.seconds:.1f} s"
    click.echo(f"{out_dir}: {verb} ({gguf.name})")
