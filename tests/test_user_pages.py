"""The user pages (README.md and docs/*.md but docs/development.md) speak to users.

A user page names no part of the project's code: no source path (``worker/jobs/handler.py``,
``tests/test_x.py``, a maintainer's ``scripts/*.py``), no dotted name of a module, function or
constant (``worker.config.names.FOREIGN_PREFIXES``, ``rp_http._transmit``), no commit hash and
no issue number; and none is longer than a reader reads in one sitting (250 lines). HTML
comments are the developers' (a claim's test is named there) and are not read. The scripts a
user runs (``scripts/run_local.sh``, ``scripts/test.sh``, the adapters' plug-in on a base of
their own) may be named.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from tests import docs

MAX_LINES = 250

#: The scripts a user of the image runs: named on user pages as commands.
USER_SCRIPTS = frozenset({"run_local.sh", "test.sh", "install_adapter_plugin.py"})

#: The project's own Python packages and modules (and the SDK's), whose dotted names are code.
_CODE_DIRS = ("worker", "plugin", "tests")


def user_pages() -> list[Path]:
    return [docs.README, *(path for path in sorted(docs.DOCS.glob("*.md"))
                           if path.name != "development.md")]


#: The project's packages: any dotted name under them is code.
_PACKAGES = frozenset({"worker", "plugin", "tests", "scripts", "benchmarks", "tools"})


@functools.cache
def _module_names() -> frozenset[str]:
    """The project's modules and packages by their last name (``jobloop``, ``config``)."""
    names: set[str] = set()
    for top in _CODE_DIRS:
        for path in (docs.ROOT / top).rglob("*.py"):
            if path.stem != "__init__":
                names.add(path.stem)
        names |= {path.name for path in (docs.ROOT / top).rglob("*") if path.is_dir()}
    return frozenset(names - {"__pycache__", "data", "bin"})


def _text(path: Path) -> str:
    """The page without its HTML comments (the developers' notes) and without link targets
    to other sites (a URL's path is not the page's words)."""
    text = re.sub(r"<!--.*?-->", "", docs.read(path), flags=re.S)
    return re.sub(r"https?://[^\s)>\]`\"']+", "https://…", text)


def _defines(module: str, name: str) -> bool:
    """Whether a module of the project named ``module`` defines ``name``."""
    for top in _CODE_DIRS:
        for path in (docs.ROOT / top).rglob(f"{module}.py"):
            if re.search(rf"^\s*(?:(?:async )?def |class )?{re.escape(name)}\b", path.read_text(),
                         re.M):
                return True
    return False


def _is_code_name(first: str, rest: list[str]) -> bool:
    """Whether ``first.rest...`` names the project's code (or the SDK's): a dotted name of its
    packages, a private name, or a name a module of that name defines."""
    if first in _PACKAGES or first.startswith("rp_") or any(p.startswith("_") for p in rest):
        return True
    return first in _module_names() and _defines(first, rest[0])


def internals(text: str) -> list[str]:
    """Each thing of ``text`` a user page must not hold, as ``what: text``."""
    found = []
    paths = r"(?<![\w/.-])(?:worker|plugin|tests|scripts|benchmarks|tools)/[\w./-]*\w"
    for match in re.finditer(paths, text):
        if match[0].startswith("scripts/") and match[0].split("/")[-1] in USER_SCRIPTS:
            continue
        found.append(f"source path: {match[0]}")
    # Fenced blocks show what a program prints: its loggers' names, the Hub's revisions.
    prose = re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)
    for match in re.finditer(r"(?<![\w.-])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", prose):
        first, *rest = match[0].split(".")
        if _is_code_name(first, rest):
            found.append(f"code name: {match[0]}")
    for match in re.finditer(r"\b[0-9a-f]{7,40}\b(?!-)", prose):
        if re.search(r"[a-f]", match[0]) and re.search(r"\d", match[0]):
            found.append(f"commit hash: {match[0]}")
    for match in re.finditer(r"\bissues? #?\d+\b|(?<![\w&/])#\d+\b(?!-)", prose, re.I):
        found.append(f"issue number: {match[0]}")
    return found


def test_the_user_pages_name_no_internals() -> None:
    found = [f"{path.relative_to(docs.ROOT)}: {what}" for path in user_pages()
             for what in internals(_text(path))]
    assert found == []


def test_no_user_page_is_over_250_lines() -> None:
    long = {path.name: n for path in user_pages()
            if (n := len(docs.read(path).splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize(("text", "what"), [
    ("the loop (`worker/jobs/jobloop.py`) posts", "source path: worker/jobs/jobloop.py"),
    ("see tests/test_stop.py::test_x", "source path: tests/test_stop.py"),
    ("run `benchmarks/bench_queue.py`", "source path: benchmarks/bench_queue.py"),
    ("listed in `worker.config.names.FOREIGN_PREFIXES`",
     "code name: worker.config.names.FOREIGN_PREFIXES"),
    ("the SDK's `rp_http._transmit` retries", "code name: rp_http._transmit"),
    ("`settings.SETTINGS` lists", "code name: settings.SETTINGS"),
    ("fixed in 9c3ace6 since", "commit hash: 9c3ace6"),
    ("as issue 46 found", "issue number: issue 46"),
    ("(#46)", "issue number: #46"),
])
def test_an_internal_is_found(text: str, what: str) -> None:
    assert internals(text) == [what]


@pytest.mark.parametrize("text", [
    "run `scripts/run_local.sh`, then `python examples/openai_chat.py`",
    "a file `hub.json`, `model.safetensors`, `config.json`, 1200000 tokens, docs.runpod.io",
    "the form's `files.file.data`, `--compilation-config.mode 3`, `/opt/worker/bin/python`",
    "[the first job](#4-the-first-job), job 0f6c1a2e-... submitted",
    "```text\nmain is at 0e6b36e1f5a2\nWARNING worker.loop: late\n```",
    "* a list item:\n\n  ```text\n  main is at 0e6b36e1f5a2\n  ```\n",
    "<!-- tests/test_x.py::test_y -->",
    "[vLLM](https://docs.vllm.ai/en/latest/configuration/engine_args/#abc1234)",
])
def test_what_users_read_is_not_taken_for_internals(tmp_path: Path, text: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(text)
    assert internals(_text(page)) == []
