"""The image, built and run for real: every deploy option as a container (marked ``image``).

No Docker engine, GPU or Docker Hub here. ``tools/make_base_image.py`` makes a stand-in of
the official vLLM image from packages (its docstring lists how it differs from the real one)
and builders (Debian 13's buildah 1.39, Debian 12's 1.28); the Dockerfile is built unchanged
on top of it, for Option 1 and for
Option 2 (the tiny model downloaded at build time from a loopback stand-in of the Hugging Face
Hub, as a gated repo that needs the build secret). Containers run the image's own entrypoint
with buildah, on the host's network, against the test bed's loopback job API:

* serverless mode, the model streamed from a bucket of a loopback S3 store (moto) by the Run:ai
  Model Streamer that the build added to the base: prompt, messages, a stream and a generic
  route answered by real vLLM; the flag catalog is the baked file, and no catalog is dumped at
  start;
* local mode: the README's ``/runsync`` curl call;
* http mode (a plain pod) and lb mode (a load-balancing endpoint): ``/v1/models``, a chat
  completion, the health route (``/health``, ``/ping``);
* Option 2: the baked model served offline (the stand-in Hub counts no request at start), and
  a diagnosed start failure answering jobs with ``startup_error``;
* secrets: the build secret is in no layer, config, history entry or build log; a run-time
  ``HF_TOKEN`` and ``AWS_SECRET_ACCESS_KEY`` are in no process's argv and no log line (and do
  reach vLLM's environment);
* ``VLLM_VERSION`` as ``v0.32.0`` and ``latest`` builds on that tag, and ``0.32.0`` (no
  official tag) fails naming it, with either builder;
* Debian 12's buildah 1.28 builds Options 1 and 2 too, into images with the same entry point,
  environment, flag catalog and baked model as 1.39's, the build secret in neither's config,
  history or log;
* a Dockerfile whose COPY names a missing file fails the build with the file's name.

Containers serve the tiny model on the CPU: eager mode, a 512-token context, a 64 MB KV cache
and float32 (the portable CPU kernels). Build and start times, and the worker's layers' size
over the base, are printed in the run's "figures" section, never asserted.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, report_figure
from tests.fake_hub import FakeHub
from tests.fake_job_api import FakeJobApi, JobRecord
from tests.fake_s3 import SECRET_ACCESS_KEY, FakeS3, fake_s3
from tests.image_bed import Build, Container, ImageBed
from tests.shared_workers import POOL, pooled
from tests.test_docker import readme_docker_builds
from tests.test_examples import curl_commands
from tests.test_security import every_cmdline
from tests.worker_process import ROOT
from worker.config.flags import PACKAGED_VERSION, FlagCatalog, packaged_catalog_path

# The first test of a machine also makes the builders and the base image (several minutes,
# once per machine), counted in its time: the image tests' bound is above the suite's 300 s.
pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]

BUILD_TOKEN = "hf_BuildSecretOfTheGatedRepo7731"
RUNTIME_TOKEN = "hf_RuntimeSecretOfTheEndpoint4402"
GATED_REPO = "acme/tiny-gated"
MODEL_IN_CONTAINER = "/models/tiny"
#: This run's images (another checkout's run on the machine shares the storage, not the names).
IMAGE = f"localhost/worker-vllm-test-{os.getpid()}"
#: What of tiny_env (conftest) belongs to this machine rather than to a container.
HOST_ONLY = ("TMPDIR", "VLLM_CACHE_ROOT", "VLLM_EXECUTABLE", "MODEL_NAME", "HF_HUB_OFFLINE")
BAKED_CATALOG_LINE = "vLLM flag catalog: /opt/worker/vllm-flags.json (VLLM_FLAG_CATALOG)"
#: The health route of the modes that serve HTTP themselves: a plain pod's vLLM, and the
#: load-balancer worker (HEALTH_CHECK_PATH's default; Option 2 runs in lb mode below).
HTTP_HEALTH, LB_HEALTH = "/health", "/ping"
#: The key of the plain pod (http mode) below: vLLM itself requires it.
POD_KEY = "sk-pod-test-4f1c9e"
START_TIMEOUT = 400.0


# -- the bed: base, builds ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def bed() -> ImageBed:
    started = time.monotonic()
    try:
        made = ImageBed()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    report_figure(f"builder ready in {time.monotonic() - started:.0f} s "
                  "(made unless cached on this machine)")
    return made


@pytest.fixture(scope="session")
def base_tags(bed: ImageBed) -> list[str]:
    started = time.monotonic()
    tags = bed.base(PACKAGED_VERSION)
    report_figure(f"stand-in base {tags[0]}: ready in {time.monotonic() - started:.0f} s "
                  "(built unless cached on this machine)")
    return tags


@pytest.fixture(scope="session")
def hub(tiny_model: Path) -> Iterator[FakeHub]:
    with FakeHub(GATED_REPO, tiny_model, BUILD_TOKEN) as server:
        yield server


@pytest.fixture(scope="session")
def build_dir(bed: ImageBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("image-builds")
    # This run's images go; so do cache layers no image uses any more (the base stays).
    names = bed.run("buildah", "images", "--format", "{{.Name}}:{{.Tag}}").stdout.split()
    mine = [name for name in names if name.startswith(IMAGE + ":")]
    if mine:
        bed.run("buildah", "rmi", *mine, check=False)
    bed.run("buildah", "rmi", "--prune", check=False)


#: The builder of each Debian suite the image tests build with.
BUILDERS = ("trixie", "bookworm")
OLD_BUILDER = "bookworm"


def built(bed: ImageBed, build_dir: Path, name: str, **kwargs: Any) -> Build:
    build = bed.build(f"{IMAGE}:{name}", build_dir / f"{name}.log", **kwargs)
    if build.returncode != 0:
        pytest.fail(build.failure())
    report_figure(f"build {name} ({build.builder}): {build.seconds:.0f} s")
    return build


@pytest.fixture(scope="session")
def old_builder(bed: ImageBed, base_tags: list[str]) -> str:
    """Debian 12's buildah (made once per machine, like the other builder)."""
    started = time.monotonic()
    version = bed.builder_of(OLD_BUILDER).version()
    report_figure(f"builder {OLD_BUILDER} (buildah {version}) ready in "
                  f"{time.monotonic() - started:.0f} s (made unless cached on this machine)")
    return OLD_BUILDER


