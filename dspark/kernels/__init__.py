"""kernels layer: see docs/ARCHITECTURE.md."""
