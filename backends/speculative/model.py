"""Triton Python-based backend `speculative`: streamed text generation with lossless
speculative decoding on CPU (dspark.decoding); this file only adapts it to Triton.

Decoupled. Inputs follow Triton's LLM backends, so /generate, /generate_stream and gRPC
streaming work unchanged: text_input (BYTES, UTF-8), messages (BYTES, optional: a JSON chat),
stream (BOOL), sampling_parameters (BYTES, JSON: max_tokens, temperature, top_k, top_p, seed,
stop, chat, speculative {method, num_speculative_tokens, tree_width, adaptive}),
exclude_input_in_output (BOOL); outputs text_output (BYTES) and, on the final response only, usage
(BYTES, JSON: prompt_tokens, completion_tokens, finish_reason). docs/speculative.md has the rest.

Requests run on a bounded worker pool (max_concurrent_requests; up to max_queued_requests more
wait at most max_queue_wait_ms, beyond that UNAVAILABLE); a request's loop checks for
cancellation every round; finalize cancels what runs and drains it.
"""
import dataclasses
import faulthandler
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark.decoding.models import llm_generator, toy_generator
from dspark.decoding.request import parse_generate_options, parse_messages
from dspark.decoding.sampling import SpeculativeParams
from dspark.decoding.serving import INPUTS, OUTPUTS, RequestPool, ServingConfig, limit_heap_growth
from dspark.decoding.stats import DecodeStats
from dspark.decoding.text import send_coalesced
from dspark.errors import ConfigError, RequestError, UnavailableError
from dspark.llm.importer import STAMP_FILE
from dspark.triton.adapter import config_parameters, server_http_url, triton_error
from dspark.triton.response_sender import GuardedSender, StreamLedger

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DRAIN_TIMEOUT_S = 3.0  # finalize: requests in flight end at their next round, well within this
# Triton calls finalize only once every request has had its final response, so a model with
# requests in flight learns of an unload (or a server stop) from the server's health endpoints:
# while busy, it asks every this many seconds whether the server is live and the model ready;
# while idle, every IDLE_POLL_S (an unload that then never reaches finalize is reported).
UNLOAD_POLL_S = 0.25
IDLE_POLL_S = 1.0
# an unload ends running requests within a round and Triton then calls finalize; when it has not
# after this long, the model logs so with every thread's stack (a stop that hangs is diagnosable)
UNLOAD_REPORT_S = 5.0
# a request asks the server whether its client cancelled at most this often (an IPC round trip
# that would otherwise sit in every decode round); a cancel still ends it within a few tokens
CANCEL_RECHECK_S = 0.02

