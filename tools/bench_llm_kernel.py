"""Benchmark of dspark's llama kernels on SmolLM2-135M-Instruct or another GGUF (dspark/bench/llm_kernels.py)."""
from dspark.bench.llm_kernels import main

if __name__ == "__main__":
    main()
