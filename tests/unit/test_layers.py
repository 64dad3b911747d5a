"""The package's shape: its layers and forbidden imports (pyproject.toml, [tool.importlinter])
hold, and no modules import each other in a circle (an import inside a function counts too)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

from dspark.paths import project_root


def test_every_import_goes_down_the_layers():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", "pyproject.toml", "--no-cache"], cwd=project_root(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    # the layers, decoding assembles no models, no pb_utils in dspark/, no torch in serving
    assert "4 kept, 0 broken" in result.stdout


def _circles(graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_modules_import_each_other_in_a_circle():
    graph = grimp.build_graph("dspark", cache_dir=None)
    # a package's __init__ that hands on its submodules' names is not a circle of code
    for module in list(graph.modules):
        if graph.find_children(module):
            for child in graph.find_modules_directly_imported_by(module):
                if child.startswith(module + "."):
                    graph.remove_import(importer=module, imported=child)
    assert _circles(graph) == []


def test_a_circle_is_found_where_there_is_one():
    graph = grimp.ImportGraph()
    for module in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(module)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.y", imported="a.z")
    assert _circles(graph) == [["a.x", "a.y"]]
