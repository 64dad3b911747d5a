"""The Triton servers a rollout drives: their endpoints and the calls the controller makes.

Every call to the model-repository API (load, unload, index) carries the server's API key in
the ``dspark-api-key`` header (the restricted model-repository API); inference and health calls need none.

Loads go over gRPC: Triton's HTTP frontend runs a ``load`` on the worker thread that received
it, and every other HTTP connection served by that thread waits until the load returns (2.51,
measured: clients' requests on those connections timed out at 1 s during a 2.4 s load, while the
others were answered). Its gRPC frontend runs a load on a thread of its own.
"""
from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence
from urllib.parse import urlparse

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, triton_to_np_dtype

from dspark.errors import ConfigError, UnavailableError

from dspark.server.access import repository_headers


@dataclass(frozen=True)
class Endpoint:
    """One server: its HTTP URL, its metrics URL (default: HTTP port + 2, Triton's layout) and
    its gRPC address, host:port (default: HTTP port + 1), which the controller loads models by."""

    url: str
    metrics_url: str
    grpc_url: str = ""

    def __post_init__(self) -> None:
        if not self.grpc_url:  # also a state file written before the field existed
            parsed = urlparse(self.url)
            object.__setattr__(self, "grpc_url", f"{parsed.hostname}:{parsed.port + 1}")

    @classmethod
    def parse(cls, url: str, metrics_url: Optional[str] = None, grpc_url: Optional[str] = None) -> "Endpoint":
        url = url.strip().rstrip("/")
        if "://" not in url:
            url = f"http://{url}"
        parsed = urlparse(url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ConfigError("server", f"{url!r} is not an HTTP endpoint like http://10.0.0.5:8000")
        if metrics_url is None:
            metrics_url = f"http://{parsed.hostname}:{parsed.port + 2}/metrics"
        elif "://" not in metrics_url:
            metrics_url = f"http://{metrics_url}"
        grpc_url = (grpc_url or "").strip().removeprefix("grpc://")
        if grpc_url and not urlparse(f"grpc://{grpc_url}").port:
            raise ConfigError("grpc-url", f"{grpc_url!r} is not a gRPC address like 10.0.0.5:8001")
        return cls(url, metrics_url, grpc_url)

    @property
    def host_port(self) -> str:
        return self.url.split("://", 1)[1]


def read_endpoints(urls: Sequence[str] = (), metrics_urls: Sequence[str] = (),
                   servers_file: Optional[Path] = None, dns: Sequence[str] = (),
                   grpc_urls: Sequence[str] = ()) -> list[Endpoint]:
    """Endpoints from ``--server`` URLs (paired in order with ``--metrics-url`` and ``--grpc-url``),
    a file (YAML: a list of URLs or of {url, metrics_url, grpc_url}; or plain text, one
    ``URL [METRICS_URL]`` a line, ``#`` comments) and DNS names ``HOST:PORT`` whose every address
    is a server (a Kubernetes headless Service lists the ready pods of a fleet that way)."""
    if metrics_urls and len(metrics_urls) != len(urls):
        raise ConfigError("metrics-url", f"give one per --server ({len(urls)}), or none for HTTP port + 2")
    if grpc_urls and len(grpc_urls) != len(urls):
        raise ConfigError("grpc-url", f"give one per --server ({len(urls)}), or none for HTTP port + 1")
    endpoints = [Endpoint.parse(u, m, g) for u, m, g in zip(urls, metrics_urls or [None] * len(urls),
                                                            grpc_urls or [None] * len(urls))]
    if servers_file is not None:
        endpoints += _endpoints_from_file(Path(servers_file))
    for name in dns:
        host, _, port = name.rpartition(":")
        try:
            addresses = sorted({info[4][0] for info in socket.getaddrinfo(host, int(port), socket.AF_INET,
                                                                          socket.SOCK_STREAM)})
        except (OSError, ValueError) as error:
            raise ConfigError("servers-dns", f"cannot resolve {name!r} (HOST:PORT): {error}") from None
        endpoints += [Endpoint.parse(f"http://{address}:{port}") for address in addresses]
    if not endpoints:
        raise ConfigError("server", "no server given: pass --server URL (repeatable), --servers-file or --servers-dns")
    return endpoints


def _endpoints_from_file(path: Path) -> list[Endpoint]:
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError("servers-file", str(error), path) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if isinstance(data, list):
        out = []
        for i, item in enumerate(data):
            if isinstance(item, str):
                out.append(Endpoint.parse(item))
            elif isinstance(item, dict) and "url" in item:
                out.append(Endpoint.parse(item["url"], item.get("metrics_url"), item.get("grpc_url")))
            else:
                raise ConfigError(f"[{i}]", "expected a URL or a mapping with url (and metrics_url, grpc_url)", path)
        return out
    out = []
    for line in text.splitlines():
        parts = re.split(r"\s+", line.split("#", 1)[0].strip())
        if parts[0]:
            out.append(Endpoint.parse(parts[0], parts[1] if len(parts) > 1 else None))
    return out


class Server:
    """The controller's handle on one server (tritonclient over HTTP)."""

    def __init__(self, endpoint: Endpoint, api_key: Optional[str] = None, timeout_s: float = 120.0):
        self.endpoint = endpoint
        self.headers = repository_headers(api_key) or None
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._clients: list[httpclient.InferenceServerClient] = []
        self._grpc: Optional[grpcclient.InferenceServerClient] = None
        self._grpc_lock = threading.Lock()
        self.notes: list[str] = []  # what the controller should log once (a fallback taken)

    @property
    def client(self) -> httpclient.InferenceServerClient:
        """This thread's client (tritonclient.http runs on gevent: a client stays in its thread)."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = httpclient.InferenceServerClient(self.endpoint.host_port, connection_timeout=self.timeout_s,
                                                      network_timeout=self.timeout_s)
            self._local.client = client
            self._clients.append(client)
        return client

    @property
    def name(self) -> str:
        return self.endpoint.url

    @property
    def grpc(self) -> grpcclient.InferenceServerClient:
        """One gRPC client for all threads (a gRPC channel is thread-safe)."""
        with self._grpc_lock:
            if self._grpc is None:
                self._grpc = grpcclient.InferenceServerClient(self.endpoint.grpc_url)
            return self._grpc

    def close(self) -> None:
        """Close the clients of this thread (others close with their threads' greenlet hubs)."""
        client = getattr(self._local, "client", None)
        if client is not None:
            client.close()
            self._local.client = None
        with self._grpc_lock:
            if self._grpc is not None:
                self._grpc.close()
                self._grpc = None

    def load(self, model: str) -> None:
        """(Re)load ``model`` as its config.pbtxt now says, over gRPC (module docstring: an HTTP
        load stalls other clients); over HTTP when the gRPC endpoint cannot be reached."""
        try:
            self.grpc.load_model(model, headers=self.headers, client_timeout=self.timeout_s)
            return
        except InferenceServerException as error:
            if not _unreachable(error):
                raise UnavailableError(f"{self.name}: loading '{model}' failed: {error.message()}", "load") from None
            self.notes.append(f"{self.name}: gRPC endpoint {self.endpoint.grpc_url} unreachable ({error.message()}); "
                              "loading over HTTP, which holds other HTTP clients until the load returns "
                              "(pass --grpc-url)")
        try:
            self.client.load_model(model, headers=self.headers)
        except InferenceServerException as error:
            raise UnavailableError(f"{self.name}: loading '{model}' failed: {error.message()}", "load") from None
        except OSError as error:
            raise UnavailableError(f"{self.name}: unreachable while loading '{model}': {error}", "load") from None

    def ready(self, model: str, version: Optional[int] = None) -> bool:
        """Whether ``version`` of ``model`` (any version when None) is ready for inference."""
        try:
            return bool(self.client.is_model_ready(model, "" if version is None else str(version)))
        except (InferenceServerException, OSError):
            return False

    def healthy(self) -> bool:
        try:
            return bool(self.client.is_server_live())
        except (InferenceServerException, OSError):
            return False

    def index(self) -> list[dict]:
        """The repository index: every model version the server knows, with its state."""
        try:
            return self.client.get_model_repository_index(headers=self.headers)
        except (InferenceServerException, OSError) as error:
            message = error.message() if isinstance(error, InferenceServerException) else str(error)
            raise UnavailableError(f"{self.name}: repository index: {message}", "index") from None

    def wait_unloaded(self, model: str, version: int, timeout_s: float) -> bool:
        """Wait until ``version`` is gone, not just not ready: is_model_ready turns false as soon
        as an unload starts, while the version's instances may still run for seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [item.get("state") for item in self.index()
                      if item.get("name") == model and item.get("version") == str(version)]
            if not any(state in ("READY", "LOADING", "UNLOADING") for state in states):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def wait_ready(self, model: str, version: int, want: bool, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.ready(model, version) != want:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def warm_up(self, model: str, version: int, requests: int, inputs: Optional[dict] = None) -> None:
        """Send ``requests`` inferences straight to ``model`` version ``version``; raises on the
        first failure. Inputs: ``inputs`` (name -> array), else zeros shaped from the config."""
        arrays = inputs or self.sample_inputs(model, version)
        for _ in range(requests):
            self.infer(model, version, arrays)

    def infer(self, model: str, version: int, arrays: dict) -> dict:
        tensors = []
        for name, array in arrays.items():
            tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        try:
            result = self.client.infer(model, tensors, model_version=str(version))
        except InferenceServerException as error:
            raise UnavailableError(f"{self.name}: '{model}' version {version} failed: {error.message()}",
                                   "warmup") from None
        return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}

    def sample_inputs(self, model: str, version: int) -> dict:
        config = self.client.get_model_config(model, str(version))
        batch = [1] if config.get("max_batch_size", 0) > 0 else []
        arrays = {}
        for spec in config.get("input", []):
            shape = batch + [1 if d < 0 else d for d in spec["dims"]]
            dtype = triton_to_np_dtype(spec["data_type"].removeprefix("TYPE_"))
            arrays[spec["name"]] = np.zeros(shape, dtype=dtype)
        return arrays


def _unreachable(error: InferenceServerException) -> bool:
    """A gRPC call that never reached a server (no listener, wrong address), not one it refused."""
    return "UNAVAILABLE" in str(error.status() or "") and "connect" in (error.message() or "").lower()


def connect(endpoints: Iterable[Endpoint], api_key: Optional[str], timeout_s: float = 120.0) -> list[Server]:
    return [Server(e, api_key, timeout_s) for e in endpoints]
