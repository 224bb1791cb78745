"""Every relative link and ``#anchor`` of the docs leads somewhere.

The pages are README.md, docs/*.md and the Hub's .runpod/README.md. A link to a file must
name one of the repository; a link with an anchor (``sizing.md#the-context``, ``#dry-run``) must
name a heading of its page, by GitHub's rule for anchors: the heading in lower case, its
punctuation dropped (letters, digits, ``_`` and ``-`` stay), each space a ``-``, and a
repeated heading numbered (``-1``, ``-2``, ...). Links to other sites are not followed (no
request leaves this machine).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import docs

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, repeated ones numbered as GitHub numbers them."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for heading in HEADING.findall(re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)):
        slug = anchor(heading)
        if slug in counts:
            counts[slug] += 1
            slug = f"{slug}-{counts[slug]}"
        else:
            counts[slug] = 0
        found.add(slug)
    return found


def broken_links(paths: list[Path], root: Path) -> list[str]:
    """``page: link (why)`` for each link of ``paths`` that leads nowhere."""
    broken = []
    for page in paths:
        for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            destination = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(root)}: {target}"
            if not destination.exists():
                broken.append(f"{where} (no such file)")
            elif not destination.is_relative_to(root):
                broken.append(f"{where} (outside the repository)")
            elif fragment and fragment not in anchors(destination.read_text(encoding="utf-8")):
                broken.append(f"{where} (no such heading)")
    return broken


def test_every_link_of_the_docs_leads_somewhere() -> None:
    pages = docs.pages()
    assert len(pages) >= 10
    links = sum(len(LINK.findall(_prose(docs.read(page)))) for page in pages)
    assert links > 50
    assert broken_links(pages, docs.ROOT) == []


@pytest.mark.parametrize(("heading", "slug"), [
    ("The worker's own settings", "the-workers-own-settings"),
    ("`VLLM_EXTRA_ARGS`", "vllm_extra_args"),
    ("Environment variables are `vllm serve` flags", "environment-variables-are-vllm-serve-flags"),
    ("Option 1: one image, the model chosen by environment variables",
     "option-1-one-image-the-model-chosen-by-environment-variables"),
    ("Why is my answer 16 tokens long?", "why-is-my-answer-16-tokens-long"),
    ("Failed starts: `startup_error`", "failed-starts-startup_error"),
])
def test_anchors_follow_githubs_rule(heading: str, slug: str) -> None:
    assert anchor(heading) == slug


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    other = tmp_path / "docs" / "other.md"
    other.write_text("# Other\n\n## Part\n\n## Part\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n[ok](docs/other.md#part-1) [ok](#title) [ok](https://example.com/x)\n"
        "[gone](docs/missing.md) [no heading](docs/other.md#whole) [no anchor](#nope)\n"
        "```text\n[in code](docs/missing.md)\n```\n"
    )
    assert broken_links([page, other], tmp_path) == [
        "README.md: docs/missing.md (no such file)",
        "README.md: docs/other.md#whole (no such heading)",
        "README.md: #nope (no such heading)",
    ]
