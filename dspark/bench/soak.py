"""Soak the speculative backend (not part of `make test`): a real tritonserver serving spec_lm,
`--workers` clients sending mixed requests for `--minutes` (HTTP /generate and /generate_stream,
gRPC streams of which `--cancel-share` are cancelled mid-stream, chat requests, sampled ones,
every method, a few bad inputs), the stub's resident memory sampled all along; then requests are
left in flight and the server is stopped: the model must unload within 5 s.

    .venv/bin/python tools/soak_spec.py --minutes 12 --json-out bench-results/soak_spec.json

Verdicts: resident memory after warm-up flat within 5 % (the median of the last tenth of the
samples against the median of the first tenth after warm-up), and the unload time.
"""
from __future__ import annotations

import json
import queue
import random
import re
import statistics
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import numpy as np
import requests
import tritonclient.grpc as grpcclient

from dspark.bench.machine import this_machine
from dspark.bench.resources import ResourceSampler, model_stubs, resident_mib, stub_processes
from dspark.bench.spec_inprocess import load_prompts
from dspark.paths import demo_repositories, project_root
from dspark.server.launcher import TritonServer

UNLOAD_TARGET_S = 5.0
FLAT_TARGET = 0.05


def stub_pid(server, model: str) -> tuple[int, str]:
    """The stub serving ``model`` and its shared-memory region."""
    stubs = stub_processes(server._process.pid, model)
    if not stubs:
        raise SystemExit(f"no stub for {model}")
    pid, argv = stubs[0]
    return pid, argv[2].lstrip("/")


def grpc_stream(url: str, model: str, prompt: str, sampling: dict, cancel_after: int | None) -> str:
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    for name, value, dtype in (("text_input", prompt.encode(), "BYTES"),
                               ("sampling_parameters", json.dumps(sampling).encode(), "BYTES"),
                               ("stream", True, "BOOL")):
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
        inputs.append(tensor)
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    pieces, outcome = 0, "ok"
    try:
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                outcome = "error"
                break
            response = result.get_response()
            if response.outputs:
                pieces += 1
                if cancel_after is not None and pieces >= cancel_after:
                    client.stop_stream(cancel_requests=True)
                    return "cancelled"
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.close()
    return outcome


class Load:
    """One worker's request mix."""

    def __init__(self, server, model: str, methods: list[str], cancel_share: float, seed: int,
                 chat: bool):
        self.server, self.model, self.methods, self.chat = server, model, methods, chat
        self.cancel_share = cancel_share
        self.rng = random.Random(seed)
        self.prompts = load_prompts(4)

    def one(self) -> str:
        rng, prompt = self.rng, self.rng.choice(self.prompts)
        sampling = {"max_tokens": rng.choice((8, 16, 32, 48)),
                    "speculative": {"method": rng.choice(self.methods)}}
        if rng.random() < 0.3:
            sampling.update(temperature=0.8, seed=rng.randrange(1 << 30))
        if prompt.chat and self.chat:
            sampling["chat"] = True
        kind = rng.choices(("grpc", "http", "sse", "bad"), weights=(5, 3, 2, 1))[0]
        http = f"http://{self.server.http_url}/v2/models/{self.model}"
        if kind == "grpc":
            cancel = rng.randint(1, 3) if rng.random() < self.cancel_share else None
            return "grpc-" + grpc_stream(self.server.grpc_url, self.model, prompt.text, sampling, cancel)
        if kind == "bad":
            body = rng.choice([{"text_input": "", "sampling_parameters": "{}"},
                               {"text_input": prompt.text, "sampling_parameters": '{"temperature": -1}'},
                               {"text_input": prompt.text, "sampling_parameters": '{"top_p": 0}'},
                               {"text_input": prompt.text, "sampling_parameters": '{"speculative": {"method": "x"}}'}])
            reply = requests.post(f"{http}/generate", json=body, timeout=300)
            return "bad-" + ("400" if reply.status_code == 400 else f"UNEXPECTED-{reply.status_code}")
        body = {"text_input": prompt.text, "sampling_parameters": json.dumps(sampling)}
        if kind == "sse":
            body["stream"] = True
            with requests.post(f"{http}/generate_stream", json=body, stream=True, timeout=300) as reply:
                ok = reply.status_code == 200 and not any(b'"error"' in line for line in reply.iter_lines())
            return "sse-" + ("ok" if ok else "error")
        reply = requests.post(f"{http}/generate", json=body, timeout=300)
        return "http-" + ("ok" if reply.status_code == 200 else f"error-{reply.status_code}")


