"""Reproduce Triton 2.51's gRPC stream leak that keeps an unloaded model alive (dspark/bench/stream_cancel.py)."""
from dspark.bench.stream_cancel import main

if __name__ == "__main__":
    main()
