"""The words of the diagnosis: one explanation (cause, fix) per kind of failed start.

Each ``explain_*`` function turns a matched root error into what happened, in vLLM's words
(quoted, shortened), and what the user should set, named as they set it: the variable, the
``VLLM_EXTRA_ARGS`` entry or the config-file key, read from the command's typed sources.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from worker.config.command import ALIASES
from worker.config.flags import env_name
from worker.config.resolved import Launch, VllmCommand
from worker.model.messages import (
    gated_message,
    invalid_token_message,
    not_found_message,
    repo_page,
    revision_not_found_message,
)
from worker.start.diagnosis.logread import Raised


@dataclass(frozen=True)
class Context:
    """What an explanation may read: the start (command, environment facts) and the chain."""

    launch: Launch
    chain: tuple[Raised, ...]

    @property
    def command(self) -> VllmCommand:
        return self.launch.command


_DEFAULT_VARIABLE = {flag: variable for variable, flag in ALIASES.items()}
_QUOTE_LIMIT = 260


def _variable(flag: str, context: Context) -> str:
    """How the user sets ``flag``: the variable (or file, or VLLM_EXTRA_ARGS) that set it."""
    return context.command.setting_of(flag) or _DEFAULT_VARIABLE.get(flag, env_name(flag))


def _assign(flag: str, value: str, context: Context) -> str:
    """``ENFORCE_EAGER=true``, or the flag with its value where the user wrote the flag."""
    source = context.command.source(flag)
    assignment = source.assignment(flag, value) if source is not None else None
    return assignment or f"{_variable(flag, context)}={value}"


def _came_from(flag: str, context: Context) -> str:
    """``--foo came from VLLM_EXTRA_ARGS``: where to look for the value vLLM rejected."""
    source = context.command.source(flag)
    if source is None:
        return (
            f"{flag} was set by none of the worker's variables (check VLLM_EXTRA_ARGS and "
            "the config file)"
        )
    return f"{flag} came from {source}"


def quote(text: str, limit: int = _QUOTE_LIMIT) -> str:
    """vLLM's message, shortened at a word boundary: the user reads the gist, the log the rest."""
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) <= limit:
        return text
    return text[: text.rfind(" ", 0, limit)].rstrip(",;:") + " …"


def full_stop(text: str) -> str:
    """``text`` ending with a full stop (or the mark it already ends with)."""
    return text if text.endswith((".", "!", "?", "…")) else f"{text}."


def _sentences(text: str, count: int) -> str:
    """The first ``count`` sentences (vLLM's messages put the facts first, advice after),
    less a list's opening cut after its first number (``Please verify the following
    requirements: 1.``)."""
    ends = [m.end() for m in re.finditer(r"(?<!')[.!?](?=\s+[A-Z(`'\"]|$)|(?=\n)", text)]
    first = text[: ends[count - 1]] if len(ends) >= count else text
    return _LIST_OPENING.sub("", first) or first


_LIST_OPENING = re.compile(r"\s*[^.!?]*:\s*1\.$")


def _is_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~"))


_REPO_PATTERNS = (
    re.compile(r"'namespace/repo_name': '(?P<repo>[^']+)'"),
    re.compile(r"(?:maximum length is 96|in repo_id|cannot end by '\.git'): '(?P<repo>[^']+)'"),
    re.compile(r"Invalid repository ID or local directory specified: '(?P<repo>[^']+)'"),
    re.compile(r"(?P<repo>\S+) is not a local folder (?:and is not a valid model|or a valid repo)"),
    re.compile(r"Access to model (?P<repo>\S+?) is restricted"),
    re.compile(r"(?P<repo>\S+) is a gated repository"),
    re.compile(r"have access to it at https://huggingface\.co/(?P<repo>\S+?)\.?(?=\s|$)"),
    re.compile(r"The repository (?P<repo>\S+) (?:contains|references) custom code"),
    re.compile(r"Check the model page at 'https://huggingface\.co/(?P<repo>[^']+)'"),
    re.compile(r"(?P<repo>\S+) does not appear to have a file named"),
    re.compile(
        r"huggingface\.co/(?:api/models/)?(?P<repo>[^/\s']+(?:/[^/\s']+)?)/(?:resolve|revision|tree)/"
    ),
)


def _failing_repo(context: Context) -> str | None:
    """The repo id (or path) the root error and its causes name, first found."""
    for raised in context.chain:
        for pattern in _REPO_PATTERNS:
            if match := pattern.search(raised.message):
                return match["repo"]
    return None


def _repo_variable(repo: str | None, context: Context) -> str:
    """The variable that named the failing repo: the tokenizer's when it is the tokenizer."""
    tokenizer = context.command.tokenizer
    if tokenizer and repo == tokenizer:
        return _variable("--tokenizer", context)
    return _variable("--model", context)


