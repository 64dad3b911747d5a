"""dspark/bench building blocks: machine peak, table, result schema, inputs, windows, metrics,
perf output, docs markers."""
import base64
import json

import numpy as np
import pytest

from dspark.bench import docs, inputs
from dspark.bench.client import Record, error_kind
from dspark.bench.load import LoadSettings, is_stable, summarize
from dspark.bench.machine import detect
from dspark.bench.model import ModelSpec, parse_levels
from dspark.bench.profile import parse_perf_csv
from dspark.bench.resources import model_counters, parse_metrics, summarize_samples
from dspark.bench.results import BenchResult, load
from dspark.bench.table import Column, format_table
from dspark.errors import ConfigError

ZEN3 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel name\t: AMD EPYC 7B13\n"
        "cpu MHz\t\t: 2450.000\nflags\t\t: sse4_2 avx fma avx2\n\nprocessor\t: 1\n")
ZEN4 = "vendor_id : AuthenticAMD\ncpu family : 25\nmodel name : AMD EPYC 9B14\ncpu MHz : 2600.0\nflags : avx fma avx2 avx512f avx512_bf16\n"
SPR = ("vendor_id : GenuineIntel\ncpu family : 6\nmodel name : Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
       "cpu MHz : 2699.9\nflags : avx fma avx2 avx512f amx_bf16 amx_int8\n")


def test_fma_peak_from_the_instruction_set_and_the_clock(monkeypatch):
    monkeypatch.delenv("DSPARK_CPU_GHZ", raising=False)
    monkeypatch.delenv("DSPARK_FLOP_PER_CYCLE", raising=False)
    zen3, zen4, spr = detect(ZEN3), detect(ZEN4), detect(SPR)
    assert (zen3.fp32_flop_per_cycle, zen4.fp32_flop_per_cycle, spr.fp32_flop_per_cycle) == (32, 32, 64)
    assert zen3.clock_ghz == 2.45 and "cpu MHz" in zen3.clock_source
    assert spr.clock_ghz == 2.7 and "model name" in spr.clock_source  # the base clock, not the current MHz
    assert spr.fp32_peak_gflops(1) == pytest.approx(2.7 * 64)
    assert spr.fp32_peak_gflops(2) == pytest.approx(2 * 2.7 * 64)
    assert "2.70 GHz x 64 FLOP/cycle" in spr.peak_basis and "AVX-512" in spr.peak_basis
    assert "amx_bf16" in spr.isa and "avx512f" not in zen3.isa
    # the tables' header tells the CPUs apart where the model name does not
    assert (zen3.cpu_class, zen4.cpu_class, spr.cpu_class) == ("Zen 3: AVX2", "Zen 4: AVX-512 BF16", "AVX-512 + AMX")
    monkeypatch.setenv("DSPARK_CPU_GHZ", "3.0")
    monkeypatch.setenv("DSPARK_FLOP_PER_CYCLE", "16")
    assert detect(ZEN3).fp32_peak_gflops(1) == pytest.approx(48.0)


def test_one_table_printer_text_and_markdown():
    rows = [{"name": "a", "ms": 1.23456, "share": 0.5, "pair": [83.2, 65.0]}, {"name": "bb", "ms": None}]
    columns = [Column("name"), Column("ms", "ms", ".2f"), Column("share", "%", ".0%"), Column("pair", "b/m", ".0f")]
    text = format_table(rows, columns).splitlines()
    assert text[0] == "name |   ms |   % |   b/m"
    assert text[2] == "   a | 1.23 | 50% | 83/65"
    assert text[3] == "  bb |    - |   - |     -"
    md = format_table(rows, columns, markdown=True).splitlines()
    assert md[:3] == ["| name | ms | % | b/m |", "|---|---|---|---|", "| a | 1.23 | 50% | 83/65 |"]


