"""Names that set no flag (:mod:`worker.config.names`): the typo rule, measured, and the speculative
warning.

The typo rule must catch real typos and stay silent on every name an image, the platform or
the suite puts in the environment: a false "did you mean" would be noise on every worker.
Both sets are measured here, the second from the installed runpod SDK and huggingface_hub,
this repository's Dockerfile, tests/data/platform_env.txt and (marked ``vllm``) vLLM's own
variables.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import subprocess
from pathlib import Path

import huggingface_hub
import pytest
import runpod

from tests.fake_job_api import FakeJobApi
from tests.tiny_model import tiny_env
from tests.worker_process import base_env
from worker.config.command import _typo_targets, build_command
from worker.config.flags import FlagCatalog, env_name, packaged_catalog_path
from worker.config.names import (
    EARLIER_NAMES,
    FOREIGN_PREFIXES,
    MIN_SLIP_LENGTH,
    RETIRED,
    SLIP_RATIO,
    SPECULATIVE_PARTS,
    probable_name,
    speculative_config_hint,
)
from worker.config.settings import WORKER_SETTING_NAMES
from worker.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def catalog() -> FlagCatalog:
    return FlagCatalog.load(packaged_catalog_path())


@pytest.fixture(scope="module")
def known(catalog: FlagCatalog) -> frozenset[str]:
    return _typo_targets(catalog)


# -- real typos ----------------------------------------------------------------------------
TYPOS = {
    "MAX_MODEL_LENGTH": "MAX_MODEL_LEN",
    "MAX_MODEL_LENGHT": "MAX_MODEL_LEN",
    "MAX_MODEL_LENTH": "MAX_MODEL_LEN",
    "MAXMODELLEN": "MAX_MODEL_LEN",
    "max_model_len": "MAX_MODEL_LEN",
    "Max-Model-Len": "MAX_MODEL_LEN",
    "GPU_MEMORY_UTILISATION": "GPU_MEMORY_UTILIZATION",
    "GPU_MEMORY_UTILIZATON": "GPU_MEMORY_UTILIZATION",
    "GPU_MEM_UTILIZATION": "GPU_MEMORY_UTILIZATION",
    "TENSOR_PARALLEL": "TENSOR_PARALLEL_SIZE",
    "TENSOR_PARALELL_SIZE": "TENSOR_PARALLEL_SIZE",
    "PIPELINE_PARALLEL": "PIPELINE_PARALLEL_SIZE",
    "ENFORCE_EAGAR": "ENFORCE_EAGER",
    "ENFORCE_EAGER_MODE": "ENFORCE_EAGER",
    "ENABLE_PREFIX_CACHE": "ENABLE_PREFIX_CACHING",
    "ENABLE_CHUNKED_PREFIL": "ENABLE_CHUNKED_PREFILL",
    "ENABLE_EXPERT_PARALLELISM": "ENABLE_EXPERT_PARALLEL",
    "ENABLE_AUTO_TOOL": "ENABLE_AUTO_TOOL_CHOICE",
    "TOOL_CALL_PARSERS": "TOOL_CALL_PARSER",
    "REASONING_PARSERS": "REASONING_PARSER",
    "TRUST_REMOTE_CODES": "TRUST_REMOTE_CODE",
    "TRUST_REMOTE": "TRUST_REMOTE_CODE",
    "MAX_NUM_SEQ": "MAX_NUM_SEQS",
    "MAX_NUM_BATCHED_TOKEN": "MAX_NUM_BATCHED_TOKENS",
    "QUANTISATION": "QUANTIZATION",
    "KV_CACHE_TYPE": "KV_CACHE_DTYPE",
    "SERVED_MODEL": "SERVED_MODEL_NAME",
    "CHAT_TEMPLATES": "CHAT_TEMPLATE",
    "LORA_MODULE": "LORA_MODULES",
    "ENABLE_LORAS": "ENABLE_LORA",
    "MAX_LORA": "MAX_LORAS",
    "MODEL_NAMES": "MODEL_NAME",
    "MODELNAME": "MODEL_NAME",
    "TOKENISER_NAME": "TOKENIZER_NAME",
    "MAX_CONCURENCY": "MAX_CONCURRENCY",
    "DEFAULT_BATCHSIZE": "DEFAULT_BATCH_SIZE",
    "REQUEST_TIMEOUTS": "REQUEST_TIMEOUT",
}


@pytest.mark.parametrize(("typo", "meant"), TYPOS.items())
def test_a_real_typo_names_what_it_meant(typo: str, meant: str, known: frozenset[str]) -> None:
    assert probable_name(typo, known) == meant


@pytest.mark.parametrize("name", [
    "DTYPES",  # one letter from a name shorter than MIN_SLIP_LENGTH: too likely another's
    "MAX_TOKENS",  # a sampling parameter, not a typo of DEFAULT_MAX_TOKENS
    "VLLM_EXTRA_ARG",  # VLLM_*: vLLM itself warns about a name it does not know
    "MAX",
    "X",
])
def test_what_the_rule_leaves_alone(name: str, known: frozenset[str]) -> None:
    assert probable_name(name, known) is None


def test_the_typos_clear_the_threshold_and_the_platform_stays_below_it(
    known: frozenset[str],
) -> None:
    """The measurement behind SLIP_RATIO: the weakest character slip of TYPOS is above it
    with room, the closest name of the environments measured below it."""
    def key(name: str) -> str:
        return re.sub(r"[^A-Z0-9]", "_", name.upper())

    def ratio(name: str) -> float:
        matcher = difflib.SequenceMatcher()
        matcher.set_seq2(key(name))  # difflib caches what it learns of the second sequence
        best = 0.0
        for k in known:
            if len(k) >= MIN_SLIP_LENGTH and k != key(name):
                matcher.set_seq1(k)  # the quick ratios are upper bounds of the ratio
                if matcher.real_quick_ratio() > best and matcher.quick_ratio() > best:
                    best = max(best, matcher.ratio())
        return best

    # the character slips: not a case slip, not a word left out or added
    slips = {t: ratio(t) for t, m in TYPOS.items()
             if key(t) != m and not m.startswith(key(t) + "_")
             and not key(t).startswith(m + "_")}
    closest = max(ratio(n) for n in platform_names() if not n.upper().startswith(
        FOREIGN_PREFIXES) and n.upper() not in known)
    print(f"weakest typo {min(slips.values()):.3f}, closest platform name {closest:.3f}, "
          f"threshold {SLIP_RATIO}")
    assert closest < SLIP_RATIO <= min(slips.values())


# -- the environments no typo may come from ------------------------------------------------
def _names_in(text: str, pattern: str) -> set[str]:
    return set(re.findall(pattern, text))


def dockerfile_env_names() -> set[str]:
    """The names this repository's Dockerfile sets with ENV (with continuation lines)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    names: set[str] = set()
    for line in text.splitlines():
        if line.strip().startswith("ENV "):
            names |= _names_in(line, r"([A-Za-z_][A-Za-z0-9_]*)=")
    return names


