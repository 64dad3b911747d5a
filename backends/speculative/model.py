"""Triton Python-based backend `speculative`: streamed text generation with lossless
speculative decoding (draft model, prompt lookup or tree) over ONNX Runtime.

Decoupled. Inputs follow Triton's LLM backends, so /generate, /generate_stream and gRPC
streaming work unchanged: text_input (BYTES), stream (BOOL), sampling_parameters (BYTES, JSON:
max_tokens, temperature, top_k, top_p, seed, stop, speculative {method none|draft|ngram|hybrid|tree,
num_speculative_tokens, tree_width, adaptive}), exclude_input_in_output (BOOL); output
text_output (BYTES).

Config parameters: target_model and draft_model (names of sibling models in this repository
whose version 1 holds model.onnx), tokenizer (file in this model's version folder,
tokenizer.json), default_method (hybrid), num_speculative_tokens (4), tree_width (4),
intra_op_threads (1), stream_interval_ms (10: a streamed response carries all text produced
since the last one and goes out at most this often; the first at once), draft_runtime (kernel:
dspark's C forward pass; onnxruntime).
"""
import json
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark.decoding.engine import DecodeStats
from dspark.decoding.request import parse_sampling_parameters
from dspark.decoding.sampling import SpeculativeParams
from dspark.decoding.text import DRAFT_RUNTIMES, TextGenerator, send_coalesced
from dspark.errors import RequestError
from dspark.triton.adapter import config_parameters, parameter_int, triton_error

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise RequestError(name, f"expected one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _text_tensor(text: str):
    return pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config_parameters(config)
        repository = Path(args["model_repository"])
        version_dir = repository / args["model_version"]
        threads = parameter_int(params, "intra_op_threads", 1, minimum=1)
        target = repository.parent / params.get("target_model", "spec_target") / "1" / "model.onnx"
        draft_name = params.get("draft_model", "spec_draft")
        draft = repository.parent / draft_name / "1" / "model.onnx" if draft_name else None
        tokenizer = version_dir / (params.get("tokenizer") or "tokenizer.json")
        for path in (target, draft, tokenizer):
            if path is not None and not path.is_file():
                raise pb_utils.TritonModelException(
                    f"speculative backend: {path} does not exist: run `make setup` (it builds the "
                    "LM pair from tools/weights) or fix the model's parameters")
        draft_runtime = params.get("draft_runtime") or "kernel"
        if draft_runtime not in DRAFT_RUNTIMES:
            raise pb_utils.TritonModelException(
                f"speculative backend: parameter draft_runtime is {draft_runtime!r}; use one of "
                f"{sorted(DRAFT_RUNTIMES)}")
        self.generator = TextGenerator.from_files(target, draft, tokenizer, threads, draft_runtime)
        self.stream_interval_s = parameter_int(params, "stream_interval_ms", 10, minimum=0) / 1e3
        self.default_spec = SpeculativeParams(
            method=params.get("default_method") or "hybrid",
            num_speculative_tokens=parameter_int(params, "num_speculative_tokens", 4, minimum=1),
            tree_width=parameter_int(params, "tree_width", 4, minimum=1)).validate()
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
        self.workers = set()
        pb_utils.Logger.log_info(
            f"speculative backend: {args['model_name']} target={target.parent.parent.name} "
            f"draft={draft_name or 'none'} ({draft_runtime}) default={self.default_spec}")

    def execute(self, requests):
        # Each request runs on its own thread (ORT releases the GIL), so requests overlap.
        for request in requests:
            worker = threading.Thread(target=self._serve, args=(request,), daemon=True)
            self.workers.add(worker)
            worker.start()
        return None

    def _serve(self, request):
        sender = request.get_response_sender()
        try:
            self._generate(request, sender)
        except Exception as error:  # noqa: BLE001 - report, close the stream, keep serving
            if not isinstance(error, RequestError):
                pb_utils.Logger.log_error(f"speculative backend: request failed: {error!r}")
            sender.send(pb_utils.InferenceResponse(error=triton_error(pb_utils, error, "generation failed")),
                        flags=FINAL)
        finally:
            self.workers.discard(threading.current_thread())

    def _generate(self, request, sender):
        prompt = _scalar(request, "text_input")
        if prompt is None:
            raise RequestError("text_input", "is required")
        prompt = prompt.decode("utf-8", errors="replace") if isinstance(prompt, bytes) else str(prompt)
        stream = bool(_scalar(request, "stream"))
        exclude = bool(_scalar(request, "exclude_input_in_output"))
        raw = _scalar(request, "sampling_parameters")
        sampling, spec = parse_sampling_parameters(raw, self.default_spec)
        stats = DecodeStats()
        started = time.perf_counter()
        pieces = self.generator.stream(prompt, sampling, spec, stats, cancelled=sender.is_cancelled)
        if stream:
            def send(text):
                if not sender.is_cancelled():
                    sender.send(pb_utils.InferenceResponse(output_tensors=[_text_tensor(text)]))

            send_coalesced(pieces, send, self.stream_interval_s)
            sender.send(flags=FINAL)
        else:
            text = "".join(pieces)
            if not exclude:
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
        for worker in list(self.workers):
            worker.join(timeout=5)
