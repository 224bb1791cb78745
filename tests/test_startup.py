"""The start, in-process: the parts it drives (process, health wait, hub check) are stand-ins.

What is checked is the wiring around the policy (tests/test_policy.py): what is launched, with
which command, how often, and what the start ends with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from pathlib import Path

import pytest

from tests.launches import CATALOG
from worker.config.resolved import Launch
from worker.config.settings import Settings
from worker.errors import ConfigError
from worker.model.messages import HubMessage
from worker.model.preflight import HubOutage, PreflightResult
from worker.model.targets import plan_hub_checks
from worker.secrets import SecretMasker
from worker.start.build import Builder
from worker.start.startup import HubCheck, Startup
from worker.start.supervisor import Readiness, VllmProcess

KV_TOO_SMALL = (
    "(EngineCore pid=8) ERROR 12-01 10:00:00 [core.py:1] ValueError: To serve at least one "
    "request with the model's max seq len (512), (0.06 GiB KV cache is needed, which is larger "
    "than the available KV cache memory (0.01 GiB). Based on the available memory, the estimated "
    "maximum model length is 96. Try increasing `gpu_memory_utilization`."
)


class FakeProcess(VllmProcess):
    """A vLLM that is never started: its end is scripted (healthy, or exited with a tail)."""

    def __init__(self, launch: Launch, readiness: Readiness, tail: Sequence[str]) -> None:
        super().__init__(launch.command.argv, launch.env)
        self.launch = launch
        self.readiness = readiness
        self._scripted_tail = list(tail)
        self.stopped = False

    def stop(self, grace: float = 15.0) -> None:
        self.stopped = True

    def drain_output(self, timeout: float = 2.0) -> None:
        pass

    def tail(self, lines: int | None = None) -> list[str]:
        return self._scripted_tail

    @property
    def returncode(self) -> int | None:
        return None if self.readiness is Readiness.HEALTHY else 1


class Script:
    """The ends of successive attempts; records every launch."""

    def __init__(self, *ends: tuple[Readiness, Sequence[str]]) -> None:
        self.ends = list(ends)
        self.launches: list[FakeProcess] = []

    def spawn(self, launch: Launch) -> VllmProcess:
        readiness, tail = self.ends.pop(0)
        process = FakeProcess(launch, readiness, tail)
        self.launches.append(process)
        return process

    @staticmethod
    async def wait(process: VllmProcess) -> Readiness:
        assert isinstance(process, FakeProcess)
        await asyncio.sleep(0)
        return process.readiness


async def no_hub_problem(launch: Launch, only: Collection[str] | None) -> PreflightResult:
    return PreflightResult()


def startup(env: dict[str, str], script: Script, tmp_path: Path, *,
            hub_check: HubCheck = no_hub_problem, settings_error: ConfigError | None = None,
            baked_args_path: str = "/nonexistent", hub_retry_timeout: float = 15.0) -> Startup:
    settings = Settings(base_path=str(tmp_path / "no-volume"), baked_model_file=baked_args_path,
                        hub_retry_timeout=hub_retry_timeout)
    builder = Builder(settings, {"MODEL_NAME": "/models/m", **env},
                      catalog_loader=lambda *_: CATALOG)
    return Startup(builder, masker=SecretMasker(), settings_error=settings_error,
                   spawn=script.spawn, hub_check=hub_check,
                   wait_healthy=script.wait)


async def test_a_healthy_start_is_ready_after_one_launch(tmp_path: Path) -> None:
    script = Script((Readiness.HEALTHY, []))
    outcome = await startup({"SERVED_MODEL_NAME": "tiny"}, script, tmp_path).run()
    assert outcome.ready and outcome.tried == []
    assert outcome.command is not None and outcome.command.default_model_name == "tiny"
    assert len(script.launches) == 1 and not script.launches[0].stopped


async def test_out_of_memory_relaunches_once_smaller_then_serves(tmp_path: Path) -> None:
    script = Script((Readiness.EXITED, [KV_TOO_SMALL]), (Readiness.HEALTHY, []))
    outcome = await startup({"ENFORCE_EAGER": "false"}, script, tmp_path).run()
    assert outcome.ready
    assert outcome.tried == ["a relaunch with ENFORCE_EAGER=true and MAX_NUM_BATCHED_TOKENS=8192"]
    first, second = (p.launch.command for p in script.launches)
    assert "--no-enforce-eager" in first.argv and "--enforce-eager" in second.argv
    assert second.value("--max-num-batched-tokens") == "8192"


async def test_out_of_memory_twice_is_explained_with_what_was_tried(tmp_path: Path) -> None:
    script = Script((Readiness.EXITED, [KV_TOO_SMALL]), (Readiness.EXITED, [KV_TOO_SMALL]))
    outcome = await startup({}, script, tmp_path).run()
    assert outcome.error is not None and outcome.error.type == "startup_error"
    assert "Already tried: a relaunch with ENFORCE_EAGER=true" in outcome.error.message
    assert len(script.launches) == 2


async def test_the_hub_saying_no_stops_the_loading_vllm(tmp_path: Path) -> None:
    loading = asyncio.Event()

    class Loading(Script):
        @staticmethod
        async def wait(process: VllmProcess) -> Readiness:
            await loading.wait()  # never set: vLLM is still loading
            return Readiness.HEALTHY

    async def hub_says_no(launch: Launch, only: Collection[str] | None) -> PreflightResult:
        return PreflightResult((HubMessage("model_not_found",
                                           f"no such model {launch.command.model}.", "x"),))

    script = Loading((Readiness.HEALTHY, []))
    outcome = await startup({}, script, tmp_path, hub_check=hub_says_no).run()
    assert outcome.error is not None
    assert outcome.error.message == "no such model /models/m. Fix: x"
    assert script.launches[0].stopped


async def test_a_configuration_error_launches_nothing(tmp_path: Path) -> None:
    script = Script()
    outcome = await startup({"ENFORCE_EAGER": "maybe"}, script, tmp_path).run()
    assert outcome.error is not None and "ENFORCE_EAGER='maybe'" in outcome.error.message
    assert script.launches == []


async def test_an_invalid_worker_setting_launches_nothing(tmp_path: Path) -> None:
    script = Script()
    error = ConfigError("MAX_CONCURRENCY='x' is not valid")
    outcome = await startup({}, script, tmp_path, settings_error=error).run()
    assert outcome.error is error and script.launches == []


async def test_a_missing_baked_model_launches_nothing(tmp_path: Path) -> None:
    baked = tmp_path / "local_model_args.json"
    baked.write_text('{"MODEL_NAME": "/nonexistent/baked-model"}')
    script = Script()
    outcome = await startup({}, script, tmp_path, baked_args_path=str(baked)).run()
    assert outcome.error is not None and outcome.error.extra["kind"] == "baked_model_missing"
    assert script.launches == []


@pytest.mark.parametrize("readiness", [Readiness.EXITED, Readiness.TIMED_OUT])
async def test_an_unrecognised_end_is_prestart_failed(
    readiness: Readiness, tmp_path: Path
) -> None:
    script = Script((readiness, ["RuntimeError: something odd"]))
    outcome = await startup({}, script, tmp_path).run()
    assert outcome.error is not None and outcome.error.type == "prestart_failed"
    assert outcome.error.extra["logs"] == "RuntimeError: something odd"
    assert script.launches[0].stopped


def _down(launch: Launch) -> PreflightResult:
    [target] = plan_hub_checks(launch.command, launch.hub).targets
    return PreflightResult(outage=HubOutage("http://hub.internal", ((target, "answered 503"),)))


async def test_the_hub_down_stops_vllm_and_is_asked_again_until_it_gives_up(
    tmp_path: Path
) -> None:
    now = [100.0]
    asked: list[tuple[float, Collection[str] | None]] = []

    async def down(launch: Launch, only: Collection[str] | None) -> PreflightResult:
        asked.append((now[0] - 100.0, only))
        return _down(launch)

    async def sleep(seconds: float) -> None:
        now[0] += seconds

    script = Script((Readiness.HEALTHY, []))
    start = startup({"MODEL_NAME": "acme/x", "HF_HOME": str(tmp_path / "hf")}, script, tmp_path,
                    hub_check=down, hub_retry_timeout=10)
    start._clock, start._sleep = (lambda: now[0]), sleep
    outcome = await start.run()
    assert outcome.error is not None and outcome.error.type == "hub_unreachable"
    assert script.launches[0].stopped and len(script.launches) == 1
    # Asked at once, then 1, 2, 4 and 8 s after, the last at HUB_RETRY_TIMEOUT; about the repo
    # that was down only.
    assert asked == [(0.0, None), *((t, {"acme/x"}) for t in (1.0, 2.0, 4.0, 8.0, 10.0))]
    assert "The worker kept asking for 10 s (HUB_RETRY_TIMEOUT)." in outcome.error.message


async def test_vllm_is_launched_again_once_the_hub_answers(tmp_path: Path) -> None:
    answers = iter(["down", "down", "up", "up"])

    async def flaky(launch: Launch, only: Collection[str] | None) -> PreflightResult:
        return _down(launch) if next(answers) == "down" else PreflightResult()

    now, paused = [100.0], list[float]()

    async def sleep(seconds: float) -> None:  # the pauses between the asks, not waited out
        paused.append(seconds)
        now[0] += seconds

    script = Script((Readiness.HEALTHY, []), (Readiness.HEALTHY, []))
    start = startup({"MODEL_NAME": "acme/x", "HF_HOME": str(tmp_path / "hf")}, script,
                    tmp_path, hub_check=flaky, hub_retry_timeout=30)
    start._clock, start._sleep = (lambda: now[0]), sleep
    outcome = await start.run()
    assert outcome.ready and outcome.tried == []
    assert [p.stopped for p in script.launches] == [True, False]
    assert paused == [1.0, 1.0]  # asked at once, 1 s and 2 s after: down, down, then up


@pytest.mark.parametrize("has_it", [False, True])
async def test_without_the_buckets_resolver_in_vllms_python_nothing_is_launched(
    tmp_path: Path, has_it: bool
) -> None:
    """LORA_ADAPTERS_URI needs the resolver plugin in vLLM's Python: without its entry point
    the start ends with what to install, before vLLM is launched."""
    from worker.model.bucket_adapters import VllmPlugins

    script = Script((Readiness.HEALTHY, []))
    asked: list[str] = []

    def plugins(launch: Launch) -> VllmPlugins:
        asked.append(launch.env["LORA_ADAPTERS_URI"])
        names = ("lora_bucket_resolver",) if has_it else ("lora_filesystem_resolver",)
        return VllmPlugins("/opt/vllm/bin/python", names)

    run = startup({"LORA_ADAPTERS_URI": "s3://b/loras", "ENABLE_LORA": "true"}, script,
                  tmp_path)
    run._plugins = plugins
    outcome = await run.run()
    assert asked == ["s3://b/loras"]
    if has_it:
        assert outcome.ready and len(script.launches) == 1
        return
    assert outcome.error is not None and outcome.error.extra == {
        "kind": "adapter_plugin_missing"}
    assert "/opt/vllm/bin/python scripts/install_adapter_plugin.py" in outcome.error.message
    assert script.launches == []
