"""One command line: every runnable is a `dspark` command (click); nothing outside dspark/cli/
parses arguments with argparse, and the tools/ wrappers run the CLI."""
from __future__ import annotations

import ast
import subprocess
import sys

from click.testing import CliRunner

import dspark
from dspark.cli.main import cli
from dspark.paths import project_root


def _imports_argparse(path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            return True
    return False


def test_no_argparse_outside_the_cli():
    package = project_root() / "dspark"
    files = [p for p in sorted(package.rglob("*.py")) + sorted((project_root() / "tools").rglob("*.py"))
             if not p.is_relative_to(package / "cli")]
    assert [str(p.relative_to(project_root())) for p in files if _imports_argparse(p)] == []


def test_the_former_argparse_mains_are_dspark_commands():
    for words in (["bench", "drafter"], ["bench", "llm-kernels"], ["bench", "soak"], ["bench", "stream-cancel"],
                  ["accel", "check"], ["train", "gather"], ["train", "vocab"], ["train", "train"], ["train", "export"]):
        result = CliRunner().invoke(cli, [*words, "--help"])
        assert result.exit_code == 0 and "Usage: " in result.output, (words, result.output)


def test_llm_kernels_lists_are_comma_separated_and_checked():
    result = CliRunner().invoke(cli, ["bench", "llm-kernels", "--skip", "steps,tea"])
    assert result.exit_code == 2 and "tea: not a table" in result.output


def test_a_tool_wrapper_runs_the_cli():
    run = subprocess.run([sys.executable, str(project_root() / "tools" / "gpu_check.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "Usage: dspark accel check" in run.stdout, run.stderr
    assert dspark.__file__
