"""Resource use of a Triton server during a run: CPU and memory of the server process and of its
backend stub processes (psutil, sampled on a thread), and Triton's /metrics before and after.

The server is found from the port it listens on (this machine only) or given by pid; its children
are the Python backend stubs (one per model instance), re-listed at every sample so instances that
load during the run are counted.
"""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Iterable

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "")


def split_url(url: str) -> tuple[str, int]:
    host, _, port = url.rpartition(":")
    host = host.removeprefix("http://").removeprefix("https://").strip("[]")
    return host, int(port)


def default_metrics_url(url: str, protocol: str) -> str:
    """Triton's metrics endpoint next to ``url`` in `dspark serve`'s (and Triton's default) port
    layout: HTTP port + 2, gRPC port + 1."""
    host, port = split_url(url)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port + (2 if protocol == 'http' else 1)}/metrics"


def server_pid(url: str) -> int | None:
    """The pid listening on the url's port on this machine, or None (remote, or not visible)."""
    import psutil

    host, port = split_url(url)
    if host not in LOCAL_HOSTS and not host.startswith("127."):
        return None
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except psutil.AccessDenied:
        return None
    return None


@dataclass
class ResourceSampler:
    """Samples every ``interval_s``: t (s since start), server and stub CPU (% of one core), RSS
    (MiB), the machine's CPU (% of all cores), and the stub count."""

    pid: int
    interval_s: float = 0.5
    samples: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.server = psutil.Process(self.pid)
        self.server_name = self.server.name()
        self._known: dict[int, object] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-resources", daemon=True)
        self.t0 = time.perf_counter()

    def _stubs(self) -> list[tuple[str, object]]:
        """(model instance, process) of every stub now; processes kept so cpu_percent has a base."""
        try:
            children = self.server.children(recursive=True)
        except self._psutil.Error:
            return []
        current = {}
        for child in children:
            if child.pid not in self._known:
                try:
                    self._known[child.pid] = (stub_instance(child.cmdline()), child)
                except self._psutil.Error:
                    continue
            current[child.pid] = self._known[child.pid]
        self._known = current
        return list(current.values())

    def sample(self) -> dict:
        psutil = self._psutil
        row = {"t": time.perf_counter() - self.t0, "server_cpu": 0.0, "stubs_cpu": 0.0,
               "server_rss_mib": 0.0, "stubs_rss_mib": 0.0, "stubs": 0,
               "machine_cpu": psutil.cpu_percent(interval=None), "per_stub": {}}
        try:
            row["server_cpu"] = self.server.cpu_percent(interval=None)
            row["server_rss_mib"] = self.server.memory_info().rss / 2**20
        except psutil.Error:
            pass
        for instance, stub in self._stubs():
            try:
                cpu, rss = stub.cpu_percent(interval=None), stub.memory_info().rss / 2**20
            except psutil.Error:
                continue
            row["stubs_cpu"] += cpu
            row["stubs_rss_mib"] += rss
            row["stubs"] += 1
            row["per_stub"][f"{instance}:{stub.pid}"] = [round(cpu, 1), round(rss, 1)]
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.sample())

    def start(self) -> "ResourceSampler":
        self.sample()  # primes cpu_percent
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples

    def between(self, start: float, end: float) -> list[dict]:
        """Samples within a perf_counter span (a measured point)."""
        return [s for s in self.samples if start - self.t0 <= s["t"] <= end - self.t0]