def test_results_round_trip_and_refuse_other_versions(tmp_path):
    result = BenchResult("micro/x", {"n": 1}, [{"k": 1, "v": np.float32(2.5)}], [Column("v", "v", ".1f")], ["k"])
    path = result.save(tmp_path / "r.json")
    data = json.loads(path.read_text())
    assert data["schema"] == "dspark-bench" and data["schema_version"] == 1
    assert {"cpu_model", "isa", "cores", "fp32_peak_gflops_per_core"} <= set(data["machine"])
    assert "commit" in data["git"]
    back = load(path)
    assert back.rows == [{"k": 1, "v": 2.5}] and back.table() == result.table()
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="schema_version: 99 is not supported"):
        load(path)


MODEL = inputs.ModelInfo.from_config({
    "name": "m", "max_batch_size": 8,
    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["4"]},
              {"name": "ids", "data_type": "TYPE_INT64", "dims": ["-1"]},
              {"name": "text", "data_type": "TYPE_STRING", "dims": ["1"]},
              {"name": "flag", "data_type": "TYPE_BOOL", "dims": ["1"], "optional": True}],
    "output": [{"name": "y"}]})


def test_inputs_generated_from_the_config():
    arrays = inputs.generated(MODEL, batch=2, shapes=inputs.parse_shapes(["ids:5"]))[0]
    assert arrays["x"].shape == (2, 4) and arrays["x"].dtype == np.float32
    assert arrays["ids"].shape == (2, 5) and arrays["ids"].dtype == np.int64 and arrays["ids"].max() < 8
    assert arrays["text"].dtype == object and isinstance(arrays["text"][0, 0], bytes)
    assert "flag" not in arrays  # optional inputs are left out
    with pytest.raises(ConfigError, match="ids:5,5 does not fit"):
        inputs.generated(MODEL, 1, {"ids": [5, 5]})
    with pytest.raises(ConfigError, match="expected NAME:d1,d2"):
        inputs.parse_shapes(["ids"])


def test_inputs_from_a_perf_analyzer_file(tmp_path):
    raw = base64.b64encode(np.arange(4, dtype="<f4").tobytes()).decode()
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": [
        {"x": [[1, 2], [3, 4]], "ids": {"content": [7, 8, 9], "shape": [3]}, "text": ["hello"]},
        {"x": {"b64": raw}, "ids": {"content": [1, 2, 3], "shape": [3]}, "text": [{"a": 1}]},
        {"x": [0, 0, 0, 0], "ids": {"content": [5, 5, 5]}, "text": ["third"]}]}))
    requests = inputs.from_file(path, MODEL, batch=2, shapes={"ids": [3]})
    assert len(requests) == 2  # entries 0+1, then 2+0 (round-robin)
    assert requests[0]["x"].tolist() == [[1, 2, 3, 4], [0, 1, 2, 3]]
    assert requests[0]["ids"].tolist() == [[7, 8, 9], [1, 2, 3]]
    assert requests[0]["text"].tolist() == [[b"hello"], [b'{"a": 1}']]
    assert requests[1]["text"][1, 0] == b"hello"


@pytest.mark.parametrize("data, message", [
    ({"rows": []}, "expected {\"data\""),
    ({"data": [{"nope": [1]}]}, "data\\[0\\]: model m has no input 'nope'"),
    ({"data": [{"x": [1, 2, 3]}]}, "input 'ids' is missing"),
    ({"data": [{"x": [1, 2, 3], "ids": [1], "text": ["a"]}]}, "data\\[0\\].x: 3 values do not fill shape \\[4\\]"),
])
def test_bad_input_files_are_named(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message) as caught:
        inputs.from_file(path, MODEL, 1)
    assert "bad.json" in str(caught.value)


def records(latencies_ms, errors=()):
    out = [Record("m", 0.0, 0.0, done=ms / 1e3) for ms in latencies_ms]
    return out + [Record("m", 0.0, 0.0, done=0.001, error=kind, detail=f"{kind} here") for kind in errors]