# -- explanations, one per kind of failure -------------------------------------------------
def _smaller_footprint(context: Context) -> str:
    """The settings that shrink what vLLM needs besides the KV cache, named as the user set them."""
    return (
        f"lower {_variable('--max-num-seqs', context)}, set "
        f"{_assign('--enforce-eager', 'true', context)}, use a quantized checkpoint or more GPUs "
        f"({_variable('--tensor-parallel-size', context)})"
    )


def explain_cuda_oom(match: re.Match[str], raised: Raised, context: Context) -> tuple[str, str]:
    total = match.groupdict().get("total")
    cause = f"vLLM ran out of GPU memory: {quote(_sentences(raised.message, 3 if total else 1))}"
    space = f" in the GPU's {total}" if total else ""
    fix = (
        f"Make the model and its buffers fit{space}: "
        f"lower {_variable('--max-model-len', context)}, {_smaller_footprint(context)}, or lower "
        f"{_variable('--gpu-memory-utilization', context)} (e.g. 0.85) to leave headroom."
    )
    return cause, fix


def explain_oom_loading(
    match: re.Match[str], raised: Raised, context: Context
) -> tuple[str, str]:
    total = match.groupdict().get("total")
    space = f" ({total})" if total else ""
    cause = f"The model's weights do not fit in GPU memory: {quote(_sentences(raised.message, 3))}"
    fix = (
        f"Use a quantized checkpoint (AWQ, GPTQ, FP8) in {_variable('--model', context)}, "
        f"spread the model over more GPUs ({_variable('--tensor-parallel-size', context)}), "
        f"or choose a GPU with more memory than this one{space}."
    )
    return cause, fix


def explain_kv_too_small(
    match: re.Match[str], raised: Raised, context: Context
) -> tuple[str, str]:
    max_len = _variable("--max-model-len", context)
    groups = match.groupdict()
    if groups.get("max_len"):
        sentences = 2 if groups.get("estimated") else 1
        cause = (
            "The KV cache cannot hold one request of the maximum length: "
            f"{quote(_sentences(raised.message, sentences))}"
        )
        if groups.get("estimated"):
            first = f"set {_assign('--max-model-len', groups['estimated'], context)} or lower"
        else:
            first = f"lower {max_len}"
    else:
        cause = f"vLLM has no memory left for the KV cache: {quote(_sentences(raised.message, 1))}"
        first = f"lower {max_len}"
    if _explicit_kv_cache(context):
        knobs = (
            f"{first}, or give the KV cache more memory "
            f"({_variable('--kv-cache-memory-bytes', context)} or VLLM_CPU_KVCACHE_SPACE)."
        )
    else:
        knobs = (
            f"{first}; or leave the KV cache more memory: raise "
            f"{_variable('--gpu-memory-utilization', context)} (e.g. 0.95), "
            f"{_smaller_footprint(context)}; on the CPU backend set VLLM_CPU_KVCACHE_SPACE (GiB) "
            "or KV_CACHE_MEMORY_BYTES."
        )
    return cause, knobs[0].upper() + knobs[1:]


def _explicit_kv_cache(context: Context) -> bool:
    """The user fixed the KV cache size: then that size, not the utilization, is the knob."""
    return bool(
        context.launch.cpu_kv_cache_space
        or "--kv-cache-memory-bytes" in context.command.flags
    )


def explain_memory_taken(
    match: re.Match[str], raised: Raised, context: Context
) -> tuple[str, str]:
    utilization = _variable("--gpu-memory-utilization", context)
    free, total = float(match["free"]), float(match["total"])
    share = math.floor(max(free / total - 0.05, 0.05) * 20) / 20 if total else 0.5
    reason = quote(_sentences(raised.message, 1))
    cause = f"Less memory is free than vLLM was told to reserve: {reason}"
    what = match["what_kv"] or match["what"]
    if what == "kv":
        fix = (
            f"Ask for a smaller KV cache ({_variable('--kv-cache-memory-bytes', context)} or "
            f"VLLM_CPU_KVCACHE_SPACE) or a smaller {utilization}, or stop other processes that "
            "use this memory."
        )
    elif what == "CPU":
        fix = (
            f"On the CPU backend {utilization} is the share of RAM vLLM reserves: set it to "
            f"{share:g} or lower (or size the KV cache with KV_CACHE_MEMORY_BYTES / "
            "VLLM_CPU_KVCACHE_SPACE), or stop other processes that use the memory."
        )
    else:
        fix = (
            "Another process holds GPU memory: set "
            f"{_assign('--gpu-memory-utilization', f'{share:g}', context)} or lower, or make "
            "sure nothing else runs on the GPU."
        )
    return cause, fix


