"""cli layer: see docs/ARCHITECTURE.md."""
