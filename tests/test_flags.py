"""The flag catalog: the dump from vLLM's parser, loading, lookups, and where it comes from."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from worker.config import catalog as catalogs
from worker.config import flags
from worker.config.catalog import resolve_catalog
from worker.config.flags import (
    Flag,
    FlagCatalog,
    catalog_from_parser,
    env_name,
    packaged_catalog_path,
)
from worker.config.versions import packaged_versions
from worker.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
#: The environment a dump runs in (the worker passes its own).
HOST = dict(os.environ)


def _catalog_json(version: str = "9.9.9") -> dict[str, object]:
    return FlagCatalog(
        version=version,
        positionals=("model_tag",),
        flags=(
            Flag("--max-model-len", "value", option_strings=("--max-model-len",)),
            Flag("--enforce-eager", "bool_pair",
                 option_strings=("--enforce-eager", "--no-enforce-eager")),
        ),
    ).to_json()


# -- names and lookups ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "name"),
    [
        ("--max-model-len", "MAX_MODEL_LEN"),
        ("--enforce-eager", "ENFORCE_EAGER"),
        ("--compilation-config.level", "COMPILATION_CONFIG_LEVEL"),
        ("--all2all-backend", "ALL2ALL_BACKEND"),
        ("--weird+flag", "WEIRD_FLAG"),
        ("-tp", "TP"),
    ],
)
def test_env_name(flag: str, name: str) -> None:
    assert env_name(flag) == name


@pytest.fixture
def catalog() -> FlagCatalog:
    return FlagCatalog(
        version="1",
        flags=(
            Flag("--tensor-parallel-size", "value",
                 option_strings=("--tensor-parallel-size", "-tp")),
            Flag("--gpu-memory-utilization", "value",
                 option_strings=("--gpu-memory-utilization", "--device-memory-utilization")),
            Flag("--enforce-eager", "bool_pair",
                 option_strings=("--enforce-eager", "--no-enforce-eager")),
        ),
    )


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("--tensor-parallel-size", "--tensor-parallel-size"),
        ("-tp", "--tensor-parallel-size"),
        ("--tensor_parallel_size", "--tensor-parallel-size"),
        ("--device-memory-utilization", "--gpu-memory-utilization"),
        ("--no-enforce-eager", "--enforce-eager"),
        ("--nope", None),
        ("-x", None),
    ],
)
def test_get(catalog: FlagCatalog, option: str, expected: str | None) -> None:
    found = catalog.get(option)
    assert (found.name if found else None) == expected
    assert (option in catalog) is (expected is not None)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("TENSOR_PARALLEL_SIZE", "--tensor-parallel-size"),
        ("DEVICE_MEMORY_UTILIZATION", "--gpu-memory-utilization"),
        ("ENFORCE_EAGER", "--enforce-eager"),
        ("NO_ENFORCE_EAGER", None),  # the negative is reached through ENFORCE_EAGER=false
        ("TP", None),  # short options have no variable
        ("tensor_parallel_size", None),
    ],
)
def test_by_env_name(catalog: FlagCatalog, name: str, expected: str | None) -> None:
    found = catalog.by_env_name(name)
    assert (found.name if found else None) == expected


def test_negative_of_a_pair(catalog: FlagCatalog) -> None:
    pair = catalog.get("--enforce-eager")
    value = catalog.get("-tp")
    assert pair is not None and value is not None
    assert pair.negative == "--no-enforce-eager"
    assert value.negative is None


# -- (de)serialisation ---------------------------------------------------------------------
def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_catalog_json()))
    loaded = FlagCatalog.load(path)
    assert loaded.version == "9.9.9"
    assert loaded.model_positional
    assert loaded.to_json() == _catalog_json()
    assert len(loaded) == 2 and [f.name for f in loaded] == ["--max-model-len", "--enforce-eager"]


@pytest.mark.parametrize(
    "request_fields", [[], {"completion": ["a"], "chat": [], "structured_outputs": []}])
def test_a_catalog_with_malformed_request_fields_is_refused(request_fields: object) -> None:
    data = {**_catalog_json(), "request_fields": request_fields}
    with pytest.raises(ValueError, match="request_fields"):
        FlagCatalog.from_json(data)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ([], "JSON object"),
        ({"schema": 99, "flags": [{}]}, "schema 99"),
        ({"schema": 3, "flags": []}, "non-empty list"),
        ({"schema": 3, "flags": [{"name": "--x"}]}, "malformed"),
        ({"schema": 3, "flags": [{"name": "--x", "kind": "toggle"}]}, "unknown kind"),
        ({"schema": 3, "flags": [{"name": "x", "kind": "value"}]}, "not a long option"),
    ],
)
def test_invalid_catalogs(data: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        FlagCatalog.from_json(data)


def test_packaged_catalog_is_vllm_0_32() -> None:
    real = FlagCatalog.load(packaged_catalog_path())
    assert real.version == flags.PACKAGED_VERSION == "0.32.0"
    assert real.model_positional
    by = {f.name: f for f in real}
    assert by["--enforce-eager"].kind == "bool_pair"
    assert by["--max-model-len"].kind == "value" and not by["--max-model-len"].multi
    assert by["--served-model-name"].multi
    assert by["--middleware"].append
    assert by["--disable-log-stats"].kind == "store_true"
    assert real.get("-tp") is by["--tensor-parallel-size"]
    assert by["--dtype"].choices and "bfloat16" in by["--dtype"].choices


# -- walking a parser (the dump's logic, without vLLM) ---------------------------------------
def test_catalog_from_parser() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--no-color", dest="color", action="store_false")
    parser.add_argument("--mw", action="append")
    parser.add_argument("--names", nargs="+")
    parser.add_argument("--pair", nargs=2)
    parser.add_argument("--token", nargs="?")
    parser.add_argument("--size", "-s", type=int, choices=[1, 2])
    parser.add_argument("-x")  # short only: no variable can name it
    catalog = catalog_from_parser(parser, "t")
    by = {f.name: f for f in catalog}
    assert catalog.positionals == ("model_tag",)
    assert set(by) == {"--help", "--eager", "--quiet", "--no-color", "--mw", "--names", "--pair",
                       "--token", "--size"}
    assert by["--eager"].kind == "bool_pair" and by["--eager"].negative == "--no-eager"
    assert by["--quiet"].kind == "store_true"
    assert by["--no-color"].kind == "store_false"
    assert (by["--mw"].multi, by["--mw"].append) == (True, True)
    assert (by["--names"].nargs, by["--names"].multi) == ("+", True)
    assert (by["--pair"].nargs, by["--pair"].multi) == (2, True)
    assert (by["--token"].nargs, by["--token"].multi) == ("?", False)
    assert by["--size"].choices == ("1", "2") and by["--size"].option_strings == ("--size", "-s")


# -- the real dump ---------------------------------------------------------------------------
def dump_with(python: str, tmp_path: Path) -> FlagCatalog:
    """The catalog that ``python``'s vLLM dumps, as the image's build step runs it."""
    out = tmp_path / "catalog.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [python, "-m", "worker.config.flags", "dump", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    catalog = FlagCatalog.load(out)
    by = {f.name: f for f in catalog}
    assert by["--enforce-eager"].kind == "bool_pair"
    assert by["--max-model-len"].kind == "value"
    assert by["--served-model-name"].multi
    assert catalog.model_positional
    return catalog


@pytest.mark.vllm
@pytest.mark.vllm_tools
def test_dump_with_vllm(vllm_python: str, tmp_path: Path) -> None:
    catalog = dump_with(vllm_python, tmp_path)
    # The packaged catalog of the default vLLM is this very dump: regenerate it when vLLM
    # changes (tools/dump_catalogs.py).
    assert catalog.version.split("+")[0] == flags.PACKAGED_VERSION
    assert catalog == FlagCatalog.load(packaged_catalog_path())


# -- resolve_catalog -----------------------------------------------------------------------
def fake_python(tmp_path: Path, *, version: str = "9.9.9", dump: str = "ok") -> Path:
    """A stand-in for vLLM's interpreter: answers the version query and the dump.

    ``dump``: ``ok`` writes a catalog, ``fail`` exits 1, ``hang`` sleeps. Every call is
    appended to ``calls.log`` beside it.
    """
    catalog = tmp_path / "source-catalog.json"
    catalog.write_text(json.dumps(_catalog_json(version)))
    log = tmp_path / "calls.log"
    actions = {
        "ok": f'cp "{catalog}" "$5"',
        "fail": 'echo "ModuleNotFoundError: No module named vllm" >&2; exit 1',
        "hang": "sleep 30",
    }
    script = tmp_path / "python"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$1" >> "{log}"\n'
        f'if [ "$1" = "-c" ]; then echo "{version}"; exit 0; fi\n'
        f"{actions[dump]}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_explicit_path_wins(tmp_path: Path) -> None:
    explicit = tmp_path / "baked.json"
    explicit.write_text(json.dumps(_catalog_json("1.2.3")))
    python = fake_python(tmp_path)
    catalog, note = resolve_catalog(str(python), tmp_path / "cache", explicit, print, env=HOST)
    assert catalog.version == "1.2.3"
    assert "VLLM_FLAG_CATALOG" in note and str(explicit) in note
    assert calls(tmp_path) == []


@pytest.mark.parametrize("content", [None, "{not json", '{"schema": 1, "flags": []}'])
def test_broken_explicit_path_is_a_config_error(tmp_path: Path, content: str | None) -> None:
    explicit = tmp_path / "baked.json"
    if content is not None:
        explicit.write_text(content)
    with pytest.raises(ConfigError) as info:
        resolve_catalog(None, tmp_path / "cache", explicit, print, env=HOST)
    assert "VLLM_FLAG_CATALOG=" in info.value.message and str(explicit) in info.value.message


def test_dump_once_then_cache(tmp_path: Path) -> None:
    python = fake_python(tmp_path)
    cache = tmp_path / "cache"
    catalog, note = resolve_catalog(str(python), cache, None, print, env=HOST)
    assert catalog.version == "9.9.9"
    assert note.startswith(f"dumped by {python}") and "cached in" in note
    assert calls(tmp_path) == ["-c", "-m"]
    cached = list(cache.iterdir())
    assert [p.name for p in cached] == [f"vllm-flags-v{flags.SCHEMA_VERSION}-9.9.9.json"]
    assert oct(cached[0].stat().st_mode & 0o777) == "0o644"

    again, note = resolve_catalog(str(python), cache, None, print, env=HOST)
    assert again == catalog
    assert note.startswith("cached dump")
    assert calls(tmp_path) == ["-c", "-m", "-c"]  # no second dump


def test_a_corrupt_cache_is_dumped_again(tmp_path: Path) -> None:
    python = fake_python(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"vllm-flags-v{flags.SCHEMA_VERSION}-9.9.9.json").write_text("{")
    logged: list[str] = []
    catalog, note = resolve_catalog(str(python), cache, None, logged.append, env=HOST)
    assert catalog.version == "9.9.9" and note.startswith("dumped by")
    assert "unusable" in logged[0]
    assert FlagCatalog.load(cache / f"vllm-flags-v{flags.SCHEMA_VERSION}-9.9.9.json") == catalog


@pytest.mark.parametrize(("dump", "version", "nearest"), [
    ("fail", "9.9.9", packaged_versions()[-1]),  # past the newest: the newest
    ("hang", "9.9.9", packaged_versions()[-1]),
    ("fail", "0.28.7", "0.28.0"),  # a later patch of a packaged minor release
])
def test_a_failing_dump_falls_back_to_the_nearest_packaged_catalog(
    tmp_path: Path, dump: str, version: str, nearest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(catalogs, "DUMP_TIMEOUT", 0.5)
    python = fake_python(tmp_path, dump=dump, version=version)
    logged: list[str] = []
    catalog, note = resolve_catalog(str(python), tmp_path / "cache", None, logged.append, env=HOST)
    assert catalog.version == nearest
    assert catalog.stands_in_for == catalog.running_version == version
    assert note.startswith(f"packaged vllm-{nearest}.json")
    assert f"installed vLLM is {version}" in note
    # Another vLLM's request fields would refuse the fields new in this one: none are checked.
    assert catalog.request_fields is None and "request fields are sent unchecked" in note
    assert len(logged) == 1 and f"could not dump the flag catalog with {python}" in logged[0]
    if dump == "fail":
        assert "No module named vllm" in logged[0]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_no_interpreter_no_cache_uses_the_packaged_catalog(tmp_path: Path) -> None:
    catalog, note = resolve_catalog(None, tmp_path / "cache", None, print, env=HOST)
    assert catalog == FlagCatalog.load(packaged_catalog_path())
    assert note.startswith("packaged")


def test_a_missing_interpreter_falls_back(tmp_path: Path) -> None:
    logged: list[str] = []
    catalog, _ = resolve_catalog(str(tmp_path / "nope"), tmp_path / "cache", None, logged.append,
                                 env=HOST)
    assert catalog.version == "0.32.0"
    assert logged and "could not dump" in logged[0]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_a_version_with_a_packaged_catalog_needs_no_dump(tmp_path: Path, version: str) -> None:
    # The version comes from the package metadata (one short query, no vLLM import): a
    # newcomer's first start on the pinned vLLM launches it at once.
    python = fake_python(tmp_path, version=version)
    catalog, note = resolve_catalog(str(python), tmp_path / "cache", None, print, env=HOST)
    assert catalog == FlagCatalog.load(packaged_catalog_path())
    assert note == f"packaged vllm-0.32.0.json (matches the installed vLLM {version})"
    assert calls(tmp_path) == ["-c"]  # the version query only: no dump
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_cache_still_uses_the_dump(tmp_path: Path) -> None:
    python = fake_python(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    logged: list[str] = []
    catalog, note = resolve_catalog(str(python), blocker / "cache", None, logged.append, env=HOST)
    assert catalog.version == "9.9.9" and note.startswith("dumped by")
    assert "could not cache" in logged[0]
