"""Hot reload without a controller: a version added with `dspark repo add` to a repository a
server polls, or made live with `dspark repo publish` on a server with explicit model control,
takes over with zero failed requests from clients calling the model (no version named)."""
from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

from tests.conftest import TEST_EXIT_TIMEOUT_S, dump_log_on_failure
from dspark.cli.repo import repo as repo_cli
from dspark.rollout import demo
from dspark.server.launcher import TritonServer

pytestmark = pytest.mark.integration
MODEL = "hot_demo"


@pytest.fixture(scope="module", params=["poll", "explicit"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"hot-{request.param}")
    repo = demo.build_repository(root / "repo", model=MODEL, router=False)
    server = TritonServer([repo], model_control=request.param, exit_timeout_s=TEST_EXIT_TIMEOUT_S,
                          load_models=[MODEL] if request.param == "explicit" else ())
    failed_before = request.session.testsfailed
    server.start()
    load = demo.LoadGenerator([server.http_url], model=MODEL, threads_per_server=3).start()
    try:
        yield request.param, root, repo, server, load
    finally:
        load.stop()
        dump_log_on_failure(request, server, failed_before)
        server.stop()


def test_new_version_goes_live_with_zero_failed_requests(served):
    mode, root, repo, server, load = served
    runner = CliRunner()
    for folder, semver in ((2, "1.1.0"), (3, "1.2.0")):
        artifact = demo.model_artifact(root / f"model-{semver}.py", semver)
        if mode == "poll":
            out = runner.invoke(repo_cli, ["add", MODEL, str(artifact), "--version", semver, "-r", str(repo)])
        else:
            out = runner.invoke(repo_cli, ["publish", MODEL, str(artifact), "--version", semver, "-r", str(repo),
                                           "--server", server.http_url, "--api-key", server.api_key])
            assert f"{MODEL} {semver} (version {folder}) live" in out.output, out.output
        assert out.exit_code == 0, out.output
        deadline = time.monotonic() + 30  # poll mode: Triton looks every 2 s
        while load.versions(since=time.monotonic() - 0.3) != {folder}:
            assert time.monotonic() < deadline, f"version {folder} never took over: {load.versions(time.monotonic() - 1)}"
            time.sleep(0.2)
    assert len(load.results) > 50  # clients were busy all along
    assert not load.failures(), load.failures()[:3]
