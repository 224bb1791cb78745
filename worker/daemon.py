"""Blocking calls in daemon threads, their results delivered to futures of an event loop.

The Hub's client is synchronous, and a request can hang (DNS, a stuck proxy). The pre-flight
and the prefetch run such calls here rather than in the loop's default executor, whose threads
are joined at exit: a request hanging in a daemon thread can neither hold up the start nor keep
the process from exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["in_daemon_thread"]

_T = TypeVar("_T")


def in_daemon_thread(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], _T], name: str
) -> asyncio.Future[_T]:
    """Run ``fn`` in a new daemon thread; its result arrives in a future of ``loop``.

    Cancelling the future only stops the waiting: the thread runs to its end, and its answer
    is dropped.
    """
    future: asyncio.Future[_T] = loop.create_future()

    def deliver(result: _T | None, error: BaseException | None) -> None:
        if future.done():
            return  # the deadline passed: nobody waits for this answer any more
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # delivered to the awaiting side, not lost in the thread
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
