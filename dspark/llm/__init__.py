"""LLMs from GGUF files: reader, tokenizers, target runtimes, reference and evaluation."""
