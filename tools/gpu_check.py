"""Check the whole GPU path of the accelerator layer in one run (dspark/runtimes/accel/gpu_check.py)."""
import sys

from dspark.runtimes.accel.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
