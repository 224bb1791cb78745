"""The documentation as the tests read it: the README, the pages of docs/, the Hub's page.

Every test that holds a claim of the docs to the code reads the text from here, so that a
paragraph may move between pages without its test losing it: the README's commands, the
jobs, the tables and the links are looked for on every page unless a test names the page.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
HUB_PAGE = ROOT / ".runpod" / "README.md"

#: Pages whose jobs need more than the one tiny model the tests serve (an adapter on a
#: volume, a vision-language model, a pooling endpoint, an audio model, a bucket, the ranks of
#: a cluster): their own tests run them, not the shared worker of tests/test_examples.py.
OWN_SET_UP = frozenset({"adapters.md", "adapters-bucket.md", "batch.md", "clusters.md",
                        "images.md", "pooling.md", "speech-to-text.md"})


def pages() -> list[Path]:
    """README.md, the pages of docs/ in name order, then the Hub's page."""
    return [README, *sorted(DOCS.glob("*.md")), HUB_PAGE]


def job_pages() -> list[Path]:
    """The pages whose jobs and commands run on the tests' tiny model."""
    return [path for path in pages() if path.name not in OWN_SET_UP]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def page(name: str) -> str:
    """The text of ``docs/NAME`` (``README.md``: the README)."""
    return read(README if name == README.name else DOCS / name)


def blocks(language: str, where: list[Path] | None = None) -> list[str]:
    """The fenced blocks of ``language`` on ``where`` (every page), in page order."""
    found: list[str] = []
    for path in pages() if where is None else where:
        found += blocks_of(read(path), language)
    return found


def blocks_of(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line, ``## Job errors``) up to the next
    heading of the same level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    after = text.split(f"\n{heading}\n", 1)[1]
    ends = re.search(rf"^#{{1,{level}}} ", after, re.M)
    return after[: ends.start()] if ends else after


def table_rows(text: str, header: str, *, every: bool = False) -> list[list[str]]:
    """The cells of each row of the (``every``: each) table whose header line starts with
    ``header``."""
    tables = text.split(header)[1:] if every else [text.split(header, 1)[1]]
    rows = []
    for after in tables:
        lines = after.split("\n\n", 1)[0].splitlines()[2:]  # the rest of the header, the rule
        rows += [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
                 for line in lines if line.startswith("|")]
    return rows


#: A test or script a page names: in inline code (`tests/test_x.py::test_y`) or in an HTML
#: comment beside a claim (<!-- tests/test_x.py::test_y -->), where a reader does not trip on it.
_REFERENCE = re.compile(r"((?:tests|scripts|benchmarks|tools)/[\w/]+\.py)(?:::(\w+))?")


def references(text: str) -> list[tuple[str, str | None]]:
    """The ``(path, test name or None)`` of every test or script ``text`` names in inline code
    or in an HTML comment."""
    found: list[tuple[str, str | None]] = []
    for match in re.finditer(r"`([^`\n]+)`|<!--(.*?)-->", text, re.S):
        found += [(ref[1], ref[2]) for ref in _REFERENCE.finditer(match[1] or match[2])
                  if match[2] is not None or ref.group(0) == match[1]]
    return found
