"""Check the whole GPU path of the accelerator layer in one run: `dspark accel check`."""
import sys

from dspark.cli.main import cli

if __name__ == "__main__":
    cli(['accel', 'check', *sys.argv[1:]], prog_name="dspark")
