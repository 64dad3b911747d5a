"""triton layer: see docs/ARCHITECTURE.md."""
