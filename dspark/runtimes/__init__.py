"""Runtimes that run a model: ONNX Runtime sessions, the fused transformer on dspark's kernels, accelerator providers (accel/)."""
