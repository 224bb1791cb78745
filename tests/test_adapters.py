"""Adapters per job, in-process: which resolvers a launch turns on (vLLM 0.32's rules), what
the worker says at start, and what a job naming an adapter that cannot be had is told.

The same answers of the real vLLM are checked end to end in tests/test_e2e_adapters.py; the
bodies below are vLLM's, copied from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import docs
from tests import test_model_source as model_source
from tests.hf_cache import write_snapshot
from tests.launches import launch_of
from tests.test_startup import Script, startup
from worker.config.settings import Settings
from worker.jobs.handler import Proxy
from worker.jobs.routing import sent_model
from worker.model.adapters import (
    AdapterSources,
    FolderLook,
    adapter_sources,
    look_in_folder,
    missing_adapter_folder,
)

ON = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "ENABLE_LORA": "true"}
MODEL = "org/base"
BOTH = "lora_filesystem_resolver,lora_hf_hub_resolver"


def sources_of(env: dict[str, str]) -> AdapterSources:
    return adapter_sources(launch_of({"MODEL_NAME": MODEL, **env}))


# -- which resolvers vLLM registers -----------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "folder", "repos", "per_job"),
    [
        ({}, None, (), False),
        # VLLM_PLUGINS unset loads every general plugin: the folder's resolver registers...
        ({"VLLM_LORA_RESOLVER_CACHE_DIR": "/v/loras"}, "/v/loras", (), False),
        ({**ON, "VLLM_LORA_RESOLVER_CACHE_DIR": "/v/loras"}, "/v/loras", (), True),
        # ... but the Hub's only when VLLM_PLUGINS names it.
        ({**ON, "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a"}, None, (), False),
        ({**ON, "VLLM_PLUGINS": "lora_hf_hub_resolver",
          "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a,acme/b"}, None, ("acme/a", "acme/b"), True),
        # Naming only the Hub's turns the folder's off.
        ({**ON, "VLLM_PLUGINS": "lora_hf_hub_resolver", "VLLM_LORA_RESOLVER_CACHE_DIR": "/v",
          "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a"}, None, ("acme/a",), True),
        ({**ON, "VLLM_PLUGINS": BOTH, "VLLM_LORA_RESOLVER_CACHE_DIR": "/v",
          "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a"}, "/v", ("acme/a",), True),
        # An empty VLLM_PLUGINS is a list naming no plugin, as vLLM reads it.
        ({**ON, "VLLM_PLUGINS": "", "VLLM_LORA_RESOLVER_CACHE_DIR": "/v"}, None, (), False),
        ({**ON, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_LORA_RESOLVER_CACHE_DIR": "/v"},
         "/v", (), True),
        # vLLM takes "1" and "true" only.
        ({**ON, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes", "VLLM_LORA_RESOLVER_CACHE_DIR": "/v"},
         "/v", (), False),
    ],
    ids=["nothing", "folder-registered", "folder-per-job", "hub-not-named", "hub", "hub-only",
         "both", "empty-plugins", "runtime-1", "runtime-yes"],
)
def test_the_resolvers_vllm_registers(
    env: dict[str, str], folder: str | None, repos: tuple[str, ...], per_job: bool
) -> None:
    sources = sources_of(env)
    assert (sources.folder, sources.hub_repos, sources.per_job) == (folder, repos, per_job)


def test_what_the_launch_tells_about_the_model_and_lora() -> None:
    sources = sources_of({**ON, "SERVED_MODEL_NAME": "a b", "MAX_LORA_RANK": "64",
                          "LORA_MODULES": "sql=/loras/sql"})
    assert sources.base_model == MODEL and sources.served_names == ("a", "b")
    assert sources.static_adapters == ("sql",) and sources.lora_enabled
    assert sources.max_lora_rank == 64
    plain = sources_of({})
    assert plain.served_names == (MODEL,) and plain.max_lora_rank == 16
    assert not plain.lora_enabled


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"VLLM_LORA_RESOLVER_CACHE_DIR": "/v"}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING is not true"),
        ({**ON, "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a"},
         "VLLM_PLUGINS does not name lora_hf_hub_resolver"),
        ({**ON, "VLLM_PLUGINS": "lora_hf_hub_resolver", "VLLM_LORA_RESOLVER_CACHE_DIR": "/v",
          "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a"},
         "VLLM_PLUGINS does not name lora_filesystem_resolver"),
        ({**ON, "VLLM_PLUGINS": "lora_filesystem_resolver, lora_hf_hub_resolver",
          "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a"},
         "VLLM_PLUGINS has the entry ' lora_hf_hub_resolver'"),
        ({**ON, "VLLM_PLUGINS": BOTH, "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a, acme/b"},
         "VLLM_LORA_RESOLVER_HF_REPO_LIST has the entry ' acme/b'"),
        ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "VLLM_LORA_RESOLVER_CACHE_DIR": "/v"},
         "LoRA is off in vLLM: set ENABLE_LORA=true"),
        ({**ON, "VLLM_PLUGINS": BOTH, "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a",
          "HF_HUB_OFFLINE": "1"}, "the Hub resolver cannot download while HF_HUB_OFFLINE=1"),
    ],
    ids=["runtime-off", "hub-not-named", "folder-not-named", "plugin-space", "repo-space",
         "lora-off", "offline"],
)
def test_settings_that_cannot_work_as_meant_are_warned_about(
    env: dict[str, str], needle: str
) -> None:
    warnings = sources_of(env).warnings
    assert any(needle in warning for warning in warnings), warnings


def test_a_working_setup_warns_of_nothing() -> None:
    sources = sources_of({**ON, "VLLM_PLUGINS": BOTH, "VLLM_LORA_RESOLVER_CACHE_DIR": "/v",
                          "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a,acme/b"})
    assert sources.warnings == ()
    assert sources.summary() == ("adapters named by jobs are looked up in the folder /v "
                                 "(VLLM_LORA_RESOLVER_CACHE_DIR) and the Hub repos acme/a, "
                                 "acme/b (VLLM_LORA_RESOLVER_HF_REPO_LIST)")
    assert sources_of({}).summary() is None


# -- the folder, at start ---------------------------------------------------------------------
def test_a_missing_folder_is_a_configuration_error(tmp_path: Path) -> None:
    sources = sources_of({"VLLM_LORA_RESOLVER_CACHE_DIR": str(tmp_path / "loras")})
    error = missing_adapter_folder(sources)
    assert error is not None and error.type == "startup_error"
    assert f"VLLM_LORA_RESOLVER_CACHE_DIR='{tmp_path / 'loras'}' is not a folder" in error.message
    assert f"mkdir -p {tmp_path / 'loras'}" in error.message
    (tmp_path / "loras").mkdir()
    assert missing_adapter_folder(sources) is None
    # Not registered (VLLM_PLUGINS names another plugin): vLLM never checks it.
    assert missing_adapter_folder(sources_of({
        "VLLM_PLUGINS": "lora_hf_hub_resolver",
        "VLLM_LORA_RESOLVER_CACHE_DIR": str(tmp_path / "nope")})) is None


async def test_a_missing_folder_launches_nothing(tmp_path: Path) -> None:
    script = Script()
    outcome = await startup({"VLLM_LORA_RESOLVER_CACHE_DIR": str(tmp_path / "loras")},
                            script, tmp_path).run()
    assert outcome.error is not None and "is not a folder" in outcome.error.message
    assert script.launches == []


# -- what the folder holds, as vLLM's filesystem resolver judges it ---------------------------
def write_adapter(folder: Path, config: Any) -> Path:
    folder.mkdir(parents=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "adapter_config.json").write_text(text)
    return folder


@pytest.mark.parametrize(
    ("config", "state", "detail"),
    [
        (None, "missing", ""),
        ("no-config", "no_config", ""),
        ("{not json", "unreadable", "Expecting property name"),
        ({"base_model_name_or_path": MODEL}, "unreadable", "it has no peft_type"),
        ({"peft_type": "IA3", "base_model_name_or_path": MODEL}, "not_lora", "IA3"),
        ({"peft_type": "LORA"}, "unreadable", "it has no base_model_name_or_path"),
        ({"peft_type": "LORA", "base_model_name_or_path": "org/other", "r": 8}, "other_base",
         "org/other"),
        ({"peft_type": "LORA", "base_model_name_or_path": MODEL, "r": 32}, "adapter", ""),
    ],
    ids=["missing", "no-config", "not-json", "no-peft-type", "ia3", "no-base", "other-base",
         "adapter"],
)
def test_what_the_folder_holds(
    tmp_path: Path, config: Any, state: str, detail: str
) -> None:
    if config == "no-config":
        (tmp_path / "x").mkdir()
    elif config is not None:
        write_adapter(tmp_path / "x", config)
    look = look_in_folder(str(tmp_path), "x", MODEL)
    assert (look.path, look.state) == (str(tmp_path / "x"), state)
    assert detail in look.detail
    if state == "adapter":
        assert look.rank == 32


# -- what a job is told -----------------------------------------------------------------------
NOT_FOUND = {"message": "The model `x` does not exist. Valid aliases: tiny.",
             "type": "NotFoundError", "param": "model", "code": 404}
FOLDER_ON = {**ON, "SERVED_MODEL_NAME": "tiny", "VLLM_LORA_RESOLVER_CACHE_DIR": "/v/loras"}
HUB_ON = {**ON, "SERVED_MODEL_NAME": "tiny", "VLLM_PLUGINS": BOTH,
          "VLLM_LORA_RESOLVER_CACHE_DIR": "/v/loras",
          "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/tiny-lora,acme/missing"}


def told(env: dict[str, str], name: str, look: FolderLook | None = None, *, status: int = 404,
         vllm: Any = None) -> str | None:
    looked = look or FolderLook(f"/v/loras/{name}", "missing")
    return sources_of(env).explain(status, NOT_FOUND if vllm is None else vllm, name,
                                   lambda _: looked)


def test_a_name_in_no_folder_and_no_allowed_repo() -> None:
    assert told(HUB_ON, "nope") == (
        "No model or adapter named 'nope' is served here, and vLLM's resolvers found none: "
        "there is no /v/loras/nope; 'nope' is in none of the Hub repos "
        "VLLM_LORA_RESOLVER_HF_REPO_LIST allows (acme/tiny-lora, acme/missing); a Hub adapter "
        "is named by its repo, org/repo, or org/repo/<folder> for one in a folder of the repo. "
        "This worker serves tiny. Fix: put the adapter in /v/loras/nope (adapter_config.json "
        "and adapter_model.safetensors, as PEFT saves them); or add the adapter's repo to "
        "VLLM_LORA_RESOLVER_HF_REPO_LIST; or send one of the served names."
    )


@pytest.mark.parametrize(
    ("look", "needles"),
    [
        (FolderLook("/v/loras/x", "no_config"), ("/v/loras/x has no adapter_config.json",)),
        (FolderLook("/v/loras/x", "not_lora", "IA3"),
         ("says peft_type 'IA3', and vLLM loads LORA adapters only",)),
        (FolderLook("/v/loras/x", "other_base", "org/other"),
         ("names the base model 'org/other' (base_model_name_or_path)",
          "named exactly as --model names it: 'org/base'",
          "set its base_model_name_or_path to 'org/base'")),
        (FolderLook("/v/loras/x", "adapter"), ("written after vLLM looked?", "send the job again")),
    ],
    ids=["no-config", "not-lora", "other-base", "written-since"],
)
def test_what_the_folder_held_is_said(look: FolderLook, needles: tuple[str, ...]) -> None:
    message = told(FOLDER_ON, "x", look)
    assert message is not None
    for needle in needles:
        assert needle in message


def test_a_missing_folder_of_an_allowed_repo() -> None:
    message = told(HUB_ON, "acme/tiny-lora/b")
    assert message is not None
    assert "the allowed repo acme/tiny-lora has no adapter in 'b'" in message
    assert "the allowed repo acme/tiny-lora has no adapter at its root" in (
        told(HUB_ON, "acme/tiny-lora") or "")


def test_with_resolvers_off_the_job_is_told_how_to_turn_one_on() -> None:
    env = {"SERVED_MODEL_NAME": "tiny", "LORA_MODULES": "sql=/loras/sql"}
    assert told(env, "nope") == (
        "No model or adapter named 'nope' is served here. This worker serves tiny and the "
        "adapters sql (LORA_MODULES). vLLM looks up adapters named by jobs only with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true and a resolver, and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set. Fix: send one of the served names, or "
        "turn a resolver on (docs/adapters.md)."
    )
    assert "no resolver is on" in (told({**ON, "SERVED_MODEL_NAME": "tiny"}, "nope") or "")


def test_a_listed_repo_the_hub_does_not_show() -> None:
    vllm = {"message": "401 Client Error.\n\nRepository Not Found for url: "
                       "http://127.0.0.1:1/api/models/acme/missing/tree/main?recursive=true.",
            "type": "InternalServerError", "param": None, "code": 500}
    message = told(HUB_ON, "acme/missing", status=500, vllm=vllm)
    assert message is not None
    assert message.startswith(
        "vLLM's Hub resolver could not read the repo acme/missing (allowed by "
        "VLLM_LORA_RESOLVER_HF_REPO_LIST) for the adapter 'acme/missing': 401 Client Error. "
        "Repository Not Found for url: http://127.0.0.1:1/api/models/acme/missing/tree/main")
    assert "check that acme/missing exists on the Hub under that id" in message
    offline = told({**HUB_ON, "HF_HUB_OFFLINE": "1"}, "acme/missing", status=500, vllm=vllm)
    assert offline is not None and "vLLM runs offline (HF_HUB_OFFLINE=1" in offline
    # Another 500 (the engine's, say) is vLLM's to tell.
    assert told(HUB_ON, "acme/missing", status=500, vllm={"message": "boom"}) is None


def test_an_unreadable_adapter_config_in_the_folder() -> None:
    look = FolderLook("/v/loras/x", "unreadable", "it has no peft_type")
    message = told(FOLDER_ON, "x", look, status=500,
                   vllm={"message": "'peft_type'", "code": 500})
    assert message is not None and message.startswith(
        "vLLM's filesystem resolver could not read /v/loras/x/adapter_config.json for the "
        "adapter 'x': it has no peft_type.")


FOUND = {"message": "LoRA adapter 'x' was found but could not be loaded.",
         "type": "BadRequestError", "param": None, "code": 400}


@pytest.mark.parametrize(
    ("env", "look", "needle"),
    [
        (FOLDER_ON, FolderLook("/v/loras/x", "adapter", rank=32),
         "found the adapter 'x' in /v/loras/x but could not load it. Fix: its rank (r=32 in "
         "/v/loras/x/adapter_config.json) is above MAX_LORA_RANK (16): set MAX_LORA_RANK=32"),
        ({**FOLDER_ON, "ENABLE_LORA": "false"}, FolderLook("/v/loras/x", "adapter", rank=8),
         "Fix: LoRA is off in vLLM: set ENABLE_LORA=true."),
        (FOLDER_ON, FolderLook("/v/loras/x", "adapter", rank=8),
         "check its rank against MAX_LORA_RANK (16)"),
    ],
    ids=["rank", "lora-off", "other"],
)
def test_an_adapter_found_but_not_loaded(env: dict[str, str], look: FolderLook,
                                         needle: str) -> None:
    message = told(env, "x", look, status=400, vllm=FOUND)
    assert message is not None and needle in message, message


def test_what_is_left_to_vllm() -> None:
    assert told(HUB_ON, "tiny") is None  # a served name: its 404 is another one
    assert told({**HUB_ON, "LORA_MODULES": "sql=/l"}, "sql") is None
    assert told(HUB_ON, "x", status=400, vllm={"message": "max_tokens too large"}) is None
    route = {"detail": "Not Found"}  # an unknown route, not the model
    assert told(HUB_ON, "x", vllm=route) is None
    assert sources_of(HUB_ON).explain(404, NOT_FOUND, None) is None


def test_the_model_sent() -> None:
    assert sent_model(b'{"model": "sql", "prompt": "x"}') == "sql"
    assert sent_model(b"") is None and sent_model(b"[1]") is None
    assert sent_model(b"not json") is None and sent_model(b'{"model": 3}') is None


# -- at the proxy: the one place vLLM's errors become job errors -------------------------------
async def job_error(adapters: AdapterSources | None, model: str, status: int,
                    body: dict[str, Any]) -> dict[str, Any]:
    def answer(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["model"] == model
        return httpx.Response(status, json=body)

    proxy = Proxy(Settings(vllm_port=8000), served_model="tiny", adapters=adapters,
                  transport=httpx.MockTransport(answer))
    try:
        items = [item async for item in proxy.handle(
            {"id": "j", "input": {"prompt": "x", "model": model}})]
    finally:
        await proxy.aclose()
    [item] = items
    error: dict[str, Any] = json.loads(item["error"])
    return error


async def test_the_job_gets_the_explanation_with_vllms_status_and_error(tmp_path: Path) -> None:
    (tmp_path / "loras").mkdir()
    env = {**FOLDER_ON, "VLLM_LORA_RESOLVER_CACHE_DIR": str(tmp_path / "loras")}
    body = {"error": {**NOT_FOUND, "message": "The model `nope` does not exist. Valid "
                                              "aliases: tiny."}}
    error = await job_error(sources_of(env), "nope", 404, body)
    assert error["type"] == "vllm_error" and error["code"] == 404
    assert error["message"].startswith("No model or adapter named 'nope' is served here, and "
                                       f"vLLM's resolvers found none: there is no "
                                       f"{tmp_path / 'loras' / 'nope'}.")
    assert error["vllm"] == body["error"]
    # Without adapter sources (a stand-in proxy), vLLM's message as it was.
    plain = await job_error(None, "nope", 404, body)
    assert plain["message"] == "The model `nope` does not exist. Valid aliases: tiny."


# -- docs/adapters.md --------------------------------------------------------------------------
PAGE = "adapters.md"
#: The names the page's examples send, in the page's order.
EXAMPLE_NAMES = ("support", "acme/adapters/support")


def page_blocks(kind: str) -> list[str]:
    return docs.blocks_of(docs.page(PAGE), kind)


def page_sources() -> AdapterSources:
    """The settings the page's variable blocks set, together."""
    env = dict(line.split("=", 1) for block in page_blocks("text") if "VLLM_" in block
               for line in block.splitlines() if "=" in line)
    return sources_of(env)


