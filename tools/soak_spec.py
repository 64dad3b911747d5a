"""Soak the speculative backend (dspark/bench/soak.py); not part of `make test`."""
from dspark.bench.soak import main

if __name__ == "__main__":
    main()