def package_names(package: Path, pattern: str) -> set[str]:
    return {name for path in package.rglob("*.py")
            for name in _names_in(path.read_text(errors="replace"), pattern)}


@functools.cache
def platform_names() -> frozenset[str]:
    """Every name measured: the data file, the installed runpod SDK's RUNPOD_* and
    huggingface_hub's HF_*, the Dockerfile, this process and the suite's workers."""
    listed = {word for line in (ROOT / "tests/data/platform_env.txt").read_text().splitlines()
              if not line.startswith("#") for word in line.split()}
    sdk = package_names(Path(runpod.__file__).parent, r"[\"'](RUNPOD_[A-Z0-9_]+)[\"']")
    hub = package_names(Path(huggingface_hub.__file__).parent, r"[\"'](HF_[A-Z0-9_]+)[\"']")
    suite = set(base_env()) | set(os.environ) | set(_job_api_env())
    suite |= set(tiny_env("vllm", ROOT, {"TMPDIR": "/tmp"}))
    return frozenset(listed | sdk | hub | dockerfile_env_names() | suite)


def _job_api_env() -> dict[str, str]:
    with FakeJobApi() as api:
        return api.env()


def test_the_measured_environments_are_what_they_claim() -> None:
    names = platform_names()
    assert {"RUNPOD_WEBHOOK_GET_JOB", "RUNPOD_POD_ID", "RUNPOD_PING_INTERVAL"} <= names  # SDK
    assert {"HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_HUB_CACHE"} <= names  # huggingface_hub
    assert {"WORKER_PYTHON", "TOKENIZERS_PARALLELISM"} <= dockerfile_env_names()
    assert len(names) > 200


def test_no_name_of_an_image_the_platform_or_the_suite_is_taken_for_a_typo(
    known: frozenset[str],
) -> None:
    suggested = {name: probable_name(name, known) for name in sorted(platform_names())
                 if name.upper() not in known}
    assert {name: meant for name, meant in suggested.items() if meant} == {}


def test_no_name_a_typo_may_mean_lies_in_another_programs_namespace(
    known: frozenset[str],
) -> None:
    """But the worker's VLLM_* settings: a typo of one is vLLM's to warn about."""
    foreign = {k for k in known if k.startswith(FOREIGN_PREFIXES)}
    assert foreign and foreign <= WORKER_SETTING_NAMES


def test_no_name_the_worker_handles_gets_a_guess(catalog: FlagCatalog) -> None:
    """Every flag variable (each long option, ``NO_X`` included), retired and earlier name,
    set on its own, is a flag or its own warning: never a "did you mean"."""
    names = {env_name(option) for flag in catalog for option in flag.option_strings
             if option.startswith("--")} | set(RETIRED) | set(EARLIER_NAMES)
    guessed, built, refused = [], 0, []
    for name in sorted(names):
        try:
            command = build_command({"MODEL_NAME": "m", name: "1"}, catalog,
                                    file_exists=lambda path: False)
        except ConfigError as error:  # a value the flag refuses: it was read as the flag
            refused.append(error.message)
            assert error.message.startswith(f"{name}="), error.message
            continue
        built += 1
        guessed += [w for w in command.warnings if "did you mean" in w]
    assert guessed == []
    # "1" is a value most flags take: the check above ran on most names, not on none.
    assert built > len(names) // 2, refused


