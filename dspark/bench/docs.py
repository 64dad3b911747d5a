"""Reproducible docs: the tables between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``
in the docs are written by `dspark bench all` from results it measures at HEAD with a committed
command (DOC_TABLES), never by hand. Each block says the command, the commit and the CPU."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dspark.bench.compare import select as select_rows
from dspark.bench.results import BenchResult, header_line, load
from dspark.errors import ConfigError
from dspark.paths import project_root

RESULTS_DIR = Path("bench-results/docs")


@dataclass(frozen=True)
class DocTable:
    name: str               # the marker name
    doc: str                # the file under the project root
    args: tuple[str, ...]   # `dspark` arguments that measure it; {json} is the result path
    source: str = ""        # a view: the rows ``where`` of the table ``source`` measures (args unused)
    where: tuple[tuple[str, str], ...] = ()

    @property
    def measured_as(self) -> str:
        return self.source or self.name

    def json_path(self, results_dir: Path) -> Path:
        return results_dir / f"{self.measured_as}.json"

    def command(self, results_dir: Path) -> list[str]:
        return [a.replace("{json}", str(self.json_path(results_dir))) for a in self.args]


DOC_TABLES: tuple[DocTable, ...] = (
    DocTable("kernels", "docs/kernels.md", ("bench", "kernels", "--json", "{json}")),
    DocTable("fused-blocks", "docs/kernels.md", ("bench", "micro", "fused-blocks", "--out", "{dir}")),
    DocTable("sgemm", "docs/kernels.md", ("bench", "micro", "sgemm", "--out", "{dir}")),
    DocTable("pool", "docs/kernels.md", ("bench", "pool", "--json", "{json}")),
    DocTable("gemm", "docs/accelerators.md", ("bench", "gemm", "--rounds", "31", "--json-out", "{json}")),
    DocTable("crosscheck", "docs/bench.md", ("bench", "crosscheck", "--repeats", "3", "--json", "{json}")),
    DocTable("router", "docs/router.md", ("bench", "router", "--repeat", "2", "--variant", "auto:1:0",
                                          "--out", "{dir}/router", "--json", "{json}")),
    DocTable("router-10x3", "docs/router.md", ("bench", "router", "--service-ms", "10", "--instances", "3", "--repeat",
                                               "2", "--variant", "auto:1:0", "--out", "{dir}/router-10x3",
                                               "--json", "{json}")),
    DocTable("rollout", "docs/rollout.md", ("bench", "rollout", "--rollouts", "20", "--json", "{json}")),
    DocTable("rollout-fleet", "docs/rollout.md", ("bench", "rollout", "--rollouts", "20", "--servers", "2",
                                                  "--json", "{json}")),
    DocTable("spec", "docs/speculative.md", ("bench", "spec", "--json", "{json}")),
    DocTable("spec-greedy", "README.md", (), source="spec", where=(("run", "greedy, in process"),)),
    DocTable("spec-gemma", "docs/llm.md", ("bench", "spec", "--model", "gemma_lm", "--no-server", "--no-sampled",
                                           "--json", "{json}")),
    DocTable("llm-quality", "docs/llm.md", ("bench", "llm-quality", "--json", "{json}")),
    DocTable("openai", "docs/openai.md", ("bench", "openai", "--json", "{json}")),
    DocTable("constrained", "docs/openai.md", ("bench", "constrained", "--json", "{json}")),
    DocTable("prefix", "docs/openai.md", ("bench", "prefix", "--json", "{json}")),
    DocTable("trace", "docs/trace.md", ("bench", "trace", "--json", "{json}")),
)


def _known() -> dict[str, DocTable]:
    return {t.name: t for t in DOC_TABLES}


def args_for(table: DocTable, results_dir: Path) -> list[str]:
    """The `dspark` arguments that measure a table (a view: its source) into ``results_dir``."""
    table = _known()[table.source] if table.source else table
    return [a.replace("{dir}", str(results_dir)) for a in table.command(results_dir)]


def marker(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- bench:{re.escape(name)} -->\n)(.*?)(<!-- /bench:{re.escape(name)} -->)", re.S)


def render(table: DocTable, result: BenchResult, results_dir: Path) -> str:
    """The block between the markers: how it was made, then the table, then the result's notes."""
    lines = [f"`dspark {' '.join(args_for(table, results_dir))}` ({header_line(result)}; "
             f"written by `dspark bench all`):", "", result.table(markdown=True), ""]
    lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines).rstrip() + "\n"


def rewrite(doc: Path, name: str, block: str) -> None:
    text = doc.read_text()
    pattern = marker(name)
    if not pattern.search(text):
        raise ConfigError(f"<!-- bench:{name} -->", "marker pair not found (add <!-- bench:NAME --> and "
                          f"<!-- /bench:NAME --> around the table)", doc)
    doc.write_text(pattern.sub(lambda m: m.group(1) + block + m.group(3), text, count=1))


def select(names: Sequence[str]) -> list[DocTable]:
    known = _known()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError("table", f"no docs table {unknown[0]!r}; known: {', '.join(known)}")
    return [known[n] for n in names] if names else list(DOC_TABLES)


def refresh(tables: Sequence[DocTable], measure: Callable[[list[str]], None] | None,
            results_dir: Path = RESULTS_DIR, root: Path | None = None,
            echo: Callable[[str], None] = print) -> list[Path]:
    """Measure every table (``measure`` runs `dspark` arguments; None re-renders the results already
    in ``results_dir``), then rewrite their blocks: measuring first keeps the docs unchanged while
    the benchmarks run, so each result's git state is the commit's. Returns the docs changed."""
    root = root or project_root()
    if measure is not None:
        for name in dict.fromkeys(t.measured_as for t in tables):  # a view and its source: measured once
            args = args_for(_known()[name], results_dir)
            echo(f"bench all: {name}: dspark {' '.join(args)}")
            measure(args)
    changed = []
    for table in tables:
        doc = root / table.doc
        result = load(table.json_path(results_dir))
        if table.where:
            result = select_rows(result, dict(table.where))
        rewrite(doc, table.name, render(table, result, results_dir))
        changed.append(doc)
    return sorted(set(changed))
