"""Running one validated job: queueing for the generation slot, the worker thread, the hand-off
of its output to the request task, SSE framing and cancellation on disconnect.

Generation runs in a worker thread, one at a time (``state.slot``); a client that disconnects
cancels its generation at the next token, and its request is counted and logged as status 499
("client closed request", as nginx logs it), not as the 200 nobody received. One that
disconnects while its request waits for the slot leaves the queue at once: its generation,
which never starts, is counted as cancelled. A streamed job answers ``data: {chunk}\\n\\n``
events and ``data: [DONE]\\n\\n``; an error after the stream started is sent as one error
event. A generation the server's shutdown stops (:meth:`ServerState.stop_generations`) runs to
its end instead: its answer, stream or JSON, ends properly with ``finish_reason: "length"``
(cut short), and a request still waiting for the slot then gets a 503
``server_shutting_down``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from localmoe.serve.errors import HTTPError, error_from_exception, log
from localmoe.serve.state import ServerState, stopped_by_server

_END = object()  # the worker is done

#: the status a request the client closed before its answer ended is counted and logged with
#: (nginx's "client closed request"); the client never sees it
CLIENT_CLOSED = 499


def json_bytes(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON, non-ASCII kept; a text holding a lone surrogate (from a request's
    ``"\\ud800"`` escape, or model output) is written ASCII-escaped instead, which is still
    the same JSON value, rather than failing to encode."""
    try:
        return json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(obj).encode()


class SafeJSONResponse(JSONResponse):
    """A JSONResponse that encodes any text (see :func:`json_bytes`)."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def sse(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (UTF-8, not ASCII-escaped; see
    :func:`json_bytes`)."""
    return b"data: " + json_bytes(obj) + b"\n\n"


class _Handoff:
    """Items from the generation thread to the request task.

    Items go into a deque and the event loop is woken only when it is not already due to
    drain it, so a fast model's tokens coalesce into fewer wake-ups and socket writes.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.wake = asyncio.Event()
        self.pending = False

    def put(self, item: Any) -> None:
        """Called from the worker thread."""
        self.items.append(item)
        if not self.pending:
            self.pending = True
            self.loop.call_soon_threadsafe(self.wake.set)

    async def take(self) -> list:
        """All items put since the last take (at least one)."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            self.pending = False
            got = []
            while self.items:
                got.append(self.items.popleft())
            if got:
                return got


def _job_times(job, t_arrival: float) -> tuple[float | None, float | None]:
    """(TTFT from the request's arrival, mean time per output token after the first), seconds."""
    ttft = tpot = None
    if job.t_first is not None:
        ttft = job.t_first - t_arrival
        n = getattr(job.result, "completion_tokens", 0) or 0
        if n > 1 and job.t_end is not None:
            tpot = (job.t_end - job.t_first) / (n - 1)
    return ttft, tpot


def _mark_cut(obj: dict, job, cancel) -> dict:
    """``obj`` (a chunk or a response) with ``finish_reason: "length"`` where the server's
    shutdown stopped the generation (the engine's "cancelled", which the OpenAI layer reports
    as "stop"): the answer was cut short, which "stop" would hide."""
    if stopped_by_server(cancel) and getattr(job.result, "finish_reason", None) == "cancelled":
        for choice in obj.get("choices") or ():
            if choice.get("finish_reason") == "stop":
                choice["finish_reason"] = "length"
    return obj


def _work(job, cancel: threading.Event, t_arrival: float, handoff: _Handoff,
          state: ServerState) -> None:
    """The worker thread: run ``job``, hand its SSE-encoded chunks (stream) or response dict
    over, then an exception if it raised and ``_END``; frees the slot. A stream the client
    left is dropped at once; one the server's shutdown stopped runs on to its final chunks."""
    m = state.metrics
    try:
        if job.stream:
            it = job.chunks()
            try:
                for chunk in it:
                    handoff.put(sse(_mark_cut(chunk, job, cancel)))
                    if cancel.is_set() and not stopped_by_server(cancel):
                        break
            finally:
                it.close()
        else:
            handoff.put(_mark_cut(job.response(), job, cancel))
    except BaseException as e:  # noqa: BLE001 -- handed to the request task
        handoff.put(e)
    finally:
        # before the client sees the end; a set cancel means the client left (the request task
        # sets it only after _END otherwise)
        m.observe_generation(job.result, *_job_times(job, t_arrival), stopped=cancel.is_set())
        handoff.put(_END)

        def done():
            m.running -= 1
            state.slot.release()

        handoff.loop.call_soon_threadsafe(done)


async def _watch_disconnect(request: Request, cancel: threading.Event) -> bool:
    """Set ``cancel`` when the client disconnects; True when it did."""
    try:
        while not cancel.is_set():
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                cancel.set()
                return True
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 -- receive channel closed: nothing to watch
        pass
    return False


class CountedStream(StreamingResponse):
    """The SSE response of a streamed job. Its status line (200) goes out before the answer,
    so the request is counted when the stream ends (``on_end(status)``): 200 when the
    client read it to ``[DONE]``, :data:`CLIENT_CLOSED` when it went away first."""

    def __init__(self, body, on_end, **kw):
        super().__init__(body, **kw)
        self.completed = False   # set by the body once [DONE] was sent
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end(200 if self.completed else CLIENT_CLOSED)


