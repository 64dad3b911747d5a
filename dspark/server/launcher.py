"""Run a real `tritonserver` with dspark's Python-based backends loaded (found by
dspark.server.install; its API key and bound addresses from dspark.server.access), watch it
start, and stop it leaving nothing behind (its shared-memory regions, its files).

Used by `dspark serve` and by the test fixture, so the two start the server the same way.
One module of ~500 lines: the ports, the process, its log and what it leaves behind are one
server's life, from its start (with a retry on ports taken) to its stop (with the clean-up).
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import psutil

from dspark.paths import backends_dir
from dspark.server import stub_priority
from dspark.server.access import (API_KEY_ENV, API_KEY_HEADER, KEY_FD_ENV, LOOPBACK, PARENT_PID_ENV, SERVER_UMASK,
                                  ServerError, check_api_key, check_host, check_repository_permissions, guard_library,
                                  new_api_key, repository_headers, restricted_api_args)
from dspark.server.install import STUB_NAME, ServerInstall, build_backend_directory, find_server

LOG_NAME = "tritonserver.log"
KEY_FILE_NAME = "api-key"  # a generated key, 0600 in the server's 0700 temporary folder


def open_private(path: Union[Path, str], mode: str = "wb"):
    """``path`` opened for writing, owner-only (0600) whatever the umask, also when it existed:
    a server log names models, requests' errors and, at higher verbosity, their contents."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode)

# A model's load failure in Triton's log, with its reason: E1203 05:43:40.558571 23046
# model_lifecycle.cc:642] "failed to load 'bad' version 1: Invalid argument: ..."
_LOAD_FAILURE = re.compile(r'^E\d{4} [^\]]*\] "(?P<message>failed to load \'[^\']*\' version \d+: .*?)"?$', re.M)

# Repositories Triton reads itself (its cloud storage); a local folder is every other string.
REMOTE_REPOSITORY_PREFIXES = ("s3://", "gs://", "as://")

def is_remote_repository(repository: Union[Path, str]) -> bool:
    """Whether ``repository`` is a cloud storage URL that Triton reads (kept as given: a Path
    would turn s3://host into s3:/host)."""
    return isinstance(repository, str) and repository.startswith(REMOTE_REPOSITORY_PREFIXES)


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_HANDED_OUT: set[int] = set()  # ports ServerPorts.free gave out in this process
_PORT_TAKEN = ("Address already in use", "is already in use by another process")  # Triton's bind, check_free


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
            ports = (http, http + 1, http + 2)
            # free now, and not handed to another server of this process that has not bound them yet
            if http + 2 < 65536 and not _HANDED_OUT.intersection(ports) and \
                    not any(port_in_use(LOOPBACK, p) for p in ports[1:]):
                _HANDED_OUT.update(ports)
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
    """The /dev/shm files ``pid`` maps, from /proc/PID/maps ("address perms offset dev inode
    path" lines). Not psutil's memory_maps: it reads smaps, whose page walk cost `dspark serve`
    ~45 ms of CPU per server and stub at every note (every 2 s), 8x this."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:  # gone, or not ours
        return set()
    paths = (fields[5] for fields in (line.split(maxsplit=5) for line in lines) if len(fields) == 6)
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


_NOISE = ("CUDA", "NVML", "DCGM", "CudaDriverHelper", "pinned memory", "GPU")  # a start without a GPU


def _error_line(lines: Sequence[str]) -> Optional[str]:
    """The most telling error line of a server log's ``lines``, if any."""
    for marker in ("failed to load", "error:", "Error", "E1", "E0"):
        for line in lines:
            if marker in line and not any(word in line for word in _NOISE):
                return line.strip()
    return None


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


class StartCancelled(Exception):
    """start() was cancelled (cancel_start(), e.g. from a signal handler); the server is stopped."""