def run_soak(args) -> None:
    """The command's work; ``args`` holds its options as attributes (dspark/cli builds it)."""

    toy = args.model.startswith("spec_toy")
    repositories = [project_root() / "tests" / "spec_toy_repository"] if toy else demo_repositories()
    # the server removes its own temp folder at a clean stop: keep the log, it is read afterwards
    log = Path(tempfile.mkdtemp(prefix="dspark-soak-")) / "tritonserver.log"
    server = TritonServer(repositories=repositories, model_control="explicit", load_models=[args.model],
                          exit_timeout_s=30, log_path=log)
    server.start()
    pid, region = stub_pid(server, args.model)
    methods = re.findall(r"'(\w+)'", requests.post(
        f"http://{server.http_url}/v2/models/{args.model}/generate", timeout=60,
        json={"text_input": "x", "sampling_parameters": '{"speculative": {"method": "?"}}'}).json()["error"])
    print(f"soak: {args.model} (stub pid {pid}, methods {methods}), {args.workers} workers, "
          f"{args.minutes} min, {args.cancel_share:.0%} of gRPC streams cancelled", flush=True)
    sampler = ResourceSampler(server._process.pid, args.sample_s).start()
    outcomes: Counter = Counter()
    deadline = time.monotonic() + args.minutes * 60
    lock = threading.Lock()

    def worker(seed: int) -> None:
        load = Load(server, args.model, methods, args.cancel_share, seed, chat=not toy)
        while time.monotonic() < deadline:
            try:
                outcome = load.one()
            except Exception as error:  # noqa: BLE001 - counted, the soak goes on
                outcome = f"client-{type(error).__name__}"
            with lock:
                outcomes[outcome] += 1

    started = time.monotonic()
    with ThreadPoolExecutor(args.workers) as pool:
        futures = [pool.submit(worker, seed) for seed in range(args.workers)]
        while not all(f.done() for f in futures):
            time.sleep(30)
            with lock:
                total = sum(outcomes.values())
            print(f"  {(time.monotonic() - started) / 60:5.1f} min: {total} requests, "
                  f"stub {resident_mib(pid):.0f} MB", flush=True)
    idle_start = resident_mib(pid)
    time.sleep(20)
    samples = [(s["t"], sum(rss for _, rss in model_stubs(s, args.model))) for s in sampler.stop()]
    idle_end = resident_mib(pid)

    # stop with requests in flight
    in_flight = ThreadPoolExecutor(4)
    for _ in range(4):
        in_flight.submit(grpc_stream, server.grpc_url, args.model, "Tell me a long story about a dragon.",
                         {"max_tokens": 1000, "chat": not toy, "speculative": {"method": "none"}}, None)
    time.sleep(3)
    stop_at = datetime.now()
    t = time.perf_counter()
    server.stop(keep_log=True)  # its log tells when the model unloaded
    exit_s = time.perf_counter() - t
    in_flight.shutdown(wait=True)
    unload_s = None
    for line in server.log_text().splitlines():
        match = re.match(r"I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*successfully unloaded '" + args.model, line)
        if match:
            when = datetime.strptime(f"{stop_at.year}{match[1]} {match[2]}", "%Y%m%d %H:%M:%S.%f")
            unload_s = (when - stop_at).total_seconds()
    shm_left = region in server.left_shm_regions  # Triton's own clean-up missed it; stop() removed it

    rss = [mb for _, mb in samples]
    warm = [mb for s, mb in samples if s >= args.warmup_share * args.minutes * 60]
    tenth = max(1, len(warm) // 10)
    early, late = statistics.median(warm[:tenth]), statistics.median(warm[-tenth:])
    growth = (late - early) / early
    report = {"settings": vars(args) | {"json_out": str(args.json_out)}, "machine": this_machine().to_json(),
              "requests": sum(outcomes.values()), "outcomes": dict(outcomes),
              "rss_mb": {"first": rss[0], "after warm-up": early, "end": late, "max": max(rss),
                         "idle after 20 s": idle_end, "idle before": idle_start},
              "rss_growth_after_warmup": round(growth, 4), "flat": abs(growth) <= FLAT_TARGET,
              "server_exit_s": round(exit_s, 2), "unload_s": unload_s,
              "unloaded_in_time": unload_s is not None and unload_s <= UNLOAD_TARGET_S,
              "shared_memory_left": shm_left, "samples": samples}
    print(f"requests: {report['requests']} {dict(outcomes)}")
    print(f"stub resident memory: {rss[0]:.0f} MB at start, {early:.0f} MB after warm-up, {late:.0f} MB at "
          f"the end ({growth:+.1%}; target within {FLAT_TARGET:.0%}: {'ok' if report['flat'] else 'MISSED'}), "
          f"{idle_end:.0f} MB idle")
    print(f"stop with 4 requests in flight: model unloaded after "
          f"{'?' if unload_s is None else f'{unload_s:.1f}'} s (target {UNLOAD_TARGET_S:.0f} s: "
          f"{'ok' if report['unloaded_in_time'] else 'MISSED'}), server exited after {exit_s:.1f} s, "
          f"shared memory left behind: {shm_left}; log {log}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=1))
