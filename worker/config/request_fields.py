"""Which fields vLLM's completion and chat requests read, and what a prompt or messages job's
fields become before the request leaves the worker.

vLLM's request models take any extra field and drop it with a debug line
(``OpenAIBaseModel``, ``extra="allow"``), so a job written for an older vLLM's table of
sampling parameters (``best_of``, ``early_stopping``, the ``guided_*`` fields) would get a
different answer from the one it asked for, and nothing would say so. Here each field of
``sampling_params``, and each key of the job's input beside it, is one of:

* a field of the route's request in the vLLM that runs: sent as it is;
* a former name whose meaning is kept exactly (``guided_choice`` and the other removed
  guided-decoding fields): sent as the ``structured_outputs`` field that replaced it, with a
  note for the log;
* anything else: the job fails with ``invalid_request`` naming the field and what to use
  instead (a removed field's replacement, or the closest field's name), and nothing is sent.

The field lists come from the vLLM that runs, dumped with the flag catalog
(:func:`dump_request_fields`, run by ``python -m worker.config.flags dump`` in vLLM's interpreter),
never from an import of vLLM here. Without them (a catalog of another vLLM version) the job's
fields are sent as written. The ``openai_route`` and ``route`` shapes are vLLM's own API and
are never checked: their bodies go through byte for byte.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal

from worker.errors import InvalidRequest

RequestKind = Literal["completion", "chat"]

#: vLLM's former guided-decoding fields (removed from its requests), and the field of
#: ``structured_outputs`` that keeps each one's meaning.
GUIDED_FIELDS: Mapping[str, str] = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}

#: Fields gone from vLLM's requests whose meaning has no exact replacement: what to do instead.
RETIRED_FIELDS: Mapping[str, str] = {
    "best_of": "to get several samples use 'n' (and 'use_beam_search' for beam search): vLLM "
               "no longer generates extra candidates to return the best of them",
    "early_stopping": "leave it out: vLLM's beam search ('use_beam_search') no longer takes "
                      "it and stops each beam at its end-of-sequence token",
    "guided_decoding_backend": "choose the backend for the endpoint with "
                               "STRUCTURED_OUTPUTS_CONFIG='{\"backend\": \"xgrammar\"}' (vLLM's "
                               "--structured-outputs-config), and the constraint in the job "
                               "with 'structured_outputs'",
}

#: The table of ``sampling_params`` that Runpod's guide and the reference worker document, in
#: its order, with what vLLM does with each one it still reads (docs/jobs.md is made of it,
#: with each field's fate in the running vLLM: tools/gen_docs.py).
DOCUMENTED_SAMPLING_PARAMS: Mapping[str, str] = {
    "n": "How many answers (choices) to return for the prompt.",
    "best_of": "Generates best_of candidates and returns the n likeliest.",
    "presence_penalty": "Lowers the odds of every token already in the output by the same "
                        "amount (-2 to 2).",
    "frequency_penalty": "Lowers the odds of a token by how often it is already in the "
                         "output (-2 to 2).",
    "repetition_penalty": "Divides the odds of tokens already in the prompt or the output "
                          "(above 1 discourages repeats, 1 does nothing).",
    "temperature": "Randomness of the sampling: 0 always takes the likeliest token.",
    "top_p": "Samples among the likeliest tokens whose probabilities add up to top_p.",
    "top_k": "Samples among the k likeliest tokens (0 or -1: all).",
    "min_p": "Leaves out the tokens less likely than min_p times the likeliest one.",
    "use_beam_search": "Beam search instead of sampling, with n beams.",
    "length_penalty": "With beam search: a beam's score is divided by its length to this "
                      "power (above 1 favours longer answers).",
    "early_stopping": "With beam search: when to stop once enough beams have ended.",
    "stop": "Strings that end the answer (left out of it unless "
            "include_stop_str_in_output).",
    "stop_token_ids": "Token ids that end the answer.",
    "ignore_eos": "Goes on past the end-of-sequence token, up to max_tokens.",
    "max_tokens": "The most tokens to generate (a prompt job's default is 16: see above).",
    "min_tokens": "The fewest tokens to generate before the end-of-sequence token or a stop "
                  "may end the answer.",
    "skip_special_tokens": "Leaves special tokens out of the text (default true).",
    "spaces_between_special_tokens": "Puts spaces between special tokens in the text "
                                     "(default true).",
    "truncate_prompt_tokens": "Keeps only the last N tokens of the prompt.",
}

#: Where vLLM defines each request model (the first that imports is read).
_REQUEST_MODELS: Mapping[RequestKind, tuple[str, ...]] = {
    "completion": ("vllm.entrypoints.openai.completion.protocol:CompletionRequest",
                   "vllm.entrypoints.openai.protocol:CompletionRequest"),
    "chat": ("vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
             "vllm.entrypoints.openai.protocol:ChatCompletionRequest"),
}
_STRUCTURED_OUTPUTS = ("vllm.sampling_params:StructuredOutputsParams",)

#: Keys of a prompt or messages job's input that the worker reads itself.
JOB_KEYS = frozenset({
    "prompt", "messages", "sampling_params", "stream", "apply_chat_template", "model",
    "max_batch_size", "min_batch_size", "batch_size_growth_factor", "max_batch_delay",
    # The reference worker's switch for the OpenAI format, which is the only one here.
    "use_openai_format",
})


@dataclass(frozen=True)
class RequestFields:
    """The fields (names and aliases) of one vLLM's completion and chat requests, and of
    the ``structured_outputs`` object they take."""

    completion: frozenset[str]
    chat: frozenset[str]
    structured_outputs: frozenset[str]

    def of(self, kind: RequestKind) -> frozenset[str]:
        return self.completion if kind == "completion" else self.chat

    def to_json(self) -> dict[str, list[str]]:
        return {"completion": sorted(self.completion), "chat": sorted(self.chat),
                "structured_outputs": sorted(self.structured_outputs)}

    @classmethod
    def from_json(cls, data: object) -> RequestFields:
        """ValueError when ``data`` is not the form :meth:`to_json` writes."""
        if not isinstance(data, dict):
            raise ValueError("'request_fields' is a JSON object")
        lists = {}
        for key in ("completion", "chat", "structured_outputs"):
            names = data.get(key)
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"'request_fields.{key}' is a list of field names")
            lists[key] = frozenset(names)
        if not lists["completion"] or not lists["chat"]:
            raise ValueError("'request_fields' names no field of a request")
        return cls(lists["completion"], lists["chat"], lists["structured_outputs"])


@dataclass(frozen=True)
class CheckedFields:
    """A job's request fields as they go to vLLM, and what the log should hear of them."""

    body: dict[str, Any]
    notes: tuple[str, ...] = ()


