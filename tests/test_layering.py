"""Which layer may import which: the package's import graph keeps its boundaries.

Read from the source (no imports run), so a forbidden import fails here even where it
sits under `TYPE_CHECKING` or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "diffbatch"

# (modules under this folder, must not import modules under this prefix)
FORBIDDEN = [
    ("pipelines", "diffbatch.sched"),  # the pipeline-facing batch lives with the pipelines
    ("bench", "diffbatch.entrypoints"),  # the benchmark client is not the server
    ("sched", "diffbatch.engine"),
    ("sched", "diffbatch.executor"),
    ("engine", "diffbatch.worker"),  # the engine guesses nothing about the worker's CPUs
    ("", "scripts"),  # training data and the judge are not runtime code
    ("", "tests"),  # neither are test helpers
]


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(("folder", "prefix"), FORBIDDEN)
def test_no_forbidden_imports(folder: str, prefix: str):
    offenders = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for name in sorted(imported_modules(path))
        if name == prefix or name.startswith(prefix + ".")
    ]
    assert not offenders, "\n".join(offenders)


def test_each_scheduling_policy_imports_only_the_shared_base():
    for policy in ("scheduler.py", "grouped.py"):
        other = {"scheduler.py": "diffbatch.sched.grouped",
                 "grouped.py": "diffbatch.sched.scheduler"}[policy]
        assert other not in imported_modules(PACKAGE / "sched" / policy)


def test_the_pipelines_import_no_circle():
    """Model-folder helpers live in `model_folder`, so the registry, the diffusers
    adapter and the tiny models' builder never import each other in a circle."""
    modules = {path.stem: path for path in (PACKAGE / "pipelines").glob("*.py")}
    graph = {name: {imported.rsplit(".", 1)[-1] if imported.count(".") == 2 else
                    imported.split(".")[2]
                    for imported in imported_modules(path)
                    if imported.startswith("diffbatch.pipelines.")} & set(modules)
             for name, path in modules.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
                   for nxt in graph[start])

    circles = [name for name in ("registry", "diffusers_t2i", "tiny", "model_folder")
               if reaches(name, name, {name})]
    assert not circles, f"import circle through {circles}"