async def _sse_stream(backlog: list, handoff: _Handoff, cancel: threading.Event, watcher,
                      job, done: list):
    """The body of a streamed response: the worker's events until ``_END``, an error event if
    it raised, then ``[DONE]``; closing it cancels the generation. ``done[0]`` (the response)
    is marked completed once ``[DONE]`` was sent for a generation the client did not cut."""
    try:
        batch = backlog
        while True:
            out = []
            ended = False
            for item in batch:
                if item is _END:
                    ended = True
                    break
                if isinstance(item, BaseException):
                    out.append(sse(error_from_exception(item).body()))
                    ended = True
                    break
                out.append(item)
            if out:
                yield b"".join(out)
            if ended:
                break
            batch = await handoff.take()
        yield b"data: [DONE]\n\n"
        if not _cut_by_client(job, watcher, cancel):
            done[0].completed = True
    finally:
        cancel.set()  # no-op after a finished generation; stops one still running
        watcher.cancel()


def _cut_by_client(job, watcher, cancel) -> bool:
    """Whether the client went away before ``job``'s answer ended: the disconnect watcher saw
    it go (before that, or with no watcher, a generation cut short by the cancel event, unless
    the server's shutdown set it: that answer was sent whole)."""
    if watcher.done() and not watcher.cancelled() and watcher.result():
        return True
    if stopped_by_server(cancel):
        return False
    return getattr(job.result, "finish_reason", None) == "cancelled"


def log_client_closed(endpoint: str, job, queued: bool = False) -> None:
    """One log line for a request the client closed before its answer ended (``queued``:
    while it waited for the model, so nothing was generated)."""
    if queued:
        log.info("%s: the client closed the request (%d) while it waited for the model; "
                 "nothing was generated", endpoint, CLIENT_CLOSED)
        return
    n = getattr(job.result, "completion_tokens", None)
    log.info("%s: the client closed the request (%d) before the answer ended%s", endpoint,
             CLIENT_CLOSED, "" if n is None else f"; {n} tokens generated")


async def _acquire_unless_gone(slot: asyncio.Semaphore, watcher: asyncio.Task) -> bool:
    """Wait for ``slot``; False (the slot not held) as soon as ``watcher`` saw the client
    disconnect first."""
    acq = asyncio.ensure_future(slot.acquire())
    try:
        while not acq.done():
            await asyncio.wait({acq, watcher} if not watcher.done() else {acq},
                               return_when=asyncio.FIRST_COMPLETED)
            if watcher.done() and not watcher.cancelled() and watcher.result():
                break
    finally:
        if not acq.done():  # gone, or this task was cancelled: leave the queue
            acq.cancel()
            try:
                await acq
            except asyncio.CancelledError:
                pass
    if acq.cancelled():
        return False
    if watcher.done() and not watcher.cancelled() and watcher.result():
        slot.release()  # got it just as the client left: the next one may have it
        return False
    return True


async def generate(request: Request, job, cancel: threading.Event, t_arrival: float,
                   state: ServerState, endpoint: str = ""):
    """Wait for the slot, run ``job`` in a worker thread; a JSONResponse or an SSE
    :class:`CountedStream` (which counts the request in ``state.metrics`` under ``endpoint``
    when it ends). An error before the first output is raised (answered as an error object
    by the caller), and so is an HTTPError :data:`CLIENT_CLOSED` for a job whose client
    disconnected before its answer began: while it waited for the slot (it leaves the queue
    then, its generation counted as cancelled), or before its JSON answer or a stream's first
    chunk was ready."""
    m = state.metrics
    # watched from the start: a client that leaves while its request waits leaves the queue
    watcher = asyncio.create_task(_watch_disconnect(request, cancel))
    m.queue_depth += 1
    try:
        got = await _acquire_unless_gone(state.slot, watcher)
    except BaseException:
        watcher.cancel()
        raise
    finally:
        m.queue_depth -= 1
    if not got:
        m.count_cancelled()  # its generation never started
        log_client_closed(endpoint, job, queued=True)
        raise HTTPError(CLIENT_CLOSED, "the client closed the request while it waited for "
                        "the model", code="client_disconnected")
    if state.stopping:  # the shutdown's grace period is over: no generation starts now
        state.slot.release()
        watcher.cancel()
        m.count_cancelled()
        raise HTTPError(503, "the server is shutting down; retry the request later or on "
                        "another server", type_="server_error", code="server_shutting_down")
    m.running += 1
    handoff = _Handoff(asyncio.get_running_loop())
    threading.Thread(target=_work, args=(job, cancel, t_arrival, handoff, state),
                     name="localmoe-gen", daemon=True).start()
    try:
        backlog = await handoff.take()
    except BaseException:
        cancel.set()
        watcher.cancel()
        raise
    first = backlog[0]
    if cancel.is_set() and not stopped_by_server(cancel):
        # only the watcher (or the shutdown, whose stopped answer is sent) sets it before the
        # answer (or the stream's first chunk): the client is gone, whatever the worker
        # handed over (an error of the cut generation included)
        log_client_closed(endpoint, job)
        raise HTTPError(CLIENT_CLOSED, "the client closed the request before the answer "
                        "was ready", code="client_disconnected")
    if isinstance(first, BaseException) or first is _END:
        watcher.cancel()
        if first is _END:
            raise HTTPError(500, "generation ended without output", type_="server_error")
        raise first
    if not job.stream:
        watcher.cancel()
        return SafeJSONResponse(first)

    def on_end(status: int) -> None:
        # the body may never have run (the server saw the disconnect first): stop the work
        cancel.set()
        watcher.cancel()
        if status == CLIENT_CLOSED:
            log_client_closed(endpoint, job)
        m.count_request(endpoint, status)

    done: list = []
    resp = CountedStream(_sse_stream(backlog, handoff, cancel, watcher, job, done), on_end,
                         media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    done.append(resp)
    return resp
