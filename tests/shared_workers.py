"""Long-lived workers over a real vLLM, shared by the tests that only need a healthy one.

A real ``vllm serve`` of the tiny model takes 20-40 s to start on this project's 2 cores, so
a test that only needs "a healthy worker serving the tiny model" takes one from this pool
instead of starting its own: one start per configuration for the whole run, whichever
modules its tests live in. A test that needs its own flags, failure, signal or death keeps
its own launch.

The pool holds at most one worker at a time, so that no two vLLMs share the 2 cores unless a
test starts both:

* each configuration is a fixture registered here (:func:`pooled`); asking for another
  configuration, or running any other test that starts a vLLM (marked ``vllm``, ``image`` or
  ``soak``), stops the live one first;
* the collection puts the users of a configuration next to each other (at the place of the
  first one), so each starts once; a test that ends its worker (a SIGTERM, vLLM's death)
  takes it out of the pool with :meth:`SharedWorkers.retire`, and such tests (their fixture
  registered with ``ends_it=True``) run last among their configuration's users;
* a worker a test left unhealthy (it died, its vLLM stopped answering) is not handed out
  again: the next user gets a fresh one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import pytest


class Shared(Protocol):
    def alive(self) -> bool:
        """Whether the worker can still serve (its process runs and vLLM answers)."""
        ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Pooled:
    key: str
    """The configuration (one live worker per key at most, one key at a time)."""
    ends_it: bool
    """The fixture's tests end the worker: they run last among the key's users."""


#: (the module that defines it, fixture name) → the configuration it hands out. The module
#: counts: another module may have a fixture of the same name.
POOLED_FIXTURES: dict[tuple[str, str], Pooled] = {}

W = TypeVar("W", bound=Shared)


def pooled(fixture: str, key: str, *, ends_it: bool = False) -> None:
    """Register the calling module's fixture ``fixture`` as handing out the pool's worker
    ``key``."""
    module = sys._getframe(1).f_globals["__name__"]
    POOLED_FIXTURES[(module, fixture)] = Pooled(key, ends_it)


class SharedWorkers:
    """The pool: at most one live worker, of one configuration."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._worker: Shared | None = None
        self.starts: dict[str, int] = {}

    def get(self, key: str, start: Callable[[], W]) -> W:
        """The live worker of ``key``, started (after stopping any other) when there is none
        or it can no longer serve."""
        if self._key == key and self._worker is not None and self._worker.alive():
            return self._worker  # type: ignore[return-value]
        self.stop()
        worker = start()
        self._key, self._worker = key, worker
        self.starts[key] = self.starts.get(key, 0) + 1
        return worker

    def retire(self, key: str, start: Callable[[], W]) -> W:
        """The worker of ``key`` (as :meth:`get`), taken out of the pool: the caller ends
        it, and the next user of ``key`` gets a new one."""
        worker = self.get(key, start)
        self._key, self._worker = None, None
        return worker

    def stop(self) -> None:
        if self._worker is not None:
            worker, self._worker, self._key = self._worker, None, None
            worker.stop()


POOL = SharedWorkers()


def _pooled_of(item: pytest.Item) -> Pooled | None:
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    found = set()
    for name, defs in definitions.items():
        if defs:  # the definition in force is the last (the closest to the test)
            func = defs[-1].func
            entry = POOLED_FIXTURES.get((getattr(func, "__module__", ""), name))
            if entry is not None:
                found.add(entry)
    if len({entry.key for entry in found}) > 1:
        raise pytest.UsageError(f"{item.nodeid} asks for two shared workers at once: "
                                f"{sorted(entry.key for entry in found)}")
    return max(found, key=lambda entry: entry.ends_it, default=None)


def order(items: list[pytest.Item]) -> None:
    """Each configuration's users together, at the place of the first; those that end the
    worker last among them. Every other test keeps its place."""
    first: dict[str, int] = {}
    keys: list[tuple[int, int, int]] = []
    for index, item in enumerate(items):
        entry = _pooled_of(item)
        if entry is None:
            keys.append((index, 0, index))
        else:
            place = first.setdefault(entry.key, index)
            keys.append((place, 1 + entry.ends_it, index))
    ordered = [item for _, item in sorted(zip(keys, items, strict=True), key=lambda p: p[0])]
    items[:] = ordered


_STARTS_VLLM = ("vllm", "image", "soak")


def before_test(item: pytest.Item) -> None:
    """A test that may start a vLLM of its own runs with no shared worker alive."""
    if _pooled_of(item) is None and any(item.get_closest_marker(m) for m in _STARTS_VLLM):
        POOL.stop()