def check_job_fields(
    job_input: Mapping[str, Any],
    sampling: Mapping[str, Any],
    kind: RequestKind,
    known: RequestFields | None,
) -> CheckedFields:
    """The body fields of a prompt or messages job (its ``sampling_params``, with the former
    guided-decoding fields of either place mapped), or InvalidRequest naming the first field
    vLLM would ignore. ``known`` None: the running vLLM's fields are unknown, sent as written.
    """
    if known is None:
        return CheckedFields(dict(sampling))
    accepted = known.of(kind)
    body: dict[str, Any] = {}
    guided: dict[str, tuple[str, Any]] = {}
    for key, value in sampling.items():
        if key in accepted:
            body[key] = value
        elif key in GUIDED_FIELDS:
            guided[key] = (f"sampling_params.{key}", value)
        else:
            raise _unknown(f"sampling_params.{key}", key, kind, accepted)
    for key, value in job_input.items():
        if key in JOB_KEYS:
            continue
        if key in GUIDED_FIELDS:
            if key in guided:
                raise InvalidRequest(
                    f"'{key}' is given twice, in the job's input and in 'sampling_params': "
                    "give it once.", param=key)
            guided[key] = (key, value)
        elif key in accepted:
            raise InvalidRequest(
                f"'{key}' is a field of vLLM's request and goes in 'sampling_params', beside "
                f"the job's '{'prompt' if kind == 'completion' else 'messages'}' (here vLLM "
                "would never see it).", param=key)
        else:
            raise _unknown(key, key, kind, JOB_KEYS | accepted)
    if not guided:
        return CheckedFields(body)
    return _with_structured_outputs(body, guided, known, kind)


