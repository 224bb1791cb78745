"""A batch job: every line of a file of requests sent to vLLM, each result out once done.

:meth:`BatchRunner.run` is what the proxy runs for a job whose input holds ``batch`` or
``batch_url`` (:mod:`worker.jobs.batch_format` has the formats, :mod:`worker.jobs.batch_files`
the files). The job is one job of the SDK's loop (one of ``MAX_CONCURRENCY``); its lines go
to vLLM through the proxy's own pooled client (:meth:`worker.jobs.handler.Proxy.answer`):

* **Concurrency.** At most ``BATCH_CONCURRENCY`` lines are in flight, those of every batch of
  the worker together (one semaphore): enough to keep vLLM's running batch full (its
  ``max_num_seqs``), and no more, so that an ordinary job that arrives waits in vLLM's queue
  for one line to end, not behind a batch's surplus. A line's slot is freed by its task's
  done-callback, which runs even for a task cancelled before it started.
* **Results.** Each result is added as its line ends and handed out in pieces of whole results
  as the job's stream batching says (:class:`worker.jobs.relay.PendingBatches`: the first piece
  at once, the next ones growing, none waiting more than ``max_batch_delay``), each with the
  counts; with ``output_url`` they are kept, written there at the end, and the job's output is
  a summary. A write that still fails after its tries keeps them on disk (the volume, else the
  worker's own) and puts them into the job's output instead, the summary saying why and
  where the file is; results too large for the job's output fail the job with an error that
  names their file.
* **Cancel.** The job's task ending (the SDK cancels it) cancels the dispatch and every line in
  flight: the lines not sent never are, and each request in flight is closed, which makes vLLM
  abort it.
* **SIGTERM** (:meth:`BatchRunner.drain`): no line is sent any more, each unsent line gets a
  ``worker_stopping`` result at once, the lines in flight get their share of the drain
  (:func:`worker.jobs.batch_format.lines_drain`) and are then aborted with one; the job then
  ends as a completed job, every line answered.
* **Progress.** A log line every ``WORKER_PROGRESS_INTERVAL`` seconds while a batch runs, and
  one at its end.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from worker.errors import InvalidRequest, WorkerError
from worker.jobs import batch_format as fmt
from worker.jobs.batch_files import BatchFiles
from worker.jobs.capacity import Shape
from worker.jobs.pacer import Pacer
from worker.jobs.relay import PendingBatches
from worker.jobs.routing import BatchPolicy, VllmRequest

logger = logging.getLogger("worker.batch")
T = TypeVar("T")

LineSender = Callable[[VllmRequest], Awaitable[fmt.LineAnswer]]
"""Sends one line's request to vLLM: its answer, or a WorkerError (timeout, vLLM gone)."""


@dataclass(frozen=True)
class BatchOptions:
    """What the mode that serves decides for batch jobs: the lines in flight at once, the
    files' reader and writer, the seconds between two progress lines."""

    concurrency: int = fmt.DEFAULT_CONCURRENCY
    files: BatchFiles | None = None
    progress_interval: float = 10.0


#: A batch past these many lines, or a file past these many characters, is parsed and written
#: in a thread; a small one on the loop (a thread's hand-off costs more than its parse).
BIG_LINES = 1000
BIG_TEXT = 1 << 20


