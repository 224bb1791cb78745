"""The declared range of vLLM versions, and what a variable of another version's flag is told
(worker/config/versions.py), in-process: the packaged catalogs are the only input read."""

from __future__ import annotations

import json

import pytest

from worker.config import versions
from worker.config.command import build_command
from worker.config.flags import PACKAGED_DIR, FlagCatalog, packaged_catalog_path
from worker.config.versions import (
    FlagHistory,
    history_of,
    in_range,
    nearest_version,
    packaged_history,
    packaged_versions,
    range_warning,
    version_key,
)


@pytest.mark.parametrize(("version", "key"), [
    ("0.32.0", (0, 32, 0)),
    ("0.32.0+cpu", (0, 32, 0)),
    ("v0.33.0rc1", (0, 33, 0)),
    ("0.27", (0, 27, 0)),
    ("0.11.1.dev42+g1234", (0, 11, 1)),
    ("0.34.0.dev12+gabc123", (0, 34, 0)),
    ("unknown", None),
    ("", None),
])
def test_version_key(version: str, key: tuple[int, ...] | None) -> None:
    assert version_key(version) == key


@pytest.mark.parametrize(("version", "inside"), [
    ("0.27.0", False),
    ("0.27.1", True),
    ("0.27.1+cpu", True),
    ("0.30.0", True),
    ("0.32.0", True),
    ("0.33.0", True),
    ("0.33.4", True),
    ("0.34.0", False),
    ("1.0.0", False),
    ("0.8.5", False),
    # As PEP 440 orders them: a pre-release or dev build of the oldest comes before it.
    ("0.27.1rc1", False),
    ("0.27.1.dev3+g1a2b3c", False),
    ("0.27.1.post1", True),
    ("0.28.0rc2", True),
    ("0.33.1.dev5+gabc123", True),
    ("0.34.0.dev12+gabc123", False),  # a nightly past the range
    ("0.34.0rc1", False),
    ("unknown", None),
])
def test_the_declared_range(version: str, inside: bool | None) -> None:
    assert in_range(version) is inside
    warning = range_warning(version)
    if inside is False:
        assert warning is not None
        assert warning.startswith(f"vLLM {version} is outside")
        assert "(0.27.1 to 0.33.x)" in warning and "starts as usual" in warning
        assert "\n" not in warning
    else:
        assert warning is None


def test_a_vllm_outside_the_range_starts_with_one_warning_that_names_it() -> None:
    catalog = FlagCatalog.load(packaged_catalog_path())
    env = {"MODEL_NAME": "Qwen/Qwen3-0.6B"}
    inside = build_command(env, catalog)
    assert not [w for w in inside.warnings if "outside the versions" in w]
    # The running vLLM is 0.26.0 and the packaged 0.32.0 catalog stands in for it.
    outside = build_command(env, FlagCatalog(catalog.version, catalog.flags,
                                             positionals=catalog.positionals,
                                             stands_in_for="0.26.0"))
    [line] = [w for w in outside.warnings if "outside the versions" in w]
    assert line.startswith("vLLM 0.26.0 is outside the versions this worker is tested with")
    assert outside.argv == inside.argv  # never refused: the same command


@pytest.mark.parametrize(("version", "nearest"), [
    ("0.31.2", "0.31.0"),    # the newest of its minor release not newer than it
    ("0.31.0", "0.31.0"),
    ("0.27.0", "0.26.1"),   # before the minor's first packaged patch: the closest older
    ("0.40.0", "0.33.0"),   # past the newest: the newest
    ("0.8.5", "0.26.1"),    # before the oldest: the oldest
    ("0.31.0rc1", "0.31.0"),  # a pre-release: its release's catalog
    ("0.31.1.dev4+gabc123", "0.31.0"),
    ("0.34.0.dev12+gabc123", "0.33.0"),  # a nightly past the newest: the newest
    ("0.31.0+cpu", "0.31.0"),
    ("garbage", None),
    (None, None),
])
def test_the_nearest_packaged_catalog_stands_in(version: str | None, nearest: str | None) -> None:
    available = ["0.26.1", "0.27.1", "0.31.0", "0.33.0", "0.29.0"]
    assert nearest_version(version, available) == nearest


_LEN = ("MAX_MODEL_LEN", "--max-model-len")
_OFFLOAD = ("KV_OFFLOADING_SIZE", "--kv-offloading-size")
HISTORY = history_of({
    "0.27.1": [("SWAP_SPACE", "--swap-space"), _LEN],
    "0.29.0": [_LEN, _OFFLOAD],
    "0.30.0": [_LEN, _OFFLOAD, ("ODD_ONE", "--odd-one")],
    "0.32.0": [_LEN, _OFFLOAD],
})


@pytest.mark.parametrize(("var", "spans"), [
    ("MAX_MODEL_LEN", ("0.27.1 and later",)),
    ("SWAP_SPACE", ("0.27.1",)),
    ("KV_OFFLOADING_SIZE", ("0.29.0 and later",)),
    ("ODD_ONE", ("0.30.0",)),
    ("PATH", ()),
])
def test_the_versions_that_have_a_flag(var: str, spans: tuple[str, ...]) -> None:
    assert HISTORY.versions == ("0.27.1", "0.29.0", "0.30.0", "0.32.0")
    assert HISTORY.spans(var) == spans


def test_spans_of_a_flag_that_came_went_and_came_back() -> None:
    history = FlagHistory(("0.27.1", "0.28.0", "0.29.0", "0.30.0"),
                          {"X": frozenset({"0.27.1", "0.28.0", "0.30.0"})}, {"X": "--x"})
    assert history.spans("X") == ("0.27.1 to 0.28.0", "0.30.0 and later")