@pytest.mark.vllm
@pytest.mark.vllm_tools
def test_no_variable_of_vllm_is_taken_for_a_typo(vllm_python: str, known: frozenset[str]) -> None:
    script = "import json, vllm.envs; print(json.dumps(sorted(vllm.envs.environment_variables)))"
    done = subprocess.run([vllm_python, "-c", script], capture_output=True, text=True,
                          timeout=300, check=True)
    names = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(names) > 100
    assert {n: probable_name(n, known) for n in names if probable_name(n, known)} == {}


# -- the earlier speculative variables -------------------------------------------------------
ALL_IGNORED = list(SPECULATIVE_PARTS)


@pytest.mark.parametrize(("env", "expected"), [
    ({"SPECULATIVE_METHOD": "ngram", "NUM_SPECULATIVE_TOKENS": "4",
      "NGRAM_PROMPT_LOOKUP_MAX": "4", "NGRAM_PROMPT_LOOKUP_MIN": "1"},
     {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
      "prompt_lookup_min": 1}),
    # lookup sizes without a method or a model: ngram, as the earlier worker decided
    ({"NGRAM_PROMPT_LOOKUP_MAX": "3", "NUM_SPECULATIVE_TOKENS": "2"},
     {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
    ({"SPECULATIVE_MODEL": "org/draft", "NUM_SPECULATIVE_TOKENS": "5",
      "SPECULATIVE_DRAFT_TENSOR_PARALLEL_SIZE": "1", "SPECULATIVE_MAX_MODEL_LEN": "2048",
      "SPECULATIVE_ENFORCE_EAGER": "true", "SPECULATIVE_MODEL_REVISION": "main"},
     {"model": "org/draft", "num_speculative_tokens": 5, "draft_tensor_parallel_size": 1,
      "max_model_len": 2048, "revision": "main", "enforce_eager": True}),
    # 0 was the earlier form's "unset" for these
    ({"SPECULATIVE_METHOD": "eagle3", "NUM_SPECULATIVE_TOKENS": "0"}, {"method": "eagle3"}),
])
def test_the_speculative_variables_become_one_speculative_config(
    env: dict[str, str], expected: dict[str, object]
) -> None:
    hint = speculative_config_hint(env, ALL_IGNORED, "0.32.0")
    assert hint is not None
    assert all(var in hint for var in env) and "vLLM 0.32.0 has no such" in hint
    written = re.search(r"SPECULATIVE_CONFIG='(.*)' instead$", hint)
    assert written is not None, hint
    assert json.loads(written[1]) == expected


def test_a_speculative_config_wins_over_them_as_before() -> None:
    hint = speculative_config_hint(
        {"SPECULATIVE_CONFIG": '{"method": "ngram"}', "NGRAM_PROMPT_LOOKUP_MAX": "4"},
        ALL_IGNORED, "0.32.0")
    assert hint == ('NGRAM_PROMPT_LOOKUP_MAX is ignored: SPECULATIVE_CONFIG is set and wins '
                    '(as in the earlier worker); put it into it as "prompt_lookup_max"')


@pytest.mark.parametrize(("env", "ignored", "expected"), [
    ({}, ALL_IGNORED, None),
    ({"NGRAM_PROMPT_LOOKUP_MAX": " "}, ALL_IGNORED, None),  # empty is unset
    ({"NGRAM_PROMPT_LOOKUP_MAX": "4"}, [], None),  # a vLLM that has the flag again
    ({"NUM_SPECULATIVE_TOKENS": "0", "NGRAM_PROMPT_LOOKUP_MIN": "0"}, ALL_IGNORED,
     "NGRAM_PROMPT_LOOKUP_MIN and NUM_SPECULATIVE_TOKENS are ignored: 0 meant unset in the "
     "earlier worker; remove them"),
])
def test_when_there_is_nothing_to_write(
    env: dict[str, str], ignored: list[str], expected: str | None
) -> None:
    assert speculative_config_hint(env, ignored, "0.32.0") == expected


def test_a_value_with_a_quote_is_shell_quoted() -> None:
    hint = speculative_config_hint({"SPECULATIVE_MODEL": "it's"}, ALL_IGNORED, "0.32.0")
    assert hint is not None
    assert hint.endswith("""SPECULATIVE_CONFIG='{"model": "it'"'"'s"}' instead""")
    script = hint.split("set ", 1)[1].removesuffix(" instead")
    done = subprocess.run(["bash", "-c", f"{script}; printf %s \"$SPECULATIVE_CONFIG\""],
                          capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == {"model": "it's"}
