"""The vLLM versions this worker is tested with, and what changes between them.

The worker never imports vLLM: what it knows of a version is the flag catalog dumped from that
version's own argument parser, packaged for each minor release of the range
(``worker/config/catalogs/vllm-<version>.json``, written by ``python -m worker.config.flags
dump`` in that version's interpreter). From them:

* the declared range (:data:`OLDEST` to every release of :data:`NEWEST_MINOR`): a vLLM
  outside it starts as any other, with one warning line that names the range
  (:func:`range_warning`); it is never refused;
* a variable naming a flag that the running vLLM lacks but another version has is told which
  versions have it (:meth:`FlagHistory.note`), where it would otherwise be ignored unexplained;
* when the running version has no catalog of its own and none can be dumped, the packaged
  catalog nearest to it stands in (:func:`nearest_version`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from worker.config.flags import PACKAGED_DIR, env_name

if TYPE_CHECKING:
    from packaging.version import Version

#: The oldest vLLM the worker is tested with: the reference worker's documented version, run
#: by the tests as the second CPU vLLM (``.venv-vllm-0.27.1``).
OLDEST = "0.27.1"
#: The newest minor release supported (every ``0.33.x``), through its packaged catalog.
NEWEST_MINOR = "0.33"
#: The CPU builds of vLLM the test suite runs (the oldest, and the image's default).
TESTED = ("0.27.1", "0.32.0")
RANGE_TEXT = f"{OLDEST} to {NEWEST_MINOR}.x"
#: Where a user reads what changes between versions.
GUIDE = "docs/versions.md"

_CATALOG_NAME = re.compile(r"vllm-(?P<version>\d[^/]*)\.json")


_PLAIN = re.compile(r"v?(\d+(?:\.\d+)*)")


def parse_version(version: str) -> Version | None:
    """``version`` as vLLM writes it, read as Python's packaging reads it (PEP 440: ``0.32.0``,
    ``0.33.0rc1``, ``0.34.0.dev12+gabc123``, ``0.32.0+cpu``; a leading ``v`` as the image tags
    have it); None when it is not one. Imported here only: building the command needs none
    of it for a plain release (tests/test_command.py keeps that build to the standard
    library)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version.strip().removeprefix("v"))
    except InvalidVersion:
        return None


def _release(numbers: tuple[int, ...]) -> tuple[int, ...]:
    return numbers + (0,) * (3 - len(numbers)) if len(numbers) < 3 else numbers


def version_key(version: str) -> tuple[int, ...] | None:
    """The release numbers of ``version`` (``0.32.0+cpu`` → (0, 32, 0); ``v0.33.0rc1`` →
    (0, 33, 0)), three at least; None when it is not a version."""
    if plain := _PLAIN.fullmatch(version.strip()):
        return _release(tuple(int(part) for part in plain.group(1).split(".")))
    parsed = parse_version(version)
    return None if parsed is None else _release(parsed.release)


def in_range(version: str) -> bool | None:
    """Whether ``version`` is in the declared range; None when it cannot be read. Ordered as
    PEP 440 orders them: a pre-release or dev build of :data:`OLDEST` comes before it (out),
    one of a minor release up to :data:`NEWEST_MINOR` is in; a local part (``+cpu``) counts
    as its release."""
    key = version_key(version)
    oldest, newest = version_key(OLDEST), version_key(NEWEST_MINOR)
    assert oldest is not None and newest is not None
    if key is None:
        return None
    if not _PLAIN.fullmatch(version.strip()):  # a pre-release, a dev build, a local part
        parsed, first = parse_version(version), parse_version(OLDEST)
        assert parsed is not None and first is not None
        return parsed >= first and key[:2] <= newest[:2]
    return oldest <= key and key[:2] <= newest[:2]


def range_warning(version: str) -> str | None:
    """The one line a start logs when its vLLM is outside the declared range; None inside it,
    or when the version cannot be read (a catalog that names none says nothing of it)."""
    if in_range(version) is not False:
        return None
    return (f"vLLM {version} is outside the versions this worker is tested with "
            f"({RANGE_TEXT}): it starts as usual, but its flags, request fields and error "
            f"messages may differ from what the worker knows ({GUIDE})")