def test_summaries_percentiles_errors_and_streaming():
    s = summarize(records(range(1, 101), errors=("UNAVAILABLE", "UNAVAILABLE", "timeout")), duration_s=2.0)
    assert s["qps"] == 50.0 and s["requests"] == 103
    assert s["p50_ms"] == pytest.approx(50.5) and s["p99_ms"] == pytest.approx(99.01)
    assert s["errors"] == {"UNAVAILABLE": 2, "timeout": 1} and s["error_rate"] == pytest.approx(3 / 103)
    assert s["error_examples"] == {"UNAVAILABLE": "UNAVAILABLE here", "timeout": "timeout here"}
    streamed = Record("m", 0.0, 0.0, done=0.1, first=0.02, gaps=[0.01, 0.03])
    s = summarize([streamed], 1.0)
    assert s["ttft_p50_ms"] == pytest.approx(20.0) and s["itl_p50_ms"] == pytest.approx(20.0)
    assert s["responses_per_s"] == 3.0


def test_windows_are_stable_when_the_last_ones_agree():
    w = lambda qps, ms: {"qps": qps, "mean_ms": ms}  # noqa: E731
    assert is_stable([w(50, 9), w(100, 5), w(104, 5.2), w(98, 4.9)], 3, 0.10)
    assert not is_stable([w(100, 5), w(104, 5.2), w(80, 4.9)], 3, 0.10)
    assert not is_stable([w(100, 5), w(100, 5)], 3, 0.10)
    with pytest.raises(ConfigError, match="max-windows"):
        LoadSettings(stable_windows=4, max_windows=3)


def test_levels_and_model_specs():
    assert parse_levels("1,2,4") == [1, 2, 4]
    assert parse_levels("2:8:2") == [2, 4, 6, 8]
    assert parse_levels("10:30:10") == [10, 20, 30]
    with pytest.raises(ConfigError, match="START:END"):
        parse_levels("8:2")
    assert ModelSpec.parse("a:3:in.json") == ModelSpec("a", 3.0, __import__("pathlib").Path("in.json"))
    with pytest.raises(ConfigError, match="WEIGHT > 0"):
        ModelSpec.parse("a:0")


def test_error_kinds():
    import asyncio

    from dspark.bench.client import GrpcError, HttpError, _StreamError

    assert error_kind(GrpcError("UNAVAILABLE", "queue full")) == "UNAVAILABLE"
    assert error_kind(GrpcError("INVALID_ARGUMENT", "bad")) == "INVALID_ARG"
    assert error_kind(HttpError(400, "bad")) == "INVALID_ARG" and error_kind(HttpError(503, "x")) == "UNAVAILABLE"
    assert error_kind(HttpError(418, "teapot")) == "HTTP_418"
    assert error_kind(_StreamError("model is unavailable now")) == "UNAVAILABLE"
    assert error_kind(_StreamError("boom")) == "stream_error"
    assert error_kind(asyncio.TimeoutError()) == "timeout"
    assert error_kind(ConnectionRefusedError()) == "connection"
    assert error_kind(asyncio.IncompleteReadError(b"", 10)) == "connection"


