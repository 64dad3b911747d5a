"""Helpers for backends/*/model.py that need no pb_utils: Triton errors, stub facts."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from dspark.errors import error_code


def triton_error(pb_utils: Any, error: BaseException, context: str = "") -> Any:
    """Any exception as a `pb_utils.TritonError` with the code dspark's error model gives it
    (dspark.errors); the one place where that mapping happens. ``pb_utils`` is passed in so this
    module imports no Triton code. ``context`` prefixes the message of unexpected (INTERNAL) errors."""
    code = error_code(error)
    message = str(error) or type(error).__name__
    if code == "INTERNAL" and context:
        message = f"{context}: {message}"
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL))


def stub_version_dir() -> Optional[Path]:
    """The version folder being loaded, as the Python backend stub was told on its command line.

    `auto_complete_config` gets no model path from Triton; the stub's argv[1] is
    `<repository>/<model>/<version>/model.py`. None where /proc is not available.
    """
    try:
        argv = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if len(argv) < 2 or not argv[1]:
        return None
    return Path(argv[1].decode()).parent


def server_http_url(argv: Optional[list[str]] = None) -> Optional[str]:
    """``host:port`` of the HTTP endpoint of the tritonserver this stub belongs to, from the
    server's command line (the stub's parent; ``argv`` for tests), or None when HTTP is off.

    A Python model learns of its unload only through finalize, after its last request ended; a
    model with long requests in flight asks the server's health endpoints instead (the stub's
    own model-readiness call can block while the server stops)."""
    if argv is None:
        try:
            argv = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            return None
    options: dict[str, str] = {}
    for arg, following in zip(argv[1:], [*argv[2:], ""]):
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            options[key] = value if "=" in arg else following
    if options.get("allow-http", "true").lower() in ("false", "0", "no"):
        return None
    host = options.get("http-address", "0.0.0.0")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    return f"{host}:{options.get('http-port', '8000')}"
