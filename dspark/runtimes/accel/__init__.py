"""Accelerator layer (engines): ONNX Runtime execution providers (`providers`, `devices`), the
cuBLAS-style GemmEx shim's Python binding (`gemm`), TensorRT engines (`tensorrt_engine`) and
quantized model variants (`quantize`). See docs/accelerators.md."""