def readme_build(option: int, hub: FakeHub | None = None) -> dict[str, Any]:
    """The README's ``docker build`` of Option ``option`` as the bed's arguments: its build
    arguments and secrets, the model replaced by the stand-in Hub's gated repo."""
    # Option 1's is the build without a build argument; Option 2's names the model.
    [words] = [build for build in readme_docker_builds()
               if ("MODEL_NAME=" in " ".join(build)) == (option == 2)
               and ("--build-arg" in build) == (option == 2)]
    build_args: dict[str, str] = {}
    secrets: list[str] = []
    for flag, value in itertools.pairwise(words):
        if flag == "--build-arg":
            name, _, text = value.partition("=")
            build_args[name] = GATED_REPO if name == "MODEL_NAME" else text
        elif flag == "--secret":
            secrets.append(dict(p.split("=", 1) for p in value.split(","))["id"])
    if hub is not None:
        build_args["HF_ENDPOINT"] = hub.url
    return {"build_args": build_args, "secrets": secrets}


@pytest.fixture(scope="session")
def option1(bed: ImageBed, base_tags: list[str], build_dir: Path) -> Build:
    """The README's ``docker build -t worker-vllm .``: no build argument at all."""
    wanted = readme_build(1)
    assert wanted == {"build_args": {}, "secrets": []}, wanted
    build = built(bed, build_dir, "option1")
    worker_layers = bed.size(build.tag) - bed.size(base_tags[0])
    report_figure(f"worker layers over the base: {worker_layers / 2**20:.0f} MiB")
    return build


