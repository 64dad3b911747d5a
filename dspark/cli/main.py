"""`dspark`: the command line. Each command lives in its own module, named in COMMANDS and imported
only when it runs (or when `dspark --help` lists it), so a command starts without the others'
imports."""
import click

from dspark import __version__
from dspark.cli.lazy import lazy_group

# command name -> "module:attribute" of its click command
COMMANDS = {
    "serve": "dspark.cli.serve:serve",
    "demo": "dspark.cli.serve:demo",
    "repo": "dspark.cli.repo:repo",
    "info": "dspark.cli.info:info",
    "bench": "dspark.cli.bench:bench",
    "route": "dspark.cli.route:route",
    "quantize": "dspark.cli.quantize:quantize",
    "llm": "dspark.cli.llm:llm",
    "rollout": "dspark.cli.rollout:rollout",
    "accel": "dspark.cli.accel:accel",
    "trace": "dspark.cli.trace:trace",
    "train": "dspark.cli.train:train",
}


@lazy_group(COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dspark")
def cli() -> None:
    """Triton Inference Server plugins: serve, manage repositories, benchmark."""


def main() -> None:
    cli()
