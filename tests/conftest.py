"""Shared fixtures: one real tritonserver for the session, serving the demo repositories."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from dspark.paths import demo_repositories
from dspark.server.launcher import TritonServer
from dspark.server.access import DEFAULT_HEADER_PATTERN, header_forward_args

LOG_TAIL_LINES = 200


def pytest_sessionstart(session: pytest.Session) -> None:
    """The test fixture GGUF pair (tests/fixtures/gguf_pair.py), written and imported once."""
    from tests.fixtures.gguf_pair import build_all

    build_all()
# Triton's exit timeout for test servers: a fixture's stop exits at once (Triton would otherwise
# wait for its models to unload, 1-3 s a server, and for clients' idle keep-alive connections);
# TritonServer.stop kills the stubs left and removes their shared memory. The tests of a clean
# stop set their own timeout.
TEST_EXIT_TIMEOUT_S = 0
# How often the routers of test repositories re-read their routing file (the default 500 ms is
# the wait of every routing change a test makes): a change applies within ~0.1 s.
TEST_ROUTER_POLL_MS = 100


def dump_log_on_failure(request: pytest.FixtureRequest, server: TritonServer, failed_before: int) -> None:
    """Print the end of the server log when a test that used it failed."""
    if request.session.testsfailed > failed_before:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        lines = server.log_text().splitlines()[-LOG_TAIL_LINES:]
        reporter.write_line(f"\n----- tritonserver log ({server.log_path}), last {len(lines)} lines -----")
        for line in lines:
            reporter.write_line(line)


@contextmanager
def serving(request: pytest.FixtureRequest, repositories: Sequence[Path], extra_args: Sequence[str] = (),
            **options) -> Iterator[TritonServer]:
    """A real server on free ports for a fixture: headers forwarded, log dumped if a test failed.

    ``extra_args`` are more tritonserver flags; ``options`` go to TritonServer (e.g.
    model_control="explicit": then ``server.repository_headers`` carry the generated API key that
    load/unload calls need)."""
    server = TritonServer(repositories=repositories, exit_timeout_s=TEST_EXIT_TIMEOUT_S,
                          extra_args=[*header_forward_args(DEFAULT_HEADER_PATTERN), *extra_args], **options)
    failed_before = request.session.testsfailed
    server.start()
    try:
        yield server
    finally:
        dump_log_on_failure(request, server, failed_before)
        server.stop()


@pytest.fixture(scope="session")
def triton_server(request: pytest.FixtureRequest):
    """The demo repositories (model_repository/ + ensembles/) on a real server, free ports."""
    with serving(request, demo_repositories()) as server:
        yield server