def explain_max_model_len(
    match: re.Match[str], raised: Raised, context: Context
) -> tuple[str, str]:
    derived = int(float(match["derived"]))
    model_max = match["model_max"]
    if model_max not in (None, "None"):
        derived = max(derived, int(float(model_max)))
    variable = _variable("--max-model-len", context)
    cause = f"The model's context is shorter than requested: {quote(_sentences(match[0], 1))}"
    fix = (
        f"Set {variable} to {derived} or less (or leave it unset for the model's own maximum); "
        "only if the model really handles longer contexts (e.g. with RoPE scaling), set "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
    )
    return cause, fix


def explain_bad_flag(match: re.Match[str], raised: Raised, context: Context) -> tuple[str, str]:
    """argparse or a config validator rejected a value: quote it, say where the flag came from."""
    flags = _named_flags(raised, context, strict=raised.cls != "argparse" and not raised.fields)
    what = "command line" if raised.cls == "argparse" else "configuration"
    cause = f"vLLM rejected its {what}: {quote(raised.message)}"
    if not flags:
        if raised.cls != "argparse":
            return cause, ""
        return cause, (
            "Check the flags the worker passed: VLLM_EXTRA_ARGS, the config file and the "
            "variables named like flags."
        )
    flags = [flag for flag in flags if flag in context.command.flags] or flags  # the user's first
    unknown = "unrecognized arguments" in raised.message or "ambiguous option" in raised.message
    remedy = "remove it or correct its spelling" if unknown else "correct or remove its value"
    return cause, "; ".join(f"{_came_from(flag, context)}: {remedy}" for flag in flags) + "."


#: argparse names the option first; a hint may follow on later lines (``--task`` → ``--runner``).
_ARGPARSE_OPTION = re.compile(
    r"^(?:argument (?:-\w+/)*(?P<flag>--[\w-]+)|ambiguous option: (?P<ambiguous>--[\w-]+)"
    r"|unrecognized arguments: (?P<unknown>[^\n]*))"
)
_FLAG_IN_TEXT = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
_FIELD_IN_TEXT = re.compile(r"(?<![\w.-])`?([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`?")


def _named_flags(raised: Raised, context: Context, *, strict: bool) -> list[str]:
    """The flags a message names: ``--flag`` as is, ``snake_case`` fields as their flags.

    ``strict``: only fields the user set count (a validator's prose mentions many names).
    """
    if raised.cls == "argparse" and (option := _ARGPARSE_OPTION.match(raised.message)):
        named = option["flag"] or option["ambiguous"] or option["unknown"]
        return [flag.split("=", 1)[0] for flag in _FLAG_IN_TEXT.findall(named)]
    names = [flag.split("=", 1)[0] for flag in _FLAG_IN_TEXT.findall(raised.message)]
    fields = [*raised.fields, *(m[1] for m in _FIELD_IN_TEXT.finditer(raised.message))]
    for field in fields:
        flag = "--" + field.replace("_", "-")
        if flag in context.command.flags or (field in raised.fields and not strict):
            names.append(flag)
    return list(dict.fromkeys(names))


def explain_model_not_found(
    match: re.Match[str], raised: Raised, context: Context
) -> tuple[str, str]:
    repo = _failing_repo(context)
    variable = _repo_variable(repo, context)
    said = quote(_sentences(raised.message, 1))
    if repo is not None and _is_path(repo):
        missing = (
            "does not exist"
            if match["kind"] is not None
            else "does not exist or holds no config.json"
        )
        cause = f"The model path {repo} {missing} (vLLM: {said})."
        fix = (
            f"Set {variable} to a directory that holds the model's config.json and weights "
            "(e.g. on the network volume, /runpod-volume/...), or to a Hugging Face repo id "
            "such as Qwen/Qwen3-0.6B."
        )
        return cause, fix
    if match["no_config"] is not None:
        cause = f"{repo or 'The model'} has no config.json, which vLLM needs (vLLM: {said})."
        fix = (
            f"Set {variable} to a repo or directory in Hugging Face format (config.json and "
            "safetensors weights), not e.g. a GGUF-only repo."
        )
        return cause, fix
    fix = f"Check {variable} (namespace/name, e.g. Qwen/Qwen3-0.6B, spelled as on huggingface.co)"
    if repo is not None and match["kind"] is not None:
        return f"'{repo}' is not a valid Hugging Face repo id (vLLM: {said}).", f"{fix}."
    tokenizer = context.command.tokenizer
    message = not_found_message(
        repo,
        variable,
        role="tokenizer" if tokenizer and repo == tokenizer else "model",
        token_set=context.launch.hub.token is not None,
        evidence=f"vLLM: {said}",
    )
    return message.cause, message.fix


