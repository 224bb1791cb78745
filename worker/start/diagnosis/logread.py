"""Reading vLLM's log: the root error of a failed start, and the exceptions it chains to.

The root error is the last exception vLLM printed that is not one of its "see root cause
above" wrappers (or argparse's usage error). Nothing outside its traceback is read: a "404"
in a warning 300 lines earlier must never decide what the failure was.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Frame", "Raised", "root_chain", "root_excerpt"]

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
class Frame:
    path: str
    func: str


@dataclass(frozen=True)
class Raised:
    """One exception as printed: class, message (whitespace collapsed) and traceback frames."""

    cls: str
    message: str
    frames: tuple[Frame, ...] = ()
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


def _find_root(lines: Sequence[_Line], exit_code: int | None) -> tuple[list[str], int] | None:
    """Where the root error is: the lines of its origin, and its position among them.

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
        if _argparse_error(same, position, exit_code) is not None or (
            _exception_match(same, position) is not None and not _is_ignored(same, position)
        ):
            return same, position
    return None


def root_chain(log_tail: Sequence[str], exit_code: int | None) -> tuple[Raised, ...]:
    """The root error and the exceptions it chains to (root first); empty when there is none."""
    found = _find_root(_parse_lines(log_tail), exit_code)
    if found is None:
        return ()
    texts, position = found
    argparse = _argparse_error(texts, position, exit_code)
    return (argparse,) if argparse is not None else _chain(texts, position)


def root_excerpt(
    log_tail: Sequence[str], exit_code: int | None, *, max_lines: int = 30
) -> str | None:
    """The root error as printed, with the lines just above it (its traceback's last frames).

    Prefixes are dropped, so a traceback that vLLM's processes interleaved reads whole. None
    when the log holds no root error.
    """
    found = _find_root(_parse_lines(log_tail), exit_code)
    if found is None:
        return None
    texts, position = found
    end = position + 1 + len(_continuation(texts, position))
    start = _traceback_header(texts, position)
    if start is None:
        start = _frames_start(texts, position)
    return "\n".join(texts[max(start, end - max_lines) : end])


def _argparse_error(texts: Sequence[str], position: int, exit_code: int | None) -> Raised | None:
    """argparse's complaint, when this line is one (exit code 2, or its usage line above)."""
    match = _ARGPARSE.match(texts[position])
    if match is None:
        return None
    usage_above = any(_USAGE.match(text) for text in texts[max(0, position - 12) : position])
    if exit_code != 2 and not usage_above:
        return None
    return Raised("argparse", _collapse([match["msg"], *_continuation(texts, position)]))


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


def _chain(texts: Sequence[str], position: int) -> tuple[Raised, ...]:
    """The exception at ``position`` and, through "direct cause" links, the ones before it."""
    chain: list[Raised] = []
    current: int | None = position
    while current is not None:
        chain.append(_raised_at(texts, current))
        current = _cause_of(texts, current)
    return tuple(chain)


def _raised_at(texts: Sequence[str], position: int) -> Raised:
    match = _exception_match(texts, position)
    assert match is not None
    frames = tuple(
        Frame(frame["path"], frame["func"])
        for text in texts[_frames_start(texts, position) : position]
        if (frame := _FRAME.match(text))
    )
    message_lines = [match["msg"] or "", *_continuation(texts, position)]
    if match["cls"].endswith("ValidationError"):
        message, fields = _pydantic_message(message_lines)
        return Raised(match["cls"], message, frames, fields)
    return Raised(match["cls"], _collapse(message_lines), frames)


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