METRICS_TEXT = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m",version="1"} 110
nv_inference_request_success{model="other",version="1"} 5
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 2
# TYPE nv_inference_count counter
nv_inference_count{model="m",version="1"} 200
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="m",version="1"} 50
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="m",version="1"} 3000
# TYPE nv_inference_compute_infer_duration_us counter
nv_inference_compute_infer_duration_us{model="m",version="1"} 12000
"""


def test_triton_metrics_before_and_after():
    after = parse_metrics(METRICS_TEXT)
    before = parse_metrics(METRICS_TEXT.replace(" 110", " 10").replace(" 200", " 100").replace(" 50\n", " 25\n")
                           .replace(" 3000", " 1000").replace(" 12000", " 2000").replace(" 2\n", " 0\n"))
    delta = model_counters(before, after, "m")
    assert delta["success"] == 100 and delta["failure"] == 2
    assert delta["server_queue_us_per_request"] == pytest.approx(2000 / 102)
    assert delta["server_compute_us_per_request"] == pytest.approx(10000 / 102)
    assert delta["server_mean_batch"] == 4.0


def test_resource_samples_per_model_instance():
    samples = [{"server_cpu": 10, "stubs_cpu": 60, "server_rss_mib": 50, "stubs_rss_mib": 900, "machine_cpu": 80,
                "per_stub": {"m_0_0:11": [40, 100], "m_1_0:12": [10, 120], "mm_0_0:13": [10, 680]}}] * 2
    use = summarize_samples(samples, "m")
    assert use["model_stubs_cpu_pct"] == 50 and use["model_stubs_rss_mib"] == 220
    assert use["stubs_cpu_pct"] == 60 and use["server_cpu_pct"] == 10


def test_perf_stat_output_with_unsupported_hardware_events():
    counters, unsupported = parse_perf_csv(
        "# started on x\n\n1234.5,msec,task-clock,1234500,100.00,0.617,CPUs utilized\n"
        "42,,context-switches,1234500,100.00,34.0,/sec\n<not supported>,,cycles,0,100.00,,\n"
        "<not counted>,,instructions,0,0.00,,\n")
    assert [c["event"] for c in counters] == ["task-clock", "context-switches"]
    assert counters[0]["value"] == 1234.5 and counters[0]["unit"] == "msec"
    assert unsupported == ["cycles (not supported)", "instructions (not counted)"]


def test_docs_blocks_are_rewritten_between_markers(tmp_path):
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "kernels.md"
    doc.write_text("intro\n<!-- bench:kernels -->\nold table\n<!-- /bench:kernels -->\nafter\n")
    results = tmp_path / "results"
    BenchResult("micro/fused", {}, [{"rows": 16, "x": 1.5}], [Column("rows"), Column("x", "x ORT", ".2f")],
                notes=["a note"]).save(results / "kernels.json")
    changed = docs.refresh(docs.select(["kernels"]), None, results, root=tmp_path, echo=lambda _: None)
    text = doc.read_text()
    assert changed == [doc] and "old table" not in text
    assert "| rows | x ORT |\n|---|---|\n| 16 | 1.50 |" in text and "- a note" in text
    assert text.startswith("intro\n<!-- bench:kernels -->\n`dspark bench kernels --json ")
    assert text.endswith("<!-- /bench:kernels -->\nafter\n")
    doc.write_text("no markers here\n")
    with pytest.raises(ConfigError, match="bench:kernels -->: marker pair not found"):
        docs.refresh(docs.select(["kernels"]), None, results, root=tmp_path, echo=lambda _: None)
    with pytest.raises(ConfigError, match="no docs table 'nope'"):
        docs.select(["nope"])


class FakeTransport:
    """Answers every request after ``service_s``; counts requests in flight."""

    def __init__(self, service_s: float):
        self.service_s, self.inflight, self.most = service_s, 0, 0

    async def send(self, target, model, prepared, scheduled):
        import asyncio
        import time

        record = Record(target, scheduled, time.perf_counter())
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        await asyncio.sleep(self.service_s)
        self.inflight -= 1
        record.done = time.perf_counter()
        return record


def point(transport, targets, mode, level, rate_at=None):
    import asyncio

    from dspark.bench.load import LoadGenerator

    settings = LoadSettings(warmup_s=0.1, window_s=0.3, stable_windows=2, max_windows=2, seed=3)
    return asyncio.run(LoadGenerator(transport, targets, settings).run_point(mode, level, rate_at))


def test_closed_loop_keeps_exactly_the_concurrency_outstanding():
    from dspark.bench.load import Target

    fake = FakeTransport(0.01)
    result = point(fake, [Target("m", ["p"])], "concurrency", 3)
    assert fake.most == 3 and result.records and all(r.target == "m" for r in result.records)
    assert result.duration_s >= 0.59  # two windows of 0.3 s


def test_open_loop_follows_the_rate_and_its_shape_and_labels_split_the_traffic():
    from dspark.bench.load import Target

    fake = FakeTransport(0.05)  # slower than the spacing: the open loop does not wait for answers
    targets = [Target("router", ["a"], 3.0, label="gold"), Target("router", ["b"], 1.0, label="standard")]
    full = point(fake, targets, "rate", 200)
    assert fake.most > 3
    assert len(full.records) / full.duration_s == pytest.approx(200, rel=0.5)
    gold = sum(r.target == "gold" for r in full.records) / len(full.records)
    assert 0.6 < gold < 0.9
    quarter = point(FakeTransport(0.001), targets, "rate", 200, rate_at=lambda t: 50.0)
    assert len(quarter.records) / quarter.duration_s == pytest.approx(50, rel=0.6)
    with pytest.raises(ConfigError, match="may appear once"):
        point(fake, [Target("m", ["a"]), Target("m", ["b"])], "rate", 10)


def test_request_parameters_travel_in_both_protocols():
    import asyncio

    from dspark.bench.client import GrpcTransport, HttpTransport

    info = inputs.ModelInfo.from_config({"name": "m", "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["2"]}]})
    arrays = {"x": np.array([1.0, 2.0], np.float32)}
    http = HttpTransport("127.0.0.1:9", 1.0)
    asyncio.run(http.open(1))
    request = http.prepare(info, arrays, {"tier": "gold", "priority_boost": 2})
    head, _, body = request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v2/models/m/infer HTTP/1.1") and b"Inference-Header-Content-Length" in head
    header_len = int([line for line in head.split(b"\r\n") if line.startswith(b"Inference-Header")][0].split(b":")[1])
    header = json.loads(body[:header_len])
    assert header["parameters"] == {"tier": "gold", "priority_boost": 2, "binary_data_output": True}
    assert np.frombuffer(body[header_len:], np.float32).tolist() == [1.0, 2.0]

    async def grpc_request():
        transport = GrpcTransport("127.0.0.1:9", 1.0)
        await transport.open(1)
        try:
            return transport.prepare(info, arrays, {"tier": "gold", "n": 2, "on": True})
        finally:
            await transport.close()
    proto = asyncio.run(grpc_request())
    assert proto.parameters["tier"].string_param == "gold" and proto.parameters["n"].int64_param == 2
    assert proto.parameters["on"].bool_param is True
    assert np.frombuffer(proto.raw_input_contents[0], np.float32).tolist() == [1.0, 2.0]


def test_a_classifier_refines_error_kinds_from_their_messages():
    import asyncio

    from dspark.bench.load import LoadGenerator, Target

    class Failing(FakeTransport):
        async def send(self, target, model, prepared, scheduled):
            record = await super().send(target, model, prepared, scheduled)
            record.error, record.detail = "UNAVAILABLE", f"request waited past its queue deadline ({prepared})"
            return record

    settings = LoadSettings(warmup_s=0.05, window_s=0.2, stable_windows=1, max_windows=1)
    generator = LoadGenerator(Failing(0.005), [Target("m", ["gold"])], settings,
                              classify=lambda kind, message: "deadline" if "queue deadline" in message else kind)
    records = asyncio.run(generator.run_point("concurrency", 1)).records
    assert records and {r.error for r in records} == {"deadline"}


def test_fixed_runs_send_exactly_the_requests_asked_for():
    import asyncio

    from dspark.bench.load import LoadGenerator, Target

    targets = [Target("m", ["p0", "p1", "p2"]), Target("m", ["q"], label="other")]
    fake = FakeTransport(0.01)
    generator = LoadGenerator(fake, targets, LoadSettings(seed=1))
    counted = asyncio.run(generator.run_fixed(concurrency=2, count=7))
    assert len(counted.records) == 7 and fake.most == 2 and counted.stable
    schedule = [(0.0, 0), (0.05, 1), (0.1, 0), (0.1, 1)]
    replayed = asyncio.run(LoadGenerator(FakeTransport(0.01), targets, LoadSettings()).run_fixed(schedule=schedule))
    assert sorted(r.target for r in replayed.records) == ["m", "m", "other", "other"]
    assert max(r.sent - r.scheduled for r in replayed.records) < 0.05
    assert replayed.duration_s >= 0.1 and replayed.windows[0]["requests"] == 4


def test_every_docs_table_has_its_marker_pair_in_its_doc():
    from dspark.paths import project_root

    for table in docs.DOC_TABLES:
        text = (project_root() / table.doc).read_text()
        assert docs.marker(table.name).search(text), f"{table.doc} lacks <!-- bench:{table.name} --> markers"
