"""Soak the speculative backend: `dspark bench soak` (dspark/bench/soak.py); not part of `make test`."""
import sys

from dspark.cli.main import cli

if __name__ == "__main__":
    cli(['bench', 'soak', *sys.argv[1:]], prog_name="dspark")