def test_the_pages_examples_are_what_the_worker_answers() -> None:
    sources = page_sources()
    examples = [json.loads(block) for block in page_blocks("json") if "vllm_error" in block]
    assert len(examples) == len(EXAMPLE_NAMES)
    folder = sources.folder
    assert folder is not None

    def nothing_there(name: str) -> FolderLook:
        return FolderLook(str(Path(folder) / name), "missing")

    for name, example in zip(EXAMPLE_NAMES, examples, strict=True):
        assert sources.explain(example["code"], example["vllm"], name,
                               nothing_there) == example["message"]
    relayed = [json.loads(block) for block in page_blocks("json") if block.startswith('{"error"')]
    assert relayed == [{"error": examples[0]["vllm"]}]  # lb mode: vLLM's object as it is
    text = " ".join(docs.page(PAGE).split())
    summary = sources.summary()
    assert summary is not None and summary in text
    error = missing_adapter_folder(sources, is_dir=lambda _: False)
    assert error is not None and error.message in text


# -- a cached model beside the Hub's adapters ---------------------------------------------------
def test_a_cached_model_keeps_vllm_online_when_jobs_name_hub_adapters(tmp_path: Path) -> None:
    """The worker runs vLLM offline when every repo of the command is cached; the Hub
    resolver then could fetch nothing (huggingface_hub refuses to list a repo offline)."""
    write_snapshot(model_source.hub_cache(tmp_path), "acme/tiny", model_source.MODEL)
    hub = {**ON, "VLLM_PLUGINS": BOTH, "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/a"}
    launch = model_source.start(tmp_path, **hub)
    assert launch.env.get("HF_HUB_OFFLINE") != "1"
    assert model_source.reasons(launch)[-1] == (
        "VLLM_LORA_RESOLVER_HF_REPO_LIST (adapters named by jobs come from the Hub) is set: vLLM "
        "asks the Hub as usual, though everything is cached")
    assert adapter_sources(launch).offline is None
    # Adapters from the folder need no Hub; nor do Hub settings no job reaches.
    for env in ({**ON, "VLLM_LORA_RESOLVER_CACHE_DIR": str(tmp_path)},
                {**hub, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false"}):
        launch = model_source.start(tmp_path, **env)
        assert launch.env.get("HF_HUB_OFFLINE") == "1", env
        assert adapter_sources(launch).offline == "HF_HUB_OFFLINE=1"
