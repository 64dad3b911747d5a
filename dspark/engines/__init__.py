"""engines layer: see docs/ARCHITECTURE.md."""