def build_option2(bed: ImageBed, hub: FakeHub, build_dir: Path, name: str,
                  **kwargs: Any) -> Build:
    """The README's Option 2 with the stand-in Hub: the gated tiny model, the build secret."""
    wanted = readme_build(2, hub)
    assert wanted["secrets"] == ["HF_TOKEN"], wanted
    secret = build_dir / "hf-token"
    secret.write_text(BUILD_TOKEN)
    secret.chmod(0o600)
    return built(bed, build_dir, name, build_args=wanted["build_args"],
                 secrets={"HF_TOKEN": secret}, **kwargs)


@pytest.fixture(scope="session")
def option2(bed: ImageBed, option1: Build, hub: FakeHub, build_dir: Path) -> Build:
    return build_option2(bed, hub, build_dir, "option2")


# -- containers --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def serverless_api() -> Iterator[FakeJobApi]:
    """The job API of the module's serverless container alone (other tests get their own
    job_api: a worker takes every job of the API it polls)."""
    with FakeJobApi() as api:
        yield api


@dataclass
class Running:
    container: Container
    taking_after: float | None = None

    def alive(self) -> bool:
        return self.container.proc.poll() is None

    def stop(self) -> None:
        self.container.kill()


@dataclass
class Containers:
    """Starts containers of the built images, each with the CPU settings and its own vLLM port.
    Every container's Hub is the stand-in: no request can leave loopback, and any is counted."""

    bed: ImageBed
    hub: FakeHub
    cpu_env: dict[str, str]

    def start(self, image: str, env: dict[str, str], log: Path, *,
              mounts: list[tuple[Path, str]] | None = None) -> Running:
        full = {**self.cpu_env, "HF_ENDPOINT": self.hub.url, "VLLM_PORT": str(free_port()),
                **env}
        return Running(self.bed.container(image, full, log, mounts=mounts or []))


@pytest.fixture(scope="session")
def containers(bed: ImageBed, hub: FakeHub, tiny_env: dict[str, str]) -> Containers:
    """The tiny model's CPU settings are the other tests' (eager, 512 tokens, a 64 MB KV cache,
    float32)."""
    return Containers(bed, hub, {k: v for k, v in tiny_env.items() if k not in HOST_ONLY})


def wait_taking_jobs(running: Running) -> float:
    """Seconds from the entrypoint's start to the worker's 'taking jobs'."""
    running.container.wait_for_log("taking jobs", timeout=START_TIMEOUT)
    running.taking_after = time.monotonic() - running.container.started_at
    return running.taking_after


pooled("serverless", "image-serverless")


@pytest.fixture(scope="module")
def bucket(tiny_model: Path) -> Iterator[FakeS3]:
    """A loopback S3-compatible store holding the tiny model under s3://models/tiny."""
    with fake_s3() as store:
        store.upload(tiny_model, "models", "tiny")
        yield store


@pytest.fixture
def serverless(containers: Containers, option1: Build, serverless_api: FakeJobApi,
               bucket: FakeS3, tmp_path_factory: pytest.TempPathFactory) -> Running:
    """Option 1 in serverless mode, the model streamed from a bucket of a loopback S3 store
    (the streamer the build added to a base without it), a run-time HF_TOKEN; shared by the
    tests that read it, stopped once they are done (tests/shared_workers.py)."""
    def start() -> Running:
        env = {**serverless_api.env(), **bucket.env(), "MODEL_NAME": "s3://models/tiny",
               "HF_TOKEN": RUNTIME_TOKEN}
        log = tmp_path_factory.mktemp("serverless") / "container.log"
        running = containers.start(option1.tag, env, log)
        try:
            report_figure(f"cold start in the container (entrypoint -> taking jobs): "
                          f"{wait_taking_jobs(running):.1f} s")
        except BaseException:
            running.stop()
            raise
        return running

    return POOL.get("image-serverless", start)


