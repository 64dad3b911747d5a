"""Who may use a started server: its API key for Triton's restricted APIs (given to the server
through a pipe, never its command line or environment), the headers forwarded to models (never
the key's), and the addresses it binds (loopback unless the user opts in)."""
from __future__ import annotations

import ipaddress
import itertools
import re
import secrets
import stat
from pathlib import Path
from typing import Optional

import re2

from dspark import _ext

# Headers Triton passes to models as request parameters (the router reads dspark-tier, dspark-user-id).
# Triton forwards a header to models when its RE2 pattern matches anywhere in the name
# (PartialMatch), so the default names the router's headers exactly: "dspark-.*" would also hand
# every model the API key. Header names are case-insensitive; RE2 matches them as sent.
DEFAULT_HEADER_PATTERN = "(?i)^dspark-(tier|user-id)$"
LOOPBACK = "127.0.0.1"
# Triton's APIs that answer only requests carrying this header with the server's key, in every
# model-control mode: the model-repository API (load, unload, index) can load code; through
# shared memory a client can have the server write into any region it names, a model stub's IPC
# region included (which crashed the server); logging and trace change what the server writes
# where; statistics tell who runs what, and no dspark client needs them. Health, metadata,
# model-config and inference stay open.
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace", "statistics")
API_KEY_HEADER = "dspark-api-key"
# Triton's gRPC side looks for the key under this prefixed metadata name.
GRPC_API_KEY_HEADER = f"triton-grpc-protocol-{API_KEY_HEADER}"
API_KEY_ENV = "DSPARK_API_KEY"
API_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~-]{16,256}")
# The key reaches tritonserver through a pipe: its command line holds KEY_MARKER, which the
# preloaded guard library (cython_ext/guard/server_guard.c) replaces with what it reads from the
# descriptor named by KEY_FD_ENV, so the key is in no process list and no stub's environment.
KEY_MARKER = "@DSPARK_API_KEY@"
KEY_FD_ENV = "DSPARK_KEY_FD"
# Set to the launcher's pid, the guard library has tritonserver SIGTERMed when its parent dies.
PARENT_PID_ENV = "DSPARK_PARENT_PID"
GUARD_LIBRARY = "libserverguard.so"
# Files the server and its stubs create are the user's alone; the guard library makes the
# Python backend's /dev/shm IPC regions (which hold requests and responses) honour it too.
SERVER_UMASK = 0o077



class ServerError(RuntimeError):
    """The server could not be found or did not start; the message says why and how to fix it."""


def new_api_key() -> str:
    """A random key for the restricted APIs (256 bits, URL-safe characters)."""
    return secrets.token_urlsafe(32)


def check_api_key(key: str) -> str:
    """The key as given, or ServerError saying what a key must look like."""
    if not API_KEY_PATTERN.fullmatch(key):
        raise ServerError(f"--api-key / {API_KEY_ENV}: must be 16 to 256 characters from A-Z a-z 0-9 . _ ~ - "
                          f"(got {len(key)} characters); leave it unset to have one generated")
    return key


def repository_headers(api_key: Optional[str]) -> dict[str, str]:
    """Headers for calls to the restricted APIs (tritonclient's `headers=`), good for HTTP and gRPC clients."""
    return {API_KEY_HEADER: api_key, GRPC_API_KEY_HEADER: api_key} if api_key else {}


# Inference names client shared-memory regions by their registered name (an input's or an
# output's `shared_memory_region` parameter), which Triton resolves in its frontend before any
# backend sees the request: a backend cannot tell, so a region registered under a name others
# can guess is readable and writable by anyone who can run inference. Keying inference too
# (`key_inference`) closes that; the default keeps inference open and registers under names
# new_region_name() makes, which nobody can guess.
INFERENCE_API = "inference"


