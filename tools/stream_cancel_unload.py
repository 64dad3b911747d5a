"""Reproduce Triton 2.51's gRPC stream that keeps an unloaded model alive: `dspark bench stream-cancel`."""
import sys

from dspark.cli.main import cli

if __name__ == "__main__":
    cli(['bench', 'stream-cancel', *sys.argv[1:]], prog_name="dspark")