def run_job(job_api: FakeJobApi, job_input: dict[str, Any]) -> JobRecord:
    record = job_api.wait_done(job_api.submit(job_input), timeout=120)
    assert record.done is not None and "error" not in record.done, record.done
    return record


def test_serverless_answers_prompt_messages_stream_and_a_route(
    serverless: Running, serverless_api: FakeJobApi
) -> None:
    job_api = serverless_api
    prompt = run_job(job_api, {"prompt": "Hello", "sampling_params": {"max_tokens": 6,
                                                                      "ignore_eos": True}})
    [completion] = prompt.done["output"]
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] == 6

    chat = run_job(job_api, {"messages": [{"role": "user", "content": "Hi"}],
                             "sampling_params": {"max_tokens": 4, "ignore_eos": True}})
    [answer] = chat.done["output"]
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] == 4

    stream = run_job(job_api, {"prompt": "Count", "stream": True,
                               "sampling_params": {"max_tokens": 5, "ignore_eos": True}})
    text = "".join(stream.outputs)
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 5

    tokens = run_job(job_api, {"route": "/tokenize", "body": {"prompt": "Hello world"}})
    [tokenized] = tokens.done["output"]
    assert tokenized["count"] == len(tokenized["tokens"]) > 0


def test_the_flag_catalog_is_the_baked_file_and_nothing_is_dumped_at_start(
    serverless: Running,
) -> None:
    log = serverless.container.log()
    catalog_lines = [line for line in log.splitlines() if "flag catalog" in line]
    assert any(BAKED_CATALOG_LINE in line for line in catalog_lines), (
        "the worker did not load the catalog baked at /opt/worker/vllm-flags.json; its catalog "
        f"lines: {catalog_lines}")
    assert "dumped by" not in log and "could not dump" not in log, catalog_lines


def test_a_runtime_hf_token_is_in_no_argv_and_no_log_line(serverless: Running) -> None:
    [vllm_pid] = serverless.container.vllm_pids()
    environ = Path(f"/proc/{vllm_pid}/environ").read_bytes().split(b"\0")
    assert f"HF_TOKEN={RUNTIME_TOKEN}".encode() in environ, "the token did not reach vLLM"
    assert RUNTIME_TOKEN not in every_cmdline(), "HF_TOKEN's value is in a process's argv"
    assert RUNTIME_TOKEN not in serverless.container.log(), "HF_TOKEN's value is in the log"
    # The store's secret key too: in vLLM's environment, in no argv and no log line.
    assert f"AWS_SECRET_ACCESS_KEY={SECRET_ACCESS_KEY}".encode() in environ
    assert SECRET_ACCESS_KEY not in every_cmdline() + serverless.container.log()


def test_the_build_added_the_streamer_and_the_model_streamed_from_the_bucket(
    serverless: Running, option1: Build, bucket: FakeS3, tiny_model: Path,
) -> None:
    # The stand-in base has no runai_model_streamer (install_vllm_cpu.sh installs vLLM alone):
    # the Dockerfile installed vLLM's runai extra, and the worker streamed the model with it.
    assert "installing vLLM's runai extra: runai-model-streamer" in option1.log
    log = serverless.container.log()
    assert "model s3://models/tiny: streamed from http://127.0.0.1:" in log, log[-3000:]
    assert "Loading safetensors using Runai Model Streamer" in log, log[-3000:]
    assert bucket.bytes_read > (tiny_model / "model.safetensors").stat().st_size


