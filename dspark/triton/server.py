"""Find, configure and run a real `tritonserver` with dspark's Python-based backends loaded.

Used by `dspark serve` and by the test fixture, so the two start the server the same way.
"""
from __future__ import annotations

import ipaddress
import itertools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import psutil
import re2

from dspark import _ext
from dspark.paths import backends_dir
from dspark.triton import stub_priority

SERVER_ENV_VAR = "TRITONSERVER"
INSTALL_HINT = (
    "install the bundled server with `pip install nvidia-pytriton==0.7.0`, put `tritonserver` on PATH, "
    f"set {SERVER_ENV_VAR}=/path/to/tritonserver, or pass --server /path/to/tritonserver"
)
# Headers Triton passes to models as request parameters (the router reads dspark-tier, dspark-user-id).
# Triton forwards a header to models when its RE2 pattern matches anywhere in the name
# (PartialMatch), so the default names the router's headers exactly: "dspark-.*" would also hand
# every model the API key. Header names are case-insensitive; RE2 matches them as sent.
DEFAULT_HEADER_PATTERN = "(?i)^dspark-(tier|user-id)$"
PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB_NAME = "triton_python_backend_stub"
LOG_NAME = "tritonserver.log"

# A model's load failure in Triton's log, with its reason: E1203 05:43:40.558571 23046
# model_lifecycle.cc:642] "failed to load 'bad' version 1: Invalid argument: ..."
_LOAD_FAILURE = re.compile(r'^E\d{4} [^\]]*\] "(?P<message>failed to load \'[^\']*\' version \d+: .*?)"?$', re.M)

# Repositories Triton reads itself (its cloud storage); a local folder is every other string.
REMOTE_REPOSITORY_PREFIXES = ("s3://", "gs://", "as://")

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
# preloaded guard library (cython_ext/server_guard.c) replaces with what it reads from the
# descriptor named by KEY_FD_ENV, so the key is in no process list and no stub's environment.
KEY_MARKER = "@DSPARK_API_KEY@"
KEY_FD_ENV = "DSPARK_KEY_FD"
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


def is_remote_repository(repository: Union[Path, str]) -> bool:
    """Whether ``repository`` is a cloud storage URL that Triton reads (kept as given: a Path
    would turn s3://host into s3:/host)."""
    return isinstance(repository, str) and repository.startswith(REMOTE_REPOSITORY_PREFIXES)


def repository_headers(api_key: Optional[str]) -> dict[str, str]:
    """Headers for calls to the restricted APIs (tritonclient's `headers=`), good for HTTP and gRPC clients."""
    return {API_KEY_HEADER: api_key, GRPC_API_KEY_HEADER: api_key} if api_key else {}


def restricted_api_args() -> list[str]:
    """Triton flags that refuse calls to RESTRICTED_APIS over HTTP and gRPC without the key
    (KEY_MARKER stands for it)."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{API_KEY_HEADER}={KEY_MARKER}",
            f"--grpc-restricted-protocol={apis}:{API_KEY_HEADER}={KEY_MARKER}"]


def guard_library() -> Path:
    """The library preloaded into tritonserver (cython_ext/server_guard.c); ServerError if not built."""
    path = Path(_ext.__file__).parent / GUARD_LIBRARY
    if not path.is_file():
        raise ServerError(f"{path} is missing: build it with `make setup` (pip install -e .)")
    return path


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def check_host(host: str) -> str:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ServerError(f"--host {host!r}: expected an IP address such as 127.0.0.1 (the default), "
                          "::1, or 0.0.0.0 for every interface") from None
    return host


def _url_host(host: str) -> str:
    """The address clients connect to: loopback for a wildcard bind, IPv6 in brackets."""
    address = ipaddress.ip_address(host)
    if address.is_unspecified:
        address = ipaddress.ip_address("::1" if address.version == 6 else LOOPBACK)
    return f"[{address}]" if address.version == 6 else str(address)


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on (host, port), or on the wildcard address that covers it."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "in use"
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


@dataclass(frozen=True)
class ServerInstall:
    """One Triton installation: the binary, its Python backend, and what the stub needs to load."""

    binary: Path
    python_backend: Path
    stubs_by_python: Optional[Path] = None  # folder of <major.minor>/triton_python_backend_stub
    library_dirs: tuple[Path, ...] = ()

    def stub_for_running_python(self) -> Path:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        if self.stubs_by_python is not None:
            stub = self.stubs_by_python / version / STUB_NAME
            if stub.is_file():
                return stub
            raise ServerError(
                f"the server at {self.binary} ships no Python backend stub for Python {version} "
                f"(looked in {self.stubs_by_python}); run dspark with one of: "
                + ", ".join(sorted(p.name for p in self.stubs_by_python.iterdir()))
            )
        stub = self.python_backend / STUB_NAME
        if not stub.is_file():
            raise ServerError(f"no {STUB_NAME} in {self.python_backend}; the Python backend install is incomplete")
        return stub


def _pytriton_install() -> Optional[ServerInstall]:
    try:
        import pytriton  # noqa: F401  (the nvidia-pytriton wheel)
    except ImportError:
        return None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return ServerInstall(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stubs_by_python=root / "python_backend_stubs",
        library_dirs=(libs,) if libs.is_dir() else (),
    )


def _system_install(binary: Path) -> ServerInstall:
    """A server laid out as in NVIDIA's container: <prefix>/bin/tritonserver, <prefix>/backends/python."""
    prefix = binary.resolve().parent.parent
    return ServerInstall(binary=binary, python_backend=prefix / "backends" / "python")


