"""Triton Python-based backend `speculative`: streamed text generation with lossless
speculative decoding on CPU (dspark.decoding); this file only adapts it to Triton.

Decoupled. Inputs follow Triton's LLM backends, so /generate, /generate_stream and gRPC
streaming work unchanged (dspark.triton.generate; docs/speculative.md). Requests run on a bounded
worker pool (max_concurrent_requests; up to max_queued_requests more wait at most
max_queue_wait_ms, beyond that UNAVAILABLE); a request's loop checks for cancellation every round;
an unload is seen by dspark.triton.unload_watch; finalize cancels what runs and drains it.
"""
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark._ext import probes
from dspark.decoding.sampling import SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.decoding.text import Delta, join_deltas, send_coalesced
from dspark.errors import RequestError, UnavailableError
from dspark.params import parse_parameters
from dspark.tensors import GENERATE_INPUTS, GENERATE_OUTPUTS
from dspark.triton.adapter import triton_error
from dspark.triton.generate import build_generator, read_call, refuse_if_unloaded, tokenizer_call, usage
from dspark.triton.metrics import SpeculativeMetrics
from dspark.triton.params import SpeculativeParameters
from dspark.triton.request_pool import RequestPool, limit_heap_growth
from dspark.triton.response_sender import GuardedSender, StreamLedger
from dspark.triton.unload_watch import UnloadWatch

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DRAIN_TIMEOUT_S = 3.0  # finalize: requests in flight end at their next round, well within this
# a request asks the server whether its client cancelled at most this often (an IPC round trip
# that would otherwise sit in every decode round); a cancel still ends it within a few tokens
CANCEL_RECHECK_S = 0.02


def _text_tensor(text: str, name: str = "text_output"):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """Inputs and outputs as above, and the decoupled policy (as vllm_backend sets it):
        a request streams many responses."""
        config = auto_complete_model_config.as_dict()
        have = {i["name"] for i in config.get("input", [])}
        for tensor in GENERATE_INPUTS:
            if tensor["name"] not in have:
                auto_complete_model_config.add_input(tensor)
        have = {o["name"] for o in config.get("output", [])}
        for tensor in GENERATE_OUTPUTS:
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
        settings = parse_parameters(SpeculativeParameters, config, path=repository / "config.pbtxt")
        limit_heap_growth()  # this stub runs one model: its heap settings are ours to choose
        self.generator, served = build_generator(settings, repository, args["model_version"])
        self.default_spec = SpeculativeParams(
            method=settings.default_method, num_speculative_tokens=settings.num_speculative_tokens,
            tree_width=settings.tree_width)
        self.stream_interval_s = settings.stream_interval_ms / 1e3
        self.name = args["model_name"]
        self.metrics = SpeculativeMetrics(pb_utils, self.name, args["model_version"])
        self.pool = RequestPool(settings.max_concurrent_requests, settings.max_queued_requests,
                                settings.max_queue_wait_ms / 1e3, name=self.name)
        self.streams = StreamLedger()
        # senders ask the server "cancelled?" here, never on a decode thread (response_sender.py)
        self.cancel_asks = ThreadPoolExecutor(1, thread_name_prefix="cancel-ask")
        self.watch = UnloadWatch(self.name, args["model_version"], self.pool, self.streams,
                                 pb_utils.Logger.log_info, pb_utils.Logger.log_warn).start()
        engine = self.generator.engine
        pb_utils.Logger.log_info(
            f"speculative backend: {self.name} {served} context={engine.context} methods={engine.methods} "
            f"default={settings.default_method} workers={settings.max_concurrent_requests} "
            f"batch_verification={settings.batch_verification} prefix_cache_mb={settings.prefix_cache_mb:g}")

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
        self.metrics.running(+1)
        try:
            self._generate(request, sender)
        except Exception as error:  # noqa: BLE001 - report, close the stream, keep serving
            self._fail(sender, error)
        finally:
            self.metrics.running(-1)

    def _generate(self, request, sender):
        answer = tokenizer_call(lambda name: _input(request, name), self.generator)
        if answer is not None:  # /tokenize, /detokenize: no generation
            counts = {"prompt_tokens": len(answer.get("tokens", ())), "completion_tokens": 0, "finish_reason": "stop"}
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                _text_tensor(json.dumps(answer)), _text_tensor(json.dumps(counts), "usage")]), final=True)
            return
        call = read_call(lambda name: _input(request, name), self.generator, self.default_spec)
        stats = DecodeStats()
        started = time.perf_counter()
        probes.request_start(self.name, call.spec.method, len(call.ids))
        pieces = self.generator.stream(call.ids, call.sampling, call.spec, stats,
                                       cancelled=lambda: self.pool.closing.is_set() or sender.is_cancelled())
        text, entries = "", [] if call.sampling.logprobs is not None else None
        if call.stream:
            def send(piece):  # the text first: each call below is an IPC round trip
                probes.stream_begin(len(piece))
                if not sender.known_cancelled:
                    outputs = [_text_tensor(piece)]
                    if entries is not None:
                        outputs.append(_text_tensor(json.dumps(piece.logprobs or []), "logprobs"))
                    sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
                probes.stream_end(len(piece))
                self.metrics.count_generated(stats)
                sender.is_cancelled(ask_here=True)  # asked here, the decode loop rarely has to

            text = send_coalesced(pieces, send, self.stream_interval_s)  # the last text rides on the final response
            if text and stats.finish_reason == "cancelled":  # which may be an unload's error: the text first
                send(text)
                text = Delta("")
            if entries is not None:
                entries = text.logprobs or []
        else:
            done = join_deltas(list(pieces))
            text = call.echo + done
            if entries is not None:
                entries = done.logprobs or []
        engine = self.generator.engine
        self.metrics.record(stats, time.perf_counter() - started, engine.target_calls,
                            engine.prefix_cache.stats if engine.prefix_cache is not None else None)
        probes.request_end(self.name, call.spec.method, stats.generated_tokens, stats.rounds, stats.draft_s,
                           stats.target_s)
        refuse_if_unloaded(stats, self.pool.closing.is_set(), self.name)
        outputs = [_text_tensor(text), _text_tensor(json.dumps(usage(call, stats)), "usage")]
        if entries is not None:  # streamed: each response carries its own text's entries
            outputs.append(_text_tensor(json.dumps(entries), "logprobs"))
        sender.send(pb_utils.InferenceResponse(output_tensors=outputs), final=True)

    def finalize(self):
        """Cancel what runs (each request ends at its next round and is answered), reject what
        waits, then release the engine and the metric families."""
        started = time.monotonic()
        drained = self.pool.close(DRAIN_TIMEOUT_S)
        self.cancel_asks.shutdown(wait=True)
        self.watch.stop(DRAIN_TIMEOUT_S)
        self.generator.engine.close()
        self.metrics.close()
        pb_utils.Logger.log_info(f"speculative backend: finalized in {time.monotonic() - started:.2f} s"
                                 + ("" if drained else " (some requests did not end in time)"))
