"""dspark's LLM kernels against llama.cpp: `dspark bench llm-kernels` (dspark/bench/llm_kernels.py)."""
import sys

from dspark.cli.main import cli

if __name__ == "__main__":
    cli(['bench', 'llm-kernels', *sys.argv[1:]], prog_name="dspark")