def find_server(explicit: Optional[str] = None) -> ServerInstall:
    """The server to run: an explicit path, then $TRITONSERVER, the nvidia-pytriton wheel, PATH."""
    candidate = explicit or os.environ.get(SERVER_ENV_VAR)
    if candidate:
        binary = Path(candidate)
        if not binary.is_file():
            raise ServerError(f"no Triton server at {binary}: {INSTALL_HINT}")
        bundled = _pytriton_install()
        if bundled is not None and bundled.binary.resolve() == binary.resolve():
            return bundled
        install = _system_install(binary)
    else:
        install = _pytriton_install()
        if install is None:
            on_path = shutil.which("tritonserver")
            if on_path is None:
                raise ServerError(f"no Triton server found: {INSTALL_HINT}")
            install = _system_install(Path(on_path))
    if not install.binary.is_file():
        raise ServerError(f"the Triton server binary {install.binary} is missing: {INSTALL_HINT}")
    if not os.access(install.binary, os.X_OK):
        raise ServerError(f"the Triton server {install.binary} is not executable: chmod +x it or reinstall")
    missing = [name for name in PYTHON_BACKEND_FILES if not (install.python_backend / name).is_file()]
    if missing:
        raise ServerError(
            f"Triton's Python backend is incomplete in {install.python_backend} (missing {', '.join(missing)}): "
            "reinstall the server with its Python backend"
        )
    return install


def build_backend_directory(install: ServerInstall, destination: Path, sources: Path) -> list[str]:
    """Lay out a --backend-directory: Triton's Python backend plus each backends/<name> of ours.

    Returns the names of our Python-based backends.
    """
    python_dir = destination / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in PYTHON_BACKEND_FILES:
        shutil.copy2(install.python_backend / name, python_dir / name)
    shutil.copy2(install.stub_for_running_python(), python_dir / STUB_NAME)
    names = []
    for backend in sorted(sources.iterdir()):
        if (backend / "model.py").is_file() and backend.name != "python":
            shutil.copytree(backend, destination / backend.name, ignore=shutil.ignore_patterns("__pycache__"))
            names.append(backend.name)
    return names


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ServerPorts:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    def named(self) -> list[tuple[str, str, int]]:
        """(protocol, CLI option, port) of each endpoint."""
        return [("HTTP", "--http-port", self.http), ("gRPC", "--grpc-port", self.grpc),
                ("metrics", "--metrics-port", self.metrics)]

    def check_free(self, host: str) -> None:
        """ServerError naming the first port that is taken (or given twice) and the option to change."""
        seen: dict[int, str] = {}
        for protocol, option, port in self.named():
            if port in seen:
                raise ServerError(f"port {port} is given for both {seen[port]} and {protocol}: "
                                  f"pass {option} with another port")
            seen[port] = protocol
            if port_in_use(host, port):
                raise ServerError(f"port {port} ({protocol}) on {host} is already in use by another process: "
                                  f"stop it, or pass {option} with a free port")

    @classmethod
    def free(cls) -> "ServerPorts":
        """Three free consecutive ports, Triton's layout (HTTP, gRPC = HTTP + 1, metrics = HTTP + 2),
        which clients given only the HTTP URL assume (the rollout controller loads models over gRPC)."""
        for _ in range(100):
            http = _free_port()
            if http + 2 < 65536 and not any(port_in_use(LOOPBACK, p) for p in (http + 1, http + 2)):
                return cls(http=http, grpc=http + 1, metrics=http + 2)
        raise ServerError("no three consecutive free ports found for HTTP, gRPC and metrics")