def test_a_variable_of_a_newer_flag_names_the_running_version_and_those_that_have_it() -> None:
    old = FlagCatalog.load(packaged_catalog_path())
    catalog = FlagCatalog("0.27.1", tuple(f for f in old if f.name != "--kv-offloading-size"),
                          positionals=old.positionals)
    command = build_command({"MODEL_NAME": "m", "KV_OFFLOADING_SIZE": "4"}, catalog,
                            history=lambda: HISTORY)
    assert "--kv-offloading-size" not in command.argv
    [line] = [w for w in command.warnings if w.startswith("KV_OFFLOADING_SIZE")]
    assert line == ("KV_OFFLOADING_SIZE is ignored: vLLM 0.27.1 has no --kv-offloading-size "
                    "(it is a flag of vLLM 0.29.0 and later; docs/versions.md)")


def test_a_retired_flag_known_to_older_versions_keeps_its_advice() -> None:
    catalog = FlagCatalog.load(packaged_catalog_path())
    command = build_command({"MODEL_NAME": "m", "SWAP_SPACE": "4"}, catalog,
                            history=lambda: HISTORY)
    [line] = [w for w in command.warnings if w.startswith("SWAP_SPACE")]
    assert line.startswith("SWAP_SPACE is ignored: vLLM 0.32.0 has no --swap-space (it is a "
                           "flag of vLLM 0.27.1; ")
    assert line.endswith("; vLLM V1 has no CPU swap space; remove it (KV_OFFLOADING_SIZE "
                         "offloads KV cache to CPU memory)")


def test_extra_args_of_another_versions_flag_are_passed_on_with_a_warning() -> None:
    catalog = FlagCatalog.load(packaged_catalog_path())
    command = build_command({"MODEL_NAME": "m", "VLLM_EXTRA_ARGS": "--swap-space 4"}, catalog,
                            history=lambda: HISTORY)
    assert command.argv[-6:-4] == ("--swap-space", "4")  # vLLM's parser has the last word
    [line] = [w for w in command.warnings if w.startswith("VLLM_EXTRA_ARGS")]
    assert line.startswith("VLLM_EXTRA_ARGS sets --swap-space, which vLLM will refuse: vLLM "
                           "0.32.0 has no --swap-space (it is a flag of vLLM 0.27.1; ")


def test_names_of_no_version_are_not_told_anything() -> None:
    catalog = FlagCatalog.load(packaged_catalog_path())
    command = build_command({"MODEL_NAME": "m", "PATH": "/bin", "HOME": "/root"}, catalog,
                            history=lambda: HISTORY)
    assert not [w for w in command.warnings if "PATH" in w or "HOME" in w]


# -- the packaged catalogs ---------------------------------------------------------------
def test_every_minor_release_of_the_range_has_a_packaged_catalog() -> None:
    packaged = packaged_versions()
    minors = {version_key(v)[:2] for v in packaged}  # type: ignore[index]
    oldest, newest = version_key(versions.OLDEST), version_key(versions.NEWEST_MINOR)
    assert oldest is not None and newest is not None
    assert minors == {(0, minor) for minor in range(oldest[1], newest[1] + 1)}
    assert set(versions.TESTED) <= set(packaged)
    assert packaged[0] == versions.OLDEST
    for version in packaged:
        path = PACKAGED_DIR / f"vllm-{version}.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data["vllm_version"] == version, path
        assert data.get("request_fields"), f"{path}: no request fields"
        assert FlagCatalog.load(path).model_positional


def test_the_packaged_history_reads_every_catalog() -> None:
    history = packaged_history()
    assert history.versions == packaged_versions()
    assert history.spans("MAX_MODEL_LEN") == (f"{versions.OLDEST} and later",)
    assert history.options["MAX_MODEL_LEN"] == "--max-model-len"


def test_the_versions_pages_example_is_what_the_oldest_vllm_gets() -> None:
    oldest = FlagCatalog.load(packaged_catalog_path(versions.OLDEST))
    command = build_command({"MODEL_NAME": "m", "SSE_KEEP_ALIVE_INTERVAL": "10"}, oldest)
    [line] = [w for w in command.warnings if w.startswith("SSE_KEEP_ALIVE_INTERVAL")]
    assert f"`{line}`" in (PACKAGED_DIR.parents[2] / "docs" / "versions.md").read_text()


def test_vllm_0_33s_enable_disable_pairs_map_both_ways() -> None:
    """vLLM 0.33 pairs ``--enable-y`` with ``--disable-y`` (no ``--no-`` form in its help):
    a false turns a pair off with its opposite word, and the opposite word's variable never
    sets the pair's flag the wrong way round."""
    catalog = FlagCatalog.load(packaged_catalog_path("0.33.0"))
    command = build_command({"MODEL_NAME": "m", "ENABLE_PREFIX_CACHING": "false",
                             "DISABLE_SLIDING_WINDOW": "false", "ENABLE_SLIDING_WINDOW": "true",
                             "VLLM_EXTRA_ARGS": "--disable-cascade-attn"}, catalog)
    assert "--disable-prefix-caching" in command.argv
    assert "--enable-sliding-window" in command.argv
    assert "--disable-sliding-window" not in command.argv
    assert ("ENABLE_SLIDING_WINDOW is ignored: --enable-sliding-window is set by "
            "DISABLE_SLIDING_WINDOW=false") in command.warnings
    assert command.flags["--disable-cascade-attn"].switch is True
    older = build_command({"MODEL_NAME": "m", "ENABLE_PREFIX_CACHING": "false"},
                          FlagCatalog.load(packaged_catalog_path()))
    assert "--no-enable-prefix-caching" in older.argv
