"""Why `vllm serve` failed to start, and what the user should set: from the last lines it printed.

A failed start that the worker cannot explain is retried by the platform on another host, which
is right for a broken GPU and a waste of hours for a typo in ``MAX_MODEL_LEN``. So
:func:`diagnose` recognises the failures that no restart can fix and turns each into one
:class:`Diagnosis`: vLLM's own reason (quoted, shortened) and the environment variables to change.

It classifies the *root error* only: the last exception vLLM printed that is not one of its
"see root cause above" wrappers (or argparse's usage error), together with the exceptions that
traceback chains to. A "404" or "out of memory" in a warning 300 lines earlier must never decide
the answer, so nothing outside that traceback is read. Faults of the machine (CUDA, NCCL, NVML,
driver, network) are recognised only to answer None: another host may well succeed.

The recognised messages live in one table, :data:`_RULES`, whose patterns were copied from the
sources of vLLM 0.32, huggingface_hub and transformers (file references beside each rule).
Everything here is pure: no I/O, so every rule is tested with verbatim log tails.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from worker.command import ALIASES
from worker.preflight import (
    gated_message,
    invalid_token_message,
    not_found_message,
    revision_not_found_message,
)

__all__ = ["Diagnosis", "diagnose"]


@dataclass(frozen=True)
class Diagnosis:
    """A recognised start-up failure: what happened, in vLLM's words, and what to set.

    ``kind`` is a short stable id a client may branch on. ``recoverable_by_smaller_footprint``
    tells the supervisor that one relaunch with ``ENFORCE_EAGER=true`` and fewer batched
    tokens may succeed (true only when memory ran out while vLLM sized its buffers).
    """

    kind: str
    cause: str
    fix: str
    recoverable_by_smaller_footprint: bool = False

    @property
    def message(self) -> str:
        return f"{self.cause} Fix: {self.fix}"


_NO_SOURCES: Mapping[str, str] = MappingProxyType({})


def diagnose(
    log_tail: Sequence[str],
    exit_code: int | None,
    env: Mapping[str, str],
    flag_sources: Mapping[str, str] = _NO_SOURCES,
) -> Diagnosis | None:
    """The diagnosis of a failed start, or None when the failure is not one we recognise.

    ``log_tail`` holds vLLM's last output lines (stdout and stderr merged), ``exit_code`` its
    exit status (2: argparse rejected the command line), ``env`` the variables the command was
    built from and ``flag_sources`` where each flag came from (``{"--max-model-len": "env
    MAX_MODEL_LEN"}``), so that the fix names what the user actually set.
    """
    lines = _parse_lines(log_tail)
    chain = _root_chain(lines, exit_code)
    if not chain:
        return None
    context = _Context(env, flag_sources, chain)
    for rule in _RULES:
        if rule.env_condition is not None and not rule.env_condition(env):
            continue
        for raised in chain[:1] if rule.root_only else chain:
            match = rule.pattern.search(raised.text)
            if match is None or not _frames_match(rule, raised):
                continue
            if rule.explain is None:
                return None  # a fault of the machine or the network: a restart elsewhere may help
            cause, fix = rule.explain(match, raised, context)
            if not fix:
                continue  # the rule needs something the message lacks (e.g. a flag to name)
            return Diagnosis(rule.kind, _full_stop(cause), fix, rule.recoverable)
    return None


# -- reading the log -----------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: vLLM's prefixes: ``(EngineCore pid=12) ``, torch's ``[rank0]: `` and vLLM's log header
#: ``ERROR 11-30 12:00:01 [core.py:1510] `` (each line of a logged traceback carries it).
_PREFIX = re.compile(
    r"^(?:\[rank\d+\]:\s?)?"
    r"(?:\((?P<proc>[^()]*\bpid=\d+[^()]*)\) )?"
    r"(?:\[rank\d+\]:\s?)?"
    r"(?:(?P<header>(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\]) ?)?"
)
_QUIET_LEVELS = frozenset({"DEBUG", "INFO", "WARNING"})
#: An exception line: ``ValueError: ...``, ``huggingface_hub.errors.GatedRepoError: ...``.
_EXCEPTION = re.compile(
    r"^(?P<cls>(?:[A-Za-z_]\w*\.)*(?:[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)|Exception))"
    r"(?::\s?(?P<msg>.*))?$"
)
#: Any class name right after a traceback's frames (``torch._dynamo.exc.Unsupported: ...``).
_EXCEPTION_AFTER_FRAMES = re.compile(r"^(?P<cls>(?:[A-Za-z_]\w*\.)*[A-Z]\w*)(?::\s?(?P<msg>.*))?$")
#: argparse's last line, ``vllm serve: error: argument --dtype: invalid choice: ...``.
_ARGPARSE = re.compile(r"^(?:[\w.-]+(?: [\w.-]+)?: )?error: (?P<msg>.+)$")
_USAGE = re.compile(r"^usage: ")
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line \d+, in (?P<func>\S+)')
_TRACEBACK = "Traceback (most recent call last):"
_CONNECTORS = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
#: Lines that end an exception's message (whatever follows belongs to something else).
_MESSAGE_END = re.compile(
    r"^(?:Traceback \(most recent call last\):|The above exception|During handling of the above"
    r"|Process \S+:$|Exception ignored in|\S+\.py:\d+: \w*Warning|\[[WEIF]\d{4} |\s+File \")"
)
#: vLLM's wrappers that only point back at the real error printed before them.
_WRAPPER = re.compile(
    r"See root cause above|See stack trace (?:\(above\) )?for (?:the )?root cause"
    r"|check the stack trace above for the root cause"
)
_NOT_A_CAUSE = frozenset({"KeyboardInterrupt", "SystemExit", "CancelledError", "GeneratorExit"})
_MAX_MESSAGE_LINES = 40


@dataclass(frozen=True)
class _Line:
    origin: str
    """Which process and log record printed it: the lines of one traceback share it."""
    level: str | None
    text: str


@dataclass(frozen=True)
class _Frame:
    path: str
    func: str


@dataclass(frozen=True)
class _Raised:
    """One exception as printed: class, message (whitespace collapsed) and traceback frames."""

    cls: str
    message: str
    frames: tuple[_Frame, ...] = ()
    fields: tuple[str, ...] = ()
    """Fields a pydantic ValidationError names (``gpu_memory_utilization``)."""

    @property
    def text(self) -> str:
        """What the rules search: the class (some are the whole signal) and the message."""
        return f"{self.cls}: {self.message}"


def _parse_lines(log_tail: Sequence[str]) -> list[_Line]:
    """Split off the prefixes, so that a traceback reads the same whoever printed it."""
    lines = []
    for chunk in log_tail:
        for raw in chunk.splitlines() or [""]:
            text = _ANSI.sub("", raw).rstrip()
            prefix = _PREFIX.match(text)
            assert prefix is not None  # every group is optional
            origin = f"{prefix['proc'] or ''}|{prefix['header'] or ''}"
            lines.append(_Line(origin, prefix["level"], text[prefix.end() :]))
    return lines


def _root_chain(lines: Sequence[_Line], exit_code: int | None) -> tuple[_Raised, ...]:
    """The root error and the exceptions it chains to (root first); empty when there is none.

    Each candidate is read among the lines of its own origin, so that output of other processes
    interleaved with a traceback does not cut it.
    """
    by_origin: dict[str, list[int]] = {}
    for index, line in enumerate(lines):
        by_origin.setdefault(line.origin, []).append(index)
    texts = {origin: [lines[i].text for i in indexes] for origin, indexes in by_origin.items()}
    positions = {
        i: position for indexes in by_origin.values() for position, i in enumerate(indexes)
    }
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].level in _QUIET_LEVELS:
            continue
        same, position = texts[lines[index].origin], positions[index]
        argparse = _argparse_error(same, position, exit_code)
        if argparse is not None:
            return (argparse,)
        if _exception_match(same, position) is not None and not _is_ignored(same, position):
            return _chain(same, position)
    return ()


def _argparse_error(texts: Sequence[str], position: int, exit_code: int | None) -> _Raised | None:
    """argparse's complaint, when this line is one (exit code 2, or its usage line above)."""
    match = _ARGPARSE.match(texts[position])
    if match is None:
        return None
    usage_above = any(_USAGE.match(text) for text in texts[max(0, position - 12) : position])
    if exit_code != 2 and not usage_above:
        return None
    return _Raised("argparse", _collapse([match["msg"], *_continuation(texts, position)]))


def _exception_match(texts: Sequence[str], position: int) -> re.Match[str] | None:
    """The exception line at ``position``: by its name, or by following a traceback's frames."""
    text = texts[position]
    match = _EXCEPTION.match(text)
    if match is not None:
        return match
    above = texts[max(0, position - 4) : position]
    if above and above[-1][:1].isspace() and any(_FRAME.match(line) for line in above):
        return _EXCEPTION_AFTER_FRAMES.match(text)
    return None


def _is_ignored(texts: Sequence[str], position: int) -> bool:
    """A wrapper, an interruption or an error at interpreter exit: not the cause of the failure."""
    match = _exception_match(texts, position)
    assert match is not None
    if match["cls"].rsplit(".", 1)[-1] in _NOT_A_CAUSE:
        return True
    if _WRAPPER.search(_collapse([match["msg"] or "", *_continuation(texts, position)])):
        return True
    header = _traceback_header(texts, position)
    return header is not None and header > 0 and texts[header - 1].startswith("Exception ignored")


def _chain(texts: Sequence[str], position: int) -> tuple[_Raised, ...]:
    """The exception at ``position`` and, through "direct cause" links, the ones before it."""
    chain: list[_Raised] = []
    current: int | None = position
    while current is not None:
        chain.append(_raised_at(texts, current))
        current = _cause_of(texts, current)
    return tuple(chain)


def _raised_at(texts: Sequence[str], position: int) -> _Raised:
    match = _exception_match(texts, position)
    assert match is not None
    frames = tuple(
        _Frame(frame["path"], frame["func"])
        for text in texts[_frames_start(texts, position) : position]
        if (frame := _FRAME.match(text))
    )
    message_lines = [match["msg"] or "", *_continuation(texts, position)]
    if match["cls"].endswith("ValidationError"):
        message, fields = _pydantic_message(message_lines)
        return _Raised(match["cls"], message, frames, fields)
    return _Raised(match["cls"], _collapse(message_lines), frames)


def _continuation(texts: Sequence[str], position: int) -> list[str]:
    """The further lines of a multi-line message, up to whatever else the log says next."""
    rest = []
    for text in texts[position + 1 : position + 1 + _MAX_MESSAGE_LINES]:
        if _MESSAGE_END.match(text) or _EXCEPTION.match(text):
            break
        rest.append(text)
    return rest


def _frames_start(texts: Sequence[str], position: int) -> int:
    """The first line of the frames above the exception at ``position`` (all indented)."""
    index = position
    while index > 0 and (texts[index - 1][:1].isspace() or texts[index - 1].startswith("[Prev")):
        index -= 1
    return index


def _traceback_header(texts: Sequence[str], position: int) -> int | None:
    """The ``Traceback`` line of the exception at ``position`` (None: cut off, or no frames)."""
    index = _frames_start(texts, position) - 1
    return index if index >= 0 and texts[index] == _TRACEBACK else None


def _cause_of(texts: Sequence[str], position: int) -> int | None:
    """The exception printed above this one's traceback when Python chained the two."""
    header = _traceback_header(texts, position)
    if header is None:
        return None
    index = header - 1
    while index >= 0 and not texts[index].strip():
        index -= 1
    if index < 0 or texts[index] not in _CONNECTORS:
        return None
    for earlier in range(index - 1, max(-1, index - 1 - _MAX_MESSAGE_LINES), -1):
        if _exception_match(texts, earlier) is not None:
            return earlier
    return None


def _pydantic_message(lines: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """``1 validation error for X`` / ``field`` / ``  Input should be ... [type=...]`` → text.

    A field error names the field on its own line; a validator's ``ValueError`` comes as
    ``Value error, <message>``. The ``[type=...]`` and documentation links are noise.
    """
    parts: list[str] = []
    fields: list[str] = []
    field: str | None = None
    for line in lines[1:]:
        text = _PYDANTIC_NOISE.sub("", line).strip()
        if not text:
            continue
        if not line[:1].isspace() and _IDENTIFIER_PATH.fullmatch(text):
            field = text
            fields.append(text.rsplit(".", 1)[-1])
            continue
        text = text.removeprefix("Value error, ")
        if field is not None:
            parts.append(f"{field}: {text}")
            field = None
        elif parts and not line.startswith("  "):
            parts[-1] += f" {text}"  # a message of several lines (no indentation after the 1st)
        else:
            parts.append(text)
    return _collapse(["; ".join(parts) or lines[0]]), tuple(fields)


_PYDANTIC_NOISE = re.compile(r"\s*\[type=[^\]]*\]\s*$|^\s*For further information visit \S+\s*$")
_IDENTIFIER_PATH = re.compile(r"[A-Za-z_][\w]*(?:\.[\w]+)*")


def _collapse(parts: Sequence[str]) -> str:
    """One line per non-blank line, spaces collapsed: vLLM's line breaks end its sentences."""
    lines = (re.sub(r"\s+", " ", part).strip() for part in "\n".join(parts).splitlines())
    return "\n".join(line for line in lines if line)


# -- the rules -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Context:
    env: Mapping[str, str]
    flag_sources: Mapping[str, str]
    chain: tuple[_Raised, ...]


Explain = Callable[[re.Match[str], _Raised, _Context], tuple[str, str]]
"""(cause, fix) from the match; an empty fix means "not this rule after all"."""


@dataclass(frozen=True)
class _Rule:
    kind: str
    pattern: re.Pattern[str]
    explain: Explain | None
    """None: recognised only to answer None (a fault a restart on another host may fix)."""
    recoverable: bool = False
    root_only: bool = False
    """Match the root error only, not the exceptions it chains to."""
    innermost_frame: re.Pattern[str] | None = None
    """The frame that raised (``path:function``) must match."""
    any_frame: re.Pattern[str] | None = None
    """Some frame of the traceback (``path:function``) must match."""
    env_condition: Callable[[Mapping[str, str]], bool] | None = None


def _frames_match(rule: _Rule, raised: _Raised) -> bool:
    where = [f"{frame.path}:{frame.func}" for frame in raised.frames]
    if rule.innermost_frame is not None and not (where and rule.innermost_frame.search(where[-1])):
        return False
    return rule.any_frame is None or any(rule.any_frame.search(frame) for frame in where)


# -- wording helpers -----------------------------------------------------------------------
_DEFAULT_VARIABLE = {flag: variable for variable, flag in ALIASES.items()}
_SOURCE_VARIABLE = re.compile(r"^(?:env|alias) (?P<var>\w+)")
_QUOTE_LIMIT = 260


def _variable(flag: str, context: _Context) -> str:
    """How the user sets ``flag``: the variable (or file, or VLLM_EXTRA_ARGS) that set it."""
    source = context.flag_sources.get(flag, "")
    if match := _SOURCE_VARIABLE.match(source):
        return match["var"]
    if source == "VLLM_EXTRA_ARGS":
        return f"{flag} in VLLM_EXTRA_ARGS"
    if source.startswith("config file"):
        return f"{flag.removeprefix('--')} in the {source}"
    return _DEFAULT_VARIABLE.get(flag, flag.removeprefix("--").replace("-", "_").upper())


def _assign(flag: str, value: str, context: _Context) -> str:
    """``ENFORCE_EAGER=true``, or the flag with its value where the user wrote the flag."""
    source = context.flag_sources.get(flag, "")
    if source == "VLLM_EXTRA_ARGS":
        return f"{flag if value == 'true' else f'{flag} {value}'} in VLLM_EXTRA_ARGS"
    if source.startswith("config file"):
        return f"{flag.removeprefix('--')}: {value} in the {source}"
    return f"{_variable(flag, context)}={value}"


def _came_from(flag: str, context: _Context) -> str:
    """``--foo came from VLLM_EXTRA_ARGS``: where to look for the value vLLM rejected."""
    source = context.flag_sources.get(flag)
    if source is None:
        return (
            f"{flag} was set by none of the worker's variables (check VLLM_EXTRA_ARGS and "
            "the config file)"
        )
    return f"{flag} came from {source}"


def _quote(text: str, limit: int = _QUOTE_LIMIT) -> str:
    """vLLM's message, shortened at a word boundary: the user reads the gist, the log the rest."""
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) <= limit:
        return text
    return text[: text.rfind(" ", 0, limit)].rstrip(",;:") + " …"


def _full_stop(text: str) -> str:
    return text if text.endswith((".", "!", "?", "…")) else f"{text}."


def _sentences(text: str, count: int) -> str:
    """The first ``count`` sentences (vLLM's messages put the facts first, advice after)."""
    ends = [m.end() for m in re.finditer(r"(?<!')[.!?](?=\s+[A-Z(`'\"]|$)|(?=\n)", text)]
    return text[: ends[count - 1]] if len(ends) >= count else text


def _truthy(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


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


def _failing_repo(context: _Context) -> str | None:
    """The repo id (or path) the root error and its causes name, first found."""
    for raised in context.chain:
        for pattern in _REPO_PATTERNS:
            if match := pattern.search(raised.message):
                return match["repo"]
    return None


def _repo_variable(repo: str | None, context: _Context) -> str:
    """The variable that named the failing repo: the tokenizer's when it is the tokenizer."""
    tokenizer = context.env.get("TOKENIZER_NAME", "").strip()
    if tokenizer and repo == tokenizer:
        return _variable("--tokenizer", context)
    return _variable("--model", context)


# -- explanations, one per kind of failure -------------------------------------------------
def _smaller_footprint(context: _Context) -> str:
    """The settings that shrink what vLLM needs besides the KV cache, named as the user set them."""
    return (
        f"lower {_variable('--max-num-seqs', context)}, set "
        f"{_assign('--enforce-eager', 'true', context)}, use a quantized checkpoint or more GPUs "
        f"({_variable('--tensor-parallel-size', context)})"
    )


def _explain_cuda_oom(match: re.Match[str], raised: _Raised, context: _Context) -> tuple[str, str]:
    total = match.groupdict().get("total")
    cause = f"vLLM ran out of GPU memory: {_quote(_sentences(raised.message, 3 if total else 1))}"
    space = f" in the GPU's {total}" if total else ""
    fix = (
        f"Make the model and its buffers fit{space}: "
        f"lower {_variable('--max-model-len', context)}, {_smaller_footprint(context)}, or lower "
        f"{_variable('--gpu-memory-utilization', context)} (e.g. 0.85) to leave headroom."
    )
    return cause, fix


def _explain_oom_loading(
    match: re.Match[str], raised: _Raised, context: _Context
) -> tuple[str, str]:
    total = match.groupdict().get("total")
    space = f" ({total})" if total else ""
    cause = f"The model's weights do not fit in GPU memory: {_quote(_sentences(raised.message, 3))}"
    fix = (
        f"Use a quantized checkpoint (AWQ, GPTQ, FP8) in {_variable('--model', context)}, "
        f"spread the model over more GPUs ({_variable('--tensor-parallel-size', context)}), "
        f"or choose a GPU with more memory than this one{space}."
    )
    return cause, fix


def _explain_kv_too_small(
    match: re.Match[str], raised: _Raised, context: _Context
) -> tuple[str, str]:
    max_len = _variable("--max-model-len", context)
    groups = match.groupdict()
    if groups.get("max_len"):
        sentences = 2 if groups.get("estimated") else 1
        cause = (
            "The KV cache cannot hold one request of the maximum length: "
            f"{_quote(_sentences(raised.message, sentences))}"
        )
        if groups.get("estimated"):
            first = f"set {_assign('--max-model-len', groups['estimated'], context)} or lower"
        else:
            first = f"lower {max_len}"
    else:
        cause = f"vLLM has no memory left for the KV cache: {_quote(_sentences(raised.message, 1))}"
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


def _explicit_kv_cache(context: _Context) -> bool:
    """The user fixed the KV cache size: then that size, not the utilization, is the knob."""
    return bool(
        context.env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        or context.env.get("KV_CACHE_MEMORY_BYTES", "").strip()
        or "--kv-cache-memory-bytes" in context.flag_sources
    )


def _explain_memory_taken(
    match: re.Match[str], raised: _Raised, context: _Context
) -> tuple[str, str]:
    utilization = _variable("--gpu-memory-utilization", context)
    free, total = float(match["free"]), float(match["total"])
    share = math.floor(max(free / total - 0.05, 0.05) * 20) / 20 if total else 0.5
    reason = _quote(_sentences(raised.message, 1))
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


def _explain_max_model_len(
    match: re.Match[str], raised: _Raised, context: _Context
) -> tuple[str, str]:
    derived = int(float(match["derived"]))
    model_max = match["model_max"]
    if model_max not in (None, "None"):
        derived = max(derived, int(float(model_max)))
    variable = _variable("--max-model-len", context)
    cause = f"The model's context is shorter than requested: {_quote(_sentences(match[0], 1))}"
    fix = (
        f"Set {variable} to {derived} or less (or leave it unset for the model's own maximum); "
        "only if the model really handles longer contexts (e.g. with RoPE scaling), set "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
    )
    return cause, fix


def _explain_bad_flag(match: re.Match[str], raised: _Raised, context: _Context) -> tuple[str, str]:
    """argparse or a config validator rejected a value: quote it, say where the flag came from."""
    flags = _named_flags(raised, context, strict=raised.cls != "argparse" and not raised.fields)
    what = "command line" if raised.cls == "argparse" else "configuration"
    cause = f"vLLM rejected its {what}: {_quote(raised.message)}"
    if not flags:
        if raised.cls != "argparse":
            return cause, ""
        return cause, (
            "Check the flags the worker passed: VLLM_EXTRA_ARGS, the config file and the "
            "variables named like flags."
        )
    flags = [flag for flag in flags if flag in context.flag_sources] or flags  # the user's first
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


def _named_flags(raised: _Raised, context: _Context, *, strict: bool) -> list[str]:
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
        if flag in context.flag_sources or (field in raised.fields and not strict):
            names.append(flag)
    return list(dict.fromkeys(names))


def _explain_model_not_found(
    match: re.Match[str], raised: _Raised, context: _Context
) -> tuple[str, str]:
    repo = _failing_repo(context)
    variable = _repo_variable(repo, context)
    quote = _quote(_sentences(raised.message, 1))
    if repo is not None and _is_path(repo):
        missing = (
            "does not exist"
            if match["kind"] is not None
            else "does not exist or holds no config.json"
        )
        cause = f"The model path {repo} {missing} (vLLM: {quote})."
        fix = (
            f"Set {variable} to a directory that holds the model's config.json and weights "
            "(e.g. on the network volume, /runpod-volume/...), or to a Hugging Face repo id "
            "such as Qwen/Qwen3-0.6B."
        )
        return cause, fix
    if match["no_config"] is not None:
        cause = f"{repo or 'The model'} has no config.json, which vLLM needs (vLLM: {quote})."
        fix = (
            f"Set {variable} to a repo or directory in Hugging Face format (config.json and "
            "safetensors weights), not e.g. a GGUF-only repo."
        )
        return cause, fix
    fix = f"Check {variable} (namespace/name, e.g. Qwen/Qwen3-0.6B, spelled as on huggingface.co)"
    if repo is not None and match["kind"] is not None:
        return f"'{repo}' is not a valid Hugging Face repo id (vLLM: {quote}).", f"{fix}."
    tokenizer = context.env.get("TOKENIZER_NAME", "").strip()
    message = not_found_message(
        repo,
        variable,
        role="tokenizer" if tokenizer and repo == tokenizer else "model",
        token_set=bool(context.env.get("HF_TOKEN", "").strip()),
        evidence=f"vLLM: {quote}",
    )
    return message.cause, message.fix


def _explain_gated(match: re.Match[str], raised: _Raised, context: _Context) -> tuple[str, str]:
    repo = _failing_repo(context)
    reason = next(
        (m[0] for p in _GATED_REASONS for r in context.chain if (m := p.search(r.message))),
        _sentences(raised.message, 1),
    )
    tokenizer = context.env.get("TOKENIZER_NAME", "").strip()
    message = gated_message(
        repo,
        "tokenizer" if tokenizer and repo == tokenizer else "model",
        variable=_repo_variable(repo, context),
        token_set=bool(context.env.get("HF_TOKEN", "").strip()),
        evidence=f"Hugging Face: {_quote(reason)}",
    )
    return message.cause, message.fix


_GATED_REASONS = (
    re.compile(r"Access to model \S+ is restricted[^\n]*"),
    re.compile(r"403 Forbidden: [^\n]*"),
    re.compile(r"Cannot access gated repo for url \S+"),
)


def _explain_invalid_token(
    match: re.Match[str], raised: _Raised, context: _Context
) -> tuple[str, str]:
    message = invalid_token_message(evidence=f"Hugging Face: {match[0]}")
    return message.cause, message.fix


def _explain_revision(match: re.Match[str], raised: _Raised, context: _Context) -> tuple[str, str]:
    repo = _failing_repo(context)
    revision = match["revision"] or context.env.get("MODEL_REVISION", "").strip() or "requested"
    tokenizer = context.env.get("TOKENIZER_NAME", "").strip()
    flag = "--tokenizer-revision" if tokenizer and repo == tokenizer else "--revision"
    message = revision_not_found_message(
        repo,
        revision,
        variable=_variable(flag, context),
        evidence=f"vLLM: {_quote(_sentences(raised.message, 1))}",
    )
    return message.cause, message.fix


def _explain_offline(match: re.Match[str], raised: _Raised, context: _Context) -> tuple[str, str]:
    repo = _failing_repo(context)
    variable = _repo_variable(repo, context)
    name = repo or context.env.get(variable, "").strip() or f"the model in {variable}"
    cause = (
        f"Downloads from Hugging Face are disabled (HF_HUB_OFFLINE) and {name} is not in the "
        f"local cache (vLLM: {_quote(_sentences(raised.message, 1))})."
    )
    fix = (
        f"Unset HF_HUB_OFFLINE so that vLLM can download it, or point {variable} to a local "
        "directory that holds the model, or put the model in the cache (BASE_PATH) first."
    )
    return cause, fix


def _explain_architecture(
    match: re.Match[str], raised: _Raised, context: _Context
) -> tuple[str, str]:
    variable = _variable("--model", context)
    if match["archs"] is not None:
        archs = ", ".join(re.findall(r"'([^']+)'", match["archs"])) or match["archs"]
        cause = f"This vLLM does not support the model's architecture {archs}."
    else:
        cause = f"This vLLM cannot run the model: {_quote(_sentences(raised.message, 2))}"
    fix = (
        f"Choose a model whose architecture vLLM supports in {variable} "
        "(https://docs.vllm.ai/en/latest/models/supported_models.html) or a worker image with a "
        f"newer vLLM; if the model ships its own modeling code, "
        f"{_assign('--trust-remote-code', 'true', context)} may let vLLM's Transformers backend "
        "load it."
    )
    return cause, fix


def _explain_remote_code(
    match: re.Match[str], raised: _Raised, context: _Context
) -> tuple[str, str]:
    repo = _failing_repo(context)
    name = repo or "The model"
    cause = f"{name} contains custom code that must run to load it, which vLLM may not run."
    where = f" (read it at https://huggingface.co/{repo})" if repo and not _is_path(repo) else ""
    fix = (
        f"If you trust the repository's code{where}, set "
        f"{_assign('--trust-remote-code', 'true', context)}."
    )
    return cause, fix


def _explain_disk_full(match: re.Match[str], raised: _Raised, context: _Context) -> tuple[str, str]:
    base = context.env.get("BASE_PATH", "").strip()
    where = f"BASE_PATH={base}" if base else "BASE_PATH"
    cause = f"The disk is full: {_quote(_sentences(raised.message, 1))}"
    fix = (
        "Give the worker more disk: a network volume large enough for the model (models are "
        f"cached under {where}) or a bigger container disk; or choose a smaller model."
    )
    return cause, fix


def _explain_model_requirement(
    match: re.Match[str], raised: _Raised, context: _Context
) -> tuple[str, str]:
    source = raised.frames[-1].path.rsplit("/", 1)[-1]
    cause = f"The model's code in vLLM ({source}) rejects this setup: {_quote(raised.message)}"
    flags = _named_flags(raised, context, strict=True)
    named = "".join(f" ({_came_from(flag, context)})" for flag in flags)
    fix = (
        f"Meet that requirement{named}: change the setting it names, use the hardware or "
        f"software it asks for, or serve another model in {_variable('--model', context)}."
    )
    return cause, fix


# -- the table -----------------------------------------------------------------------------
def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


_CUDA_OOM = (
    r"(?:OutOfMemoryError: )?CUDA out of memory\. Tried to allocate \S+ \S+\.(?: GPU \d+ has a "
    r"total capacity of (?P<total>[\d.]+ \S+) of which)?|CUDA error: out of memory"
    r"|OutOfMemoryError\b"
)

#: First match wins: memory before machine faults (``CUDA error: out of memory`` is memory),
#: offline before network, gated and revision before "not found", specific before generic.
_RULES: tuple[_Rule, ...] = (
    # torch c10/cuda/CUDACachingAllocator.cpp: "CUDA out of memory. Tried to allocate 2.00 GiB.
    # GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free. ..." raised while
    # vllm/v1/worker/gpu_model_runner.py load_model loads weights: no relaunch makes them fit.
    _Rule(
        "out_of_memory",
        _rx(_CUDA_OOM),
        _explain_oom_loading,
        any_frame=re.compile(r":(?:load_model|load_weights)$"),
    ),
    _Rule("out_of_memory", _rx(_CUDA_OOM), _explain_cuda_oom, recoverable=True),
    # vllm/v1/worker/gpu_model_runner.py: "CUDA out of memory occurred when warming up sampler
    # with {num_reqs} dummy requests. Please try lowering `max_num_seqs` or ..." (also pooler).
    _Rule(
        "out_of_memory",
        _rx(r"CUDA out of memory occurred when warming up"),
        _explain_cuda_oom,
        recoverable=True,
    ),
    # vllm/v1/core/kv_cache_utils.py _check_enough_kv_cache_memory: "To serve at least one
    # request with the model's max seq len ({max_model_len}), ({needed} GiB KV cache is needed,
    # which is larger than the available KV cache memory ({available} GiB). Based on the
    # available memory, the estimated maximum model length is {estimated_max_len}. ..."
    _Rule(
        "out_of_memory",
        _rx(
            r"To serve at least one request with the model's max seq len \((?P<max_len>\d+)\), "
            r"\((?P<needed>[\d.]+) GiB KV cache is needed, which is larger than the available "
            r"KV cache memory \((?P<available>[\d.]+) GiB\)\.(?: Based on the available memory, "
            r"the estimated maximum model length is (?P<estimated>\d+)\.)?"
        ),
        _explain_kv_too_small,
        recoverable=True,
    ),
    # same function: "No available memory for the cache blocks. Try increasing
    # `gpu_memory_utilization` when initializing the engine ..."
    _Rule(
        "out_of_memory",
        _rx(r"No available memory for the cache blocks"),
        _explain_kv_too_small,
        recoverable=True,
    ),
    # vllm/v1/worker/utils.py: "Free memory on device {device} ({free}/{total} GiB) on startup
    # is less than desired GPU memory utilization ({utilization}, {requested} GiB). ..."
    # vllm/v1/worker/cpu_worker.py __init__: "Available memory on node {n} ({free}/{total} GiB)
    # on startup is less than desired CPU memory utilization ({utilization}, {requested} GiB)."
    # and determine_available_memory: "Available memory on node {n} ({free}/{total} GiB) on kv
    # cache allocation is less than requested memory for kv ({requested} GiB)."
    # Memory someone else holds: a smaller footprint of ours does not free it.
    _Rule(
        "insufficient_free_memory",
        _rx(
            r"(?:Free|Available) memory on (?:device|node) \S+ \((?P<free>[\d.]+)/(?P<total>[\d.]+)"
            r" GiB\) on (?:startup|kv cache allocation) is less than (?:desired (?P<what>GPU|CPU) "
            r"memory utilization|requested memory for (?P<what_kv>kv))"
        ),
        _explain_memory_taken,
    ),
    # Faults of the machine: vllm/distributed/device_communicators/pynccl_wrapper.py "NCCL
    # error: {error_str}", torch "CUDA error: an illegal memory access was encountered",
    # uncorrectable ECC errors, NVML and driver failures, a full /dev/shm (NCCL's shared
    # memory, sized by the platform). Another host may succeed.
    _Rule(
        "machine_fault",
        _rx(
            r"CUDA error|NCCL (?:error|WARN)|\bnccl\w*Error\b|DistBackendError|NVML|\bXid\b"
            r"|\bECC\b|CUDA driver|NVIDIA driver|No CUDA GPUs are available|cudaError"
            r"|CUBLAS_STATUS|CUDNN_STATUS|device-side assert|/dev/shm"
        ),
        None,
    ),
    # OSError [Errno 28] / hf_xet "No space left on device (os error 28)" while downloading or
    # writing caches (after the machine faults: a full /dev/shm is the platform's).
    _Rule(
        "disk_full",
        _rx(r"No space left on device|\[Errno 28\]|os error 28|\bENOSPC\b"),
        _explain_disk_full,
    ),
    # vllm/config/model.py _get_and_verify_max_len: "User-specified max_model_len
    # ({max_model_len}) is greater than the derived max_model_len ({max_len_key}=
    # {derived_max_model_len} or model_max_length={model_max_length} in model's config.json)."
    _Rule(
        "max_model_len_too_large",
        _rx(
            r"User-specified max_model_len \((?P<requested>\d+)\) is greater than the derived "
            r"max_model_len \((?P<key>\w+)=(?P<derived>[\d.]+) or model_max_length="
            r"(?P<model_max>[\w.]+) in model's config\.json\)"
        ),
        _explain_max_model_len,
    ),
    # transformers/dynamic_module_utils.py: "The repository {model_name} contains custom code
    # which must be executed to correctly load the model. ... Please pass the argument
    # `trust_remote_code=True` to allow custom code to be run."; vllm/transformers_utils/
    # config.py: "... consider setting `trust_remote_code=True` in LLM or using the
    # `--trust-remote-code` flag in the CLI."
    _Rule(
        "trust_remote_code",
        _rx(
            r"(?:contains|references) custom code (?:which must be executed|contained in)"
            r"|requires you to execute the configuration file"
            r"|consider setting `trust_remote_code=True`"
            r"|pass the argument `trust_remote_code=True`"
        ),
        _explain_remote_code,
    ),
    # vllm/model_executor/models/registry.py _raise_for_unsupported: "Model architectures
    # {architectures} are not supported for now. Supported architectures: {...}", "Model
    # architecture {arch} was supported in vLLM until v{version}, and is not supported anymore",
    # "... is not supported in-tree anymore. Please install the plugin at {url} ...";
    # transformers/models/auto/configuration_auto.py: "The checkpoint you are trying to load has
    # model type `{model_type}` but Transformers does not recognize this architecture."
    _Rule(
        "unsupported_architecture",
        _rx(
            r"Model architectures (?P<archs>\[[^\]]*\]) are not supported for now"
            r"|Model architecture \S+ (?:was supported in vLLM until|is not supported in-tree)"
            r"|has model type `[^`]+` but Transformers does not recognize this architecture"
        ),
        _explain_architecture,
    ),
    # huggingface_hub/_snapshot_download.py and file_download.py (LocalEntryNotFoundError):
    # "Cannot find an appropriate cached snapshot folder for the specified revision on the local
    # disk and outgoing traffic has been disabled.", "Cannot find the requested files in the disk
    # cache and outgoing traffic has been disabled."; huggingface_hub/utils/_http.py
    # (OfflineModeIsEnabled): "Cannot reach {url}: offline mode is enabled."
    _Rule(
        "offline_not_cached",
        _rx(r"outgoing traffic has been disabled|offline mode is enabled|OfflineModeIsEnabled"),
        _explain_offline,
    ),
    # With HF_HUB_OFFLINE=1 a cache miss reads like a network error: transformers/utils/hub.py
    # "We couldn't connect to '{endpoint}' to load the files, and couldn't find them in the
    # cached files."; file_download.py "... cannot find the requested files in the local cache."
    _Rule(
        "offline_not_cached",
        _rx(
            r"LocalEntryNotFoundError|couldn't find them in the cached files"
            r"|find the requested files in the local cache"
        ),
        _explain_offline,
        env_condition=lambda env: _truthy(env, "HF_HUB_OFFLINE"),
    ),
    # huggingface_hub/utils/_http.py hf_raise_for_status: a 401 whose X-Error-Message is
    # "Invalid credentials in Authorization header" (an expired or mistyped HF_TOKEN).
    _Rule(
        "invalid_token",
        _rx(r"Invalid credentials in Authorization header"),
        _explain_invalid_token,
    ),
    # huggingface_hub/utils/_http.py hf_raise_for_status: GatedRepoError "Cannot access gated
    # repo for url {url}." + the Hub's "Access to model {repo} is restricted ..."; a 403
    # "403 Forbidden: {message}. Cannot access content at: {url}."; transformers/utils/hub.py:
    # "You are trying to access a gated repo." and "{path_or_repo} is a gated repository."
    _Rule(
        "gated_model",
        _rx(
            r"GatedRepoError|Cannot access gated repo|trying to access a gated repo|is a gated repo"
            r"|Access to model \S+ is restricted|403 Forbidden: |Cannot access content at: "
        ),
        _explain_gated,
    ),
    # huggingface_hub/utils/_http.py RevisionNotFoundError: "404 Client Error. Revision Not Found
    # for url: {url}."; transformers/utils/hub.py: "{revision} is not a valid git identifier
    # (branch name, tag name or commit id) that exists for this model name."
    _Rule(
        "revision_not_found",
        _rx(
            r"(?P<revision>\S+) is not a valid git identifier \(branch name, tag name or commit"
            r"|RevisionNotFoundError|Revision Not Found for url"
        ),
        _explain_revision,
    ),
    # A network failure reaches us wrapped in "Invalid repository ID ..." or "We couldn't connect
    # to ...": the Hub or the network may be back on the next start.
    _Rule(
        "network",
        _rx(
            r"couldn't connect to|ConnectError|ConnectionError|ConnectTimeout|ReadTimeout"
            r"|Name or service not known|Temporary failure in name resolution|Connection refused"
            r"|Network is unreachable|check your (?:internet )?connection|timed out"
            r"|5\d\d Server Error"
        ),
        None,
    ),
    # huggingface_hub/utils/_validators.py (HFValidationError): "Repo id must be in the form
    # 'repo_name' or 'namespace/repo_name': '{repo_id}'. ..."; _http.py RepositoryNotFoundError
    # "Repository Not Found for url: {url}."; transformers/utils/hub.py "{repo} is not a local
    # folder and is not a valid model identifier listed on 'https://huggingface.co/models'" and
    # "{path_or_repo} is not a local folder or a valid repository name on 'https://hf.co'.";
    # vllm/transformers_utils/config.py get_config "Invalid repository ID or local directory
    # specified: '{model}'."
    _Rule(
        "model_not_found",
        _rx(
            r"(?P<kind>Repo id must|Cannot have -- or \.\. in repo_id|Repo_id cannot end by"
            r"|HFValidationError)"
            r"|RepositoryNotFoundError|Repository Not Found for url"
            r"|is not a local folder (?:and is not a valid model identifier|or a valid repository)"
            r"|Invalid repository ID or local directory specified"
            r"|(?P<no_config>does not appear to have a file named config\.json)"
        ),
        _explain_model_not_found,
    ),
    # A model's own vLLM code states what it needs, e.g. vllm/model_executor/models/laguna.py:
    # "Laguna requires the `LagunaConfig` from Transformers, which is available from v5.17.0."
    _Rule(
        "model_requirement",
        _rx(r"\brequires?\b|only supports?\b|not supported on\b"),
        _explain_model_requirement,
        root_only=True,
        innermost_frame=re.compile(r"/vllm/model_executor/models/[^/]+\.py:"),
    ),
    # argparse (vllm/utils/argparse_utils.py FlexibleArgumentParser): "vllm serve: error:
    # argument --dtype: invalid choice: ...", "vllm: error: unrecognized arguments: --foo".
    _Rule("bad_argument", re.compile(r"^argparse: "), _explain_bad_flag, root_only=True),
    # vLLM's config classes are pydantic dataclasses (vllm/config/utils.py @config): a field out
    # of range or a validator's ValueError surfaces as "ValidationError: 1 validation error for
    # CacheConfig / gpu_memory_utilization / Input should be less than or equal to 1".
    _Rule("bad_argument", re.compile(r"ValidationError: "), _explain_bad_flag, root_only=True),
    # A ValueError/TypeError from vLLM's argument or config code that names a flag the user set.
    _Rule(
        "bad_argument",
        re.compile(r"^(?:\w+\.)*(?:ValueError|TypeError|ArgumentTypeError|ArgumentError): "),
        _explain_bad_flag,
        root_only=True,
        innermost_frame=re.compile(
            r"/vllm/(?:config/[^/]+|engine/arg_utils|utils/argparse_utils)\.py:"
        ),
    ),
)
