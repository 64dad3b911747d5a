"""`bench spec`'s in-process part on a tiny random LM (rows, per-kind ratios, the greedy identity
check that makes the command fail), its prompt set, and its docs tables (docs/speculative.md and
the greedy view in README, measured once)."""
import pytest

from dspark.bench import docs, spec, spec_inprocess
from dspark.bench.results import BenchResult
from dspark.decoding.sampling import SamplingParams, SpeculativeParams
from dspark.paths import project_root
from tests.fixtures.gguf_pair import pair_generator


@pytest.fixture(scope="module")
def generator():
    return pair_generator()


def test_prompts_interleave_the_kinds_so_a_short_run_covers_each():
    assert [p.kind for p in spec_inprocess.load_prompts(1)] == list(spec_inprocess.KINDS)
    prompts = spec_inprocess.load_prompts(2)
    assert [p.kind for p in prompts] == list(spec_inprocess.KINDS) * 2 and len({p.text for p in prompts}) == 8


def test_distinct_8grams_score_a_looping_text_low():
    assert spec_inprocess.distinct_char_8gram_share("the quick brown fox jumps over the lazy dog") == 1.0
    assert spec_inprocess.distinct_char_8gram_share("abcd" * 50) < 0.05


def test_inprocess_rows_per_method_kind_and_depth(generator):
    prompts = [spec_inprocess.BenchPrompt(kind, False, text) for kind, text in
               (("code", "import os\n"), ("continue", "def main():\n"), ("code", "class A:\n"))]
    specs = {m: SpeculativeParams(m) for m in ("none", "ngram", "suffix", "tree")}
    results = spec_inprocess.run_inprocess(generator, prompts, specs, SamplingParams(max_tokens=24), repeats=2)
    rows = spec_inprocess.summary_rows(results, spec_inprocess.GREEDY, check_identical=True)
    assert [r["method"] for r in rows] == list(specs)
    assert all(r["identical"] == "3/3" for r in rows) and spec_inprocess.mismatched(rows) == []
    plain = rows[0]
    assert plain["x_plain"] == 1.0 and plain["tokens_per_pass"] == 1.0 and plain["accept"] is None
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["ttft_p50_ms"] > 0 and row["itl_p99_ms"] >= row["itl_p50_ms"] > 0
        assert 0 < row["distinct_8gram"] <= 1
    assert rows[3]["tokens_per_pass"] >= 1.0 and 0 <= rows[3]["accept"] <= 1
    assert results["tree"].per_position_acceptance() and all(0 <= a <= 1 for a in results["tree"].per_position_acceptance())
    kinds = spec_inprocess.kind_rows(results, prompts)
    assert kinds[0] == {"run": spec_inprocess.BY_KIND, "method": "none", "code": 1.0, "continue": 1.0}
    # one method's output differs on one prompt: the command fails naming it
    results["ngram"].runs[1] = results["tree"].runs[0]
    changed = spec_inprocess.summary_rows(results, spec_inprocess.GREEDY, check_identical=True)
    assert changed[1]["identical"] == "2/3" and spec_inprocess.mismatched(changed) == ["ngram"]
    assert spec_inprocess.mismatched(spec_inprocess.summary_rows(results, spec_inprocess.SAMPLED, check_identical=False)) == []
    # llama.cpp's rows are a peer, not one of our methods: its own greedy text may differ
    assert spec_inprocess.mismatched(changed + [{"run": spec_inprocess.GREEDY, "method": "llama.cpp plain"}]) == ["ngram"]


def test_the_result_prints_one_table_per_run(generator):
    prompts = [spec_inprocess.BenchPrompt("code", False, "import os\n")]
    specs = {m: SpeculativeParams(m) for m in ("none", "ngram")}
    sampling = SamplingParams(max_tokens=8)
    results = spec_inprocess.run_inprocess(generator, prompts, specs, sampling, repeats=1)
    rows = spec_inprocess.summary_rows(results, spec_inprocess.GREEDY, True) + spec_inprocess.batching_rows(generator, prompts, specs, sampling,
                                                                               ["none"])
    rows.append({"run": spec_inprocess.MEMORY, "measure": "KV KiB per token", "value": 45.0})
    text = BenchResult("spec", {}, rows, spec.COLUMNS, group_by="run").table(markdown=True)
    tables = text.split("\n\n")
    assert len(tables) == 3
    assert tables[0].startswith("| run | method | tokens/s | x plain | end-to-end tok/s | TTFT ms p50 |")
    assert "| own calls c1 tok/s | own calls c4 tok/s | batched c1 tok/s | batched c4 tok/s |" in tables[1]
    assert tables[2] == "| run | measure | value |\n|---|---|---|\n| memory, unload | KV KiB per token | 45.0 |"


def test_spec_docs_tables_measure_once_and_readme_shows_the_greedy_rows(tmp_path):
    for doc in ("README.md", "docs/speculative.md"):
        (tmp_path / doc).parent.mkdir(exist_ok=True)
        name = "spec-greedy" if doc == "README.md" else "spec"
        (tmp_path / doc).write_text(f"x\n<!-- bench:{name} -->\nold\n<!-- /bench:{name} -->\n")
    measured = []

    def measure(args):
        measured.append(args)
        rows = [{"run": spec_inprocess.GREEDY, "method": "none", "tokens_per_s": 20.0},
                {"run": spec_inprocess.SERVED, "method": "none", "concurrency": 1, "tokens_per_s": 18.0}]
        BenchResult("spec", {}, rows, spec.COLUMNS, group_by="run").save(tmp_path / "r" / "spec.json")

    docs.refresh(docs.select(["spec", "spec-greedy"]), measure, tmp_path / "r", root=tmp_path, echo=lambda _: None)
    assert measured == [["bench", "spec", "--json", str(tmp_path / "r" / "spec.json")]]
    readme, full = (tmp_path / "README.md").read_text(), (tmp_path / "docs/speculative.md").read_text()
    assert f"`dspark bench spec --json {tmp_path / 'r' / 'spec.json'}`" in readme
    assert "| greedy, in process | none | 20.0 |" in readme and spec_inprocess.SERVED not in readme
    assert "| greedy, in process | none | 20.0 |" in full and f"| {spec_inprocess.SERVED} | none | 1 | 18.0 |" in full


def test_the_command_fails_when_a_greedy_output_differs_from_plain(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from dspark.cli.main import cli

    rows = [{"run": spec_inprocess.GREEDY, "method": "none", "tokens_per_s": 20.0, "identical": "4/4"},
            {"run": spec_inprocess.GREEDY, "method": "suffix", "tokens_per_s": 30.0, "identical": "3/4"}]
    monkeypatch.setattr(spec, "run_spec_bench", lambda settings, log: BenchResult("spec", settings.to_json(), rows,
                                                                                 spec.COLUMNS, group_by="run"))
    out = CliRunner().invoke(cli, ["bench", "spec", "--json", str(tmp_path / "spec.json")])
    assert out.exit_code != 0 and "greedy outputs differ from plain decoding for ['suffix']" in out.output
    assert (tmp_path / "spec.json").is_file()  # written before failing
    rows[1]["identical"] = "4/4"
    assert CliRunner().invoke(cli, ["bench", "spec", "--json", str(tmp_path / "spec.json")]).exit_code == 0
