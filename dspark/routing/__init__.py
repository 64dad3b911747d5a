"""routing layer: see docs/ARCHITECTURE.md."""