def explain_gated(match: re.Match[str], raised: Raised, context: Context) -> tuple[str, str]:
    repo = _failing_repo(context)
    reason = next(
        (m[0] for p in _GATED_REASONS for r in context.chain if (m := p.search(r.message))),
        _sentences(raised.message, 1),
    )
    tokenizer = context.command.tokenizer
    message = gated_message(
        repo,
        "tokenizer" if tokenizer and repo == tokenizer else "model",
        variable=_repo_variable(repo, context),
        token_set=context.launch.hub.token is not None,
        evidence=f"Hugging Face: {quote(reason)}",
    )
    return message.cause, message.fix


_GATED_REASONS = (
    re.compile(r"Access to model \S+ is restricted[^\n]*"),
    re.compile(r"403 Forbidden: [^\n]*"),
    re.compile(r"Cannot access gated repo for url \S+"),
)


def explain_invalid_token(
    match: re.Match[str], raised: Raised, context: Context
) -> tuple[str, str]:
    message = invalid_token_message(evidence=f"Hugging Face: {match[0]}")
    return message.cause, message.fix


def explain_revision(match: re.Match[str], raised: Raised, context: Context) -> tuple[str, str]:
    repo = _failing_repo(context)
    revision = match["revision"] or context.command.revision or "requested"
    tokenizer = context.command.tokenizer
    flag = "--tokenizer-revision" if tokenizer and repo == tokenizer else "--revision"
    message = revision_not_found_message(
        repo,
        revision,
        variable=_variable(flag, context),
        evidence=f"vLLM: {quote(_sentences(raised.message, 1))}",
    )
    return message.cause, message.fix


def explain_offline(match: re.Match[str], raised: Raised, context: Context) -> tuple[str, str]:
    repo = _failing_repo(context)
    variable = _repo_variable(repo, context)
    name = repo or context.command.model or f"the model in {variable}"
    cause = (
        f"Downloads from Hugging Face are disabled (HF_HUB_OFFLINE) and {name} is not in the "
        f"local cache (vLLM: {quote(_sentences(raised.message, 1))})."
    )
    fix = (
        f"Unset HF_HUB_OFFLINE so that vLLM can download it, or point {variable} to a local "
        "directory that holds the model, or put the model in the cache (BASE_PATH) first."
    )
    return cause, fix


def explain_architecture(
    match: re.Match[str], raised: Raised, context: Context
) -> tuple[str, str]:
    variable = _variable("--model", context)
    version = context.command.vllm_version
    this = f"This vLLM ({version})" if version else "This vLLM"
    if match["archs"] is not None:
        archs = ", ".join(re.findall(r"'([^']+)'", match["archs"])) or match["archs"]
        cause = f"{this} does not support the model's architecture {archs}."
    else:
        cause = f"{this} cannot run the model: {quote(_sentences(raised.message, 2))}"
    fix = (
        f"Choose a model whose architecture vLLM supports in {variable} "
        "(https://docs.vllm.ai/en/latest/models/supported_models.html) or a worker image with a "
        "newer vLLM (the build argument VLLM_VERSION: docs/versions.md); if the model ships "
        "its own modeling code, "
        f"{_assign('--trust-remote-code', 'true', context)} may let vLLM's Transformers backend "
        "load it."
    )
    return cause, fix


def explain_remote_code(
    match: re.Match[str], raised: Raised, context: Context
) -> tuple[str, str]:
    repo = _failing_repo(context)
    name = repo or "The model"
    cause = f"{name} contains custom code that must run to load it, which vLLM may not run."
    where = f" (read it at {repo_page(repo)})" if repo and not _is_path(repo) else ""
    fix = (
        f"If you trust the repository's code{where}, set "
        f"{_assign('--trust-remote-code', 'true', context)}."
    )
    return cause, fix


def explain_disk_full(match: re.Match[str], raised: Raised, context: Context) -> tuple[str, str]:
    where = f"BASE_PATH={context.launch.base_path}"
    cause = f"The disk is full: {quote(_sentences(raised.message, 1))}"
    fix = (
        "Give the worker more disk: a network volume large enough for the model (models are "
        f"cached under {where}) or a bigger container disk; or choose a smaller model."
    )
    return cause, fix


def explain_model_requirement(
    match: re.Match[str], raised: Raised, context: Context
) -> tuple[str, str]:
    source = raised.frames[-1].path.rsplit("/", 1)[-1]
    cause = f"The model's code in vLLM ({source}) rejects this setup: {quote(raised.message)}"
    flags = _named_flags(raised, context, strict=True)
    named = "".join(f" ({_came_from(flag, context)})" for flag in flags)
    fix = (
        f"Meet that requirement{named}: change the setting it names, use the hardware or "
        f"software it asks for, or serve another model in {_variable('--model', context)}."
    )
    return cause, fix

