"""Parse a generate request's ``sampling_parameters`` JSON (Triton's LLM-backend convention)."""
from __future__ import annotations

import json
from dataclasses import replace

from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.errors import RequestError

_SAMPLING_TYPES = {"max_tokens": int, "temperature": float, "top_k": int, "top_p": float,
                   "seed": int, "stop": list}
_SPEC_TYPES = {"method": str, "num_speculative_tokens": int, "tree_width": int, "adaptive": bool}


def _typed(name: str, value, kind):
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is list and isinstance(value, str):
        return [value]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(name, f"expected {kind.__name__}, got {json.dumps(value)}")
    return value


def parse_sampling_parameters(raw: str | bytes | None, default_spec: SpeculativeParams,
                              ) -> tuple[SamplingParams, SpeculativeParams]:
    """Validated (sampling, speculative) parameters; RequestError names the bad field."""
    if raw in (None, b"", ""):
        data = {}
    else:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise RequestError("sampling_parameters", f"not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise RequestError("sampling_parameters", "must be a JSON object")
    spec_data = data.pop("speculative", {}) or {}
    if not isinstance(spec_data, dict):
        raise RequestError("speculative", "must be a JSON object")
    unknown = set(data) - set(_SAMPLING_TYPES)
    if unknown:
        raise RequestError(sorted(unknown)[0], f"unknown sampling parameter; known: "
                                                   f"{sorted(_SAMPLING_TYPES) + ['speculative']}")
    unknown = set(spec_data) - set(_SPEC_TYPES)
    if unknown:
        raise RequestError(f"speculative.{sorted(unknown)[0]}",
                               f"unknown; known: {sorted(_SPEC_TYPES)}")
    sampling = SamplingParams(**{k: _typed(k, v, _SAMPLING_TYPES[k]) for k, v in data.items()
                                 if v is not None})
    spec = replace(default_spec, **{k: _typed(f"speculative.{k}", v, _SPEC_TYPES[k])
                                    for k, v in spec_data.items()})
    return sampling.validate(), spec.validate()