def test_local_mode_serves_the_readmes_runsync_call(
    containers: Containers, option1: Build, tiny_model: Path, tmp_path: Path
) -> None:
    api_port = free_port()
    [local_call] = [c for c in curl_commands() if "http://127.0.0.1:8000/runsync" in c]
    running = containers.start(option1.tag, {"WORKER_MODE": "local", "PORT": str(api_port),
                                             "MODEL_NAME": MODEL_IN_CONTAINER,
                                             "HF_HUB_OFFLINE": "1"},
                               tmp_path / "local.log", mounts=[(tiny_model, MODEL_IN_CONTAINER)])
    try:
        running.container.wait_for_log("local API listening on", timeout=START_TIMEOUT)
        command = local_call.replace("127.0.0.1:8000", f"127.0.0.1:{api_port}")
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                              timeout=120, check=True)
        result = json.loads(done.stdout)
        assert result["status"] == "COMPLETED", result
        assert result["output"][0]["usage"]["completion_tokens"] > 0, result
    finally:
        running.container.kill()


def http_json(url: str, body: dict[str, Any] | None = None,
              key: str | None = None) -> tuple[int, Any]:
    """The status and JSON answer of a GET (or, with ``body``, a POST), an HTTP error's too."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        return error.code, None


def wait_http(url: str, container: Container, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if container.proc.poll() is not None:
            raise AssertionError(f"the container exited ({container.proc.returncode}):\n"
                                 + container.log()[-3000:])
        try:
            if http_json(url)[0] == 200:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout} s:\n" + container.log()[-3000:])


def test_http_mode_is_vllms_own_server_and_requires_its_key(
    containers: Containers, option1: Build, tiny_model: Path, tmp_path: Path
) -> None:
    """A plain pod (no WORKER_MODE and no Runpod job environment: the worker picks http mode
    itself) serves vLLM's own API on $PORT; with VLLM_API_KEY, vLLM refuses a request without
    the key (the worker's warning when there is none is tests/test_main.py's), and the key is in
    no log line."""
    port = free_port()
    env = {"PORT": str(port), "MODEL_NAME": MODEL_IN_CONTAINER, "HF_HUB_OFFLINE": "1",
           "VLLM_API_KEY": POD_KEY}
    running = containers.start(option1.tag, env, tmp_path / "http.log",
                               mounts=[(tiny_model, MODEL_IN_CONTAINER)])
    base = f"http://127.0.0.1:{port}"
    chat_body = {"model": MODEL_IN_CONTAINER, "messages": [{"role": "user", "content": "Hi"}],
                 "max_tokens": 3, "ignore_eos": True}
    try:
        wait_http(base + HTTP_HEALTH, running.container)
        status, models = http_json(base + "/v1/models", key=POD_KEY)
        assert status == 200 and models["data"][0]["id"] == MODEL_IN_CONTAINER, models
        status, chat = http_json(base + "/v1/chat/completions", chat_body, key=POD_KEY)
        assert status == 200 and chat["usage"]["completion_tokens"] == 3, chat
        assert http_json(base + HTTP_HEALTH)[0] == 200
        assert http_json(base + "/v1/models")[0] == 401
        assert http_json(base + "/v1/chat/completions", chat_body)[0] == 401
        log = running.container.log()
        assert "VLLM_API_KEY is not set" not in log
        assert POD_KEY not in log
    finally:
        running.container.kill()


# -- Option 2: the model inside ----------------------------------------------------------------
def test_option2_serves_the_baked_model_offline_in_lb_mode(
    containers: Containers, option2: Build, hub: FakeHub, tmp_path: Path
) -> None:
    """Option 2 as a load-balancing endpoint runs it: vLLM's own API on $PORT, health on
    /ping. The container's HF_ENDPOINT is the stand-in, which counts every request; no
    MODEL_NAME and no HF_HUB_OFFLINE: the image's /local_model_args.json must suffice."""
    mark = hub.count()
    port = free_port()
    running = containers.start(option2.tag, {"WORKER_MODE": "lb", "PORT": str(port)},
                               tmp_path / "option2.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + LB_HEALTH, running.container)
        status, models = http_json(base + "/v1/models")
        assert status == 200, models
        [model] = [entry["id"] for entry in models["data"]]
        status, chat = http_json(base + "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "ignore_eos": True})
        assert status == 200 and chat["usage"]["completion_tokens"] == 3, chat
        assert http_json(base + LB_HEALTH)[0] == 200
        launch = next(line for line in running.container.log().splitlines()
                      if "launching:" in line)
        assert f"/models/models--acme--tiny-gated/snapshots/{hub.commit}" in launch, launch
    finally:
        running.container.kill()
    assert hub.since(mark) == [], "the worker or vLLM asked the Hub at start"


def test_option2_a_diagnosed_start_failure_answers_jobs(
    containers: Containers, option2: Build, job_api: FakeJobApi, tmp_path: Path
) -> None:
    running = containers.start(option2.tag, {**job_api.env("option2-bad"),
                                             "MAX_MODEL_LEN": "100000"},
                               tmp_path / "option2-bad.log")
    try:
        record = job_api.wait_done(job_api.submit({"prompt": "Hi"}), timeout=START_TIMEOUT)
        assert record.error is not None, record.done
        assert record.error["type"] == "startup_error", record.error
        assert record.error["kind"] == "max_model_len_too_large", record.error
        assert "MAX_MODEL_LEN" in record.error["message"]
    finally:
        running.container.kill()


def layers_text(folders: list[Path]) -> bytes:
    """Everything a layer's tar would carry of the files in ``folders``: each path, each
    regular file's bytes, each link's target, concatenated."""
    parts = []
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            parts.append(str(path.relative_to(folder)).encode())
            if path.is_symlink():
                parts.append(os.readlink(path).encode())
            elif path.is_file():
                parts.append(path.read_bytes())
    return b"\n".join(parts)


def test_the_build_secret_is_in_no_layer_config_history_or_build_log(
    bed: ImageBed, base_tags: list[str], option2: Build, hub: FakeHub
) -> None:
    used = [r for r in hub.requests if r.token == BUILD_TOKEN and "/resolve/" in r.path]
    assert used, "the build never used the secret: the stand-in Hub saw no authorized download"
    base_layers = set(bed.inspect(base_tags[0])["OCIv1"]["rootfs"]["diff_ids"])
    image_layers = bed.inspect(option2.tag)["OCIv1"]["rootfs"]["diff_ids"]
    assert base_layers and base_layers < set(image_layers), "the image is not over the base"
    # The build's own layers (the base's were made before the build had any secret), read
    # in the storage; the config, the history and the manifest are what inspect shows.
    own = [diff_id for diff_id in image_layers if diff_id not in base_layers]
    blobs = layers_text(bed.layer_folders(own))
    inspected = json.dumps(bed.inspect(option2.tag))
    # The scan sees what the layers and the history hold: the baked snapshot and the build's
    # arguments are there.
    assert hub.commit.encode() in blobs
    assert hub.url in inspected
    secret = BUILD_TOKEN.encode()
    assert secret not in blobs, "the build secret is in a layer, the config or the manifest"
    assert BUILD_TOKEN not in inspected, "the build secret is in the image's config or history"
    assert BUILD_TOKEN not in option2.log, "the build secret is in the build log"


# -- VLLM_VERSION, and the builders people have ------------------------------------------------
@pytest.mark.parametrize("suite", BUILDERS)
@pytest.mark.parametrize(("version", "exists"), [("latest", True), (PACKAGED_VERSION, False)])
def test_vllm_version_is_the_tag_as_written(
    suite: str, version: str, exists: bool, bed: ImageBed, option1: Build, old_builder: str,
    build_dir: Path
) -> None:
    """The build log's FROM line is the resolved name. The stand-in has v0.32.0 (Option 1's
    default) and latest only, as Docker Hub's official tags carry their "v": 0.32.0 fails, the
    missing tag named in the log. Steps come from the layer cache: the same base and sources."""
    tag = f"vllm-{version}-{suite}"
    if exists:
        build = built(bed, build_dir, tag, build_args={"VLLM_VERSION": version}, suite=suite)
    else:
        build = bed.build(f"{IMAGE}:{tag}", build_dir / f"{tag}.log", suite=suite,
                          build_args={"VLLM_VERSION": version})
        assert build.returncode != 0, build.log[-2000:]
    assert f"FROM vllm/vllm-openai:{version}\n" in build.log, build.log[:500]
    assert (f"vllm/vllm-openai:{version}" in build.failure()) != exists, build.failure()


def test_the_stand_in_has_no_tag_a_wrong_resolution_could_hit(
    bed: ImageBed, base_tags: list[str]
) -> None:
    for wrong in (PACKAGED_VERSION, f"vv{PACKAGED_VERSION}"):
        found = bed.run("buildah", "inspect", "--type", "image",
                        f"docker.io/vllm/vllm-openai:{wrong}", check=False)
        assert found.returncode != 0, f"the stand-in has a tag {wrong}"


#: What of an image's config the two builders must agree on.
CONFIG_KEYS = ("Entrypoint", "Cmd", "Env", "WorkingDir", "ExposedPorts")


def test_debian_12s_buildah_builds_the_dockerfile_alike(
    bed: ImageBed, option2: Build, old_builder: str, hub: FakeHub, build_dir: Path
) -> None:
    """buildah 1.28 refused the Dockerfile of ${VAR#pattern} tags before building anything.
    Option 2 runs every step of the Dockerfile (Option 1's, then the model's download), each
    run here (no layer cache: 1.39's layers would stand in for the steps); Option 1 is the same
    steps with the download's condition false."""
    old2 = build_option2(bed, hub, build_dir, "option2-old", suite=old_builder, cache=False)
    assert "Using cache" not in old2.log
    for build in (option2, old2):  # the default VLLM_VERSION
        assert f"FROM vllm/vllm-openai:v{PACKAGED_VERSION}\n" in build.log, build.log[:500]
    configs = [bed.inspect(b.tag)["OCIv1"]["config"] for b in (option2, old2)]
    assert [{k: c.get(k) for k in CONFIG_KEYS} for c in configs] == \
        [{k: configs[0].get(k) for k in CONFIG_KEYS}] * 2
    catalogs = [bed.file_of(b.tag, "/opt/worker/vllm-flags.json") for b in (option2, old2)]
    assert catalogs[0] == catalogs[1] and json.loads(catalogs[0])["flags"]
    # The Dockerfile's catalog step, run by the image's vLLM, wrote the catalog the worker
    # ships for that version (worker/config/catalogs/).
    (build_dir / "shipped.json").write_text(catalogs[0])
    shipped, packaged = (FlagCatalog.load(path) for path in (build_dir / "shipped.json",
                                                             packaged_catalog_path()))
    assert shipped.version.split("+")[0] == PACKAGED_VERSION
    assert shipped.flags == packaged.flags
    assert shipped.request_fields == packaged.request_fields is not None
    baked = json.loads(bed.file_of(old2.tag, "/local_model_args.json"))
    assert baked["MODEL_NAME"].endswith(f"/models--acme--tiny-gated/snapshots/{hub.commit}")
    assert BUILD_TOKEN not in json.dumps(bed.inspect(old2.tag)), "the secret is in the config"
    assert BUILD_TOKEN not in old2.log, "the build secret is in the build log"


# -- a broken Dockerfile -----------------------------------------------------------------------
def test_a_copy_of_a_missing_file_fails_the_build_naming_it(
    bed: ImageBed, base_tags: list[str], build_dir: Path
) -> None:
    broken = build_dir / "Dockerfile.broken"
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY --chmod=755 start.sh /start.sh" in text
    broken.write_text(text.replace("COPY --chmod=755 start.sh", "COPY --chmod=755 strat.sh"))
    build = bed.build(f"{IMAGE}:broken", build_dir / "broken.log", dockerfile=broken)
    assert build.returncode != 0
    assert "strat.sh" in build.failure(), build.failure()
