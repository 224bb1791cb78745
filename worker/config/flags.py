"""The catalog of `vllm serve` flags: which flags exist, and how each takes its value.

The worker turns environment variables into `vllm serve` flags (:mod:`worker.config.command`). To
do that without a hand-written list that rots with every vLLM release, it reads a *catalog*
dumped from vLLM's own argument parser: every long option, its kind (value, ``--x/--no-x``
pair, bare switch), its ``nargs``, its choices and its aliases.

Dumping needs vLLM imported (~10 s and gigabytes of libraries), which the worker process
must never do: it would slow the cold start and tie the worker to vLLM's interpreter. So the
dump runs in a subprocess with vLLM's interpreter (``python -m worker.config.flags dump``), at image
build time or once per vLLM version (cached), and the worker only ever loads JSON.
:func:`worker.config.catalog.resolve_catalog` picks the best available source; a catalog of the
vLLM version of the supported range is packaged (:func:`packaged_catalog_path`,
:mod:`worker.config.versions`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

from worker.config.request_fields import RequestFields, dump_request_fields

#: Bumped whenever the JSON layout changes; a cached catalog of another schema is redumped.
SCHEMA_VERSION = 3

FlagKind = Literal["value", "bool_pair", "store_true", "store_false"]
_KINDS: frozenset[str] = frozenset({"value", "bool_pair", "store_true", "store_false"})

#: Where the catalogs shipped with the worker live (``vllm-<version>.json``).
PACKAGED_DIR = Path(__file__).resolve().parent / "catalogs"
#: The vLLM version this worker is developed and tested against.
PACKAGED_VERSION = "0.32.0"



def env_name(flag: str) -> str:
    """The environment variable that sets ``flag``: ``--max-model-len`` → ``MAX_MODEL_LEN``.

    Every character that cannot appear in a portable variable name (``-``, ``.``, ...) becomes
    ``_``, so the mapping is the same for every flag vLLM may add.
    """
    return re.sub(r"[^A-Z0-9]", "_", flag.lstrip("-").upper())


@dataclass(frozen=True)
class Flag:
    """One option of `vllm serve`, as its argparse action defines it."""

    name: str
    """The canonical long option, e.g. ``--max-model-len``."""
    kind: FlagKind
    """``value`` (takes arguments), ``bool_pair`` (``--x``/``--no-x``), or a bare switch."""
    nargs: str | int | None = None
    multi: bool = False
    """True when it takes several values (``nargs`` ``+``/``*``/N>1, or repeatable)."""
    append: bool = False
    """True for ``action="append"``: each value needs its own ``--flag VALUE``."""
    choices: tuple[str, ...] | None = None
    option_strings: tuple[str, ...] = ()
    deprecated: bool = False
    auto: bool = False
    """True when the value's type takes the word ``auto`` as a value of its own (vLLM 0.32's
    ``--max-model-len``: ``human_readable_int_or_auto``, "auto" → -1, fit to the memory), where
    it rejects other words; read from the parser at the dump (:func:`_takes_auto`)."""

    @property
    def env_name(self) -> str:
        return env_name(self.name)

    @property
    def negative(self) -> str | None:
        """The option that turns a ``bool_pair`` flag ``--x`` off: ``--no-x``, or the opposite
        word that vLLM 0.33 pairs ``--enable-y`` and ``--disable-y`` with instead (None for
        other kinds). It is reached through ``X=false``, never through a variable of its own:
        ``ENABLE_SLIDING_WINDOW=true`` must not set ``--disable-sliding-window``."""
        if self.kind != "bool_pair":
            return None
        wanted = ["--no-" + self.name[2:]]
        for word, opposite in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
            if self.name.startswith(word):
                wanted.append(opposite + self.name.removeprefix(word))
        return next((option for option in wanted if option in self.option_strings), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "nargs": self.nargs,
            "multi": self.multi,
            "append": self.append,
            "choices": list(self.choices) if self.choices is not None else None,
            "option_strings": list(self.option_strings),
            "deprecated": self.deprecated,
            "auto": self.auto,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Flag:
        kind = data["kind"]
        name = data["name"]
        if not isinstance(name, str) or not name.startswith("--"):
            raise ValueError(f"flag name {name!r} is not a long option")
        if kind not in _KINDS:
            raise ValueError(f"flag {name}: unknown kind {kind!r}")
        nargs = data.get("nargs")
        if nargs is not None and not isinstance(nargs, str | int):
            raise ValueError(f"flag {name}: nargs {nargs!r} is neither text nor a number")
        choices = data.get("choices")
        return cls(
            name=name,
            kind=cast(FlagKind, kind),
            nargs=nargs,
            multi=bool(data.get("multi", False)),
            append=bool(data.get("append", False)),
            choices=tuple(str(c) for c in choices) if choices is not None else None,
            option_strings=tuple(str(s) for s in data.get("option_strings") or (name,)),
            deprecated=bool(data.get("deprecated", False)),
            auto=bool(data.get("auto", False)),
        )


@dataclass(frozen=True)
class FlagCatalog:
    """All flags of one vLLM version, looked up by option string or by environment name."""

    version: str
    flags: tuple[Flag, ...]
    schema: int = SCHEMA_VERSION
    positionals: tuple[str, ...] = ()
    """Positional arguments of `vllm serve` (``model_tag`` since vLLM 0.5)."""
    request_fields: RequestFields | None = None
    """The fields of the same vLLM's completion and chat requests
    (:mod:`worker.config.request_fields`); None when not known."""
    stands_in_for: str | None = None
    """The version of the vLLM that runs, when this catalog is another version's standing in
    for it (none of its own could be found or dumped); never written to JSON."""
    _by_option: dict[str, Flag] = field(init=False, repr=False, compare=False)
    _by_env: dict[str, Flag] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_option: dict[str, Flag] = {}
        by_env: dict[str, Flag] = {}
        for flag in self.flags:
            for option in flag.option_strings or (flag.name,):
                by_option.setdefault(option, flag)
                # ``--no-x`` of a pair is reached through ``X=false``, not through ``NO_X``.
                if option.startswith("--") and option != flag.negative:
                    by_env.setdefault(env_name(option), flag)
        object.__setattr__(self, "_by_option", by_option)
        object.__setattr__(self, "_by_env", by_env)

    # -- lookups ---------------------------------------------------------------------------
    def get(self, option: str) -> Flag | None:
        """The flag of an option string (``--max-model-len``, ``-tp``, ``--no-enforce-eager``).

        Like vLLM's parser, underscores in a long option's name are accepted for dashes.
        """
        found = self._by_option.get(option)
        if found is None and option.startswith("--"):
            found = self._by_option.get("--" + option[2:].replace("_", "-"))
        return found

    def by_env_name(self, name: str) -> Flag | None:
        """The flag that the environment variable ``name`` (exact UPPER_SNAKE) would set."""
        return self._by_env.get(name)

    def __iter__(self) -> Iterator[Flag]:
        return iter(self.flags)

    def __len__(self) -> int:
        return len(self.flags)

    def __contains__(self, option: object) -> bool:
        return isinstance(option, str) and self.get(option) is not None

    @property
    def running_version(self) -> str:
        """The version of the vLLM that runs (this catalog's own unless it stands in)."""
        return self.stands_in_for or self.version

    @property
    def model_positional(self) -> bool:
        """Whether `vllm serve MODEL` (positional) is accepted; else ``--model`` is used."""
        return "model_tag" in self.positionals

    # -- (de)serialisation -----------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "vllm_version": self.version,
            "positionals": list(self.positionals),
            **({"request_fields": self.request_fields.to_json()}
               if self.request_fields is not None else {}),
            "flags": [flag.to_json() for flag in self.flags],
        }

    @classmethod
    def from_json(cls, data: object) -> FlagCatalog:
        """Build a catalog from its JSON form; ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError("a flag catalog is a JSON object")
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(
                f"catalog schema {data.get('schema')!r}, this worker reads {SCHEMA_VERSION}"
            )
        flags = data.get("flags")
        if not isinstance(flags, list) or not flags:
            raise ValueError("a flag catalog has a non-empty list 'flags'")
        try:
            parsed = tuple(Flag.from_json(item) for item in flags)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed flag entry: {exc!r}") from exc
        request_fields = data.get("request_fields")
        return cls(
            version=str(data.get("vllm_version") or "unknown"),
            flags=parsed,
            schema=SCHEMA_VERSION,
            positionals=tuple(str(p) for p in data.get("positionals") or ()),
            request_fields=(RequestFields.from_json(request_fields)
                            if request_fields is not None else None),
        )

    @classmethod
    def load(cls, path: Path | str) -> FlagCatalog:
        """Read a catalog file; OSError or ValueError (JSON errors included) when unusable."""
        with open(path, encoding="utf-8") as handle:
            return cls.from_json(json.load(handle))


# -- dumping (runs in vLLM's interpreter) --------------------------------------------------
def _takes_auto(action: argparse.Action) -> bool:
    """Whether the action's type reads ``auto`` as a value of its own: it accepts the word and
    refuses another one (a plain ``str`` takes any word, which says nothing)."""
    convert = action.type
    if not callable(convert) or action.choices is not None:
        return False
    try:
        convert("auto")
    except Exception:
        return False
    try:
        convert("not-a-value")
    except Exception:
        return True
    return False


def _describe_action(action: argparse.Action, deprecated: bool) -> Flag | None:
    """The catalog entry of one argparse action, or None for positionals and short-only ones."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    if not longs:
        return None
    kind: FlagKind
    if isinstance(action, argparse.BooleanOptionalAction):
        kind = "bool_pair"
        positives = [s for s in longs if not s.startswith("--no-")]
        name = positives[0] if positives else longs[0]
    else:
        name = longs[0]
        if isinstance(action, argparse._StoreFalseAction):
            kind = "store_false"
        elif action.nargs == 0:
            # store_true, store_const, help, count: a bare switch that takes no value.
            kind = "store_true"
        else:
            kind = "value"
    nargs = action.nargs if kind == "value" else None
    append = isinstance(action, argparse._AppendAction)
    multi = kind == "value" and (
        nargs in ("+", "*") or (isinstance(nargs, int) and nargs > 1) or append
    )
    choices = None if action.choices is None else tuple(str(c) for c in action.choices)
    return Flag(
        name=name,
        kind=kind,
        nargs=nargs if isinstance(nargs, str | int) else None,
        multi=multi,
        append=append,
        choices=choices,
        option_strings=tuple(action.option_strings),
        deprecated=deprecated,
        auto=kind == "value" and _takes_auto(action),
    )


