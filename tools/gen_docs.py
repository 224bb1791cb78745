#!/usr/bin/env python3
"""Rewrite the generated tables of docs/ (:data:`PAGES`) from the code, so that the two never
disagree.

    python tools/gen_docs.py          # rewrite the pages in place
    python tools/gen_docs.py --check  # exit 1 (and say which) when a page is stale

Each table sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers; only the
text between them is replaced. The sources, in docs/configuration.md:

* ``settings``: the rows of :data:`worker.config.settings.SETTINGS` an endpoint sets;

in docs/development.md:

* ``internal-settings``: its rows the image, the tests and the maintainers' tools set;

in docs/names.md:

* ``aliases``: :data:`worker.config.command.ALIASES` (names kept from earlier releases);
* ``reserved``: the flags the worker pins or refuses (:mod:`worker.config.command`);
* ``retired``: :data:`worker.config.names.RETIRED` (variables of flags vLLM removed);
* ``earlier``: :data:`worker.config.names.EARLIER_NAMES` (names the earlier worker read itself);

in docs/versions.md:

* ``versions``: the flags that some vLLM of the supported range lacks, from the packaged
  catalogs (:mod:`worker.config.versions`), with the versions that have each;

and in docs/sampling-params.md:

* ``sampling-params``: :data:`worker.config.request_fields.DOCUMENTED_SAMPLING_PARAMS` and the
  guided-decoding fields, each with its fate in the packaged catalog's vLLM (the fields of its
  requests, :mod:`worker.config.request_fields`).

tests/test_readme.py fails when the page holds anything else than what this prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.config.command import ALIASES  # noqa: E402 - after the path set-up above
from worker.config.flags import FlagCatalog, packaged_catalog_path  # noqa: E402
from worker.config.names import COLLIDING_NAMES, EARLIER_NAMES, RETIRED  # noqa: E402
from worker.config.request_fields import (  # noqa: E402
    DOCUMENTED_SAMPLING_PARAMS,
    GUIDED_FIELDS,
    RETIRED_FIELDS,
    RequestKind,
)
from worker.config.reserved import (  # noqa: E402
    FORBIDDEN_FLAGS,
    FORBIDDEN_PREFIXES,
    PINNED_FLAGS,
    reserved_reason,
)
from worker.config.settings import SETTINGS, Setting, format_value  # noqa: E402
from worker.config.versions import (  # noqa: E402
    history_of,
    packaged_history,
    packaged_versions,
)

DOCS = ROOT / "docs"


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
    rows += [(f"`{prefix}*`", reason) for prefix, reason in FORBIDDEN_PREFIXES.items()]
    return _table(("Flag", "Why the environment cannot set it"), rows)


def _advice_table(names: Mapping[str, str]) -> str:
    return _table(("Variable", "Instead"),
                  ((f"`{var}`", advice) for var, advice in sorted(names.items())))


def retired_table() -> str:
    return _advice_table(RETIRED)


def earlier_table() -> str:
    return _advice_table(EARLIER_NAMES)


def sampling_params_table() -> str:
    """Each documented sampling parameter, and vLLM's former guided-decoding fields, with what
    a prompt job and a messages job do with it in the packaged catalog's vLLM."""
    catalog = FlagCatalog.load(packaged_catalog_path())
    known = catalog.request_fields
    if known is None:
        raise ValueError("the packaged catalog has no request fields: dump it again")
    def refused(name: str) -> str:
        return f"Removed from vLLM: the job fails with `invalid_request`; {RETIRED_FIELDS[name]}."

    rows = []
    for name, meaning in DOCUMENTED_SAMPLING_PARAMS.items():
        fates = ["sent" if name in known.of(kind) else "refused"
                 for kind in ("completion", "chat")]
        if "sent" not in fates:
            meaning = refused(name)
        rows.append((f"`{name}`", *fates, meaning))
    for name, target in GUIDED_FIELDS.items():
        rows.append((f"`{name}`", f"as `structured_outputs.{target}`",
                     f"as `structured_outputs.{target}`",
                     "Removed from vLLM, which would drop it and answer unconstrained: sent as "
                     "the `structured_outputs` field with the same meaning, with a warning "
                     "in the worker's log (once)."))
    name = "guided_decoding_backend"
    rows.append((f"`{name}`", "refused", "refused", refused(name)))
    return _table(("Field", "Prompt job", "Messages job", f"What vLLM {catalog.version} does"),
                  rows)


def versions_table() -> str:
    """The flags not in every packaged catalog: their variable, and the versions with them."""
    history = packaged_history()
    every = frozenset(history.versions)
    # Not the flags the worker never sets from a variable, nor other programs' names.
    never = {name for name, option in history.options.items()
             if name in COLLIDING_NAMES or reserved_reason(option) is not None}
    rows = [(f"`{var}`", f"`{history.options[var]}`", ", ".join(history.spans(var)))
            for var in sorted(history.having) if history.having[var] != every
            and var not in never]
    return _table(("Variable", "Flag", "vLLM versions that have it"), rows)


def version_fields_table() -> str:
    """The request fields of a prompt or messages job not read by every packaged vLLM."""
    catalogs = {v: FlagCatalog.load(packaged_catalog_path(v)) for v in packaged_versions()}
    jobs: tuple[tuple[RequestKind, str], ...] = (("completion", "prompt"), ("chat", "messages"))
    rows = []
    for kind, job in jobs:
        fields = history_of({version: [(name, name) for name in catalog.request_fields.of(kind)]
                             for version, catalog in catalogs.items()
                             if catalog.request_fields is not None})
        every = frozenset(fields.versions)
        rows += [(f"`{name}`", job, ", ".join(fields.spans(name)))
                 for name in sorted(fields.having) if fields.having[name] != every]
    return _table(("Field", "Job", "vLLM versions that read it"), rows)


SECTIONS: dict[str, Callable[[], str]] = {
    "settings": settings_table,
    "internal-settings": internal_settings_table,
    "aliases": aliases_table,
    "reserved": reserved_table,
    "retired": retired_table,
    "earlier": earlier_table,
    "versions": versions_table,
}
#: The pages with generated tables, and their tables.
PAGES: dict[str, dict[str, Callable[[], str]]] = {
    "configuration.md": {"settings": settings_table},
    "names.md": {name: SECTIONS[name] for name in ("aliases", "reserved", "retired", "earlier")},
    "versions.md": {"versions": versions_table},
    "development.md": {"internal-settings": internal_settings_table},
    "sampling-params.md": {"sampling-params": sampling_params_table,
                           "version-fields": version_fields_table},
}


def render(text: str, sections: Mapping[str, Callable[[], str]] = SECTIONS,
           page: str = "configuration.md") -> str:
    """``text`` with every marked section replaced by its generated table."""
    for name, make in sections.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        if text.count(start) != 1 or text.count(end) != 1:
            raise ValueError(f"{page} must hold {start} and {end} once each")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{make()}\n{end}{tail}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gen_docs.py", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when a page is out of date")
    args = parser.parse_args(argv)
    stale = 0
    for page, sections in PAGES.items():
        path = DOCS / page
        current = path.read_text(encoding="utf-8")
        wanted = render(current, sections, page)
        name = f"{path.parent.name}/{path.name}"
        if wanted == current:
            continue
        if args.check:
            print(f"{name} is out of date: run python tools/gen_docs.py", file=sys.stderr)
            stale += 1
        else:
            path.write_text(wanted, encoding="utf-8")
            print(f"{name} updated", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