async def _off_loop(big: bool, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, in a thread when the work is ``big``."""
    return await asyncio.to_thread(function, *args) if big else function(*args)


def _release(pacer: Pacer, shape: Shape, _task: object) -> None:
    pacer.release_line(shape)


def _result_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


class BatchRunner:
    """Runs batch jobs over one :data:`LineSender`, their lines sharing the worker's slots."""

    def __init__(self, send: LineSender, options: BatchOptions, pacer: Pacer | None = None
                 ) -> None:
        self._send = send
        self._options = options
        self._files = options.files or BatchFiles()
        # The lines' gate: BATCH_CONCURRENCY lines at most, none while an ordinary job taken
        # is on its way to vLLM, and with MAX_CONCURRENCY auto only in the room vLLM has.
        self._pacer = pacer or Pacer(options.concurrency, line_limit=options.concurrency)
        self._runs: set[_Run] = set()
        self._drain: float | None = None  # set by a SIGTERM: the lines' share of the drain

    async def aclose(self) -> None:
        """Close the files' client (its connections to the stores)."""
        await self._files.aclose()

    def drain(self, drain_timeout: float) -> None:
        """SIGTERM: stop sending lines; those in flight get their share of ``drain_timeout``."""
        self._drain = fmt.lines_drain(drain_timeout)
        for run in list(self._runs):
            run.stop(self._drain)

    async def run(self, job_id: object, job_input: dict[str, Any],
                  defaults: BatchPolicy) -> AsyncIterator[Any]:
        """The job's pieces (or its summary); InvalidRequest when the batch is unusable."""
        spec = fmt.parse_batch_input(job_input, defaults)
        # Up to 200 MiB of lines: a big batch is read, parsed and (below) written in a thread,
        # so that the event loop keeps serving the other jobs (and their streams) meanwhile.
        if spec.source is not None:
            text = await self._files.read(spec.source)
            items = await _off_loop(len(text) > BIG_TEXT, fmt.file_items, text)
        else:
            items = fmt.given_items(spec.lines or ())
        parsed = await _off_loop(len(items) > BIG_LINES, fmt.parse_lines, items, spec.policy)
        if not parsed.lines:
            raise fmt.unusable(parsed.bad)
        if spec.output is not None:
            await self._files.check(spec.output)
        run = _Run(self, job_id, parsed, len(items))
        logger.info("batch %s: %d lines (%d malformed), at most %d in flight%s", job_id,
                    len(items), len(parsed.bad), self._options.concurrency,
                    f", results to {fmt.shown(spec.output.url)}" if spec.output else "")
        if spec.output is None:
            async for results in run.results(spec.policy):
                yield fmt.piece(results, run.counts)
            return
        kept: list[dict[str, Any]] = []
        async for results in run.results(spec.policy):
            kept.extend(results)
        data = await _off_loop(len(kept) > BIG_LINES, lambda: b"".join(fmt.jsonl(kept)))
        try:
            await self._files.write(spec.output, data)
        except InvalidRequest as exc:
            async for item in self._not_written(job_id, spec.output, kept, data, run.counts,
                                                exc.message):
                yield item
            return
        yield fmt.summary(run.counts, spec.output)

    async def _not_written(self, job_id: object, output: fmt.FileUrl,
                           results: list[dict[str, Any]], data: bytes, counts: fmt.Counts,
                           why: str) -> AsyncIterator[Any]:
        """Results ``output`` did not take (``why``): the work is in them, so they are kept
        on disk, and go into the job's output too where they fit its result; results too
        large for it fail the job with an error that names their file."""
        try:
            kept = await self._files.keep(job_id, data)
            where: str | None = f"kept in {kept.path}, {kept.where}"
            problem = ""
        except OSError as exc:
            kept, where, problem = None, None, str(exc)
        pieces = [fmt.piece(results[start:start + fmt.FALLBACK_PIECE], counts)
                  for start in range(0, len(results), fmt.FALLBACK_PIECE)]
        summary = fmt.summary(counts, output, f"{why} The results are in this output" + (
            f", and {where}." if where else f"; {problem}."))
        if await _off_loop(len(results) > BIG_LINES, fmt.fits_result, job_id, len(data),
                           [*pieces, summary]):
            logger.warning("batch %s: %s The results go into the job's output instead%s.",
                           job_id, why, f", and are {where}" if where else f"; {problem}")
            for item in (*pieces, summary):
                yield item
            return
        said = (f"The {len(results)} results ({len(data):,} bytes, more than the job's output "
                f"holds) are {where}." if where else
                f"The {len(results)} results ({len(data):,} bytes) are more than the job's "
                f"output holds, and were {problem}: they are lost.")
        logger.warning("batch %s: %s %s", job_id, why, said)
        raise InvalidRequest(f"{why} {said}", param=output.field,
                             results_file=kept.path if kept else None, **counts.figures())


class _Run:
    """One batch job's lines: their dispatch, their results, its progress lines.

    Every line gets one result, however its task ends: its own (an answer, an error), or from
    the task's done-callback (aborted by a SIGTERM, even before it began). The dispatch's
    done-callback answers the lines it did not send and closes the results once every line
    in flight has ended."""

    def __init__(self, runner: BatchRunner, job_id: object, parsed: fmt.ParsedLines,
                 total: int) -> None:
        self._runner = runner
        self._job_id = job_id
        self._lines = parsed.lines
        self._bad = parsed.bad
        self.counts = fmt.Counts(total)
        self._pending = PendingBatches[dict[str, Any]]()
        self._in_flight: dict[asyncio.Task[None], fmt.BatchLine] = {}
        self._sent = 0
        self._drain: float | None = None
        self._dispatch: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None
        self._started = time.monotonic()

    def _add(self, result: dict[str, Any]) -> None:
        self.counts.add(result)
        self._pending.add(result)

    async def results(self, policy: BatchPolicy) -> AsyncIterator[list[dict[str, Any]]]:
        """The results in pieces, until every line has one."""
        for bad in self._bad:
            self._add(fmt.failed(bad.number, bad.custom_id, bad.reason, _result_id()))
        runner = self._runner
        runner._runs.add(self)
        job_task = asyncio.current_task()
        self._dispatch = asyncio.create_task(self._send_lines(), name="batch-dispatch")
        self._dispatch.add_done_callback(self._dispatched)
        # The SDK cancels a job's task, often while it POSTs a piece, not inside this
        # generator: the lines are tied to the task itself.
        if job_task is not None:
            job_task.add_done_callback(self._abandon)
        progress = asyncio.create_task(self._report(), name="batch-progress")
        if runner._drain is not None:  # taken as the SIGTERM came
            self.stop(runner._drain)
        try:
            async for results in self._pending.batches(policy):
                yield results
        finally:
            runner._runs.discard(self)
            if job_task is not None:
                job_task.remove_done_callback(self._abandon)
            self._abandon()
            progress.cancel()
            logger.info("%s", fmt.progress_line(self._job_id, self.counts,
                                                time.monotonic() - self._started))

    async def _send_lines(self) -> None:
        pacer = self._runner._pacer
        for line in self._lines:
            shape = pacer.line_shape(line.request.route, line.request.body)
            await pacer.acquire_line(shape)
            task = asyncio.create_task(self._line(line), name="batch-line")
            self._in_flight[task] = line
            self._sent += 1
            # Freed however the task ends, even cancelled before it began.
            task.add_done_callback(functools.partial(_release, pacer, shape))
            task.add_done_callback(self._ended)

    async def _line(self, line: fmt.BatchLine) -> None:
        try:
            result = fmt.answered(line, await self._runner._send(line.request), _result_id())
        except WorkerError as exc:
            result = fmt.failed(line.number, line.custom_id, exc, _result_id())
        self._add(result)

    def _ended(self, task: asyncio.Task[None]) -> None:
        line = self._in_flight.pop(task)
        if task.cancelled():
            if self._drain is not None:  # else the job was cancelled: no result is wanted
                self._add(fmt.aborted(line, self._drain, _result_id()))
        elif (exc := task.exception()) is not None:
            logger.error("batch %s: line %d failed in the worker", self._job_id, line.number,
                         exc_info=exc)
            self._add(fmt.failed(line.number, line.custom_id, WorkerError(
                f"The worker failed on this line ({type(exc).__name__})."), _result_id()))

    def _dispatched(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() and self._drain is None:
            return  # the job was cancelled
        unsent = self._lines[self._sent:]
        for line in unsent:
            self._add(fmt.not_sent(line, _result_id()))
        if unsent:
            logger.info("batch %s: %d line(s) not sent (SIGTERM)", self._job_id, len(unsent))
        error = None if task.cancelled() else task.exception()
        self._closing = asyncio.create_task(self._close(error), name="batch-close")

    async def _close(self, error: BaseException | None) -> None:
        while self._in_flight:
            await asyncio.wait(list(self._in_flight))
        self._pending.finish(error)

    def stop(self, drain: float) -> None:
        """SIGTERM: send no more lines; abort those in flight after ``drain`` seconds."""
        if self._drain is not None:
            return
        self._drain = drain
        if self._dispatch is not None:
            self._dispatch.cancel()
        asyncio.get_running_loop().call_later(drain, self._abort_in_flight)

    def _abort_in_flight(self) -> None:
        for task in list(self._in_flight):
            task.cancel()

    def _abandon(self, _task: object = None) -> None:
        """The job ended (done, failed or cancelled): nothing of it keeps running."""
        for task in (self._dispatch, self._closing):
            if task is not None:
                task.cancel()
        self._abort_in_flight()

    async def _report(self) -> None:
        interval = self._runner._options.progress_interval
        while True:
            await asyncio.sleep(interval)
            logger.info("%s", fmt.progress_line(self._job_id, self.counts,
                                                time.monotonic() - self._started))


__all__ = ["BatchOptions", "BatchRunner", "LineSender"]
