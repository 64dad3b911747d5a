"""`dspark repo`: ModelSpec YAML <-> config.pbtxt, semantic versions <-> version folders."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from dspark.cli.lazy import LazyChoice
from dspark.paths import demo_repositories

# dspark.repository (protobuf, tritonclient, pydantic) is imported by the commands, so other
# commands' start-up does not pay for it


def _frameworks() -> list[str]:
    from dspark.repository.modelspec import FRAMEWORKS

    return sorted(FRAMEWORKS)


def _repositories(paths) -> list[Path]:
    return list(paths) or demo_repositories()


@click.group()
def repo() -> None:
    """Manage a model repository through modelspec.yaml files."""


@repo.command()
@click.argument("repository", type=click.Path(path_type=Path), default=Path("model_repository"))
def init(repository: Path) -> None:
    """Create REPOSITORY, and write a modelspec.yaml for each model that has only a config.pbtxt."""
    from dspark.repository import repo as repository_ops
    from dspark.repository.modelspec import SpecError

    try:
        written = repository_ops.init_repository(repository)
    except SpecError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"repository {repository}: {len(written)} model(s) adopted")
    for path in written:
        click.echo(f"  wrote {path}")


@repo.command()
@click.argument("name")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--version", "semver", required=True, help="Semantic version of this artifact, e.g. 1.2.0.")
@click.option("--framework", type=LazyChoice(_frameworks), default=None,
              help="Needed for a new model whose file ending does not say it.")
@click.option("--repository", "-r", type=click.Path(path_type=Path), default=Path("model_repository"),
              show_default=True)
def add(name: str, artifact: Path, semver: str, framework, repository: Path) -> None:
    """Add ARTIFACT as a new version of model NAME (creating the model if it is new)."""
    from dspark.repository import repo as repository_ops
    from dspark.repository.modelspec import SpecError

    try:
        record = repository_ops.add_version(repository, name, artifact, semver, framework)
    except SpecError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{name} {record.semver} -> {repository / name / str(record.folder) / record.artifact}")


@repo.command()
@click.argument("repositories", nargs=-1, type=click.Path(path_type=Path))
def validate(repositories) -> None:
    """Check every model in the repositories (default: the demo ones); exit 1 on any problem."""
    from dspark.repository import repo as repository_ops

    repositories = _repositories(repositories)
    problems = repository_ops.validate(repositories)
    for problem in problems:
        click.echo(f"error: {problem}", err=True)
    entries, _ = repository_ops.load_entries(repositories)
    if problems:
        click.echo(f"{len(problems)} problem(s) in {len(entries)} model(s)", err=True)
        sys.exit(1)
    click.echo(f"ok: {len(entries)} model(s) valid")


@repo.command(name="list")
@click.argument("repositories", nargs=-1, type=click.Path(path_type=Path))
def list_models(repositories) -> None:
    """Each model with its backend and its semantic version -> folder mapping."""
    from dspark.repository import repo as repository_ops

    entries, problems = repository_ops.load_entries(_repositories(repositories))
    click.echo(f"{'model':<24} {'backend':<18} {'serves':<8} versions (semver -> folder)")
    for entry in entries:
        config = entry.config
        backend = (config.platform or config.backend) if config is not None else "?"
        if entry.spec is not None:
            versions = ", ".join(f"{r.semver}->{r.folder}" for r in entry.spec.versions) or "-"
            serves = entry.spec.serve_versions if isinstance(entry.spec.serve_versions, str) else "some"
        else:
            versions = ", ".join(str(n) for n in entry.version_folders()) + " (no modelspec.yaml)"
            serves = "?"
        click.echo(f"{entry.name:<24} {backend:<18} {serves:<8} {versions}")
    for problem in problems:
        click.echo(f"error: {problem}", err=True)


@repo.command()
@click.argument("names", nargs=-1)
@click.option("--repository", "-r", type=click.Path(path_type=Path), default=Path("model_repository"),
              show_default=True)
def sync(names, repository: Path) -> None:
    """Rewrite config.pbtxt from modelspec.yaml (all models, or the NAMES given)."""
    from dspark.repository import repo as repository_ops
    from dspark.repository.modelspec import SpecError

    try:
        written = repository_ops.sync(repository, names)
    except SpecError as error:
        raise click.ClickException(str(error)) from None
    for path in written:
        click.echo(f"wrote {path}")


@repo.command()
@click.argument("name")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--version", "semver", required=True, help="Semantic version of this artifact, e.g. 1.2.0.")
@click.option("--repository", "-r", type=click.Path(path_type=Path), default=Path("model_repository"),
              show_default=True)
@click.option("--server", "-s", "servers", multiple=True, required=True,
              help="HTTP endpoint of a server with explicit model control (repeat for a fleet).")
@click.option("--api-key", envvar="DSPARK_API_KEY", default=None,
              help="Key for the servers' model-repository API (header dspark-api-key); default $DSPARK_API_KEY.")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True, help="Seconds to wait for the load.")
def publish(name: str, artifact: Path, semver: str, repository: Path, servers, api_key, timeout_s: float) -> None:
    """Add ARTIFACT as a new version of NAME and make it live on running servers, no controller:
    each server loads it beside the current version and, once it is ready, drops the old one
    (a model served as "latest"). For shadow, canary and rollback use `dspark rollout run`."""
    from dspark.errors import DsparkError
    from dspark.repository import repo as repository_ops
    from dspark.repository.modelspec import SpecError
    from dspark.rollout.fleet import Endpoint, Server

    try:
        endpoints = [Endpoint.parse(url) for url in servers]
        record = repository_ops.add_version(repository, name, artifact, semver)
    except (SpecError, DsparkError) as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{name} {record.semver} -> {repository / name / str(record.folder)}")
    for endpoint in endpoints:
        server = Server(endpoint, api_key, timeout_s)
        try:
            server.load(name)
            if not server.wait_ready(name, record.folder, True, timeout_s):
                raise click.ClickException(f"{endpoint.url}: version {record.folder} of {name} is not ready "
                                           f"(its version policy may not serve it: see {repository / name / 'modelspec.yaml'})")
        except DsparkError as error:
            raise click.ClickException(str(error)) from None
        finally:
            server.close()
        click.echo(f"{endpoint.url}: {name} {record.semver} (version {record.folder}) live")
