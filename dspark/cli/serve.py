"""`dspark serve` and `dspark demo`: run Triton on a repository with dspark's backends."""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Sequence

import click

from dspark.paths import demo_repositories
from dspark.server.launcher import ServerPorts, StartCancelled, TritonServer, is_remote_repository
from dspark.server.access import API_KEY_ENV, API_KEY_HEADER, DEFAULT_HEADER_PATTERN, LOOPBACK, ServerError, header_forward_args, is_loopback


DEMO_OPENAI_PORT = 8003


def server_options(function):
    options = [
        click.option("--repository", "-r", "repositories", multiple=True,
                     help="Model repository (repeatable): a folder, or s3://[host:port/]bucket/path (also gs://, "
                          "as://). Default: the demo model_repository/ and ensembles/."),
        click.option("--host", default=LOOPBACK, show_default=True,
                     help="Address to listen on. Loopback by default; 0.0.0.0 exposes the server to the network."),
        click.option("--metrics-host", default=LOOPBACK, show_default=True,
                     help="Address of the metrics port. Loopback by default whatever --host says: Triton's "
                          "/metrics takes no key and its series name every model."),
        click.option("--http-port", default=8000, show_default=True),
        click.option("--grpc-port", default=8001, show_default=True),
        click.option("--metrics-port", default=8002, show_default=True),
        click.option("--model-control", type=click.Choice(["none", "explicit", "poll"]), default="none",
                     show_default=True, help="Triton's model control mode."),
        click.option("--load-model", "load_models", multiple=True,
                     help="With --model-control explicit: a model to load at start (repeatable)."),
        click.option("--api-key", envvar=API_KEY_ENV, default=None, show_envvar=True,
                     help=f"Key clients must send in the {API_KEY_HEADER} header to use Triton's model-repository "
                          "(load/unload), shared-memory, logging, trace and statistics APIs. Prefer the "
                          "environment variable: a command line is visible to every local user. "
                          "Default: a new random key, written to a file only you can read, whose path is printed."),
        click.option("--log-verbose", default=0, show_default=True, help="Triton's log verbosity."),
        click.option("--log-file", type=click.Path(path_type=Path), default=None,
                     help="Where the server log goes and stays (default: a temporary folder, removed when the "
                          "server stops cleanly)."),
        click.option("--server", "server_path", default=None,
                     help="Path of a tritonserver binary (default: $TRITONSERVER, the nvidia-pytriton wheel, PATH)."),
        click.option("--forward-headers", default=DEFAULT_HEADER_PATTERN, show_default=True,
                     help="Regex of HTTP/gRPC headers Triton forwards to models as request parameters."),
        click.option("--exit-on-error/--keep-serving", default=True, show_default=True,
                     help="Whether a model that fails to load stops the server (Triton's default), or the "
                          "server serves the other models and prints why that one failed."),
        click.option("--exit-timeout", "exit_timeout_s", type=click.IntRange(0, 86400), default=30,
                     show_default=True,
                     help="Seconds a stop waits for running requests, model unloads and clients' open HTTP "
                          "connections (idle keep-alive ones too) before Triton exits anyway (exit code 1)."),
        click.option("--key-inference", is_flag=True,
                     help="Inference needs the API key too (HTTP header / gRPC metadata, as for the other "
                          "restricted APIs). Without it anyone who can reach the server may run inference, and "
                          "use a client's shared-memory region if they know the name it was registered under "
                          "(register under dspark.server.access.new_region_name())."),
        click.option("--allow-shared-repository", is_flag=True,
                     help="Serve a repository whose folders (the repository, a model's, a version's) its group "
                          "or other users may write, with a warning for each; refused otherwise, since whoever "
                          "can write there can have the server run their code."),
        click.option("--openai-port", type=click.IntRange(1, 65535), default=None,
                     help="Also serve the OpenAI-compatible API (/v1/chat/completions, ...) on this port, on "
                          "--host. Off by default. Beyond loopback it needs the API key as a Bearer token."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def start_server(repositories: Sequence[Path], host: str, metrics_host: str, http_port: int, grpc_port: int,
                 metrics_port: int, model_control: str, load_models: Sequence[str], api_key, log_verbose: int, log_file, server_path,
                 forward_headers: str, exit_on_error: bool = True, exit_timeout_s: int = 30,
                 openai_port=None, allow_shared_repository: bool = False,
                 key_inference: bool = False) -> tuple[TritonServer, object]:
    """Start the server (and the OpenAI API when ``openai_port``: the second item, else None), or
    exit with one line saying why it could not."""
    try:
        extra = header_forward_args(forward_headers) if forward_headers else []
        server = TritonServer(
            repositories=[r if is_remote_repository(r) else Path(r) for r in repositories] or demo_repositories(),
            ports=ServerPorts(http=http_port, grpc=grpc_port, metrics=metrics_port),
            model_control=model_control,
            load_models=load_models,
            log_verbose=log_verbose,
            log_path=log_file,
            server_path=server_path,
            extra_args=extra,
            host=host,
            metrics_host=metrics_host,
            api_key=api_key,
            exit_on_error=exit_on_error,
            exit_timeout_s=exit_timeout_s,
            allow_shared_repository=allow_shared_repository,
            key_inference=key_inference,
        )
        for warning in server.warnings:
            click.echo(f"dspark: warning: {warning} (--allow-shared-repository)", err=True)
        context = click.get_current_context(silent=True)
        if api_key and context and context.get_parameter_source("api_key") == click.core.ParameterSource.COMMANDLINE:
            click.echo(f"dspark: warning: --api-key on the command line is visible to every local user in the "
                       f"process list; set {API_KEY_ENV} instead", err=True)
        if not is_loopback(host):
            exposed = f"HTTP port {http_port}, gRPC port {grpc_port}" + \
                (f", OpenAI port {openai_port}" if openai_port else "")
            click.echo(f"dspark: warning: --host {host} makes the server reachable from other machines ({exposed}); "
                       "anyone who can reach it can run inference", err=True)
        if not is_loopback(metrics_host):
            click.echo(f"dspark: warning: --metrics-host {metrics_host} makes metrics port {metrics_port} reachable "
                       "from other machines, without a key (its series name every model)", err=True)
        signals_seen = stop_on_signal_while_starting(server)
        server.start()
    except ServerError as error:
        click.echo(f"dspark: {error}", err=True)
        sys.exit(1)
    except (StartCancelled, KeyboardInterrupt):  # start() has stopped the server already
        name = signal.Signals(signals_seen[0]).name if signals_seen else "SIGINT"
        click.echo(f"dspark: {name} while the server was starting; stopped it", err=True)
        sys.exit(128 + (signals_seen[0] if signals_seen else signal.SIGINT))
    for failure in server.load_failures():
        click.echo(f"dspark: warning: {failure} (serving the other models: --keep-serving)", err=True)
    click.echo(f"dspark: serving {', '.join(str(r) for r in server.repositories)}")
    click.echo(f"  HTTP     http://{server.http_url}")
    click.echo(f"  gRPC     {server.grpc_url}")
    click.echo(f"  metrics  {server.metrics_url}")
    click.echo(f"  log      {server.log_path}" + ("" if log_file else " (removed at a clean stop; --log-file keeps it)"))
    shown = "from --api-key / " + API_KEY_ENV if api_key else f"in {server.key_path} (readable by you alone)"
    click.echo(f"  API key  {shown} (send it as the {API_KEY_HEADER} header to load/unload models, "
               "register shared memory, change logging or trace settings, read statistics)")
    api = start_openai(server, host, openai_port, explicit_key=api_key) if openai_port else None
    return server, api


def stop_on_signal_while_starting(server: TritonServer) -> list[int]:
    """SIGINT/SIGTERM handlers, installed before tritonserver is started, that cancel the start
    (start() then stops the server) or, once it is ready, drain it: a signal's default action
    would end this process and leave the server (in its own session) running alone. The
    signals seen, in order."""
    seen: list[int] = []

    def cancel(signum, _frame):
        seen.append(signum)
        server.cancel_start()
        if len(seen) > 1:
            server.kill()
        elif server.ready:  # after start() returned, before serve_until_signal took over: drain
            server.terminate()

    signal.signal(signal.SIGINT, cancel)
    signal.signal(signal.SIGTERM, cancel)
    return seen


def start_openai(server: TritonServer, host: str, port: int, explicit_key):
    """The OpenAI-compatible API on a thread of this process. It needs a key when the user gave
    one or when it listens beyond loopback (then the server's key, printed)."""
    from dspark.openai.server import OpenAIServer

    key = explicit_key or (None if is_loopback(host) else server.api_key)
    api = OpenAIServer(host, port, server.http_url, key, server.repository_headers)
    try:
        api.start()
    except RuntimeError as error:
        click.echo(f"dspark: {error}", err=True)
        server.stop()
        sys.exit(1)
    click.echo(f"  OpenAI   {api.url}" + ("" if key is None else
               " (Authorization: Bearer <the API key>)"))
    return api


def stop_serving(server: TritonServer, api) -> None:
    """The OpenAI API first: Triton's shutdown waits for every HTTP connection to close, and the
    API keeps its connections to Triton alive until it stops."""
    if api is not None:
        api.stop()
    server.stop()


def serve_until_signal(server: TritonServer, api=None, ready: str = "") -> None:
    """Forward SIGINT/SIGTERM to the server (and the OpenAI API, when ``api``) as a clean drain (a
    second one kills the server); exit with its code. ``ready`` is printed once the signals are
    forwarded: a supervisor that stops the server as soon as it reads it gets a clean stop."""
    signals_seen = []

    def shut_down(signum, _frame):
        signals_seen.append(signum)
        if len(signals_seen) == 1:
            click.echo(f"dspark: {signal.Signals(signum).name}: stopping the server (draining requests; "
                       "again to kill)")
            if api is not None:  # once its requests have ended, it closes its connections to Triton
                api.request_stop()
            server.terminate()
        else:
            server.kill()

    signal.signal(signal.SIGINT, shut_down)
    signal.signal(signal.SIGTERM, shut_down)
    if ready:
        click.echo(ready)
    code = server.wait()
    stopped_by_us = signals_seen and code in (-signal.SIGTERM, -signal.SIGKILL)
    if code != 0 and not stopped_by_us:
        click.echo(f"dspark: tritonserver exited with code {code}: {server.exit_reason(code)} "
                   f"(log: {server.log_path})", err=True)
        stop_serving(server, api)
        removed = server.left_shm_regions
        if removed:
            click.echo(f"dspark: removed the {len(removed)} shared-memory regions its model stubs left", err=True)
        sys.exit(1)
    stop_serving(server, api)


@click.command()
@server_options
def serve(**options) -> None:
    """Start Triton on a model repository with dspark's backends; Ctrl-C stops it cleanly."""
    server, api = start_server(**options)
    serve_until_signal(server, api, "dspark: ready; press Ctrl-C to stop")


@click.command()
@server_options
@click.option("--exit", "exit_after", is_flag=True, help="Stop the server after the sample requests.")
def demo(exit_after: bool, **options) -> None:
    """Serve the demo repository (and the OpenAI API, on --openai-port or 8003), send it sample
    requests over HTTP, gRPC and the OpenAI API, print the answers."""
    from dspark.cli.demo_client import run_samples

    options["openai_port"] = options["openai_port"] or DEMO_OPENAI_PORT
    server, api = start_server(**options)
    try:
        run_samples(server.http_url, server.grpc_url, echo=click.echo, openai_url=api.url)
    except Exception as error:  # show the failure, and the server's view of it
        click.echo(f"dspark: sample request failed: {error}; server said: {server.first_error()}", err=True)
        stop_serving(server, api)
        sys.exit(1)
    if exit_after:
        stop_serving(server, api)
        return
    serve_until_signal(server, api, "dspark: still serving the demo repository; try the curl calls in README.md; "
                                    "Ctrl-C stops it")
