"""Training the DSpark drafter for SmolLM2-135M-Instruct (torch, CPU build: requirements-train.txt).
Serving never imports this package; torch is imported only where a step needs it."""