def nearest_version(version: str | None, available: Iterable[str]) -> str | None:
    """Of ``available`` (packaged catalogs' versions), the one to stand in for ``version``:
    the newest of its minor release whose release is not newer than its own (a pre-release or
    dev build of 0.31.0 gets 0.31.0's), else the closest release by number; None when nothing
    is available or ``version`` cannot be read."""
    key = version_key(version) if version else None
    keyed = sorted((k, v) for v in available if (k := version_key(v)) is not None)
    if key is None or not keyed:
        return None
    same_minor = [v for k, v in keyed if k[:2] == key[:2] and k <= key]
    if same_minor:
        return same_minor[-1]
    older = [v for k, v in keyed if k < key]
    newer = [v for k, v in keyed if k > key]
    # Past the newest catalog its flags are the likeliest to still exist; before the oldest,
    # the oldest is.
    return older[-1] if older else newer[0]


@dataclass(frozen=True)
class FlagHistory:
    """Which packaged vLLM versions have each flag, by the variable that sets it."""

    versions: tuple[str, ...]
    """Every packaged version, oldest first."""
    having: Mapping[str, frozenset[str]]
    """A flag's variable → the versions that have the flag."""
    options: Mapping[str, str]
    """A flag's variable → its option (``--kv-cache-memory-bytes``)."""

    def spans(self, var: str) -> tuple[str, ...]:
        """The versions that have ``var``'s flag, as runs of consecutive packaged versions:
        ``0.29.0 and later``, ``0.27.1 to 0.28.0``, ``0.30.0``."""
        having = self.having.get(var, frozenset())
        runs: list[list[str]] = []
        previous_in = False
        for version in self.versions:
            if version in having:
                if previous_in:
                    runs[-1].append(version)
                else:
                    runs.append([version])
            previous_in = version in having
        return tuple(
            f"{run[0]} and later" if run[-1] == self.versions[-1] and len(self.versions) > 1
            else run[0] if len(run) == 1 else f"{run[0]} to {run[-1]}"
            for run in runs
        )

    def note(self, var: str, running: str) -> str | None:
        """Why ``var`` sets nothing in vLLM ``running`` when another packaged version has its
        flag; None when no packaged version has it (a name the worker knows nothing of)."""
        spans = self.spans(var)
        if not spans:
            return None
        return (f"vLLM {running} has no {self.options[var]} (it is a flag of vLLM "
                f"{', '.join(spans)}; {GUIDE})")


def history_of(catalogs: Mapping[str, Sequence[tuple[str, str]]]) -> FlagHistory:
    """The history of ``catalogs``: version → its flags as (variable, option) pairs."""
    versions = tuple(sorted(catalogs, key=lambda v: version_key(v) or ()))
    having: dict[str, set[str]] = {}
    options: dict[str, str] = {}
    for version in versions:
        for var, option in catalogs[version]:
            having.setdefault(var, set()).add(version)
            options[var] = option  # the newest version's spelling
    return FlagHistory(versions, {var: frozenset(v) for var, v in having.items()}, options)


def packaged_versions(directory: Path = PACKAGED_DIR) -> tuple[str, ...]:
    """The versions whose catalog is packaged, oldest first."""
    found = (m.group("version") for path in directory.glob("vllm-*.json")
             if (m := _CATALOG_NAME.fullmatch(path.name)))
    return tuple(sorted(found, key=lambda v: version_key(v) or ()))


@functools.lru_cache(maxsize=1)
def packaged_history() -> FlagHistory:
    """The history of the packaged catalogs (read once; only a variable that sets nothing in
    the running vLLM asks for it)."""
    catalogs: dict[str, list[tuple[str, str]]] = {}
    for version in packaged_versions():
        with open(PACKAGED_DIR / f"vllm-{version}.json", encoding="utf-8") as handle:
            data = json.load(handle)
        catalogs[version] = [(env_name(flag["name"]), flag["name"]) for flag in data["flags"]]
    return history_of(catalogs)
