"""An OpenAI-compatible endpoint (/v1/models, /v1/completions, /v1/chat/completions) in front of
the LLMs Triton serves with dspark's `speculative` backend; started by `dspark serve --openai-port`."""
