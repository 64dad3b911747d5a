"""The speculative backend's work that needs no Triton: the text generator its parameters ask
for, and one generate request read and checked before any model work.

Inputs follow Triton's LLM backends (dspark.tensors.GENERATE_INPUTS): text_input or messages (a
JSON chat), stream, sampling_parameters (JSON), exclude_input_in_output; docs/speculative.md has
the rest.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from dspark.decoding.request import parse_generate_options, parse_messages
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.decoding.stats import DecodeStats
from dspark.decoding.text import TextGenerator
from dspark.errors import ConfigError, RequestError, UnavailableError
from dspark.llm.importer import STAMP_FILE
from dspark.triton.models import llm_generator
from dspark.triton.params import SpeculativeParameters

InputReader = Callable[[str], Optional[np.ndarray]]  # a request's input tensor by name, None if absent


def _imported(version_dir: Path, parameter: str, name: str) -> Path:
    """An imported LLM's folder (relative to the version folder), or ConfigError naming the parameter."""
    folder = version_dir / name
    if not (folder / STAMP_FILE).is_file():
        raise ConfigError(f"parameter '{parameter}'", f"{folder}/{STAMP_FILE} does not exist: run "
                          "`make setup` (it imports the demo models) or `dspark llm import`")
    return folder


def build_generator(settings: SpeculativeParameters, repository: Path, version: str) -> tuple[TextGenerator, str]:
    """The generator ``settings`` name, and a few words saying what it serves (for the log)."""
    version_dir = repository / version
    folder = _imported(version_dir, "llm_model", settings.llm_model)
    draft = _imported(version_dir, "draft_llm", settings.draft_llm) if settings.draft_llm else None
    generator = llm_generator(folder, settings.intra_op_threads, settings.max_context or None,
                              settings.batch_verification, draft=draft,
                              prefix_cache_mb=settings.prefix_cache_mb)
    served = f"llm={settings.llm_model} draft={settings.draft_llm or 'none'}"
    if settings.default_method not in generator.engine.methods:
        raise ConfigError("parameter 'default_method'",
                          f"{settings.default_method!r} is not one of this model's methods "
                          f"{generator.engine.methods} (a draft method needs draft_llm)")
    return generator, served


def _scalar(read: InputReader, name: str):
    array = read(name)
    if array is None:
        return None
    if array.size != 1:
        raise RequestError(name, f"expected one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _text(read: InputReader, name: str) -> Optional[str]:
    """A BYTES input as text: UTF-8 or a clear error, never a silent replacement."""
    value = _scalar(read, name)
    if value is None or isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(name, f"is not valid UTF-8 (byte 0x{value[error.start]:02x} at offset "
                                 f"{error.start}); send UTF-8 text") from None


@dataclass
class GenerateCall:
    """One request, checked: its prompt's tokens, how to sample and speculate, whether to stream,
    and the text a non-streamed reply starts with (a completion echoes its prompt unless
    exclude_input_in_output, as Triton's LLM backends do; a chat's reply is the assistant's
    message alone)."""
    ids: list[int]
    sampling: SamplingParams
    spec: SpeculativeParams
    stream: bool
    echo: str


def read_call(read: InputReader, generator: TextGenerator, default_spec: SpeculativeParams) -> GenerateCall:
    """The request's inputs read and checked, before any model work; RequestError naming the
    input otherwise."""
    prompt = _text(read, "text_input")
    messages = parse_messages(_text(read, "messages"))
    options = parse_generate_options(_scalar(read, "sampling_parameters"), default_spec, generator.engine.methods)
    if messages is None and prompt is None:
        raise RequestError("text_input", "is required (or a messages input)")
    if messages is None and not prompt:
        raise RequestError("text_input", "is empty; give a prompt")
    if messages is not None and prompt:
        raise RequestError("messages", "give text_input or messages, not both")
    if messages is None and options.chat:
        messages = [{"role": "user", "content": prompt}]
    ids = generator.encode_chat(messages) if messages is not None else generator.encode(prompt)
    sampling = options.sampling
    if messages is not None and generator.chat_stop:
        sampling = dataclasses.replace(sampling, stop=sampling.stop + list(generator.chat_stop))
    generator.engine.check(ids, options.spec)
    exclude = bool(_scalar(read, "exclude_input_in_output"))
    echo = "" if messages is not None or exclude else prompt
    return GenerateCall(ids, sampling, options.spec, bool(_scalar(read, "stream")), echo)


def tokenizer_call(read: InputReader, generator: TextGenerator) -> Optional[dict]:
    """``sampling_parameters`` ``{"tokenize": true}`` (with text_input or messages: the prompt's
    token ids as a generation would see them, chat template included, and the context) or
    ``{"detokenize": [ids]}`` (their text): the model's own tokenizer answers, nothing is
    generated. None for any other request (a generation)."""
    raw = _scalar(read, "sampling_parameters")
    if raw is None or b"tokenize" not in (raw.encode() if isinstance(raw, str) else bytes(raw)):
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None  # a generation's parser names the error
    if not isinstance(data, dict) or not ({"tokenize", "detokenize"} & data.keys()):
        return None
    extra = sorted(set(data) - {"tokenize", "detokenize"})
    if extra or len(data) != 1:
        raise RequestError("sampling_parameters", "tokenize or detokenize comes alone, without "
                                                  + (", ".join(extra) or "the other"))
    if "detokenize" in data:
        ids = data["detokenize"]
        vocab = getattr(generator.tokenizer, "vocab_size", None)
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < (vocab or i + 1) for i in ids):
            raise RequestError("detokenize", "must be a list of token ids"
                                             + (f", each in [0, {vocab})" if vocab else ""))
        # the bytes a generation of these ids sends (an incomplete character replaced)
        return {"prompt": generator.tokenizer.decode_bytes(ids).decode("utf-8", "replace")}
    if data["tokenize"] is not True:
        raise RequestError("tokenize", "must be true")
    prompt, messages = _text(read, "text_input"), parse_messages(_text(read, "messages"))
    if (messages is None) == (prompt is None):
        raise RequestError("text_input", "give text_input or messages (one of them)")
    ids = generator.encode_chat(messages) if messages is not None else generator.encode(prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": generator.engine.context}


def usage(call: GenerateCall, stats: DecodeStats) -> dict:
    """What the request used, as OpenAI's usage (the final response's ``usage`` output)."""
    return {"prompt_tokens": len(call.ids), "completion_tokens": stats.generated_tokens,
            "finish_reason": stats.finish_reason}


def refuse_if_unloaded(stats: DecodeStats, closing: bool, model: str) -> None:
    """A request the unload stopped gets an error, not a text that looks complete."""
    if stats.finish_reason == "cancelled" and closing:
        raise UnavailableError(f"{model} is unloading; the request was stopped after "
                               f"{stats.generated_tokens} tokens", "shutdown")
