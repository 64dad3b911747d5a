"""Triton Python-based backend `speculative`: streamed text generation with lossless
speculative decoding on CPU (dspark.decoding); this file only adapts it to Triton.

Decoupled. Inputs follow Triton's LLM backends, so /generate, /generate_stream and gRPC
streaming work unchanged: text_input (BYTES, UTF-8), messages (BYTES, optional: a JSON chat),
stream (BOOL), sampling_parameters (BYTES, JSON: max_tokens, temperature, top_k, top_p, seed,
stop, chat, speculative {method, num_speculative_tokens, tree_width, adaptive}),
exclude_input_in_output (BOOL); output text_output (BYTES). docs/speculative.md has the rest.

Requests run on a bounded worker pool (max_concurrent_requests; up to max_queued_requests more
wait at most max_queue_wait_ms, beyond that UNAVAILABLE); a request's loop checks for
cancellation every round; finalize cancels what runs and drains it.
"""
import json
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark.decoding.models import toy_generator
from dspark.decoding.request import parse_generate_options, parse_messages
from dspark.decoding.sampling import SpeculativeParams
from dspark.decoding.serving import RequestPool, ServingConfig
from dspark.decoding.stats import DecodeStats
from dspark.decoding.text import send_coalesced
from dspark.errors import ConfigError, RequestError
from dspark.triton.adapter import config_parameters, triton_error

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DRAIN_TIMEOUT_S = 3.0  # finalize: requests in flight end at their next round, well within this

INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "messages", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
]
OUTPUTS = [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}]


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


def _text_tensor(text: str):
    return pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))


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
        target = repository.parent / settings.target_model / "1" / "model.onnx"
        draft = (repository.parent / settings.draft_model / "1" / "model.onnx"
                 if settings.draft_model else None)
        tokenizer = version_dir / settings.tokenizer
        for path in (target, draft, tokenizer):
            if path is not None and not path.is_file():
                raise ConfigError("parameters", f"{path} does not exist: run `make setup` (it builds "
                                                "the models) or fix the model's parameters")
        self.generator = toy_generator(target, draft, tokenizer, settings.intra_op_threads,
                                       settings.draft_runtime, settings.batch_verification,
                                       settings.max_context or None)
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
        pb_utils.Logger.log_info(
            f"speculative backend: {args['model_name']} target={settings.target_model} "
            f"draft={settings.draft_model or 'none'} methods={self.generator.engine.methods} "
            f"default={settings.default_method} workers={settings.max_concurrent_requests} "
            f"batch_verification={settings.batch_verification}")

    def _init_metrics(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        specs = {  # name: (kind, description); families must outlive their metrics
            "proposed": (counter, "Draft tokens proposed (tree: deepest path per target pass)"),
            "accepted": (counter, "Draft tokens accepted by the target"),
            "generated": (counter, "Tokens generated"),
            "target_passes": (counter, "Target model passes after the prompt"),
            "mean_accepted_length": (gauge, "Tokens per target pass, last request"),
            "tokens_per_second": (gauge, "Generated tokens per second, last request"),
        }
        self.families, self.metrics = [], {}
        for key, (kind, description) in specs.items():
            suffix = "_total" if kind == counter else ""
            family = pb_utils.MetricFamily(name=f"dspark_speculative_{key}{suffix}", kind=kind,
                                           description=description)
            self.families.append(family)
            self.metrics[key] = family.Metric(labels=labels)
        self.metrics_lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            self.pool.submit(lambda r=request, s=sender: self._serve(r, s),
                             lambda error, s=sender: self._fail(s, error))
        return None

    def _fail(self, sender, error):
        if not isinstance(error, RequestError):
            pb_utils.Logger.log_warn(f"speculative backend: request failed: {error}")
        sender.send(pb_utils.InferenceResponse(error=triton_error(pb_utils, error, "generation failed")),
                    flags=FINAL)

    def _serve(self, request, sender):
        try:
            self._generate(request, sender)
        except Exception as error:  # noqa: BLE001 - report, close the stream, keep serving
            self._fail(sender, error)

    def _cancelled(self, sender):
        return lambda: self.pool.closing.is_set() or sender.is_cancelled()

    def _generate(self, request, sender):
        prompt = _text(request, "text_input")
        messages = parse_messages(_text(request, "messages"))
        options = parse_generate_options(_scalar(request, "sampling_parameters"), self.default_spec)
        if messages is None and prompt is None:
            raise RequestError("text_input", "is required (or a messages input)")
        if messages is None and not prompt:
            raise RequestError("text_input", "is empty; give a prompt")
        if messages is not None or options.chat:
            raise RequestError("sampling_parameters.chat", "this model has no chat template")
        ids = self.generator.encode(prompt)
        self.generator.engine.check(ids, options.spec)  # before any model work
        stream = bool(_scalar(request, "stream"))
        exclude = bool(_scalar(request, "exclude_input_in_output"))
        stats = DecodeStats()
        started = time.perf_counter()
        pieces = self.generator.stream(ids, options.sampling, options.spec, stats,
                                       cancelled=self._cancelled(sender))
        if stream:
            def send(text):
                if not sender.is_cancelled():
                    sender.send(pb_utils.InferenceResponse(output_tensors=[_text_tensor(text)]))

            send_coalesced(pieces, send, self.stream_interval_s)
            sender.send(flags=FINAL)
        else:
            text = "".join(pieces)
            if not exclude and prompt:
                text = prompt + text
            sender.send(pb_utils.InferenceResponse(output_tensors=[_text_tensor(text)]), flags=FINAL)
        self._record(stats, time.perf_counter() - started)

    def _record(self, stats: DecodeStats, seconds: float):
        with self.metrics_lock:
            self.metrics["proposed"].increment(stats.proposed)
            self.metrics["accepted"].increment(stats.accepted)
            self.metrics["generated"].increment(stats.generated_tokens)
            self.metrics["target_passes"].increment(stats.rounds)
            self.metrics["mean_accepted_length"].set(stats.mean_accepted_length)
            if seconds > 0:
                self.metrics["tokens_per_second"].set(stats.generated_tokens / seconds)

    def finalize(self):
        """Cancel what runs (each request ends at its next round and is answered), reject what
        waits, then release the engine and the metric families."""
        started = time.monotonic()
        drained = self.pool.close(DRAIN_TIMEOUT_S)
        self.generator.engine.close()
        self.metrics.clear()
        self.families.clear()
        pb_utils.Logger.log_info(f"speculative backend: finalized in {time.monotonic() - started:.2f} s"
                                 + ("" if drained else " (some requests did not end in time)"))
