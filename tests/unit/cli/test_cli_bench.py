"""`dspark bench`: every subcommand is registered on the one group, each CLI module imports on its
own (no import cycle between the group and its commands), and `bench all` runs the commands its
tables name through `dspark` itself."""
from __future__ import annotations

import ast

from click.testing import CliRunner

from dspark.cli.main import cli
from dspark.paths import project_root

BENCH_COMMANDS = {"all", "compare", "crosscheck", "gemm", "kernels", "llm-quality", "micro", "model", "openai",
                  "pool", "prefix", "profile", "rollout", "router", "shapes", "spec", "system",
                  "drafter", "llm-kernels", "soak", "stream-cancel"}


def test_every_bench_subcommand_is_registered():
    assert set(cli.commands["bench"].commands) == BENCH_COMMANDS


def _cli_imports() -> dict[str, set[str]]:
    """dspark.cli module -> the dspark.cli modules it imports, at the top or inside a function."""
    folder = project_root() / "dspark" / "cli"
    graph = {}
    for path in [*folder.glob("*.py"), *folder.glob("*/*.py")]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        graph[stem] = {n.split(".")[2] for n in names if n.startswith("dspark.cli.")} - {stem}
    return graph


def test_the_cli_modules_import_each_other_without_a_cycle():
    graph = _cli_imports()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
        if module not in done:
            for imported in graph.get(module, ()):
                visit(imported, path + (module,))
            done.add(module)

    for module in graph:
        visit(module, ())
    assert "bench" in graph["main"] and "bench_common" in graph["bench_router"]


def test_bench_all_runs_the_tables_commands_through_dspark(monkeypatch):
    from dspark.bench import docs

    def refresh(tables, measure, results_dir, echo):
        measure(["bench", "micro", "--list"])
        return []

    monkeypatch.setattr(docs, "refresh", refresh)
    result = CliRunner().invoke(cli, ["bench", "all", "--table", "kernels"])
    assert result.exit_code == 0, result.output
    assert "fused-blocks" in result.output  # `bench micro --list`'s registry, printed by the nested run