def resident_mib(pid: int | None = None) -> float:
    """Resident memory of a process (this one by default), MiB."""
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def stub_processes(server_pid: int, model: str) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the Python backend stubs of the server ``server_pid`` serving ``model``
    (argv[1] is the model's model.py, argv[2] its shared-memory region)."""
    import psutil

    try:
        children = psutil.Process(server_pid).children()
    except psutil.Error:
        return []
    out = []
    for child in children:
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if argv and argv[0].endswith("triton_python_backend_stub") and any(f"/{model}/" in a for a in argv):
            out.append((child.pid, argv))
    return out


def stub_instance(cmdline: list[str]) -> str:
    """The model instance a triton_python_backend_stub serves (its 9th argument, e.g. mlp_classifier_0_0)."""
    return cmdline[8] if len(cmdline) > 8 else "?"


def serves(instance: str, model: str) -> bool:
    return instance == model or instance.startswith(f"{model}_")


def model_stubs(sample: dict, model: str) -> list[list[float]]:
    """[CPU %, RSS MiB] of each of the model's stubs in one sample."""
    return [v for k, v in sample.get("per_stub", {}).items() if serves(k.rpartition(":")[0], model)]


def summarize_samples(samples: Iterable[dict], model: str | None = None) -> dict:
    """Mean CPU (% of one core) and peak RSS over samples: server, all stubs, and the model's own
    stubs (its instances) when ``model`` is given."""
    samples = list(samples)
    if not samples:
        return {}
    n = len(samples)
    out = {"server_cpu_pct": sum(s["server_cpu"] for s in samples) / n,
           "stubs_cpu_pct": sum(s["stubs_cpu"] for s in samples) / n,
           "server_rss_mib": max(s["server_rss_mib"] for s in samples),
           "stubs_rss_mib": max(s["stubs_rss_mib"] for s in samples),
           "machine_cpu_pct": sum(s["machine_cpu"] for s in samples) / n}
    if model:
        mine = [model_stubs(s, model) for s in samples]
        if any(mine):
            out["model_stubs_cpu_pct"] = sum(sum(v[0] for v in m) for m in mine) / n
            out["model_stubs_rss_mib"] = max(sum(v[1] for v in m) for m in mine)
    return out


# --- Triton's /metrics -------------------------------------------------------------------------
Sample = tuple[str, tuple[tuple[str, str], ...]]
COUNTERS = {  # Triton's per-model counters: what a run adds to each
    "nv_inference_request_success": "success", "nv_inference_request_failure": "failure",
    "nv_inference_count": "inferences", "nv_inference_exec_count": "executions",
    "nv_inference_request_duration_us": "request_us", "nv_inference_queue_duration_us": "queue_us",
    "nv_inference_compute_input_duration_us": "compute_input_us",
    "nv_inference_compute_infer_duration_us": "compute_infer_us",
    "nv_inference_compute_output_duration_us": "compute_output_us",
}


def parse_metrics(text: str) -> dict[Sample, float]:
    """Prometheus text exposition -> {(sample name, sorted labels): value}, with prometheus_client's
    parser. Counters keep the name the server wrote (the parser adds ``_total``; Triton's have none)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = family.name if family.type == "counter" and sample.name == f"{family.name}_total" else sample.name
            values[(name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return values


def scrape(metrics_url: str, timeout_s: float = 5.0) -> dict[Sample, float] | None:
    """The server's metrics now, or None when the endpoint does not answer."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            return parse_metrics(response.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def model_counters(before: dict[Sample, float], after: dict[Sample, float], model: str) -> dict:
    """What the run added to the model's Triton counters (all versions), with per-request averages:
    server-side request, queue and compute time (us), and the mean batch Triton formed."""
    delta: dict[str, float] = {v: 0.0 for v in COUNTERS.values()}
    for (name, labels), value in after.items():
        if name in COUNTERS and dict(labels).get("model") == model:
            delta[COUNTERS[name]] += value - before.get((name, labels), 0.0)
    done = delta["success"] + delta["failure"]
    out = {k: v for k, v in delta.items()}
    if done:
        out["server_request_us_per_request"] = delta["request_us"] / done
        out["server_queue_us_per_request"] = delta["queue_us"] / done
        out["server_compute_us_per_request"] = (delta["compute_input_us"] + delta["compute_infer_us"]
                                                + delta["compute_output_us"]) / done
    if delta["executions"]:
        out["server_mean_batch"] = delta["inferences"] / delta["executions"]
    return out
