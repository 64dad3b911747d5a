"""Benchmark the DSpark drafter: `dspark bench drafter` (dspark/bench/drafter.py)."""
import sys

from dspark.cli.main import cli

if __name__ == "__main__":
    cli(['bench', 'drafter', *sys.argv[1:]], prog_name="dspark")
