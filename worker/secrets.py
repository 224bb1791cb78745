"""Keep secrets out of argv, logs and job results.

A value is secret when its environment variable's name says so or when it follows a flag that
carries one (``--api-key``, ``--hf-token``). A name says so when it holds ``PASSWORD``,
``PASSWD``, ``SECRET`` or ``CREDENTIAL`` anywhere (``DBPASSWORD``, ``CLIENTSECRET``), or when
one of its ``_``-separated words is ``PASS`` or ends with ``TOKEN`` or ``KEY`` (``SMTP_PASS``,
``HF_TOKEN``, ``GITHUBTOKEN``, ``OPENAI_APIKEY``); counts and switches that only look so
(``MAX_TOKENS``, ``TOKENIZER``, ``*_TOKEN_THRESHOLD``, ``ALLOW_CREDENTIALS``) are not.
:class:`SecretMasker` replaces every occurrence of such a value in any text with ``***``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

MASK = "***"

#: Anywhere in a name (``DBPASSWORD``, ``AWS_SECRET_ACCESS_KEY``).
_SECRET_ANYWHERE = ("PASSWORD", "PASSWD", "SECRET", "CREDENTIAL")
#: A whole ``_``-separated word of a name (``SMTP_PASS``; not ``BYPASS``).
_SECRET_WORDS = frozenset({"PASS"})
#: The end of a ``_``-separated word of a name (``HF_TOKEN``, ``GITHUBTOKEN``, ``APIKEY``).
_SECRET_WORD_ENDS = ("TOKEN", "KEY")
# Flags of `vllm serve` whose value is a secret (must never be in argv; masked if it is).
SECRET_FLAGS = frozenset({"--api-key", "--hf-token", "--ssl-keyfile-password"})
# Values this short are too likely to occur by chance in ordinary text to be masked safely.
_MIN_SECRET_LENGTH = 4
# Names that look secret but hold no secret.
_NOT_SECRET = frozenset({"TOKENIZER_NAME", "TOKENIZER", "MAX_TOKENS", "ALLOW_CREDENTIALS"})
# Parts of names that mean a count or a switch, not a credential (vLLM's
# LONG_PREFILL_TOKEN_THRESHOLD, DBO_DECODE_TOKEN_THRESHOLD, ...).
_NOT_SECRET_PARTS = ("TOKENIZER", "TOKENS", "THRESHOLD")


def is_secret_name(name: str) -> bool:
    """True when an environment variable of this name holds a secret."""
    upper = name.upper()
    if upper in _NOT_SECRET or any(part in upper for part in _NOT_SECRET_PARTS):
        return False
    if any(word in upper for word in _SECRET_ANYWHERE):
        return True
    return any(word in _SECRET_WORDS or word.endswith(_SECRET_WORD_ENDS)
               for word in upper.split("_"))


class SecretMasker:
    """Masks known secret values in text. Build it once from the environment."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values = {s for s in secrets if s and len(s) >= _MIN_SECRET_LENGTH}
        # Longest first so that a secret containing another is masked whole.
        ordered = sorted(values, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    @classmethod
    def from_env(cls, env: Mapping[str, str], extra: Iterable[str] = ()) -> SecretMasker:
        return cls([v for k, v in env.items() if is_secret_name(k)] + list(extra))

    def __bool__(self) -> bool:
        return self._pattern is not None

    def mask(self, text: str) -> str:
        if self._pattern is None or not text:
            return text
        return self._pattern.sub(MASK, text)

    def mask_argv(self, argv: Sequence[str]) -> list[str]:
        """Mask secret values in an argument vector, including values of secret flags."""
        masked: list[str] = []
        hide_next = False
        for arg in argv:
            if hide_next:
                masked.append(MASK)
                hide_next = False
                continue
            flag, eq, _ = arg.partition("=")
            if flag in SECRET_FLAGS:
                if eq:
                    masked.append(f"{flag}={MASK}")
                else:
                    masked.append(arg)
                    hide_next = True
                continue
            masked.append(self.mask(arg))
        return masked
