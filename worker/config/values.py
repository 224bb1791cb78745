"""How the worker reads a yes/no value: one set of words for every place that needs one.

Flags (``ENFORCE_EAGER=true``), the worker's switches and the variables of other libraries
that the worker interprets (``HF_HUB_OFFLINE=1``) all take the same words, in any case:
``true/false``, ``1/0``, ``yes/no``, ``on/off`` (huggingface_hub's own truthy words are the
first half of these).
"""

from __future__ import annotations

TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
FALSE_WORDS = frozenset({"false", "0", "no", "off"})


def parse_bool(text: str) -> bool | None:
    """True or False for a yes/no word (any case, surrounding spaces ignored); None otherwise."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return None


def is_true(text: str | None) -> bool:
    """A variable that is on: a yes word. Unset, empty, a no word or anything else is off."""
    return text is not None and parse_bool(text) is True