def catalog_from_parser(parser: argparse.ArgumentParser, version: str) -> FlagCatalog:
    """Walk the actions of a `vllm serve` parser into a catalog (pure: testable without vLLM)."""
    deprecated: set[argparse.Action] = set(getattr(parser, "_deprecated", ()) or ())
    flags: list[Flag] = []
    positionals: list[str] = []
    for action in parser._actions:
        if not action.option_strings:
            positionals.append(action.dest)
            continue
        is_deprecated = action in deprecated or bool(getattr(action, "deprecated", False))
        flag = _describe_action(action, is_deprecated)
        if flag is not None:
            flags.append(flag)
    return FlagCatalog(version=version, flags=tuple(flags), positionals=tuple(positionals))


def dump_catalog() -> dict[str, Any]:
    """The catalog of the installed vLLM, built from its own `vllm serve` parser.

    Builds the parser exactly as ``vllm`` (``vllm.entrypoints.cli.main``) does: a
    FlexibleArgumentParser with subcommands, and the ``serve`` subcommand's
    ``subparser_init`` (which calls ``make_arg_parser``). Only works where vLLM imports.
    """
    # Imported by name, here only: the worker process never imports vLLM, and type checking
    # must not depend on vLLM being installed.
    vllm: Any = importlib.import_module("vllm")
    serve_cli: Any = importlib.import_module("vllm.entrypoints.cli.serve")
    argparse_utils: Any = importlib.import_module("vllm.utils.argparse_utils")

    root = argparse_utils.FlexibleArgumentParser(description="vLLM CLI")
    subparsers = root.add_subparsers(required=False, dest="subparser")
    serve = serve_cli.ServeSubcommand().subparser_init(subparsers)
    catalog = catalog_from_parser(serve, str(vllm.__version__))
    request_fields = dump_request_fields()
    if request_fields is not None:
        catalog = replace(catalog, request_fields=RequestFields.from_json(request_fields))
    return {**catalog.to_json(), "generated_by": "python -m worker.config.flags dump"}


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send everything written to fd 1 (vLLM's import-time logs, C extensions) to stderr.

    Keeps ``dump`` without ``--out`` printing pure JSON on stdout.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def format_catalog_json(data: Mapping[str, Any]) -> str:
    """JSON with one flag per line: small, and a vLLM upgrade reads as a clear git diff."""
    lines = []
    for key, value in data.items():
        if key == "flags" and isinstance(value, list):
            body = ",\n".join("  " + json.dumps(v, ensure_ascii=False) for v in value)
            lines.append(f' "flags": [\n{body}\n ]')
        elif key == "request_fields" and isinstance(value, dict):
            body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f' "request_fields": {{\n{body}\n }}')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_json_atomically(data: Mapping[str, Any], path: Path) -> None:
    """Write JSON next to ``path`` then rename, so a reader never sees half a catalog."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(format_catalog_json(data))
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a catalog is no secret
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- the packaged catalogs ----------------------------------------------------------------
def packaged_catalog_path(version: str = PACKAGED_VERSION) -> Path:
    """The packaged catalog of ``version`` (default PACKAGED_VERSION, the image's vLLM)."""
    return PACKAGED_DIR / f"vllm-{version}.json"


def packaged_catalog_for(version: str | None) -> Path | None:
    """The packaged catalog of exactly ``version`` (a local part like ``+cpu`` aside)."""
    if not version:
        return None
    candidate = PACKAGED_DIR / f"vllm-{version.split('+', 1)[0]}.json"
    return candidate if candidate.is_file() else None


# -- command line --------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m worker.config.flags dump [--out PATH]``: write the catalog of the installed
    vLLM."""
    parser = argparse.ArgumentParser(
        prog="python -m worker.config.flags",
        description="Catalog of `vllm serve` flags (run with the Python that has vLLM).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    dump = commands.add_parser("dump", help="write the catalog as JSON")
    dump.add_argument("--out", type=Path, help="file to write (default: stdout)")
    args = parser.parse_args(argv)

    # This command's own process (vLLM's interpreter, never the worker's): the parser does
    # not depend on the device, but vLLM infers one while building it and fails on a machine
    # without a GPU (an image build), so the CPU platform, which always loads, is the default.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    with _stdout_to_stderr():
        data = dump_catalog()
    if args.out is None:
        sys.stdout.write(format_catalog_json(data))
    else:
        write_json_atomically(data, args.out)
        print(f"wrote {len(data['flags'])} flags of vLLM {data['vllm_version']} to {args.out}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
