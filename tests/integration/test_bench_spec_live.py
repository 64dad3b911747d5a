"""`bench spec`'s served pass against the real model on the session's server: the package's gRPC
streaming transport sends the prompts in order, keeps the streamed text (the same as /generate's)
and times the first response and the gaps; the stub is found and its memory sampled."""
import json

import requests

from dspark.bench import spec_inprocess, spec_served
from dspark.bench.load import summarize
from dspark.bench.resources import ResourceSampler, model_stubs, stub_processes


def test_served_pass_keeps_each_prompts_text_in_order_with_its_timings(triton_server):
    prompts = spec_inprocess.load_prompts(1)[:3]  # chat, rewrite, code
    sampling = {"max_tokens": 12, "speculative": {"method": "ngram"}}
    pid = triton_server._process.pid
    stubs = stub_processes(pid, spec_inprocess.MODEL)
    assert len(stubs) == 1 and stubs[0][1][0].endswith("triton_python_backend_stub")
    sampler = ResourceSampler(pid, 0.1).start()
    records, wall = spec_served.run_served(triton_server.grpc_url, prompts, sampling, concurrency=2)
    samples = sampler.stop()
    texts = [b"".join(r.kept).decode() for r in records]
    for prompt, text in zip(prompts, texts):
        body = {"text_input": prompt.text, "sampling_parameters": json.dumps({**sampling, "chat": True})}
        reply = requests.post(f"http://{triton_server.http_url}/v2/models/{spec_inprocess.MODEL}/generate", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["text_output"] == text and len(text) > 10
    figures = summarize(records, wall)
    assert figures["ok"] == 3 and all(r.sent < r.first <= r.last <= r.done for r in records)
    assert 0 < figures["ttft_p50_ms"] < 1e3 * wall and wall >= max(r.done for r in records) - min(r.sent for r in records)
    assert samples and max(sum(rss for _, rss in model_stubs(s, spec_inprocess.MODEL)) for s in samples) > 100  # MiB


def test_interleaved_pass_serves_and_runs_each_prompt_in_process(triton_server):
    """Concurrency 1 with the in-process reference interleaved: the served text of each prompt
    is the in-process text, and both times cover every request."""
    from dspark.triton.models import llm_generator
    from dspark.decoding.sampling import SamplingParams, SpeculativeParams
    from dspark.paths import project_root

    prompts = spec_inprocess.load_prompts(1)[:2]
    gen = llm_generator(project_root() / "model_repository" / spec_inprocess.MODEL / "1" / "smollm2", threads=1)
    sampling = SamplingParams(max_tokens=10)
    request = {"max_tokens": 10, "speculative": {"method": "none"}}
    records, served_s, inprocess_s = spec_served.run_interleaved(triton_server.grpc_url, prompts, request, gen,
                                                          SpeculativeParams("none"), sampling)
    expected = [spec_inprocess.run_one(gen, spec_inprocess.prompt_ids(gen, p), sampling, SpeculativeParams("none")).text for p in prompts]
    assert [b"".join(r.kept).decode() for r in records] == expected
    assert served_s == sum(r.done - r.sent for r in records) > 0 and inprocess_s > 0
