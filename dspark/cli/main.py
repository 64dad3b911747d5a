"""`dspark`: the command line. Each command lives in its own module, registered in COMMANDS."""
import click

from dspark import __version__
from dspark.cli import bench, bench_router, info, llm, repo, route, serve
from dspark.cli import bench_spec, kernels  # noqa: F401  (add `bench spec`, `bench kernels`, `bench pool`)

COMMANDS = [
    serve.serve,
    serve.demo,
    repo.repo,
    info.info,
    bench.bench,
    route.route,
    llm.llm,
]
bench.bench.add_command(bench_router.router)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dspark")
def cli() -> None:
    """Triton Inference Server plugins: serve, manage repositories, benchmark."""


for command in COMMANDS:
    cli.add_command(command)


def main() -> None:
    cli()
