"""dspark: Triton Inference Server plugins (backends, kernels, repository tools)."""
__version__ = "0.1.0"
