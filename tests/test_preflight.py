"""The Hub pre-flight: what it decides for each answer of the Hub, and when it asks nothing.

huggingface_hub 2.x talks HTTP through httpx2, a package separate from httpx, which respx does
not patch (respx 0.23 imports httpx only). The Hub is therefore faked with the HTTP library's
own MockTransport, installed through huggingface_hub's public hook ``set_client_factory``: the
real HfApi, URL building and ``hf_raise_for_status`` run, only the wire is fake. Every test
installs the fake (autouse), so no test can reach the network; an unexpected request fails the
test at teardown, and so does a route that was never requested.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub.utils import _http as hub_http

from tests.launches import NO_BAKED, launch_of
from worker.errors import StartupError
from worker.model.messages import (
    HubMessage,
    disabled_message,
    gated_message,
    invalid_token_message,
    not_found_message,
    revision_not_found_message,
)
from worker.model.preflight import preflight
from worker.model.targets import plan_hub_checks

# The HTTP library huggingface_hub uses (httpx2 in 2.x, httpx in 1.x).
HTTP: Any = getattr(hub_http, "httpx2", None) or getattr(hub_http, "httpx")  # noqa: B009
API = "https://huggingface.co/api/models"
TOKEN = "hf_SecretTokenValue123"

Handler = Callable[[Any], Any]


@dataclass
class FakeHub:
    """Routes ``GET <url>`` to a canned answer; records every request it sees."""

    routes: dict[str, Handler] = field(default_factory=dict)
    requests: list[Any] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def on(self, url: str, status: int = 200, *, json_body: Any = None, headers: dict[str, str]
           | None = None, text: str = "") -> None:
        def answer(request: Any) -> Any:
            if json_body is not None:
                return HTTP.Response(status, json=json_body, headers=headers)
            return HTTP.Response(status, text=text, headers=headers)

        self.routes[url] = answer

    def on_call(self, url: str, handler: Handler) -> None:
        self.routes[url] = handler

    def handle(self, request: Any) -> Any:
        self.requests.append(request)
        url = str(request.url).split("?", 1)[0]
        handler = self.routes.get(url)
        if handler is None:
            self.unexpected.append(f"{request.method} {url}")
            return HTTP.Response(418, text="unexpected request in test")
        return handler(request)

    @property
    def urls(self) -> list[str]:
        return [str(r.url).split("?", 1)[0] for r in self.requests]


@pytest.fixture(autouse=True)
def hub() -> Iterator[FakeHub]:
    fake = FakeHub()
    huggingface_hub.set_client_factory(
        lambda: HTTP.Client(transport=HTTP.MockTransport(fake.handle))
    )
    try:
        yield fake
    finally:
        huggingface_hub.set_client_factory(hub_http.default_client_factory)
    assert not fake.unexpected, f"unexpected requests: {fake.unexpected}"
    never = set(fake.routes) - set(fake.urls)
    assert not never, f"routes never requested: {sorted(never)}"


def env_of(**values: str) -> dict[str, str]:
    # An empty HF_HOME: no token file, no cached copy, whatever this machine has.
    return {"HF_HOME": "/nonexistent/hf-home", **values}


async def run(env: dict[str, str], *, baked_args_path: str = NO_BAKED, **kwargs: Any) -> Any:
    launch = launch_of(env, baked_args_path=baked_args_path)
    return await preflight(launch.command, launch.hub, **kwargs)


PUBLIC = {"id": "Qwen/Qwen3-0.6B", "gated": False, "private": False, "sha": "abc123"}
GATED = {"id": "meta-llama/Llama-3.1-8B-Instruct", "gated": "manual", "private": False}


# -- definitive answers ------------------------------------------------------------------------
async def test_public_model_passes_with_one_anonymous_request(hub: FakeHub) -> None:
    hub.on(f"{API}/Qwen/Qwen3-0.6B", json_body=PUBLIC)
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B"))
    assert result.ok and result.startup_error is None
    assert result.warnings == ()
    assert result.checked == ("Qwen/Qwen3-0.6B",)
    assert "authorization" not in hub.requests[0].headers
    assert result.seconds >= 0  # measured (a monotonic clock's difference)


async def test_no_agent_registry_request_even_with_nothing_cached(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub 2.4 fetches /api/agent-harnesses before a process's first request when
    # HF_HOME has no copy of the day. Forget any copy this process already holds: the
    # pre-flight must still send its one request only, and write nothing into HF_HOME.
    from huggingface_hub import constants
    from huggingface_hub.utils import _detect_agent

    monkeypatch.setattr(_detect_agent, "_registry", None)
    registry = Path(constants.AGENT_HARNESSES_PATH)
    assert not await asyncio.to_thread(registry.exists)
    hub.on(f"{API}/Qwen/Qwen3-0.6B", json_body=PUBLIC)
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B"))
    assert result.ok
    assert hub.urls == [f"{API}/Qwen/Qwen3-0.6B"]
    assert not await asyncio.to_thread(registry.exists)


async def test_revision_is_asked_for(hub: FakeHub) -> None:
    hub.on(f"{API}/Qwen/Qwen3-0.6B/revision/v2.0", json_body=PUBLIC)
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B", MODEL_REVISION="v2.0"))
    assert result.ok
    assert result.checked == ("Qwen/Qwen3-0.6B@v2.0",)


async def test_gated_without_token_fails_without_asking_for_access(hub: FakeHub) -> None:
    hub.on(f"{API}/meta-llama/Llama-3.1-8B-Instruct", json_body=GATED)
    result = await run(env_of(MODEL_NAME="meta-llama/Llama-3.1-8B-Instruct"))
    error = result.startup_error
    assert isinstance(error, StartupError)
    assert error.to_dict()["type"] == "startup_error"
    assert error.extra == {"kind": "gated_model"}
    assert error.message == (
        "The model meta-llama/Llama-3.1-8B-Instruct (MODEL_NAME) is gated: Hugging Face serves "
        "its files only to accounts that accepted its license, and HF_TOKEN is not set. "
        "Fix: Accept the license at https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct "
        "with your Hugging Face account and, once access is granted, set HF_TOKEN to a read "
        "token of that account (a fine-grained token also needs read access to public gated "
        "repos); or choose another model in MODEL_NAME."
    )
    assert hub.urls == [f"{API}/meta-llama/Llama-3.1-8B-Instruct"]  # no auth-check


async def test_gated_with_a_token_without_access(hub: FakeHub) -> None:
    hub.on(f"{API}/meta-llama/Llama-3.1-8B-Instruct", json_body=GATED)
    hub.on(
        f"{API}/meta-llama/Llama-3.1-8B-Instruct/auth-check", 403,
        headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model "
                 "meta-llama/Llama-3.1-8B-Instruct is restricted and you are not in the "
                 "authorized list."},
    )
    result = await run(env_of(MODEL_NAME="meta-llama/Llama-3.1-8B-Instruct", HF_TOKEN=TOKEN))
    assert result.startup_error is not None
    assert result.startup_error.message == (
        "The model meta-llama/Llama-3.1-8B-Instruct (MODEL_NAME) is gated: Hugging Face serves "
        "its files only to accounts that accepted its license, and the account of the token in "
        "HF_TOKEN has not been granted access (license not accepted, or the request is still "
        "pending). Fix: Accept the license at "
        "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct with your Hugging Face account "
        "and, once access is granted, set HF_TOKEN to a read token of that account (a "
        "fine-grained token also needs read access to public gated repos); or choose another "
        "model in MODEL_NAME."
    )
    assert [r.headers.get("authorization") for r in hub.requests] == [f"Bearer {TOKEN}"] * 2


async def test_gated_with_access_granted_passes(hub: FakeHub) -> None:
    hub.on(f"{API}/meta-llama/Llama-3.1-8B-Instruct", json_body=GATED)
    hub.on(f"{API}/meta-llama/Llama-3.1-8B-Instruct/auth-check", json_body={})
    result = await run(env_of(MODEL_NAME="meta-llama/Llama-3.1-8B-Instruct", HF_TOKEN=TOKEN))
    assert result.ok and result.warnings == ()


async def test_401_without_token_is_private_or_gated(hub: FakeHub) -> None:
    hub.on(f"{API}/acme/secret-model", 401,
           headers={"X-Error-Message": "Invalid username or password."})
    result = await run(env_of(MODEL_NAME="acme/secret-model"))
    assert result.startup_error is not None
    assert result.startup_error.message == (
        "Hugging Face refused to show the model acme/secret-model (MODEL_NAME) without a token "
        "(401): the repo is private or gated, or does not exist, and HF_TOKEN is not set. "
        "Fix: Set HF_TOKEN to a read token of an account that can read the repo (for a gated "
        "model, accept its license at https://huggingface.co/acme/secret-model with that "
        "account first); if the repo is public, check that MODEL_NAME is the full `org/repo` "
        "id, spelled as on huggingface.co."
    )


async def test_repo_not_found_names_the_variable(hub: FakeHub) -> None:
    hub.on(f"{API}/Qwen/Qwen3-0.6", 404, headers={"X-Error-Code": "RepoNotFound"})
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6", HF_TOKEN=TOKEN))
    assert result.startup_error is not None
    assert result.startup_error.extra == {"kind": "model_not_found"}
    assert result.startup_error.message == (
        "Hugging Face has no model Qwen/Qwen3-0.6 (MODEL_NAME) that this worker can read: it "
        "does not exist, or it is private and the account of the token in HF_TOKEN cannot read "
        "it. Fix: Check that MODEL_NAME is the full `org/repo` id, spelled as on huggingface.co "
        "(e.g. Qwen/Qwen3-0.6B); if the repo is private, set HF_TOKEN to a read token of an "
        "account that can read it."
    )


async def test_generic_model_variable_is_named(hub: FakeHub) -> None:
    hub.on(f"{API}/Qwen/Qwen3-0.6", 404, headers={"X-Error-Code": "RepoNotFound"})
    result = await run(env_of(MODEL="Qwen/Qwen3-0.6"))
    assert result.startup_error is not None
    assert "(MODEL) that this worker" in result.startup_error.message
    assert "Check that MODEL is the full" in result.startup_error.message


async def test_revision_not_found(hub: FakeHub) -> None:
    hub.on(f"{API}/Qwen/Qwen3-0.6B/revision/v9", 404,
           headers={"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id: v9"})
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B", MODEL_REVISION="v9"))
    assert result.startup_error is not None
    assert result.startup_error.extra == {"kind": "revision_not_found"}
    assert result.startup_error.message == (
        "The revision 'v9' of Qwen/Qwen3-0.6B (MODEL_REVISION) does not exist on Hugging Face. "
        "Fix: Set MODEL_REVISION to an existing branch, tag or commit of Qwen/Qwen3-0.6B (see "
        '"Files and versions" on https://huggingface.co/Qwen/Qwen3-0.6B), or leave it unset '
        "for the default branch."
    )


async def test_invalid_token(hub: FakeHub) -> None:
    hub.on(f"{API}/Qwen/Qwen3-0.6B", 401,
           headers={"X-Error-Message": "Invalid credentials in Authorization header"})
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B", HF_TOKEN=TOKEN))
    assert result.startup_error is not None
    assert result.startup_error.message == invalid_token_message().message
    assert result.startup_error.extra == {"kind": "invalid_token"}


async def test_403_without_gated_code_is_a_token_permission_problem(hub: FakeHub) -> None:
    hub.on(f"{API}/acme/model", 403, headers={"X-Error-Message": "fine-grained token"})
    result = await run(env_of(MODEL_NAME="acme/model", HF_TOKEN=TOKEN))
    assert result.startup_error is not None
    assert result.startup_error.message.startswith(
        "Hugging Face answered 403 Forbidden to the token in HF_TOKEN for the model acme/model "
        "(MODEL_NAME). Fix: Set HF_TOKEN to a token that can read the repo"
    )


async def test_disabled_repo(hub: FakeHub) -> None:
    hub.on(f"{API}/acme/gone", 403, headers={"X-Error-Message": "Access to this resource is "
                                             "disabled."})
    result = await run(env_of(MODEL_NAME="acme/gone", HF_TOKEN=TOKEN))
    assert result.startup_error is not None
    assert result.startup_error.message == disabled_message("acme/gone").message


async def test_tokenizer_and_lora_failures_name_their_variables(hub: FakeHub) -> None:
    hub.on(f"{API}/Qwen/Qwen3-0.6B", json_body=PUBLIC)
    hub.on(f"{API}/acme/tok/revision/t1", 404, headers={"X-Error-Code": "RepoNotFound"})
    hub.on(f"{API}/acme/sql-lora", 404, headers={"X-Error-Code": "RepoNotFound"})
    lora = [{"name": "sql", "path": "acme/sql-lora"}, {"name": "local", "path": "/loras/x"}]
    result = await run(env_of(
        MODEL_NAME="Qwen/Qwen3-0.6B", TOKENIZER_NAME="acme/tok", TOKENIZER_REVISION="t1",
        LORA_MODULES=json.dumps(lora),
    ))
    assert result.errors == (
        not_found_message("acme/tok", "TOKENIZER_NAME", role="tokenizer").message,
        not_found_message("acme/sql-lora", 'the path of LORA_MODULES entry "sql"',
                          role="LoRA adapter").message,
    )
    assert result.startup_error is not None
    assert result.startup_error.message == "\n".join(result.errors)
    assert result.checked == ("Qwen/Qwen3-0.6B", "acme/tok@t1", "acme/sql-lora")
    assert "LORA_MODULES entry \"local\"" not in result.startup_error.message


async def test_a_model_set_in_extra_args_is_the_one_checked(hub: FakeHub) -> None:
    # VLLM_EXTRA_ARGS wins over MODEL_NAME in the command: vLLM loads other/model, so that is
    # the repo to ask about, and the fix names where it was set.
    hub.on(f"{API}/other/model", 404, headers={"X-Error-Code": "RepoNotFound"})
    result = await run(env_of(MODEL_NAME="acme/model", VLLM_EXTRA_ARGS="--model other/model"))
    assert result.checked == ("other/model",)
    assert result.errors == (
        not_found_message("other/model", "--model in VLLM_EXTRA_ARGS").message,
    )


async def test_a_model_set_in_the_config_file_is_the_one_checked(
    hub: FakeHub, tmp_path: Path
) -> None:
    config = tmp_path / "vllm.yaml"
    config.write_text("model: other/model\nrevision: v3\n")
    hub.on(f"{API}/other/model/revision/v3", json_body=PUBLIC)
    result = await run(env_of(VLLM_CONFIG_FILE=str(config)))
    assert result.ok and result.checked == ("other/model@v3",)


async def test_tokenizer_revision_defaults_to_the_model_revision(hub: FakeHub) -> None:
    # vLLM uses the model's revision for another tokenizer repo when TOKENIZER_REVISION is unset.
    hub.on(f"{API}/acme/model/revision/v2", json_body=PUBLIC)
    hub.on(f"{API}/acme/tok/revision/v2", 404, headers={"X-Error-Code": "RevisionNotFound"})
    result = await run(env_of(MODEL_NAME="acme/model", MODEL_REVISION="v2",
                              TOKENIZER_NAME="acme/tok"))
    assert result.errors == (
        revision_not_found_message(
            "acme/tok", "v2", variable="TOKENIZER_REVISION, which defaults to MODEL_REVISION"
        ).message,
    )


async def test_the_same_repo_is_asked_once(hub: FakeHub) -> None:
    hub.on(f"{API}/Qwen/Qwen3-0.6B", json_body=PUBLIC)
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B", TOKENIZER_NAME="Qwen/Qwen3-0.6B"))
    assert result.ok and len(hub.requests) == 1


async def test_refusal_for_a_cached_repo_is_only_a_warning(hub: FakeHub, tmp_path: Path) -> None:
    # huggingface_hub falls back to the local cache when the Hub refuses: the start may work.
    (tmp_path / "hub" / "models--acme--model" / "snapshots" / "abc").mkdir(parents=True)
    hub.on(f"{API}/acme/model", 401, headers={"X-Error-Message": "Invalid username or password."})
    result = await run({"HF_HOME": str(tmp_path), "MODEL_NAME": "acme/model"})
    assert result.ok
    assert len(result.warnings) == 1
    assert "A copy of acme/model is in the local cache" in result.warnings[0]


async def test_hf_endpoint_of_the_environment_is_asked(hub: FakeHub) -> None:
    hub.on("https://hf-mirror.example/api/models/acme/model", 404,
           headers={"X-Error-Code": "RepoNotFound"})
    result = await run(env_of(MODEL_NAME="acme/model", HF_ENDPOINT="https://hf-mirror.example/"))
    assert result.startup_error is not None
    assert result.problems[0].kind == "model_not_found"


async def test_token_file_is_used_like_huggingface_hub_does(hub: FakeHub, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    hub.on(f"{API}/Qwen/Qwen3-0.6B", json_body=PUBLIC)
    result = await run({"HF_HOME": str(tmp_path), "MODEL_NAME": "Qwen/Qwen3-0.6B"})
    assert result.ok
    assert hub.requests[0].headers["authorization"] == f"Bearer {TOKEN}"


# -- uncertain answers: a warning, the start goes on ---------------------------------------------
# -- no definitive answer ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (503, "Hugging Face answered 503 Service Unavailable"),
        (500, "Hugging Face answered 500 Internal Server Error"),
    ],
)
async def test_server_errors_are_an_outage(hub: FakeHub, status: int, reason: str) -> None:
    # The body echoes the token: whatever the Hub says, the token never reaches the result.
    hub.on(f"{API}/Qwen/Qwen3-0.6B", status, text=f"upstream said {TOKEN}")
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B", HF_TOKEN=TOKEN))
    assert result.ok and result.startup_error is None and result.warnings == ()
    assert result.outage is not None and result.outage.endpoint == "https://huggingface.co"
    assert [(t.repo, why) for t, why in result.outage.repos] == [("Qwen/Qwen3-0.6B", reason)]
    assert TOKEN not in repr(result)


async def test_rate_limiting_is_a_warning(hub: FakeHub) -> None:
    hub.on(f"{API}/Qwen/Qwen3-0.6B", 429, text="slow down")
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B"))
    assert result.ok and result.outage is None
    assert result.warnings == (
        "Could not check the model Qwen/Qwen3-0.6B (MODEL_NAME) on Hugging Face: Hugging Face "
        "is rate-limiting this machine (429 Too Many Requests); starting anyway (vLLM downloads "
        "it itself and a real problem will be reported from its log).",
    )


async def test_library_timeout_is_an_outage(hub: FakeHub) -> None:
    def slow(request: Any) -> Any:
        raise HTTP.ReadTimeout("The read operation timed out", request=request)

    hub.on_call(f"{API}/Qwen/Qwen3-0.6B", slow)
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B"), timeout=2)
    assert result.ok and result.outage is not None
    assert result.outage.repos[0][1] == "no answer within 2 s (ReadTimeout)"


async def test_unreachable_hub_is_an_outage(hub: FakeHub) -> None:
    def refused(request: Any) -> Any:
        raise HTTP.ConnectError("[Errno -2] Name or service not known", request=request)

    hub.on_call("http://hub.internal/api/models/Qwen/Qwen3-0.6B", refused)
    result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B", HF_ENDPOINT="http://hub.internal"))
    assert result.ok and result.warnings == ()
    assert result.outage is not None and result.outage.endpoint == "http://hub.internal"
    assert result.outage.repos[0][1] == (
        "cannot reach Hugging Face (ConnectError: [Errno -2] Name or service not known)")


async def test_a_hanging_request_neither_blocks_the_loop_nor_outlives_the_deadline(
    hub: FakeHub,
) -> None:
    # The request hangs until the test releases it (or for minutes, if the test never does).
    hanging, release, ended = threading.Event(), threading.Event(), threading.Event()

    def hang(request: Any) -> Any:
        hanging.set()
        release.wait(300)
        ended.set()
        return HTTP.Response(200, json=PUBLIC)

    hub.on_call(f"{API}/Qwen/Qwen3-0.6B", hang)
    ticks = 0  # turns of this loop while the request hung
    ticked = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        while True:
            if hanging.is_set() and not ended.is_set():
                ticks += 1
                if ticks >= 10:
                    ticked.set()
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        result = await run(env_of(MODEL_NAME="Qwen/Qwen3-0.6B"), timeout=0.3)
        # The pre-flight answered while its request still hung: past its deadline, not at
        # the request's end.
        assert not ended.is_set()
        # And the loop keeps running while the request hangs.
        await asyncio.wait_for(ticked.wait(), 120)
        assert not ended.is_set()
    finally:
        ticker.cancel()
        release.set()
    assert ticks >= 10
    assert result.ok and result.outage is not None
    assert result.outage.repos[0][1] == "no answer within 0.3 s"


# -- nothing to ask ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"MODEL_NAME": "/runpod-volume/models/llama"}, id="absolute-path"),
        pytest.param({"MODEL_NAME": "./models/llama"}, id="relative-path"),
        pytest.param({"MODEL_NAME": "~/models/llama"}, id="home-path"),
        pytest.param({"MODEL_NAME": "s3://bucket/llama"}, id="url"),
        pytest.param({"MODEL_NAME": "acme/model", "HF_HUB_OFFLINE": "1"}, id="hf-offline"),
        pytest.param({"MODEL_NAME": "acme/model", "TRANSFORMERS_OFFLINE": "1"},
                     id="transformers-offline"),
        pytest.param({"MODEL_NAME": "acme/model", "VLLM_USE_MODELSCOPE": "true"},
                     id="modelscope"),
        pytest.param({"MODEL_NAME": "acme/model-GGUF:Q4_K_M"}, id="not-a-repo-id"),
        pytest.param({"LORA_MODULES": '[{"name": "a", "path": "/loras/a"}]'}, id="local-lora"),
        pytest.param({}, id="no-model"),
    ],
)
async def test_no_request_when_nothing_is_downloaded(hub: FakeHub, env: dict[str, str]) -> None:
    result = await run(env_of(**env))
    assert hub.requests == []
    assert result.ok and result.checked == () and result.warnings == ()


async def test_no_request_for_a_baked_model(hub: FakeHub, tmp_path: Path) -> None:
    baked = tmp_path / "local_model_args.json"
    baked.write_text('{"MODEL_NAME": "/models/llama"}')
    result = await run(env_of(MODEL_NAME="acme/model"), baked_args_path=str(baked))
    assert hub.requests == []
    assert result.skipped == (
        "the model is baked into the image (/models/llama); vLLM runs offline",
    )


async def test_no_request_for_an_existing_relative_path(hub: FakeHub) -> None:
    result = await run(env_of(MODEL_NAME="models/llama"),
                       path_exists=lambda path: path == "models/llama")
    assert hub.requests == []
    assert result.skipped == ("MODEL_NAME='models/llama' is an existing local path",)


async def test_timeout_zero_turns_the_check_off(hub: FakeHub) -> None:
    result = await run(env_of(MODEL_NAME="acme/model"), timeout=0)
    assert hub.requests == [] and result.ok


def test_plan_reads_lora_name_path_words() -> None:
    launch = launch_of({"LORA_MODULES": "sql=acme/sql-lora local=/loras/x"})
    plan = plan_hub_checks(launch.command, launch.hub)
    assert [(t.repo, t.variable) for t in plan.targets] == [
        ("acme/sql-lora", 'the path of LORA_MODULES entry "sql"'),
    ]
    assert plan.skipped == ("the path of LORA_MODULES entry \"local\"='/loras/x' is a local path",)


# -- the builders the diagnosis shares ------------------------------------------------------------
def test_builders_take_evidence_and_work_without_a_repo() -> None:
    message = gated_message(None, evidence="vLLM: 'Cannot access gated repo'")
    assert isinstance(message, HubMessage)
    assert message.cause == (
        "The model in MODEL_NAME is gated: Hugging Face serves its files only to accounts that "
        "accepted its license, and HF_TOKEN is not set (vLLM: 'Cannot access gated repo')."
    )
    assert "the model's page on huggingface.co" in message.fix
    assert str(message) == message.message == f"{message.cause} Fix: {message.fix}"
    assert revision_not_found_message(None, "v9").cause == (
        "The revision 'v9' (MODEL_REVISION) does not exist on Hugging Face."
    )
