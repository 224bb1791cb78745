"""The relay of one streamed answer: vLLM's SSE body read in the background, handed out as
batches of whole events.

Why a reader task: the runpod SDK POSTs each batch before it asks for the next, so a consumer
that read vLLM's body itself would hold vLLM back for the length of every POST. The task
reads as fast as vLLM writes into a buffer; each batch takes everything buffered. The bytes
are cut only after an event's blank line, so no event and no UTF-8 character is ever split.

The batching itself (:class:`PendingBatches`: how many items a yield waits for, and for how
long) also hands out a batch job's results (:mod:`worker.jobs.batch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

import httpx

from worker.jobs import timeline
from worker.jobs.routing import BatchPolicy

logger = logging.getLogger("worker.handler")

# An SSE event ends with a blank line; the spec allows three line-ending styles.
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")

T = TypeVar("T")


class PendingBatches(Generic[T]):
    """Items added in the background (each counting for some units: SSE events, results),
    handed out in batches as a :class:`BatchPolicy` says, until :meth:`finish`."""

    def __init__(self) -> None:
        self._pending: list[T] = []
        self._pending_units = 0
        self._first_pending_at = 0.0  # when the oldest item still waiting arrived
        self._finished = False
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self._target = 1  # units the consumer waits for; wake it only then
        self._wake_on_first = False  # ... or at the first one, to start its clock
        self._loop = asyncio.get_running_loop()

    def add(self, item: T, units: int = 1) -> None:
        if not self._pending_units:
            self._first_pending_at = self._loop.time()
        self._pending.append(item)
        self._pending_units += units
        if self._pending_units >= self._target or self._wake_on_first:
            self._wakeup.set()

    def finish(self, error: BaseException | None = None) -> None:
        """No more items: the batches end with what is pending, then raise ``error``."""
        self._error = error
        self._finished = True
        self._wakeup.set()

    async def _wait_for_batch(self, target: int, max_delay: float) -> None:
        """Until ``target`` units wait, the items end, or the oldest waited ``max_delay`` s.

        The clock of an item starts when it arrives or when this is called, whichever is
        later: the consumer calls it once the previous batch was posted.
        """
        self._target = target
        resumed = self._loop.time()
        while self._pending_units < target and not self._finished:
            self._wakeup.clear()
            if not (max_delay and self._pending_units):
                self._wake_on_first = bool(max_delay)
                await self._wakeup.wait()
                continue
            self._wake_on_first = False
            deadline = max(self._first_pending_at, resumed) + max_delay
            if deadline <= self._loop.time():
                return
            timer = self._loop.call_at(deadline, self._wakeup.set)
            try:
                await self._wakeup.wait()
            finally:
                timer.cancel()

    async def batches(self, policy: BatchPolicy) -> AsyncIterator[list[T]]:
        sizes = policy.sizes()
        while True:
            await self._wait_for_batch(sizes.current, policy.max_delay)
            if self._pending:
                batch = self._pending
                self._pending = []
                self._pending_units = 0
                yield batch
                sizes.advance()
            elif self._finished:
                break
        if self._error is not None:
            raise self._error


class SseRelay:
    """Reads an SSE body in the background and hands out batches of whole events.

    The reader task owns the response: cancelling it closes the connection, which is how
    vLLM learns to abort the generation.
    """

    def __init__(self, response: httpx.Response) -> None:
        self._events = PendingBatches[str]()
        self._response = response
        self._reader = asyncio.create_task(self._read(response.aiter_bytes()))

    def abandon(self, _owner: object = None) -> None:
        """Stop reading and close the response now (callable from a done-callback)."""
        if not self._reader.done():
            logger.debug("the job's task ended: cutting vLLM's stream")
        self._reader.cancel()

    async def _read(self, chunks: AsyncIterator[bytes]) -> None:
        buffer = bytearray()
        error: BaseException | None = None
        try:
            async for chunk in chunks:
                # A terminator is at most 4 bytes: rescan only the seam with the new chunk.
                scan_from = max(0, len(buffer) - 3)
                buffer += chunk
                cut, count = 0, 0
                for match in _EVENT_END.finditer(buffer, scan_from):
                    cut, count = match.end(), count + 1
                if count:
                    self._add(buffer[:cut].decode("utf-8", errors="replace"), count)
                    del buffer[:cut]
            if buffer:  # an unterminated last event: relay it as it is
                self._add(buffer.decode("utf-8", errors="replace"), 1)
        except Exception as exc:  # handed to the consumer, which maps it
            error = exc
        except asyncio.CancelledError:
            logger.debug("vLLM's stream cut: closing its connection")
            raise
        finally:
            self._events.finish(error)
            await self._response.aclose()

    def _add(self, text: str, events: int) -> None:
        timeline.mark("first_event")  # the reader runs in a copy of the job task's context
        self._events.add(text, events)

    async def batches(self, policy: BatchPolicy) -> AsyncIterator[str]:
        async for texts in self._events.batches(policy):
            yield "".join(texts)

    async def aclose(self) -> None:
        if not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
