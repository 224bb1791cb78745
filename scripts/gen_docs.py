#!/usr/bin/env python3
"""Rewrite the generated tables of docs/configuration.md from the code, so that the two never
disagree.

    python scripts/gen_docs.py          # rewrite docs/configuration.md in place
    python scripts/gen_docs.py --check  # exit 1 (and say which) when the page is stale

Each table sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers; only the
text between them is replaced. The sources:

* ``settings``: the rows of :data:`worker.settings.SETTINGS` an endpoint sets;
* ``internal-settings``: its rows the image, the tests and the maintainers' tools set;
* ``aliases``: :data:`worker.command.ALIASES` (names kept from earlier releases);
* ``reserved``: the flags the worker pins or refuses (:mod:`worker.command`);
* ``retired``: :data:`worker.names.RETIRED` (variables of flags vLLM removed);
* ``earlier``: :data:`worker.names.EARLIER_NAMES` (names the earlier worker read itself).

tests/test_readme.py fails when the page holds anything else than what this prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.command import (  # noqa: E402 - after the path set-up above
    _FORBIDDEN_PREFIXES,
    ALIASES,
    FORBIDDEN_FLAGS,
    PINNED_FLAGS,
)
from worker.names import EARLIER_NAMES, RETIRED  # noqa: E402
from worker.settings import SETTINGS, Setting, format_value  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"


def _cell(text: str) -> str:
    """Text fit for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def default_cell(setting: Setting) -> str:
    """The default as the docs say it: in words where the value would mislead."""
    return setting.shown_default or f"`{format_value(setting.default)}`"


def meaning_cell(setting: Setting) -> str:
    """The meaning, and for a number what 0 does: a value, or refused with the reason."""
    if not setting.numeric:
        return setting.doc
    refused = setting.zero_refused()
    zero = f"0 is refused ({refused})" if refused is not None else f"0 {setting.zero}"
    return f"{setting.doc} {zero}."


def _settings_rows(internal: bool) -> list[tuple[str, str, str]]:
    return [(f"`{s.env}`", default_cell(s), meaning_cell(s))
            for s in SETTINGS if s.internal is internal]


def settings_table() -> str:
    return _table(("Variable", "Default", "Meaning"), _settings_rows(internal=False))


def internal_settings_table() -> str:
    return _table(("Variable", "Default", "Meaning"), _settings_rows(internal=True))


def aliases_table() -> str:
    return _table(
        ("Variable", "Sets", "Wins over"),
        (
            (f"`{var}`", f"`{flag}`", f"`{flag.removeprefix('--').replace('-', '_').upper()}`")
            for var, flag in ALIASES.items()
        ),
    )


def reserved_table() -> str:
    rows = [(f"`{flag}`", "set by the worker: " + reason) for flag, reason in PINNED_FLAGS.items()]
    rows += [(f"`{flag}`", reason) for flag, reason in FORBIDDEN_FLAGS.items()]
    rows += [(f"`{prefix}*`", reason) for prefix, reason in _FORBIDDEN_PREFIXES.items()]
    return _table(("Flag", "Why the environment cannot set it"), rows)


def _advice_table(names: Mapping[str, str]) -> str:
    return _table(("Variable", "Instead"),
                  ((f"`{var}`", advice) for var, advice in sorted(names.items())))


def retired_table() -> str:
    return _advice_table(RETIRED)


def earlier_table() -> str:
    return _advice_table(EARLIER_NAMES)


SECTIONS: dict[str, Callable[[], str]] = {
    "settings": settings_table,
    "internal-settings": internal_settings_table,
    "aliases": aliases_table,
    "reserved": reserved_table,
    "retired": retired_table,
    "earlier": earlier_table,
}


def render(text: str) -> str:
    """``text`` with every marked section replaced by its generated table."""
    for name, make in SECTIONS.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        if text.count(start) != 1 or text.count(end) != 1:
            raise ValueError(f"{PAGE.name} must hold {start} and {end} once each")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{make()}\n{end}{tail}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gen_docs.py", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when the page is out of date")
    args = parser.parse_args(argv)
    current = PAGE.read_text(encoding="utf-8")
    wanted = render(current)
    name = f"{PAGE.parent.name}/{PAGE.name}"
    if args.check:
        if wanted != current:
            print(f"{name} is out of date: run python scripts/gen_docs.py", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        PAGE.write_text(wanted, encoding="utf-8")
        print(f"{name} updated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
