"""DSpark on the real target, in process, against plain decoding (dspark/bench/drafter.py)."""
from dspark.bench.drafter import main

if __name__ == "__main__":
    main()
