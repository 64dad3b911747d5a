"""repository layer: see docs/ARCHITECTURE.md."""