def _listening_ports(pid: int) -> set[int]:
    """TCP ports the process `pid` listens on (empty once it has exited)."""
    try:
        process = psutil.Process(pid)
        connections = process.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return set()
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}


def shared_memory_regions(pid: int) -> set[Path]:
    """The /dev/shm files that a server process and one of its children (a Python backend stub)
    both map: the IPC region Triton's Python backend keeps per model instance (1 MiB and up, in
    RAM), which it unlinks when the model unloads but not when the server is killed or gives up
    at its exit timeout. A client's region registered with the server is mapped by the server
    alone, so it is never among them."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    in_children: set[Path] = set()
    for child in children:
        in_children |= _mapped_shm(child.pid)
    return _mapped_shm(pid) & in_children


def _mapped_shm(pid: int) -> set[Path]:
    try:
        paths = [m.path for m in psutil.Process(pid).memory_maps()]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return set()
    return {Path(p) for p in paths if p.startswith("/dev/shm/") and not p.endswith("(deleted)")}


def remove_left_regions(regions: set[Path]) -> list[str]:
    """Unlink those of ``regions`` that still exist (their server is gone); their names."""
    removed = []
    for region in sorted(regions):
        try:
            region.unlink()
            removed.append(region.name)
        except FileNotFoundError:
            continue
    return removed


def _clean_up(started: dict) -> None:
    """Last resort when a started server is never stopped (interpreter exit): kill it, free its
    shared memory, drop its files. ``started`` holds its "workdir" and, once running, its "process"."""
    process = started.get("process")
    if process is not None and process.poll() is None:
        regions = shared_memory_regions(process.pid)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        remove_left_regions(regions)
    shutil.rmtree(started["workdir"], ignore_errors=True)


@dataclass
class TritonServer:
    """A tritonserver process serving `repositories` with dspark's backends.

    It listens on `host` only (loopback unless the caller opts in). The RESTRICTED_APIS need
    `api_key` in the `dspark-api-key` header; a key is generated when none is given. Its
    temporary folder (backend directory, and the log unless `log_path` is given) is removed when
    it stops; the log of a server that failed is kept.
    """

    repositories: Sequence[Union[Path, str]]  # folders, or URLs such as s3://host:port/bucket/path
    ports: ServerPorts = field(default_factory=ServerPorts.free)
    model_control: str = "none"
    load_models: Sequence[str] = ()
    log_verbose: int = 0
    extra_args: Sequence[str] = ()
    log_path: Optional[Path] = None
    server_path: Optional[str] = None
    host: str = LOOPBACK
    # How long Triton waits on SIGTERM for in-flight requests and open client connections.
    exit_timeout_s: int = 30
    api_key: Optional[str] = None
    # False: a model that fails to load does not stop the server, which serves the others and
    # says ready (Triton's --exit-on-error=false --strict-readiness=false)
    exit_on_error: bool = True
    # After stop(): the shared-memory regions the server left behind (stop removed them).
    left_shm_regions: list[str] = field(default_factory=list, init=False)
    _regions: set[Path] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_control not in ("none", "explicit", "poll"):
            raise ValueError(f"model_control must be none, explicit or poll, not {self.model_control!r}")
        for repository in self.repositories:
            if not is_remote_repository(repository) and not Path(repository).is_dir():
                raise ServerError(f"model repository {repository} does not exist")
        check_host(self.host)
        if self.api_key:
            check_api_key(self.api_key)
        else:
            self.api_key = new_api_key()
        self._process: Optional[subprocess.Popen] = None
        self._workdir: Optional[Path] = None
        self._log_file = None
        self._stop_requested = False
        self._finalizer: Optional[weakref.finalize] = None
        self._keeper: Optional[stub_priority.PriorityKeeper] = None

    @property
    def http_url(self) -> str:
        return f"{_url_host(self.host)}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{_url_host(self.host)}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.ports.metrics}/metrics"

    @property
    def repository_headers(self) -> dict[str, str]:
        """Headers for this server's restricted APIs (model repository, shared memory, ...)."""
        return repository_headers(self.api_key)

    def command(self, install: ServerInstall, backend_directory: Path) -> list[str]:
        args = [str(install.binary)]
        for repository in self.repositories:
            where = repository if is_remote_repository(repository) else Path(repository).resolve()
            args.append(f"--model-repository={where}")
        args += [
            f"--backend-directory={backend_directory}",
            f"--http-address={self.host}",
            f"--http-port={self.ports.http}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.ports.grpc}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.ports.metrics}",
            f"--model-control-mode={self.model_control}",
            f"--log-verbose={self.log_verbose}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
        ]
        args += restricted_api_args()
        if self.model_control == "poll":
            args.append("--repository-poll-secs=2")
        args += [f"--load-model={name}" for name in self.load_models]
        if not self.exit_on_error:
            args += ["--exit-on-error=false", "--strict-readiness=false"]
        args += list(self.extra_args)
        return args

    def environment(self, install: ServerInstall) -> dict[str, str]:
        """The stub runs the first python3 on PATH: make it this interpreter, so it sees our packages.
        The guard library is preloaded; the key stays out (models run in the stubs)."""
        env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["LD_PRELOAD"] = " ".join([str(guard_library()), *filter(None, [env.get("LD_PRELOAD")])])
        library_path = [str(d) for d in install.library_dirs]
        if env.get("LD_LIBRARY_PATH"):
            library_path.append(env["LD_LIBRARY_PATH"])
        if library_path:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(library_path)
        return env

    def launch_environment(self, install: ServerInstall) -> tuple[dict[str, str], int]:
        """environment() with KEY_FD_ENV naming the read end of a new pipe that holds the key, and
        that descriptor: pass it to tritonserver (started with SERVER_UMASK), then close it."""
        key_read, key_write = os.pipe()
        try:
            os.write(key_write, self.api_key.encode())  # at most 256 bytes: never fills the pipe
        finally:
            os.close(key_write)
        return {**self.environment(install), KEY_FD_ENV: str(key_read)}, key_read

    def start(self, timeout_s: float = 120) -> None:
        install = find_server(self.server_path)
        self.ports.check_free(self.host)
        self._workdir = Path(tempfile.mkdtemp(prefix="dspark-server-"))
        started = {"workdir": self._workdir}
        self._finalizer = weakref.finalize(self, _clean_up, started)
        backend_directory = self._workdir / "backends"
        build_backend_directory(install, backend_directory, backends_dir())
        start_nice = stub_priority.start_nice()  # new stubs start lower (stub_priority's docstring)
        if start_nice:
            stub_priority.wrap_stub(backend_directory / "python" / STUB_NAME, start_nice)
        if self.log_path is None:
            self.log_path = self._workdir / LOG_NAME
        self._log_file = open(self.log_path, "wb")
        self._stop_requested = False
        environment, key_read = self.launch_environment(install)
        try:
            self._process = subprocess.Popen(
                self.command(install, backend_directory),
                env=environment,
                pass_fds=(key_read,),
                umask=SERVER_UMASK,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # our signal handler decides when the server stops
            )
        finally:
            os.close(key_read)
        started["process"] = self._process
        if start_nice:
            self._keeper = stub_priority.PriorityKeeper(self._process.pid, self.log_path).start()
        try:
            self._wait_ready(timeout_s)
        except BaseException as error:
            self.stop(keep_log=isinstance(error, ServerError))
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        """Ready means: our child is alive, listens on the HTTP port, and that port says ready.

        Another server on the same port answers the health check too; the port check above
        makes that unlikely, the listener check makes it impossible."""
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                raise ServerError(
                    f"tritonserver exited with code {code} before it was ready: {self.first_error()} "
                    f"(full log: {self.log_path})"
                )
            if self.ports.http in _listening_ports(self._process.pid):
                try:
                    with urllib.request.urlopen(url, timeout=1) as response:
                        if response.status == 200 and self.running:
                            self._check_key_in_force()
                            return
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
            time.sleep(0.2)
        raise ServerError(f"tritonserver was not ready after {timeout_s:.0f} s: {self.first_error()} (log: {self.log_path})")

    def _check_key_in_force(self) -> None:
        """ServerError unless a restricted API refuses a call without the key and answers one with
        it: else the guard library did not hand the server its key, and it must not serve."""
        url = f"http://{self.http_url}/v2/logging"
        answers = []
        for headers in ({}, {API_KEY_HEADER: self.api_key}):
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
                    answers.append(response.status)
            except urllib.error.HTTPError as error:
                answers.append(error.code)
        if answers != [403, 200]:
            raise ServerError(f"tritonserver answered GET /v2/logging with {answers[0]} without the API key and "
                              f"{answers[1]} with it (expected 403, 200): the key did not reach it through "
                              f"{GUARD_LIBRARY}; not serving (log: {self.log_path})")

    def load_failures(self) -> list[str]:
        """Each model's load failure with its reason (`failed to load 'x' version 1: ...`), as
        Triton logged it, whatever the reason mentions (CUDA and GPU included)."""
        return [match["message"] for match in _LOAD_FAILURE.finditer(self.log_text())]

    def first_error(self) -> str:
        """The most telling line of the log: the first model's load failure, else the first
        server error that is not the CUDA noise of a start on a machine without a GPU."""
        failures = self.load_failures()
        if failures:
            return failures[0] + (f" (and {len(failures) - 1} more models)" if len(failures) > 1 else "")
        noise = ("CUDA", "NVML", "DCGM", "CudaDriverHelper", "pinned memory", "GPU")
        lines = self.log_text().splitlines()
        for marker in ("failed to load", "error:", "Error", "E1", "E0"):
            for line in lines:
                if marker in line and not any(word in line for word in noise):
                    return line.strip()
        return lines[-1].strip() if lines else "no output"

    def log_text(self) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_text(errors="replace")

    def write_native_stacks(self, path: Path, timeout_s: float = 180) -> bool:
        """Every thread's native stack of the running server and of its model stubs, appended to
        ``path`` with gdb (a stop that hangs inside Triton shows where); False when gdb is
        missing or the server is not running."""
        gdb = shutil.which("gdb")
        if gdb is None or not self.running:
            return False
        server = psutil.Process(self._process.pid)
        ok = True
        with open(path, "a", encoding="utf-8") as file:
            for process in [server, *server.children(recursive=True)]:
                try:
                    name = " ".join(process.cmdline()[:2])
                except psutil.Error:  # gone meanwhile
                    continue
                out = subprocess.run([gdb, "-p", str(process.pid), "-batch", "-ex", "thread apply all bt"],
                                     capture_output=True, text=True, timeout=timeout_s)
                file.write(f"==== {process.pid} {name}\n{out.stdout}{out.stderr[-3000:]}\n")
                ok = ok and out.returncode == 0
        return ok

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait(self) -> int:
        return self._process.wait()

    def terminate(self) -> None:
        """Ask the server to drain and exit, without waiting (safe inside a signal handler)."""
        if self.running:
            self._note_regions()  # stop() removes what a server that hit its exit timeout leaves
            self._stop_requested = True
            self._process.send_signal(signal.SIGTERM)

    def _note_regions(self) -> None:
        if self.running:
            self._regions |= shared_memory_regions(self._process.pid)

    def kill(self) -> None:
        if self._process is not None:
            self._note_regions()  # stop() removes what the killed server leaves
            self._stop_requested = True
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self, keep_log: bool = False) -> Optional[int]:
        """SIGTERM (Triton drains in-flight requests), then SIGKILL the whole group if it hangs.

        Removes the temporary folder, except the log of a server that exited with an error on its
        own (or when `keep_log`): error messages name that file. Shared-memory regions of the
        server's models that it did not remove itself (it was killed, or hit its exit timeout)
        are removed and named in `left_shm_regions`."""
        timeout_s = self.exit_timeout_s + 10
        code = None
        if self._process is not None:
            if self.running:
                self.terminate()
                try:
                    self._process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.kill()
                    self._process.wait()
            code = self._process.returncode
            keep_log = keep_log or (code != 0 and not self._stop_requested)
            self.kill()  # stubs left behind by a killed server
            if self._regions:
                self.left_shm_regions = remove_left_regions(self._regions)
                self._regions = set()
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._workdir is not None:
            self._finalizer.detach()
            if keep_log and Path(self.log_path).parent == self._workdir:
                shutil.rmtree(self._workdir / "backends", ignore_errors=True)
            else:
                shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return code

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