def _with_structured_outputs(
    body: dict[str, Any],
    guided: Mapping[str, tuple[str, Any]],
    known: RequestFields,
    kind: RequestKind,
) -> CheckedFields:
    """``body`` with the former guided-decoding fields as the ``structured_outputs`` fields
    that replaced them; InvalidRequest when the job gave both forms or vLLM lacks them."""
    if "structured_outputs" not in known.of(kind):
        param = next(iter(guided.values()))[0]
        raise InvalidRequest(
            f"'{param}' was removed from vLLM and this vLLM has no 'structured_outputs' to "
            "send it as.", param=param)
    if body.get("structured_outputs") is not None:
        param = next(iter(guided.values()))[0]
        raise InvalidRequest(
            f"'{param}' is the former name of a 'structured_outputs' field, and the job also "
            "gives 'structured_outputs': give the constraint once, in 'structured_outputs'.",
            param=param)
    mapped: dict[str, Any] = {}
    notes = []
    for key, (param, value) in guided.items():
        target = GUIDED_FIELDS[key]
        if known.structured_outputs and target not in known.structured_outputs:
            raise InvalidRequest(
                f"'{param}' was removed from vLLM, and its 'structured_outputs' has no "
                f"'{target}' to send it as.", param=param)
        mapped[target] = value
        notes.append(f"job field '{param}' was removed from vLLM: sent as "
                     f"'structured_outputs.{target}', which keeps its meaning")
    return CheckedFields({**body, "structured_outputs": mapped}, tuple(notes))


def _unknown(param: str, key: str, kind: RequestKind, candidates: frozenset[str]) -> InvalidRequest:
    request = "completion" if kind == "completion" else "chat completion"
    what = f"'{param}' is not a field of vLLM's {request} request: vLLM would ignore it"
    if key in RETIRED_FIELDS:
        return InvalidRequest(f"{what}. It was removed from vLLM; {RETIRED_FIELDS[key]}.",
                              param=param)
    close = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.75)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return InvalidRequest(f"{what}, so nothing was sent.{hint}", param=param)


# -- dumping (runs in vLLM's interpreter, from ``python -m worker.config.flags dump``) -------------
def _load(paths: tuple[str, ...]) -> Any:
    for path in paths:
        module, _, name = path.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def _model_field_names(model: Any) -> frozenset[str]:
    """A pydantic model's field names and aliases: what vLLM's ``__log_extra_fields__``
    counts as known."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if alias := getattr(info, "alias", None):
            names.add(alias)
    return frozenset(names)


def dump_request_fields() -> dict[str, list[str]] | None:
    """The installed vLLM's request fields (:meth:`RequestFields.to_json`); None when its
    request models are not where any known vLLM keeps them."""
    completion = _load(_REQUEST_MODELS["completion"])
    chat = _load(_REQUEST_MODELS["chat"])
    if completion is None or chat is None:
        return None
    structured = _load(_STRUCTURED_OUTPUTS)
    structured_names = (frozenset(f.name for f in fields(structured) if not f.name.startswith("_"))
                        if structured is not None and is_dataclass(structured) else frozenset())
    return RequestFields(_model_field_names(completion), _model_field_names(chat),
                         structured_names).to_json()