@dataclass
class TritonServer:
    """A tritonserver process serving `repositories` with dspark's backends.

    It listens on `host` only (loopback unless the caller opts in). The RESTRICTED_APIS need
    `api_key` in the `dspark-api-key` header; a key is generated when none is given. Its
    temporary folder (backend directory, and the log unless `log_path` is given) is removed when
    it stops; the log of a server that failed is kept.
    """

    repositories: Sequence[Union[Path, str]]  # folders, or URLs such as s3://host:port/bucket/path
    ports: Optional[ServerPorts] = None  # None: free ports, chosen again if one is taken before the bind
    model_control: str = "none"
    load_models: Sequence[str] = ()
    log_verbose: int = 0
    extra_args: Sequence[str] = ()
    log_path: Optional[Path] = None
    server_path: Optional[str] = None
    host: str = LOOPBACK
    # Triton's /metrics has no key (its series name every model): loopback unless asked for,
    # whatever ``host`` is.
    metrics_host: str = LOOPBACK
    # How long Triton waits on SIGTERM for in-flight requests and open client connections.
    exit_timeout_s: int = 30
    api_key: Optional[str] = None
    # False: a model that fails to load does not stop the server, which serves the others and
    # says ready (Triton's --exit-on-error=false --strict-readiness=false)
    exit_on_error: bool = True
    # False: a repository, model or version folder others may write is refused (ServerError);
    # True: each is a line of ``warnings``
    allow_shared_repository: bool = False
    # True: inference needs the key too (so does every shared-memory region named in a request)
    key_inference: bool = False
    # What the caller should show the user before it serves (shared folders it was allowed).
    warnings: list[str] = field(default_factory=list, init=False)
    # After stop(): the shared-memory regions the server left behind (stop removed them).
    left_shm_regions: list[str] = field(default_factory=list, init=False)
    _regions: set[Path] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_control not in ("none", "explicit", "poll"):
            raise ValueError(f"model_control must be none, explicit or poll, not {self.model_control!r}")
        for repository in self.repositories:
            if not is_remote_repository(repository) and not Path(repository).is_dir():
                raise ServerError(f"model repository {repository} does not exist")
            if not is_remote_repository(repository):
                self.warnings += check_repository_permissions(Path(repository), self.allow_shared_repository)
        check_host(self.host)
        check_host(self.metrics_host, "--metrics-host")
        self._own_ports = self.ports is None
        if self._own_ports:
            self.ports = ServerPorts.free()
        self.key_generated = not self.api_key
        if self.api_key:
            check_api_key(self.api_key)
        else:
            self.api_key = new_api_key()
        self.key_path: Optional[Path] = None  # where a generated key is (0600) while the server runs
        self._process: Optional[subprocess.Popen] = None
        self._workdir: Optional[Path] = None
        self._log_file = None
        self._stop_requested = False
        self._cancelled = False
        self.ready = False  # start() has returned and stop() has not been called
        self._ready_log_chars = 0  # how much of the log was written before it was ready
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
        return f"http://{_url_host(self.metrics_host)}:{self.ports.metrics}/metrics"

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
            f"--metrics-address={self.metrics_host}",
            f"--metrics-port={self.ports.metrics}",
            f"--model-control-mode={self.model_control}",
            f"--log-verbose={self.log_verbose}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
        ]
        args += restricted_api_args(self.key_inference)
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
        """Start the server and wait until it is ready. Ports it chose itself are chosen anew
        (three tries) when another process takes one between the choice and Triton's bind: a
        client's outgoing connection can get any free port as its own."""
        own_log = self.log_path is None
        for attempt in range(3):
            try:
                return self._start(timeout_s)
            except ServerError as error:
                if not self._own_ports or attempt == 2 or not any(text in str(error) for text in _PORT_TAKEN):
                    raise
                if own_log and self.log_path is not None:  # the failed try's log, kept by stop()
                    shutil.rmtree(Path(self.log_path).parent, ignore_errors=True)
                    self.log_path = None
                self.ports = ServerPorts.free()

    def cancel_start(self) -> None:
        """Make a start() in progress (or about to begin) stop the server and raise StartCancelled
        (safe inside a signal handler: it only sets a flag that the wait for readiness reads)."""
        self._cancelled = True

    def _start(self, timeout_s: float) -> None:
        if self._cancelled:
            raise StartCancelled("the start was cancelled")
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
        self._log_file = open_private(self.log_path)
        if self.key_generated:  # printed nowhere: the file's path is, and it goes at the stop
            self.key_path = self._workdir / KEY_FILE_NAME
            with open_private(self.key_path, "w") as key_file:
                key_file.write(self.api_key + "\n")
        self._stop_requested = False
        environment, key_read = self.launch_environment(install)
        if threading.current_thread() is threading.main_thread():
            # the kernel's death signal follows the thread that forked: only the main one lives
            # as long as this process
            environment[PARENT_PID_ENV] = str(os.getpid())
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
            if self._cancelled:
                raise StartCancelled("the start was cancelled")
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
                            self._ready_log_chars = len(self.log_text())
                            self._note_regions()
                            self.ready = True
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
                              f"{guard_library().name}; not serving (log: {self.log_path})")

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
        lines = self.log_text().splitlines()
        return _error_line(lines) or (lines[-1].strip() if lines else "no output")

    def exit_reason(self, code: int) -> str:
        """Why a server that was ready exited with ``code``: the signal that killed it and the
        first error line it wrote since it was ready, never a line from before (a load failure
        it served on with --keep-serving)."""
        error = _error_line(self.log_text()[self._ready_log_chars:].splitlines())
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by {name}" + (f"; its last error: {error}" if error else "")
        return error or "no error line in its log since it was ready"

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

    def wait(self, note_every_s: float = 2.0) -> int:
        """Wait for the server to exit, noting its models' shared-memory regions meanwhile, so that
        stop() removes them however it ends (killed from outside too); its exit code."""
        while True:
            try:
                return self._process.wait(note_every_s)
            except subprocess.TimeoutExpired:
                self._note_regions()

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
        self.ready = False
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
                (self._workdir / KEY_FILE_NAME).unlink(missing_ok=True)
            else:
                shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return code

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
