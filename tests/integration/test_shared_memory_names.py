"""Client shared-memory regions named in inference requests: Triton resolves a request's
`shared_memory_region` in its frontend, before any backend sees it, so a region is as private as
its registered name unless inference needs the key too (`--key-inference`). With it, a caller
without the key can neither read nor overwrite a registered region, and is refused the same way
whether the name exists or not."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as client_shm
from tritonclient.utils import InferenceServerException

from dspark.paths import project_root
from dspark.server.access import new_region_name
from tests.conftest import serving

pytestmark = pytest.mark.integration

SECRET = np.arange(16, dtype=np.float32).reshape(1, 16) + 1000  # the victim's input, 64 bytes


@pytest.fixture(scope="module")
def keyed_server(request):
    with serving(request, [project_root() / "model_repository"], model_control="explicit",
                 load_models=["mlp_classifier", "spec_lm"], key_inference=True) as server:
        yield server


def _infer(client, module, region=None, headers=None, output_region=None):
    tensor = module.InferInput("features", [1, 16], "FP32")
    if region:
        tensor.set_shared_memory(region, SECRET.nbytes)
    else:
        tensor.set_data_from_numpy(SECRET)
    output = module.InferRequestedOutput("probabilities")
    if output_region:
        output.set_shared_memory(output_region, 16)
    return client.infer("mlp_classifier", [tensor], outputs=[output], headers=headers)


def _refusal(call) -> str:
    with pytest.raises(InferenceServerException) as refused:
        call()
    return str(refused.value)


def test_a_registered_region_is_out_of_reach_of_a_caller_without_the_key(keyed_server):
    key = keyed_server.repository_headers
    name = new_region_name()
    handle = client_shm.create_shared_memory_region(name, f"/{name}", SECRET.nbytes)
    clients = [(httpclient.InferenceServerClient(keyed_server.http_url), httpclient),
               (grpcclient.InferenceServerClient(keyed_server.grpc_url), grpcclient)]
    try:
        client_shm.set_shared_memory_region(handle, [SECRET])
        clients[0][0].register_system_shared_memory(name, f"/{name}", SECRET.nbytes, headers=key)
        for client, module in clients:
            # the owner, with the key, uses its region
            with_key = _infer(client, module, region=name, headers=key).as_numpy("probabilities")
            assert with_key.shape == (1, 4)
            for attempt in ({"region": name}, {"output_region": name}, {}):
                refusal = _refusal(lambda: _infer(client, module, **attempt))
                assert re.search("restricted, expecting header '(triton-grpc-protocol-)?dspark-api-key'", refusal), \
                    refusal
            # no existence oracle: a name nobody registered is refused alike
            unknown = _refusal(lambda: _infer(client, module, region="no-such-region"))
            assert unknown == _refusal(lambda: _infer(client, module, region=name))
            assert "Unable to find" not in unknown
        assert np.array_equal(client_shm.get_contents_as_numpy(handle, np.float32, [1, 16]), SECRET)
    finally:
        clients[0][0].unregister_system_shared_memory(headers=key)
        client_shm.destroy_shared_memory_region(handle)


def test_region_names_are_not_guessable():
    names = {new_region_name() for _ in range(1000)}
    assert len(names) == 1000
    assert all(re.fullmatch("dspark-[0-9a-f]{32}", name) for name in names)  # 128 random bits


def test_the_openai_api_sends_the_key_on_its_inference_calls(keyed_server):
    """`serve --key-inference --openai-port`: the API (on loopback, no Bearer key of its own) is
    served; a direct call to Triton's generate endpoint without the key is refused."""
    import openai
    import requests

    from tests.integration.conftest import serve_openai

    api = serve_openai(keyed_server)
    try:
        client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="spec_lm", max_tokens=4,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    finally:
        api.stop()
    direct = requests.post(f"http://{keyed_server.http_url}/v2/models/spec_lm/generate",
                           json={"text_input": "Hi", "sampling_parameters": "{\"max_tokens\": 2}"}, timeout=60)
    assert direct.status_code in (401, 403) or "restricted" in direct.text.lower(), direct.text
