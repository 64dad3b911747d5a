"""`dspark`: the command line. Each command lives in its own module, registered in COMMANDS."""
import click

from dspark import __version__
from dspark.cli import accel, bench, info, llm, quantize, repo, rollout, route, serve, trace, train

COMMANDS = [
    serve.serve,
    serve.demo,
    repo.repo,
    info.info,
    bench.bench,
    route.route,
    quantize.quantize,
    llm.llm,
    rollout.rollout,
    accel.accel,
    trace.trace,
    train.train,
]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dspark")
def cli() -> None:
    """Triton Inference Server plugins: serve, manage repositories, benchmark."""


for command in COMMANDS:
    cli.add_command(command)


def main() -> None:
    cli()
