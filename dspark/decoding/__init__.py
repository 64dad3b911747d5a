"""decoding layer: see docs/ARCHITECTURE.md."""
