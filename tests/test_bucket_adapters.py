"""Adapters from a bucket (LORA_ADAPTERS_URI), in-process: the resolver's decisions (pure),
its install into vLLM's Python, and what the worker sets up for it and tells a job.

The fetch against the loopback S3 store: tests/test_bucket_fetch.py; the real vLLM serving
an adapter from the bucket: tests/test_e2e_adapters.py.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from lora_bucket.answers import ANSWERS, note
from lora_bucket.checks import BucketUri, judge_config, name_problem, parse_uri
from lora_bucket.disk import Entry, lru_first, to_free
from lora_bucket.resolver import settings_of

from tests.launches import launch_of
from tests.test_bucket_fetch import BASE, ROOT, adapter
from worker.errors import ConfigError
from worker.model.adapters import BucketAnswer, adapter_sources, read_bucket_answer
from worker.model.bucket_adapters import (
    ADMIN_ROUTES,
    VllmPlugins,
    closed_route_problem,
    missing_plugin,
    plain_name_problem,
    vllm_plugins,
)


# -- the decisions ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "plain"),
    [("sql", True), ("sql-v2.1_b", True), ("acme/sql", False), ("../x", False), ("..", False),
     ("a..b", False), ("s3://b/x", False), ("http:x", False), (".hidden", False), ("", False),
     ("a b", False), ("x" * 129, False), ("a\\b", False)],
)
def test_only_a_plain_name_is_looked_up_in_the_bucket(name: str, plain: bool) -> None:
    assert (name_problem(name) is None) is plain
    assert (plain_name_problem(name) is None) is plain  # the worker's explanation agrees


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("s3://b/loras", BucketUri("b", "loras")), ("s3://b/a/b/", BucketUri("b", "a/b")),
     ("s3://b", BucketUri("b", "")), ("gs://b/x", None), ("s3:///x", None),
     ("s3://b/../x", None), ("b/x", None)],
)
def test_the_uri(value: str, parsed: BucketUri | None) -> None:
    result = parse_uri(value)
    assert result == parsed if parsed is not None else isinstance(result, str)


@pytest.mark.parametrize(
    ("config", "rank", "needle"),
    [(adapter()["adapter_config.json"], 8, None),
     (adapter(base="org/another")["adapter_config.json"], 8,
      "names the base model 'org/another' (base_model_name_or_path)"),
     (adapter(rank=64)["adapter_config.json"], 64, "set MAX_LORA_RANK=64 or more"),
     (adapter(peft="IA3")["adapter_config.json"], 8, "says peft_type 'IA3'"),
     (b"{not json", None, "is not JSON"), (b"[1]", None, "is not a JSON object")],
    ids=["lora", "other-base", "rank", "not-lora", "not-json", "not-object"],
)
def test_what_adapter_config_says(config: bytes, rank: int | None, needle: str | None) -> None:
    found, problem = judge_config(config, name="x", base_model=BASE, max_rank=16)
    assert found == rank
    assert problem is None if needle is None else needle in (problem or "")


def test_the_least_recently_used_go_first_until_the_new_one_fits() -> None:
    entries = [Entry("new", 10, 3.0), Entry("old", 10, 1.0), Entry("mid", 10, 2.0)]
    assert [entry.name for entry in lru_first(entries)] == ["old", "mid", "new"]
    assert to_free(entries, 10, 40) == 0
    assert to_free(entries, 10, 25) == 15


def test_the_plugins_settings() -> None:
    assert settings_of({}) is None
    settings = settings_of({"LORA_ADAPTERS_URI": "s3://b/p/q", "LORA_ADAPTERS_DIR": "/v/l",
                            "LORA_ADAPTERS_MAX_RANK": "32"})
    assert not isinstance(settings, str) and settings is not None
    assert (settings.root, settings.bound, settings.max_rank) == (Path("/v/l/b/p/q"),
                                                                  10 << 30, 32)
    assert isinstance(settings_of({"LORA_ADAPTERS_URI": "gs://b/p"}), str)


# -- the plugin's install ---------------------------------------------------------------------
def test_the_install_gives_vllm_the_entry_point(tmp_path: Path) -> None:
    for _ in range(2):  # again: replaced, not doubled
        subprocess.run([sys.executable, str(ROOT / "scripts" / "install_adapter_plugin.py"),
                        "--target", str(tmp_path)], check=True, timeout=60)
    assert [p.name for p in tmp_path.glob("*.dist-info")] == [
        "worker_vllm_lora_bucket-0.1.0.dist-info"]
    found = [point for dist in importlib.metadata.distributions(path=[str(tmp_path)])
             for point in dist.entry_points if point.group == "vllm.general_plugins"]
    assert [(p.name, p.value) for p in found] == [("lora_bucket_resolver",
                                                   "lora_bucket.resolver:register")]
    assert (tmp_path / "lora_bucket" / "fetch.py").is_file()
    assert not list(tmp_path.rglob("__pycache__"))


def test_the_worker_asks_vllms_python_for_the_plugin(tmp_path: Path) -> None:
    """The start asks vLLM's Python which plugins it has: this Python has no plugin's entry
    point; with the install's folder on its path (vLLM's environment), it has the resolver's."""
    without = vllm_plugins(sys.executable, {"PATH": "/usr/bin:/bin"})
    assert without is not None and "lora_bucket_resolver" not in without.names
    error = missing_plugin("s3://b/loras", without)
    assert error is not None and error.type == "startup_error"
    assert error.extra == {"kind": "adapter_plugin_missing"}
    assert error.message.startswith(
        f"LORA_ADAPTERS_URI=s3://b/loras needs the resolver plugin lora_bucket_resolver in "
        f"vLLM's Python, and {sys.executable} has no such entry point (vllm.general_plugins: ")
    assert f"Fix: install it with that Python, `{sys.executable} " \
        "scripts/install_adapter_plugin.py`" in error.message
    subprocess.run([sys.executable, str(ROOT / "scripts" / "install_adapter_plugin.py"),
                    "--target", str(tmp_path)], check=True, timeout=60)
    found = vllm_plugins(sys.executable, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert found is not None and "lora_bucket_resolver" in found.names
    assert missing_plugin("s3://b/loras", found) is None
    # An interpreter that cannot be asked: not known, nothing claimed.
    assert vllm_plugins(None) is None
    assert vllm_plugins(str(tmp_path / "no-python")) is None
    assert missing_plugin("s3://b/x", VllmPlugins("/py", ("lora_filesystem_resolver",))) \
        is not None


# -- what the worker sets up ------------------------------------------------------------------
def test_the_worker_turns_on_what_the_resolver_needs(tmp_path: Path) -> None:
    env = {"MODEL_NAME": BASE, "ENABLE_LORA": "true", "LORA_ADAPTERS_URI": "s3://b/loras/",
           "BASE_PATH": str(tmp_path), "MAX_LORA_RANK": "32"}
    launch = launch_of(env)
    assert launch.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    assert launch.env["LORA_ADAPTERS_DIR"] == str(tmp_path / "lora-adapters")  # the volume
    assert launch.env["LORA_ADAPTERS_MAX_RANK"] == "32"
    assert launch.env["LORA_ADAPTERS_VLLM_URL"] == "http://127.0.0.1:18000"  # to unload one
    assert "VLLM_PLUGINS" not in launch.env  # unset: vLLM loads every plugin
    assert launch.closed_routes == ADMIN_ROUTES  # what that variable opens, closed to jobs
    sources = adapter_sources(launch)
    assert sources.per_job and sources.bucket == "s3://b/loras" and sources.warnings == ()
    assert sources.summary() == ("adapters named by jobs are looked up in the bucket "
                                 "s3://b/loras/<name>/ (LORA_ADAPTERS_URI)")
    # No volume: local disk. A VLLM_PLUGINS list gets the plugin.
    local = launch_of({**env, "BASE_PATH": str(tmp_path / "none"),
                       "VLLM_PLUGINS": "lora_filesystem_resolver", "XDG_CACHE_HOME": "/c"})
    assert local.env["LORA_ADAPTERS_DIR"] == "/c/worker-vllm/lora-adapters"
    assert local.env["VLLM_PLUGINS"] == "lora_filesystem_resolver,lora_bucket_resolver"
    assert local.env["LORA_ADAPTERS_MAX_RANK"] == "32"


def test_the_adapter_routes_stay_closed_unless_the_user_opened_them() -> None:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING, turned on by the worker for the bucket, would open
    vLLM's load and unload routes to every job and client: they stay closed; set by the user,
    they are open, as without the bucket."""
    env = {"MODEL_NAME": BASE, "ENABLE_LORA": "true", "LORA_ADAPTERS_URI": "s3://b/loras"}
    assert launch_of(env).closed_routes == ADMIN_ROUTES
    for value in ("true", "1", "TRUE"):
        assert launch_of({**env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}).closed_routes == ()
    assert launch_of({"MODEL_NAME": BASE}).closed_routes == ()


@pytest.mark.parametrize(("route", "closed"), [
    ("/v1/load_lora_adapter", True),
    ("/v1/unload_lora_adapter", True),
    ("/v1/load_lora_adapter?x=1", True),
    ("/v1/load_lora_adapter/", True),
    ("/v1//load_lora_adapter", True),
    ("/v1/load%5Flora%5Fadapter", True),
    ("/v1%2Funload_lora_adapter", True),
    ("/v1/load_lora_adapters", False),
    ("/v1/completions", False),
    ("/V1/load_lora_adapter", False),  # vLLM's routes are case-sensitive: a 404 there
])
def test_a_closed_route_is_known_as_vllm_reads_the_path(route: str, closed: bool) -> None:
    problem = closed_route_problem(route, ADMIN_ROUTES)
    assert (problem is not None) is closed
    if problem is not None:
        assert problem.startswith("/v1/") and "is closed on this worker" in problem
        assert "Set VLLM_ALLOW_RUNTIME_LORA_UPDATING=true yourself" in problem
    assert closed_route_problem(route, ()) is None


def test_without_enable_lora_the_worker_warns() -> None:
    sources = adapter_sources(launch_of({"MODEL_NAME": BASE, "LORA_ADAPTERS_URI": "s3://b/x"}))
    assert any("LoRA is off in vLLM: set ENABLE_LORA=true" in w for w in sources.warnings)


def test_a_disk_bound_that_is_no_finite_number_is_a_configuration_error() -> None:
    for value in ("nan", "inf", "-inf", "NaN", "1e400", "x"):
        with pytest.raises(ConfigError, match=f"LORA_ADAPTERS_DISK_GIB={value!r} is not a "
                                              "positive number of GiB"):
            launch_of({"MODEL_NAME": BASE, "LORA_ADAPTERS_URI": "s3://b/x",
                       "LORA_ADAPTERS_DISK_GIB": value})
        # The plugin's own reading says so too, where vLLM's start would have crashed.
        assert settings_of({"LORA_ADAPTERS_URI": "s3://b/x",
                            "LORA_ADAPTERS_DISK_GIB": value}) == (
            "LORA_ADAPTERS_DISK_GIB and LORA_ADAPTERS_MAX_RANK must be finite numbers")


@pytest.mark.parametrize(("host", "url"), [
    ("127.0.0.1", "http://127.0.0.1:18000"), ("0.0.0.0", "http://127.0.0.1:18000"),
    ("::", "http://[::1]:18000"), ("::1", "http://[::1]:18000"),
    ("10.1.2.3", "http://10.1.2.3:18000"),
])
def test_the_resolver_reaches_its_vllm_whatever_host_vllm_listens_on(host: str,
                                                                     url: str) -> None:
    from tests.launches import CATALOG
    from worker.config.settings import Settings
    from worker.start.build import Builder

    builder = Builder(Settings(base_path="/nonexistent"),
                      {"MODEL_NAME": BASE, "LORA_ADAPTERS_URI": "s3://b/x"}, host=host,
                      port=18000, catalog_loader=lambda *_: CATALOG)
    assert builder.launch().env["LORA_ADAPTERS_VLLM_URL"] == url


@pytest.mark.parametrize("value", ["gs://b/x", "s3://", "s3://b/../x"])
def test_a_uri_the_resolver_cannot_use_is_a_configuration_error(value: str) -> None:
    with pytest.raises(ConfigError, match="is not a bucket's prefix"):
        launch_of({"MODEL_NAME": BASE, "LORA_ADAPTERS_URI": value})
    with pytest.raises(ConfigError, match="LORA_ADAPTERS_DISK_GIB='0'"):
        launch_of({"MODEL_NAME": BASE, "LORA_ADAPTERS_URI": "s3://b/x",
                   "LORA_ADAPTERS_DISK_GIB": "0"})


def test_a_job_naming_no_adapter_of_the_bucket_is_told_where_the_worker_looked() -> None:
    sources = adapter_sources(launch_of({"MODEL_NAME": BASE, "ENABLE_LORA": "true",
                                         "LORA_ADAPTERS_URI": "s3://b/loras"}))
    vllm = {"message": "The model `nope` does not exist.", "param": "model", "code": 404}
    config = "s3://b/loras/nope/adapter_config.json"
    asked: list[tuple[str, str]] = []

    def answered(said: BucketAnswer | None) -> Callable[[str, str], BucketAnswer | None]:
        def answer(path: str, name: str) -> BucketAnswer | None:
            asked.append((path, name))
            return said
        return answer

    told = sources.explain(404, vllm, "nope", answer=answered(BucketAnswer("missing", "x")))
    assert f"the bucket has no {config}" in (told or "")
    assert "upload the adapter to s3://b/loras/nope/" in (told or "")
    assert "s3:ListBucket" not in (told or "")
    # S3 answered 403: what it means, named, and the permissions to give.
    told = sources.explain(404, vllm, "nope",
                           answer=answered(BucketAnswer("forbidden", "AccessDenied"))) or ""
    assert (f"the store refused to read {config} (AccessDenied): S3 answers so for an object "
            "that is not there when the keys may not list the bucket (s3:ListBucket), and for "
            "one they may not read (s3:GetObject)") in told
    assert "Fix: give the keys in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the role) " \
        "s3:ListBucket and s3:GetObject on the bucket; or upload the adapter" in told
    # No answer kept (two writers at once): the worker says it does not know which.
    told = sources.explain(404, vllm, "nope", answer=answered(None)) or ""
    assert f"the bucket's resolver found no {config} (S3's answer was not kept" in told
    assert asked == [(sources.bucket_answers, "nope")] * 3
    told = sources.explain(404, {**vllm, "message": "x"}, "../nope", answer=answered(None)) or ""
    assert len(asked) == 3  # a name the resolver never asks S3 about: no answer read
    assert "the bucket s3://b/loras was not asked: '../nope' is not a plain name" in told
    # What the resolver said (a 500 with its message) stands as it is.
    assert sources.explain(500, {"message": "The store refused ..."}, "sql") is None


@pytest.mark.parametrize("uri", ["s3://b/loras", "s3://b/loras/", "s3://b", "s3://b//a//b/"])
def test_the_worker_reads_the_answers_where_the_resolver_writes_them(uri: str) -> None:
    launch = launch_of({"MODEL_NAME": BASE, "ENABLE_LORA": "true", "LORA_ADAPTERS_URI": uri})
    settings = settings_of(launch.env)
    assert not isinstance(settings, str) and settings is not None
    assert adapter_sources(launch).bucket_answers == str(settings.root / ANSWERS)


def test_the_answer_is_read_from_the_resolvers_file(tmp_path: Path) -> None:
    path = tmp_path / ANSWERS
    note(tmp_path, "sql", "forbidden", "AccessDenied")
    note(tmp_path, "nope", "missing", "NoSuchKey")
    assert read_bucket_answer(str(path), "sql") == BucketAnswer("forbidden", "AccessDenied")
    assert read_bucket_answer(str(path), "nope") == BucketAnswer("missing", "NoSuchKey")
    assert read_bucket_answer(str(path), "other") is None
    assert read_bucket_answer(str(tmp_path / "none"), "sql") is None
    path.write_text('{"sql": "forbidden"}')
    assert read_bucket_answer(str(path), "sql") is None
    path.write_text("[]")
    assert read_bucket_answer(str(path), "sql") is None