def _scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise RequestError(name, f"expected one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _text(request, name):
    """A BYTES input as text: UTF-8 or a clear error, never a silent replacement."""
    value = _scalar(request, name)
    if value is None or isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(name, f"is not valid UTF-8 (byte 0x{value[error.start]:02x} at offset "
                                 f"{error.start}); send UTF-8 text") from None


def _http_ok(url: str) -> bool:
    """True for 200, False for another status; OSError when the server does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as reply:
            return reply.status == 200
    except urllib.error.HTTPError:
        return False


def _model_file(repository: Path, name: str) -> Path:
    """A sibling model's graph (``name``), or a model folder given relative to this one."""
    folder = repository / name if "/" in name else repository.parent / name
    return (folder / "1" / "model.onnx").resolve()


def _text_tensor(text: str, name: str = "text_output"):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


def _final_outputs(text: str, prompt_tokens: int, stats: DecodeStats) -> list:
    """The last response's tensors: its text and what the request used (OpenAI's usage)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": stats.generated_tokens,
             "finish_reason": stats.finish_reason}
    return [_text_tensor(text), _text_tensor(json.dumps(usage), "usage")]


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """Inputs and outputs as above, and the decoupled policy (as vllm_backend sets it):
        a request streams many responses."""
        config = auto_complete_model_config.as_dict()
        have = {i["name"] for i in config.get("input", [])}
        for tensor in INPUTS:
            if tensor["name"] not in have:
                auto_complete_model_config.add_input(tensor)
        have = {o["name"] for o in config.get("output", [])}
        for tensor in OUTPUTS:
            if tensor["name"] not in have:
                auto_complete_model_config.add_output(tensor)
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        auto_complete_model_config.set_max_batch_size(0)  # requests batch in the engine
        return auto_complete_model_config

    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "speculative backend: set model_transaction_policy { decoupled: true }")
        repository = Path(args["model_repository"])
        version_dir = repository / args["model_version"]
        self.config = settings = ServingConfig.from_parameters(
            config_parameters(config), repository / "config.pbtxt")
        limit_heap_growth()  # this stub runs one model: its heap settings are ours to choose
        if settings.llm_model:
            folder = version_dir / settings.llm_model
            # the kernels read the GGUF the import names
            if not (folder / STAMP_FILE).is_file():
                raise ConfigError("parameters.llm_model", f"{folder}/{STAMP_FILE} does not exist: run "
                                  "`make setup` (it imports the model) or `dspark llm import`")
            self.generator = llm_generator(folder, settings.intra_op_threads,
                                           settings.max_context or None,
                                           settings.batch_verification)
            served = f"llm={settings.llm_model} runtime={settings.llm_runtime}"
        else:
            if not settings.target_model:
                raise ConfigError("parameters.target_model", "give llm_model (an imported LLM) or "
                                  "target_model (an LM pair in dspark's graph format)")
            target = _model_file(repository, settings.target_model)
            draft = _model_file(repository, settings.draft_model) if settings.draft_model else None
            tokenizer = version_dir / settings.tokenizer
            for path in (target, draft, tokenizer):
                if path is not None and not path.is_file():
                    raise ConfigError("parameters", f"{path} does not exist: run `make setup` (it "
                                                    "builds the models) or fix the model's parameters")
            self.generator = toy_generator(target, draft, tokenizer, settings.intra_op_threads,
                                           settings.draft_runtime, settings.batch_verification,
                                           settings.max_context or None)
            served = f"target={settings.target_model} draft={settings.draft_model or 'none'}"
        self.default_spec = SpeculativeParams(
            method=settings.default_method, num_speculative_tokens=settings.num_speculative_tokens,
            tree_width=settings.tree_width)
        if settings.default_method not in self.generator.engine.methods:
            raise ConfigError("parameters.default_method",
                              f"{settings.default_method!r} is not one of this model's methods "
                              f"{self.generator.engine.methods} (a draft method needs draft_model)")
        self.stream_interval_s = settings.stream_interval_ms / 1e3
        self._init_metrics(args)
        self.pool = RequestPool(settings.max_concurrent_requests, settings.max_queued_requests,
                                settings.max_queue_wait_ms / 1e3, name=args["model_name"])
        self.name, self.version = args["model_name"], args["model_version"]
        self.finalizing = threading.Event()
        self.streams = StreamLedger()
        # senders ask the server "cancelled?" here, never on a decode thread (response_sender.py)
        self.cancel_asks = ThreadPoolExecutor(1, thread_name_prefix="cancel-ask")
        self.watcher = threading.Thread(target=self._watch_unload, name="unload-watch", daemon=True)
        self.watcher.start()
        pb_utils.Logger.log_info(
            f"speculative backend: {args['model_name']} {served} "
            f"context={self.generator.engine.context} methods={self.generator.engine.methods} "
            f"default={settings.default_method} workers={settings.max_concurrent_requests} "
            f"batch_verification={settings.batch_verification}")

    def _watch_unload(self):
        """Ask the server whether it is still live and this model still ready (every UNLOAD_POLL_S
        while requests run, every IDLE_POLL_S while idle); when not, stop the requests (they end
        at their next round, answered). Server liveness, not readiness: with Triton's default
        strict readiness the server is "not ready" while any other model loads or unloads."""
        base = server_http_url()
        if base is None:
            return
        urls = [f"http://{base}/v2/health/live",
                f"http://{base}/v2/models/{self.name}/versions/{self.version}/ready"]
        failures = late = 0
        seen_ready, asked = False, float("-inf")
        while not self.pool.closing.wait(UNLOAD_POLL_S):
            busy = self.pool.load != (0, 0)
            if not busy and time.monotonic() - asked < IDLE_POLL_S:
                continue
            asked = time.monotonic()
            try:
                ready = all(_http_ok(url) for url in urls)
                failures = late = 0
            except (ConnectionError, urllib.error.URLError) as error:
                if isinstance(getattr(error, "reason", error), TimeoutError):
                    late = self._late_health(late, error)
                    continue  # a busy server answers late; that is no reason to stop
                if not seen_ready:
                    continue  # refused before ever ready: the server opens HTTP once every model loaded
                failures += 1  # refused: the server is gone
                ready = failures < 2
            except OSError as error:  # a timeout, or anything else the network says: ask again
                late = self._late_health(late, error)
                continue
            seen_ready = seen_ready or ready
            if not ready and seen_ready:  # never ready: still loading, or the endpoints are restricted
                running, waiting = self.pool.load
                self.pool.closing.set()
                if running or waiting:
                    pb_utils.Logger.log_info(f"speculative backend: {self.name} is unloading; stopping "
                                             f"{running} running and {waiting} waiting requests")
        if not self.finalizing.wait(UNLOAD_REPORT_S):
            self._report_stuck_unload()

    def _report_stuck_unload(self):
        running, waiting = self.pool.load
        cause = ""
        if not (running or waiting or self.streams.open_streams):
            cause = ("; every request had its final response, so Triton itself holds the model: its gRPC "
                     "frontend keeps a request whose stream the client cancelled as the final response was "
                     "written (Triton 2.51; docs/speculative.md, \"Why an unload hung\")")
        pb_utils.Logger.log_warn(f"speculative backend: {self.name}: not finalized {UNLOAD_REPORT_S:g} s after "
                                 f"the unload began ({running} requests running, {waiting} waiting; "
                                 f"{self.streams.summary()}){cause}; the stub's thread stacks follow on stderr")
        faulthandler.dump_traceback(all_threads=True)

    def _late_health(self, late: int, error: BaseException) -> int:
        """Count health checks that got no answer in time; say so once, at the fourth."""
        late += 1
        if late == 4:
            pb_utils.Logger.log_warn(f"speculative backend: {self.name}: the server's health endpoints "
                                     f"did not answer 4 times in a row ({error!r}); still asking")
        return late

    def _init_metrics(self, args):
        # Triton shares a Metric between stubs with equal labels, and the first stub to release it
        # frees it for all (triton-inference-server/server#8663): a reload's new stub starts
        # before the old one ends, so each stub's series carries its own pid.
        labels = {"model": args["model_name"], "version": args["model_version"],
                  "pid": str(os.getpid())}
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        specs = {  # name: (kind, description); families must outlive their metrics
            "proposed": (counter, "Draft tokens proposed (tree: deepest path per target pass)"),
            "accepted": (counter, "Draft tokens accepted by the target"),
            "generated": (counter, "Tokens generated"),
            "target_passes": (counter, "Target model passes after the prompt, per request"),
            "target_calls": (counter, "Target model calls of the round loops (one call verifies "
                                      "the passes of every request batched into it)"),
            "mean_accepted_length": (gauge, "Tokens per target pass, last request"),
            "tokens_per_second": (gauge, "Generated tokens per second, last request"),
            "requests_running": (gauge, "Requests generating now"),
        }
        self.families, self.metrics = [], {}
        for key, (kind, description) in specs.items():
            suffix = "_total" if kind == counter else ""
            family = pb_utils.MetricFamily(name=f"dspark_speculative_{key}{suffix}", kind=kind,
                                           description=description)
            self.families.append(family)
            self.metrics[key] = family.Metric(labels=labels)
        self.metrics_lock = threading.Lock()
        self.running = 0
        self.calls_reported = 0

    def execute(self, requests):
        for request in requests:
            sender = GuardedSender(request.get_response_sender(), FINAL, CANCEL_RECHECK_S, self.streams,
                                   self.cancel_asks.submit)
            self.pool.submit(lambda r=request, s=sender: self._serve(r, s),
                             lambda error, s=sender: self._fail(s, error))
        return None

    def _fail(self, sender, error):
        if not isinstance(error, (RequestError, UnavailableError)):
            pb_utils.Logger.log_warn(f"speculative backend: request failed: {error!r}")
        try:
            sender.send(pb_utils.InferenceResponse(error=triton_error(pb_utils, error, "generation failed")),
                        final=True)
        except Exception as send_error:  # noqa: BLE001 - the stream is lost; say so, keep serving
            pb_utils.Logger.log_warn(f"speculative backend: could not answer a request ({error!r}): {send_error!r}")

    def _serve(self, request, sender):
        self._running(+1)
        try:
            self._generate(request, sender)
        except Exception as error:  # noqa: BLE001 - report, close the stream, keep serving
            self._fail(sender, error)
        finally:
            self._running(-1)

    def _running(self, change: int):
        with self.metrics_lock:
            self.running += change
            self.metrics["requests_running"].set(self.running)

    def _cancelled(self, sender):
        return lambda: self.pool.closing.is_set() or sender.is_cancelled()

    def _generate(self, request, sender):
        prompt = _text(request, "text_input")
        messages = parse_messages(_text(request, "messages"))
        options = parse_generate_options(_scalar(request, "sampling_parameters"), self.default_spec,
                                         self.generator.engine.methods)
        if messages is None and prompt is None:
            raise RequestError("text_input", "is required (or a messages input)")
        if messages is None and not prompt:
            raise RequestError("text_input", "is empty; give a prompt")
        if messages is not None and prompt:
            raise RequestError("messages", "give text_input or messages, not both")
        if messages is None and options.chat:
            messages = [{"role": "user", "content": prompt}]
        # a chat's reply is the assistant's message alone; a completion echoes its prompt
        # unless exclude_input_in_output, as Triton's LLM backends do
        echo = "" if messages is not None else prompt
        ids = self.generator.encode_chat(messages) if messages is not None else \
            self.generator.encode(prompt)
        sampling = options.sampling
        if messages is not None and self.generator.chat_stop:
            sampling = dataclasses.replace(sampling, stop=sampling.stop + list(self.generator.chat_stop))
        self.generator.engine.check(ids, options.spec)  # before any model work
        stream = bool(_scalar(request, "stream"))
        exclude = bool(_scalar(request, "exclude_input_in_output"))
        stats = DecodeStats()
        started = time.perf_counter()
        pieces = self.generator.stream(ids, sampling, options.spec, stats,
                                       cancelled=self._cancelled(sender))
        if stream:
            def send(text):  # the text first: each call below is an IPC round trip
                if not sender.known_cancelled:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[_text_tensor(text)]))
                self._count_generated(stats)  # live, so a cancelled request is seen to stop
                sender.is_cancelled(ask_here=True)  # asked here, the decode loop rarely has to

            send_coalesced(pieces, send, self.stream_interval_s)
            self._record(stats, time.perf_counter() - started)
            self._unless_unloading(stats)
            sender.send(pb_utils.InferenceResponse(output_tensors=_final_outputs("", len(ids), stats)),
                        final=True)
        else:
            text = "".join(pieces)
            self._record(stats, time.perf_counter() - started)
            self._unless_unloading(stats)
            if not exclude:
                text = echo + text
            sender.send(pb_utils.InferenceResponse(output_tensors=_final_outputs(text, len(ids), stats)),
                        final=True)

    def _unless_unloading(self, stats: DecodeStats):
        """A request the unload stopped gets an error, not a text that looks complete."""
        if stats.finish_reason == "cancelled" and self.pool.closing.is_set():
            raise UnavailableError(f"{self.name} is unloading; the request was stopped after "
                                   f"{stats.generated_tokens} tokens", "shutdown")

    def _count_generated(self, stats: DecodeStats):
        with self.metrics_lock:  # metric calls go to the server one at a time
            new = stats.generated_tokens - stats.reported
            if new > 0:
                stats.reported += new
                self.metrics["generated"].increment(new)

    def _record(self, stats: DecodeStats, seconds: float):
        self._count_generated(stats)
        with self.metrics_lock:
            self.metrics["proposed"].increment(stats.proposed)
            self.metrics["accepted"].increment(stats.accepted)
            self.metrics["target_passes"].increment(stats.rounds)
            calls = self.generator.engine.target_calls
            self.metrics["target_calls"].increment(calls - self.calls_reported)
            self.calls_reported = calls
            self.metrics["mean_accepted_length"].set(stats.mean_accepted_length)
            if seconds > 0:
                self.metrics["tokens_per_second"].set(stats.generated_tokens / seconds)

    def finalize(self):
        """Cancel what runs (each request ends at its next round and is answered), reject what
        waits, then release the engine and the metric families."""
        started = time.monotonic()
        self.finalizing.set()
        drained = self.pool.close(DRAIN_TIMEOUT_S)
        self.cancel_asks.shutdown(wait=True)
        self.watcher.join(DRAIN_TIMEOUT_S)
        self.generator.engine.close()
        self.metrics.clear()
        self.families.clear()
        pb_utils.Logger.log_info(f"speculative backend: finalized in {time.monotonic() - started:.2f} s"
                                 + ("" if drained else " (some requests did not end in time)"))
