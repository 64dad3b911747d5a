"""The README's gRPC streaming example, run as a user would paste it, against the session server."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dspark.paths import project_root

pytestmark = pytest.mark.integration


def readme_block(containing: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (project_root() / "README.md").read_text(), re.S)
    return next(block for block in blocks if containing in block)


def test_the_readmes_stream_example_ends_with_the_final_response(triton_server):
    code = readme_block("async_stream_infer").replace('"localhost:8001"', repr(triton_server.grpc_url))
    assert "enable_empty_final_response=True" in code
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.split()) >= 5, run.stdout  # the streamed answer, then the loop ended
