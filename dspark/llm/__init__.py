"""The real-LLM runtime (issue 10): GGUF reader, tokenizer, target runtimes."""
