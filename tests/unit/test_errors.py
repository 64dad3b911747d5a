"""dspark's one error model: each error names its field and maps to one Triton code."""
import pydantic
import pytest

from dspark.errors import ConfigError, RequestError, UnavailableError, error_code, from_validation_error
from dspark.triton.adapter import triton_error


class FakeTritonError:
    """Stands in for pb_utils.TritonError: the codes it has and the (message, code) it was built with."""

    INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = "INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED"

    def __init__(self, message, code):
        self.message, self.code = message, code


class FakePbUtils:
    TritonError = FakeTritonError


@pytest.mark.parametrize("error, code, text", [
    (RequestError("temperature", "must be >= 0, got -1"), "INVALID_ARG", "temperature: must be >= 0, got -1"),
    (ConfigError("parameter 'threads'", "must be an integer", "m/config.pbtxt"), "INVALID_ARG",
     "m/config.pbtxt: parameter 'threads': must be an integer"),
    (UnavailableError("tier 'gold' queue is full", reason="queue_full"), "UNAVAILABLE", "tier 'gold' queue is full"),
    (KeyError("boom"), "INTERNAL", "generation failed: 'boom'"),
])
def test_errors_map_to_one_triton_code_each(error, code, text):
    assert error_code(error) == code
    mapped = triton_error(FakePbUtils, error, context="generation failed")
    assert (mapped.message, mapped.code) == (text, code)


def test_a_pydantic_failure_names_the_field_path():
    class Inner(pydantic.BaseModel):
        top_p: float = pydantic.Field(gt=0, le=1)

    class Outer(pydantic.BaseModel):
        sampling: list[Inner]

    with pytest.raises(pydantic.ValidationError) as raised:
        Outer.model_validate({"sampling": [{"top_p": 0.5}, {"top_p": 2}]})
    error = from_validation_error(raised.value, prefix="sampling_parameters")
    assert isinstance(error, RequestError)
    assert error.field == "sampling_parameters.sampling[1].top_p"
    assert "less than or equal to 1" in str(error) and "got 2" in str(error)
    config = from_validation_error(raised.value, ConfigError, path="routing.yaml")
    assert str(config).startswith("routing.yaml: sampling[1].top_p: ")
