"""Check the whole GPU path of the accelerator layer in one run (dspark/accel/gpu_check.py)."""
import sys

from dspark.accel.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
