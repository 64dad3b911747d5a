"""Train the DSpark drafter: `dspark train gather | vocab | train | export` (dspark/training/)."""
import sys

from dspark.cli.main import cli

if __name__ == "__main__":
    cli(['train', *sys.argv[1:]], prog_name="dspark")
