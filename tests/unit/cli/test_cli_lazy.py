"""The CLI imports a command's module when that command runs, not every module at start-up:
`dspark llm import` of a hostile GGUF refuses it without loading tritonclient, protobuf,
pydantic or the other commands (their imports made every command start in ~1 s and 80 MB)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dspark.cli import bench as bench_cli
from dspark.cli import main as main_cli
from dspark.paths import project_root
from tests.unit.llm.llm_gguf_factory import write_llama_gguf

# what the other commands' modules pull in; none is needed to read, or refuse, a GGUF
HEAVY = ("tritonclient", "google.protobuf", "grpc", "pydantic", "psutil", "onnxruntime", "scipy", "torch",
         "dspark.server", "dspark.repository", "dspark.rollout", "dspark.routing", "dspark.bench",
         "dspark.cli.serve", "dspark.cli.repo", "dspark.cli.rollout", "dspark.cli.route", "dspark.cli.bench")

RUN = """import json, sys
from dspark.cli.main import main
out, sys.argv = sys.argv[1], ["dspark", *sys.argv[2:]]
try:
    main()
finally:
    json.dump(sorted(sys.modules), open(out, "w"))
"""


def _modules_after(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    out = tmp_path / "modules.json"
    run = subprocess.run([sys.executable, "-c", RUN, str(out), *args], capture_output=True, text=True,
                         timeout=120, cwd=project_root())
    return run, set(json.loads(out.read_text()))


def _heavy(modules: set[str], heavy=HEAVY) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in heavy))


def test_llm_import_help_imports_no_other_command(tmp_path):
    run, modules = _modules_after(tmp_path, "llm", "import", "--help")
    assert run.returncode == 0 and "Usage: dspark llm import" in run.stdout, run.stderr
    assert _heavy(modules) == [] and "numpy" not in modules and "dspark.cli.llm" in modules


def test_dspark_help_lists_every_command_without_their_libraries(tmp_path):
    """Help imports each command's module for its one-line summary; their modules import the
    libraries they run on inside the commands."""
    run, modules = _modules_after(tmp_path, "--help")
    assert run.returncode == 0, run.stderr
    listed = run.stdout.split("Commands:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed if line.startswith("  ") and not line.startswith("   ")] \
        == sorted(main_cli.COMMANDS)
    libraries = ("tritonclient", "google.protobuf", "grpc", "pydantic", "numpy", "yaml", "dspark.repository",
                 "dspark.rollout", "dspark.routing", "dspark.bench")
    assert _heavy(modules, libraries) == [] and "dspark.cli.rollout" in modules


@pytest.fixture
def hostile_gguf(tmp_path) -> Path:
    """A small GGUF claiming 2,000,000 blocks (it has 3)."""
    return write_llama_gguf(tmp_path / "hostile.gguf", metadata={"block_count": 2_000_000})


def test_a_hostile_gguf_is_refused_in_one_line_without_the_other_commands_imports(tmp_path, hostile_gguf):
    run, modules = _modules_after(tmp_path, "llm", "import", str(hostile_gguf), str(tmp_path / "out"))
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr == f"Error: {hostile_gguf}: llama.block_count: found 2000000, expected an integer in [1, 3]\n"
    assert _heavy(modules) == [] and not (tmp_path / "out").exists()


def test_the_installed_dspark_refuses_a_hostile_gguf_in_one_line(tmp_path, hostile_gguf):
    dspark = shutil.which("dspark", path=str(Path(sys.executable).parent))
    assert dspark, "the dspark console script is installed beside this Python (make setup)"
    run = subprocess.run([dspark, "llm", "import", str(hostile_gguf), "--name", "bad", "-r", str(tmp_path / "repo")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.splitlines() == [f"Error: {hostile_gguf}: llama.block_count: found 2000000, "
                                       "expected an integer in [1, 3]"]
    assert not (tmp_path / "repo" / "bad").exists()


def test_a_bench_command_imports_its_own_family_only(tmp_path):
    run, modules = _modules_after(tmp_path, "bench", "kernels", "--help")
    assert run.returncode == 0 and "Usage: dspark bench kernels" in run.stdout, run.stderr
    cli_modules = {m for m in modules if m.startswith("dspark.cli.")}
    assert cli_modules == {"dspark.cli.main", "dspark.cli.lazy", "dspark.cli.bench", "dspark.cli.bench.micro",
                           "dspark.cli.bench.common"}
    assert not {"tritonclient", "pydantic", "google.protobuf"} & modules


@pytest.mark.parametrize("group, commands", [(main_cli.cli, main_cli.COMMANDS), (bench_cli.bench, bench_cli.COMMANDS)],
                         ids=["dspark", "bench"])
def test_every_registered_command_loads_under_its_own_name_and_help_lists_it(group, commands):
    ctx = click.Context(group)
    for name in commands:
        command = group.get_command(ctx, name)
        assert isinstance(command, click.Command) and command.name == name
    assert group.list_commands(ctx) == sorted(commands)
    words = [] if group is main_cli.cli else ["bench"]
    result = CliRunner().invoke(main_cli.cli, [*words, "--help"])
    assert result.exit_code == 0, result.output
    listed = result.output.split("Commands:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed if line.startswith("  ") and not line.startswith("   ")] \
        == sorted(commands)


def test_a_registry_entry_naming_another_command_is_refused():
    from dspark.cli.lazy import LazyGroup

    group = LazyGroup(name="g", commands={"sync": "dspark.cli.repo:init"})
    with pytest.raises(TypeError, match="dspark.cli.repo:init: is not the click command 'sync'"):
        group.get_command(click.Context(group), "sync")
