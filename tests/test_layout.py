"""The packages show the stages, and their imports run one way (docs/development.md, the
package map): configure (``worker.config``) → find the model (``worker.model``) → start vLLM
(``worker.start``) or serve jobs (``worker.jobs``) → the modes (``worker``'s own modules).

Read from the source with Python's own parser: every ``import`` and ``from ... import`` of a
``worker`` module, at any depth (a function's lazy import counts as much as the module's).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "worker"

#: What every stage may use: the modules of ``worker/`` that hold no stage.
SHARED = {"errors", "secrets", "daemon"}
#: Each package and the packages (or shared modules) it may import, besides its own modules.
MAY_IMPORT: dict[str, set[str]] = {
    "config": {"errors", "secrets"},
    "model": {"config", *SHARED},
    "start": {"config", "model", *SHARED},
    "jobs": {"config", *SHARED},
}
STAGES = tuple(MAY_IMPORT)


def imported(path: Path) -> set[str]:
    """The ``worker`` modules that ``path`` imports, as dotted names."""
    return imports_of(path.read_text(encoding="utf-8"))


def imports_of(source: str) -> set[str]:
    """The ``worker`` modules that Python ``source`` imports, as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "worker"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "worker":
                continue
            if node.module in ("worker", *(f"worker.{stage}" for stage in STAGES)):
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
    return found


def stage_of(module: str) -> str:
    """``worker.config.settings`` → ``config``; ``worker.errors`` → ``errors``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "worker"


def modules_of(stage: str) -> list[Path]:
    return sorted((WORKER / stage).rglob("*.py"))


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_only_the_stages_before_it(stage: str) -> None:
    wrong = {
        f"{path.relative_to(WORKER.parent)} imports {module}"
        for path in modules_of(stage)
        for module in imported(path)
        if stage_of(module) not in {stage, *MAY_IMPORT[stage]}
    }
    assert not wrong, sorted(wrong)


def test_the_shared_modules_import_no_stage() -> None:
    wrong = {
        f"worker/{name}.py imports {module}"
        for name in SHARED
        for module in imported(WORKER / f"{name}.py")
        if stage_of(module) not in SHARED
    }
    assert not wrong, sorted(wrong)


def test_every_module_is_in_a_stage_or_is_a_mode_or_shared() -> None:
    top = {path.stem for path in WORKER.glob("*.py")}
    assert top == {"__init__", "__main__", "main", "queue_worker", "lb", "local_api", *SHARED}
    assert {path.name for path in WORKER.iterdir() if path.is_dir()
            and path.name != "__pycache__"} == set(STAGES)


def test_the_reader_sees_the_imports_a_wrong_one_would_be() -> None:
    """The check can fail: each form of import of another stage is seen, lazy ones too."""
    source = (
        "from worker.model.source import resolve_sources\n"
        "import worker.jobs.handler\n"
        "from worker.start import policy\n"
        "def later():\n    from worker import queue_worker\n"
    )
    assert {stage_of(module) for module in imports_of(source)} == {
        "model", "jobs", "start", "queue_worker"}
