"""sampling_parameters {"tokenize": true} / {"detokenize": [ids]}: the speculative backend's
tokenizer answers (what /tokenize and /detokenize of the OpenAI API call), a generation does not start."""
import json

import numpy as np
import pytest

from dspark.errors import RequestError
from dspark.triton.generate import tokenizer_call


class _Bytes:
    """One token per byte; a chat template that wraps each message in brackets."""
    vocab_size = 256
    chat_template = "[{content}]"

    def encode(self, text):
        return list(text.encode())

    def decode_bytes(self, ids):
        return bytes(ids)

    def apply_chat_template(self, messages):
        return "".join(f"[{m['content']}]" for m in messages)


class _Generator:
    tokenizer = _Bytes()
    engine = type("Engine", (), {"context": 64})()
    has_chat_template = True

    def encode(self, prompt):
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages):
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))


def _reader(**inputs):
    arrays = {k: np.array([v.encode()], dtype=np.object_) for k, v in inputs.items()}
    return arrays.get


def test_tokenize_gives_the_prompts_ids_and_the_context():
    answer = tokenizer_call(_reader(text_input="hé", sampling_parameters='{"tokenize": true}'), _Generator())
    assert answer == {"tokens": [104, 195, 169], "count": 3, "max_model_len": 64}
    chat = tokenizer_call(_reader(messages=json.dumps([{"role": "user", "content": "a"}]),
                                  sampling_parameters='{"tokenize": true}'), _Generator())
    assert chat["tokens"] == list(b"[a]")


def test_detokenize_gives_the_text_back():
    assert tokenizer_call(_reader(sampling_parameters='{"detokenize": [104, 195, 169]}'), _Generator()) == \
        {"prompt": "hé"}


@pytest.mark.parametrize("params, field", [
    ('{"detokenize": [300]}', "detokenize"), ('{"detokenize": "ab"}', "detokenize"),
    ('{"detokenize": [true]}', "detokenize"), ('{"tokenize": 1}', "tokenize"),
    ('{"tokenize": true, "max_tokens": 4}', "sampling_parameters"),
])
def test_bad_tokenizer_calls_name_the_field(params, field):
    with pytest.raises(RequestError) as error:
        tokenizer_call(_reader(text_input="x", sampling_parameters=params), _Generator())
    assert error.value.field == field


def test_a_generation_is_no_tokenizer_call():
    assert tokenizer_call(_reader(text_input="x", sampling_parameters='{"max_tokens": 4}'), _Generator()) is None
    assert tokenizer_call(_reader(text_input="x"), _Generator()) is None