def restricted_api_args(key_inference: bool = False) -> list[str]:
    """Triton flags that refuse calls to RESTRICTED_APIS (and inference, when ``key_inference``)
    over HTTP and gRPC without the key (KEY_MARKER stands for it)."""
    apis = ",".join(RESTRICTED_APIS + ((INFERENCE_API,) if key_inference else ()))
    return [f"--http-restricted-api={apis}:{API_KEY_HEADER}={KEY_MARKER}",
            f"--grpc-restricted-protocol={apis}:{API_KEY_HEADER}={KEY_MARKER}"]


def new_region_name() -> str:
    """A name to register a client shared-memory region under that nobody can guess (128 random
    bits): inference names a region by it, and without --key-inference anyone may run inference."""
    return f"dspark-{secrets.token_hex(16)}"


def guard_library() -> Path:
    """The library preloaded into tritonserver (cython_ext/guard/server_guard.c); ServerError if not built."""
    path = Path(_ext.__file__).parent / GUARD_LIBRARY
    if not path.is_file():
        raise ServerError(f"{path} is missing: build it with `make setup` (pip install -e .)")
    return path


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def check_host(host: str, option: str = "--host") -> str:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ServerError(f"{option} {host!r}: expected an IP address such as 127.0.0.1 (the default), "
                          "::1, or 0.0.0.0 for every interface") from None
    return host


def _letter_cases(name: str) -> list[str]:
    """`name` in every mix of lower and upper case letters, all lower case first."""
    return ["".join(letters) for letters in itertools.product(*(dict.fromkeys((c.lower(), c.upper())) for c in name))]


def header_forward_args(pattern: str) -> list[str]:
    """Triton flags that forward HTTP and gRPC headers matching `pattern` to models; ServerError
    when the pattern is not one Triton's RE2 takes, or would forward the API key header: its HTTP
    name in any letter case (HTTP header names are case-insensitive), its gRPC name (gRPC
    metadata names are lower case)."""
    options = re2.Options()
    options.log_errors = False  # the error goes into our one line
    try:
        regex = re2.compile(pattern, options)
    except re2.error as error:
        reason = error.args[0].decode(errors="replace") if error.args and isinstance(error.args[0], bytes) else error
        raise ServerError(f"--forward-headers {pattern!r}: not a regular expression Triton (RE2) accepts "
                          f"({reason})") from None
    leaks = [name for name in (*_letter_cases(API_KEY_HEADER), GRPC_API_KEY_HEADER) if regex.search(name)]
    if leaks:
        raise ServerError(f"--forward-headers {pattern!r} matches {leaks[0]}, which would hand every model "
                          f"the API key; name the headers, e.g. {DEFAULT_HEADER_PATTERN!r}")
    return [f"--http-header-forward-pattern={pattern}", f"--grpc-header-forward-pattern={pattern}"]


def writable_by_others(repository: Path) -> list[tuple[Path, int]]:
    """The folders of a local model repository that its group or other users may write, with
    their modes: the repository, each model folder and each version folder in it. Triton loads
    (in poll mode, by itself) any model.py found there and runs it as the server's user."""
    found = []
    folders = [repository]
    for model in sorted(p for p in repository.iterdir() if p.is_dir()) if repository.is_dir() else []:
        folders.append(model)
        folders += sorted(p for p in model.iterdir() if p.is_dir())
    for folder in folders:
        mode = folder.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            found.append((folder, stat.S_IMODE(mode)))
    return found


def check_repository_permissions(repository: Path, allow_shared: bool) -> list[str]:
    """ServerError naming the first folder of ``repository`` others may write, unless
    ``allow_shared``: then one warning per such folder."""
    warnings = []
    for folder, mode in writable_by_others(repository):
        who = "others" if mode & stat.S_IWOTH else "its group"
        line = (f"model folder {folder} is writable by {who} (mode {mode:o}): whoever can write there can have "
                "the server run their code as you")
        if not allow_shared:
            raise ServerError(f"{line}; chmod go-w it, or pass --allow-shared-repository")
        warnings.append(line)
    return warnings
