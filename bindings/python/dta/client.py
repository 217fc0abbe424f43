"""Clients of the dispatcher (``dta.v1.Dispatcher``) for rollout workers.

:class:`AsyncRolloutClient` (asyncio, ``grpc.aio``) and :class:`RolloutClient` (blocking, thread
safe) stream trajectories to ``dta-dispatcher`` over one bidirectional ``Ingest`` stream and hand
back the dispatcher's answer to each as an :class:`Ack`: accepted (durable in the dispatcher's
write-ahead log: it will be trained exactly once), accepted as ``already_accepted`` (an identical
resend), or rejected with the offending field and the reason. A rejection is an answer, not an
error: the stream goes on.

Semantics follow the C++ ``RolloutSender`` (``dispatcher/client/dispatcher_client.h``):

* Delivery is at-least-once on the wire and exactly-once in effect. When the stream breaks (the
  dispatcher restarts, the network drops) or an answer does not come within ``call_timeout``, the
  client reconnects, backing off from 10 ms to 1 s while no answer arrives, and resends every
  unanswered trajectory in order; the dispatcher answers a resend of a stored one as
  ``already_accepted`` without storing it twice.
* It gives up with :class:`DispatcherError` (``UNAVAILABLE``) when no answer has arrived for
  ``retry_for`` seconds, and at once on errors that retrying cannot fix (``UNAUTHENTICATED``: a
  wrong token); every unanswered trajectory then fails with that error, and so does every later
  call: make a new client.
* Flow control: at most ``max_in_flight`` trajectories are submitted and unanswered at a time;
  :meth:`AsyncRolloutClient.submit` waits for room. The dispatcher adds its own backpressure
  (``--max_pending``) by not reading the stream.
* Every unary call (:meth:`~AsyncRolloutClient.status`, :meth:`~AsyncRolloutClient.statistics`)
  has a deadline of ``call_timeout`` and is retried like the stream.

Usage::

    async with dta.AsyncRolloutClient("127.0.0.1:50051") as client:
        acks = await client.send_all(trajectories)
        rejected = [a for a in acks if not a.accepted]   # a.field, a.reason say why
        status = await client.wait_for_policy_version(3)  # reload the weights

    with dta.RolloutClient("127.0.0.1:50051", token="s3cret") as client:
        client.send(trajectory).check()                   # raises TrajectoryRejected
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
from typing import AsyncIterator, Awaitable, Callable, Iterable, Optional, TypeVar, Union

import grpc
from grpc import aio

from dta import _wire
from dta.trajectory import Trajectory
from dta.v1 import dispatcher_pb2, dispatcher_pb2_grpc

__all__ = [
    "Ack",
    "AsyncRolloutClient",
    "DispatcherError",
    "DispatcherStatistics",
    "DispatcherStatus",
    "RolloutClient",
    "StepStatistics",
    "TrajectoryRejected",
]

#: What the clients send: a :class:`dta.Trajectory` or the wire message itself.
TrajectoryLike = Union[Trajectory, dispatcher_pb2.Trajectory]

_T = TypeVar("_T")
_BACKOFF_MIN_S = 0.01
_BACKOFF_MAX_S = 1.0
# Codes that a retry can fix: the dispatcher is restarting or unreachable, or a deadline passed.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# On the Ingest stream also CANCELLED (a dispatcher shutting down cancels its streams, as in the
# C++ RolloutSender) and INTERNAL: when the connection drops during a write, grpc.aio reports
# "Internal error from Core" instead of the transport's status (grpc/grpc#36066). Resending is
# always safe there: the dispatcher de-duplicates by id.
_RETRYABLE_STREAM = _RETRYABLE | {grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL}
# The dispatcher asks an Ingest stream to back off (its memory for received trajectories not yet
# stored, or its open streams, at their limits): RESOURCE_EXHAUSTED with a message starting so
# (dispatcher/wire/ingest_back_off.h). gRPC's own "message larger than max" has the same code and
# can never succeed.
_INGEST_BACK_OFF_PREFIX = "Ingest: "


def _stream_may_retry(code: grpc.StatusCode, details: str) -> bool:
    """Whether an Ingest stream that ended so is worth resending on (after a backoff)."""
    return code in _RETRYABLE_STREAM or (code == grpc.StatusCode.RESOURCE_EXHAUSTED
                                         and details.startswith(_INGEST_BACK_OFF_PREFIX))


@dataclasses.dataclass(frozen=True)
class Ack:
    """The dispatcher's answer to one trajectory."""

    id: str
    #: Durable in the dispatcher's log (trained exactly once, or dropped as too stale, counted).
    accepted: bool
    #: Accepted earlier with identical content: this was a resend, nothing was stored twice.
    already_accepted: bool = False
    #: Rejected: the offending field (``"loss_mask"``, ``"tokens"``, ``"id"`` for an id taken by
    #: other content, ...) and what is wrong with it.
    field: str = ""
    reason: str = ""

    def check(self) -> "Ack":
        """Returns this answer if accepted; raises :class:`TrajectoryRejected` otherwise."""
        if not self.accepted:
            raise TrajectoryRejected(self)
        return self


class TrajectoryRejected(ValueError):
    """Raised by :meth:`Ack.check` for a rejected trajectory; ``ack`` names the field."""

    def __init__(self, ack: Ack) -> None:
        super().__init__(f"trajectory '{ack.id}' rejected: {ack.reason}")
        self.ack = ack


class DispatcherError(Exception):
    """A call or a trajectory the client could not complete. ``code`` is the ``grpc.StatusCode``:
    ``UNAVAILABLE`` after ``retry_for`` without an answer, ``UNAUTHENTICATED`` for a missing or
    wrong token, ``CANCELLED`` for trajectories still unanswered when the client was closed."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclasses.dataclass(frozen=True)
class DispatcherStatus:
    """``GetStatus``: what a rollout worker needs to know when to reload weights."""

    serving: bool
    committed_steps: int
    #: Version of the trainers' weights: ``--initial_policy_version`` plus the committed steps.
    policy_version: int
    generation: int
    registered_trainers: int
    world_size: int
    #: Accepted trajectories not trained yet.
    pending_trajectories: int


@dataclasses.dataclass(frozen=True)
class StepStatistics:
    """One committed step, as ``GetStatistics`` reports it."""

    step: int
    rollouts: int
    rollout_tokens: int
    tree_tokens: int
    compression: float
    imbalance: float
    extra_tokens: int
    seconds: float
    tokens_per_second: float
    loss: float
    dropped_stale: int


@dataclasses.dataclass(frozen=True)
class DispatcherStatistics:
    """``GetStatistics``. ``accepted``, ``dropped_stale``, the step counts and ``trained_rollouts``
    are rebuilt from the log when the dispatcher restarts; ``already_accepted``, ``rejected`` and
    ``aborted_steps`` count since the process started."""

    accepted: int
    already_accepted: int
    rejected: int
    rejected_by_field: dict[str, int]
    dropped_stale: int
    committed_steps: int
    aborted_steps: int
    trained_rollouts: int
    wal_bytes: int
    wal_syncs: int
    #: The latest steps, oldest first.
    recent_steps: list[StepStatistics]


def _from_message(cls: type[_T], message, **converted) -> _T:
    values = {f.name: getattr(message, f.name) for f in dataclasses.fields(cls) if f.name not in converted}
    return cls(**values, **converted)


def _ack(response: dispatcher_pb2.IngestResponse) -> Ack:
    return Ack(id=response.id, accepted=response.outcome == dispatcher_pb2.IngestResponse.ACCEPTED,
               already_accepted=response.already_accepted, field=response.field, reason=response.reason)


class _Item:
    """A submitted trajectory waiting for its answer."""

    __slots__ = ("request", "future", "written_at")

    def __init__(self, request: dispatcher_pb2.IngestRequest, future: asyncio.Future) -> None:
        self.request = request
        self.future = future
        self.written_at = 0.0  # loop time of its latest write


class AsyncRolloutClient:
    """A rollout worker's asyncio client of ``dta-dispatcher``.

    Args:
        address: ``host:port`` of the dispatcher.
        token: the rollout credential (the token in the dispatcher's ``--rollout_token_file``),
            sent as ``authorization: Bearer <token>``; ``None``: none (a dispatcher without a
            rollout token, on loopback). The trainer credential is refused here
            (``PERMISSION_DENIED``): rollout workers and trainers have separate credentials.
        root_certificates: PEM root certificates to trust (TLS); ``None``: plaintext (loopback).
        call_timeout: seconds each answer may take (from the previous answer or from the write of
            its trajectory) before the stream is abandoned and the unanswered trajectories are
            resent; also the deadline of each unary call. Default 30.
        retry_for: seconds without any answer after which retryable failures become
            :class:`DispatcherError` (``UNAVAILABLE``). Default 600.
        max_in_flight: the most trajectories submitted and not yet answered. Default 64.

    Thread safety: none; use it from one event loop (the one it is first used in). The channel
    is opened on first use. Close it with :meth:`close` or ``async with``.
    """

    def __init__(self, address: str, *, token: Optional[str] = None,
                 root_certificates: Union[bytes, str, None] = None, call_timeout: float = 30.0,
                 retry_for: float = 600.0, max_in_flight: int = 64) -> None:
        if call_timeout <= 0 or retry_for < 0 or max_in_flight < 1:
            raise ValueError("call_timeout must be > 0, retry_for >= 0 and max_in_flight >= 1")
        self._address = address
        self._root_certificates = (root_certificates.encode() if isinstance(root_certificates, str)
                                   else root_certificates)
        self._call_timeout = call_timeout
        self._retry_for = retry_for
        self._max_in_flight = max_in_flight
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel: Optional[aio.Channel] = None
        self._stub: Optional[dispatcher_pb2_grpc.DispatcherStub] = None
        # Submitted and unanswered trajectories, in order; the first `_written` of them have been
        # written on the current stream.
        self._queue: collections.deque[_Item] = collections.deque()
        self._written = 0
        self._window: Optional[asyncio.Semaphore] = None
        self._wakeup: Optional[asyncio.Event] = None  # new work, or closing
        self._pump: Optional[asyncio.Task] = None
        self._progress_at = 0.0  # loop time of the latest answer, or of work arriving when idle
        self._closing = False
        self._aborting = False  # close() ran out of time and cancels the pump
        self._error: Optional[DispatcherError] = None

    async def __aenter__(self) -> "AsyncRolloutClient":
        return self

    async def __aexit__(self, exc_type, exc, traceback) -> None:
        # After an exception in the body, do not wait for answers that may never come.
        await self.close(timeout=0 if exc_type is not None else None)

    # Ingestion.

    async def submit(self, trajectory: TrajectoryLike) -> asyncio.Future[Ack]:
        """Queues ``trajectory`` for the stream, waiting while ``max_in_flight`` are unanswered,
        and returns a future of its :class:`Ack` (which fails with :class:`DispatcherError` if
        the client gives up). Raises ``ValueError`` naming a field the wire cannot carry, and the
        client's :class:`DispatcherError` once it has failed or is closing."""
        message = trajectory if isinstance(trajectory, dispatcher_pb2.Trajectory) else _wire.to_proto(trajectory)
        request = dispatcher_pb2.IngestRequest(trajectory=message)
        self._start()
        self._raise_if_unusable()
        await self._window.acquire()
        try:
            self._raise_if_unusable()  # it may have failed or closed while we waited
        except DispatcherError:
            self._window.release()
            raise
        loop = asyncio.get_running_loop()
        if not self._queue:
            self._progress_at = loop.time()
        item = _Item(request, loop.create_future())
        self._queue.append(item)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run(), name=f"dta-ingest-{self._address}")
        self._wakeup.set()
        return item.future

    async def send(self, trajectory: TrajectoryLike, *, timeout: Optional[float] = None) -> Ack:
        """Sends one trajectory and returns its :class:`Ack`. ``asyncio.TimeoutError`` after
        ``timeout`` seconds (the trajectory stays queued); :class:`DispatcherError` if the client
        gives up."""
        return (await self.send_all([trajectory], timeout=timeout))[0]

    async def send_all(self, trajectories: Iterable[TrajectoryLike], *,
                       timeout: Optional[float] = None) -> list[Ack]:
        """Streams ``trajectories`` (up to ``max_in_flight`` unanswered at a time) and returns
        their answers in order. ``asyncio.TimeoutError`` after ``timeout`` seconds (whatever was
        submitted stays queued); :class:`DispatcherError` if the client gives up."""
        # Converted first, so that a trajectory the wire cannot carry queues none of them.
        messages = []
        for i, t in enumerate(trajectories):
            try:
                messages.append(t if isinstance(t, dispatcher_pb2.Trajectory) else _wire.to_proto(t))
            except ValueError as error:
                raise ValueError(f"trajectory {i}: {error}") from error

        async def send_all() -> list[Ack]:
            futures = [await self.submit(m) for m in messages]
            return list(await asyncio.gather(*(asyncio.shield(f) for f in futures)))

        return await asyncio.wait_for(send_all(), timeout)

    async def flush(self, *, timeout: Optional[float] = None) -> None:
        """Waits until every trajectory submitted so far is answered (or failed).
        ``asyncio.TimeoutError`` after ``timeout`` seconds."""
        futures = [asyncio.shield(item.future) for item in self._queue]
        await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), timeout)

    async def close(self, *, timeout: Optional[float] = None) -> None:
        """Waits up to ``timeout`` seconds (``None``: as long as the client retries) for the
        answers of everything submitted, ends the stream and closes the channel. Trajectories
        still unanswered then fail with :class:`DispatcherError` (``CANCELLED``); resending them
        with a new client is safe. Idempotent."""
        self._closing = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._pump is not None:
            done, _ = await asyncio.wait({self._pump}, timeout=timeout)
            if not done:
                self._aborting = True
                self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        self._fail(DispatcherError(grpc.StatusCode.CANCELLED, "the client was closed"))
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # Status queries.

    async def status(self) -> DispatcherStatus:
        """``GetStatus``. :class:`DispatcherError` on a non-retryable error or after
        ``retry_for``."""
        response = await self._unary(lambda stub, **kw: stub.GetStatus(dispatcher_pb2.GetStatusRequest(), **kw))
        return _from_message(DispatcherStatus, response)

    async def statistics(self) -> DispatcherStatistics:
        """``GetStatistics``: accepted / rejected counts (by field), steps, log size."""
        response = await self._unary(
            lambda stub, **kw: stub.GetStatistics(dispatcher_pb2.GetStatisticsRequest(), **kw))
        return _from_message(DispatcherStatistics, response, rejected_by_field=dict(response.rejected_by_field),
                             recent_steps=[_from_message(StepStatistics, s) for s in response.recent_steps])

    async def policy_version(self) -> int:
        """The version of the trainers' latest committed weights."""
        return (await self.status()).policy_version

    async def wait_for_policy_version(self, version: int, *, timeout: Optional[float] = None,
                                      poll_interval: float = 0.5) -> DispatcherStatus:
        """Polls ``GetStatus`` every ``poll_interval`` seconds until the policy version is at
        least ``version`` and returns that status. ``asyncio.TimeoutError`` after ``timeout``
        seconds."""
        async def wait() -> DispatcherStatus:
            while True:
                status = await self.status()
                if status.policy_version >= version:
                    return status
                await asyncio.sleep(poll_interval)

        return await asyncio.wait_for(wait(), timeout)

    async def policy_versions(self, *, poll_interval: float = 1.0) -> AsyncIterator[int]:
        """Yields the current policy version, then every new one as ``GetStatus`` shows it
        (polled every ``poll_interval`` seconds); versions committed between two polls are
        skipped. Raises :class:`DispatcherError` when a query fails for good."""
        last = None
        while True:
            version = await self.policy_version()
            if version != last:
                last = version
                yield version
            await asyncio.sleep(poll_interval)

    # Internals.

    def _start(self) -> None:
        if self._channel is not None or self._closing:
            return
        options = [("grpc.max_receive_message_length", -1),
                   # Reconnect within a second of a restarted dispatcher coming back.
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", int(_BACKOFF_MAX_S * 1000))]
        if self._root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
            self._channel = aio.secure_channel(self._address, credentials, options=options)
        else:
            self._channel = aio.insecure_channel(self._address, options=options)
        self._stub = dispatcher_pb2_grpc.DispatcherStub(self._channel)
        self._window = asyncio.Semaphore(self._max_in_flight)
        self._wakeup = asyncio.Event()

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closing:
            raise DispatcherError(grpc.StatusCode.CANCELLED, "the client is closing")

    def _fail(self, error: DispatcherError) -> None:
        """Fails every unanswered trajectory and every later call with ``error``."""
        if self._error is None:
            self._error = error
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(self._error)
            self._window.release()
        self._written = 0

    async def _unary(self, call: Callable[..., Awaitable[_T]]) -> _T:
        """``call(stub, timeout=, metadata=, wait_for_ready=)`` with retries, as the C++
        clients' WithRetries: back off from 10 ms to 1 s between attempts that fail fast."""
        self._start()
        self._raise_if_unusable()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._retry_for
        backoff = _BACKOFF_MIN_S
        while True:
            started = loop.time()
            try:
                # wait_for_ready: a restarting dispatcher is waited for, within the deadline.
                return await call(self._stub, timeout=max(min(self._call_timeout, give_up - started), 0.01),
                                  metadata=self._metadata, wait_for_ready=True)
            except aio.AioRpcError as error:
                if error.code() not in _RETRYABLE:
                    raise DispatcherError(error.code(), error.details() or "") from error
                if loop.time() >= give_up:
                    raise DispatcherError(grpc.StatusCode.UNAVAILABLE, f"no answer for {self._retry_for:g} s: "
                                          f"{error.details() or error.code().name}") from error
            if loop.time() - started < backoff:  # a refusal, not a wait: back off
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _run(self) -> None:
        """The stream's life: open it, write and read until it breaks, reconnect and resend."""
        loop = asyncio.get_running_loop()
        backoff = _BACKOFF_MIN_S
        try:
            while True:
                if not self._queue:
                    if self._closing:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                answered = self._progress_at
                code, details = await self._stream()
                if code == grpc.StatusCode.OK:  # everything written was answered
                    backoff = _BACKOFF_MIN_S
                    continue
                if not _stream_may_retry(code, details or ""):
                    self._fail(DispatcherError(code, details))
                    return
                if self._queue and loop.time() - self._progress_at >= self._retry_for:
                    self._fail(DispatcherError(grpc.StatusCode.UNAVAILABLE,
                                               f"{len(self._queue)} trajectories not acknowledged "
                                               f"for {self._retry_for:g} s: {details}"))
                    return
                if self._progress_at != answered:
                    backoff = _BACKOFF_MIN_S
                else:  # no answer on that stream: back off before reconnecting
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
        except DispatcherError as error:
            self._fail(error)
        except Exception as error:  # a bug must not leave callers waiting forever
            failure = DispatcherError(grpc.StatusCode.INTERNAL, f"ingestion failed: {error!r}")
            failure.__cause__ = error
            self._fail(failure)

    async def _stream(self) -> tuple[grpc.StatusCode, str]:
        """One Ingest stream: resends the unanswered trajectories, then whatever is submitted,
        until the stream ends. Returns its status (OK: everything written was answered); raises
        DispatcherError for an answer out of order."""
        loop = asyncio.get_running_loop()
        call = self._stub.Ingest(metadata=self._metadata, wait_for_ready=True)
        self._written = 0
        last_answer = loop.time()
        stalled = False

        async def watch() -> None:
            nonlocal stalled
            while True:
                await asyncio.sleep(min(self._call_timeout / 4, 1.0))
                waiting_since = max(last_answer, self._queue[0].written_at) if self._written else None
                if waiting_since is not None and loop.time() - waiting_since > self._call_timeout:
                    stalled = True
                    call.cancel()
                    return

        writer = asyncio.create_task(self._write(call))
        watchdog = asyncio.create_task(watch())
        try:
            while True:
                response = await call.read()
                if response is aio.EOF:
                    break
                item = self._queue[0]
                if response.id != item.request.trajectory.id:
                    raise DispatcherError(grpc.StatusCode.INTERNAL, f"answer for '{response.id}' while "
                                          f"'{item.request.trajectory.id}' was expected")
                self._queue.popleft()
                self._written -= 1
                last_answer = self._progress_at = loop.time()
                if not item.future.done():
                    item.future.set_result(_ack(response))
                self._window.release()
                if not self._queue:
                    self._wakeup.set()  # the writer ends an idle stream
        except aio.AioRpcError as error:
            return error.code(), error.details() or ""
        except asyncio.CancelledError:
            if not stalled or self._aborting:  # close() cancels the pump: let it
                raise
            return grpc.StatusCode.DEADLINE_EXCEEDED, f"no acknowledgement within {self._call_timeout:g} s"
        finally:
            writer.cancel()
            watchdog.cancel()
            call.cancel()
            await asyncio.gather(writer, watchdog, return_exceptions=True)
        code = await call.code()
        if code == grpc.StatusCode.OK and self._written:
            return grpc.StatusCode.UNAVAILABLE, "the stream ended before every answer"
        return code, await call.details() or ""

    async def _write(self, call: aio.StreamStreamCall) -> None:
        """Writes the queue in order as it grows; ends the stream once everything is answered
        (an idle worker holds no stream: the next submission opens a new one) or, when closing,
        once everything is written."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                while self._written < len(self._queue):
                    item = self._queue[self._written]
                    item.written_at = loop.time()
                    self._written += 1
                    await call.write(item.request)
                if self._closing or not self._queue:
                    await call.done_writing()
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
        except (aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call is over; the reader sees why


class RolloutClient:
    """A blocking, thread-safe rollout worker's client of ``dta-dispatcher``: the
    :class:`AsyncRolloutClient` driven by a private event loop on a background thread. Same
    arguments and semantics; every method blocks until done. Close it with :meth:`close` or
    ``with``.

    Usage::

        with dta.RolloutClient("127.0.0.1:50051") as client:
            futures = [client.submit(t) for t in trajectories]   # waits for window room
            acks = [f.result() for f in futures]
            if client.policy_version() > loaded: ...
    """

    def __init__(self, address: str, *, token: Optional[str] = None,
                 root_certificates: Union[bytes, str, None] = None, call_timeout: float = 30.0,
                 retry_for: float = 600.0, max_in_flight: int = 64) -> None:
        self._client = AsyncRolloutClient(address, token=token, root_certificates=root_certificates,
                                          call_timeout=call_timeout, retry_for=retry_for,
                                          max_in_flight=max_in_flight)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dta-rollout-client", daemon=True)
        self._thread.start()
        # Guards _closed against calls scheduling work while close() tears the loop down.
        self._lock = threading.Lock()
        self._closing = False
        self._closed = False

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(timeout=0 if exc_type is not None else None)

    def _run(self, coroutine: Awaitable[_T]) -> _T:
        with self._lock:
            if self._closed:
                coroutine.close()
                raise DispatcherError(grpc.StatusCode.CANCELLED, "the client was closed")
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            # close() cancelled it (another thread's wait, a backoff): it ends, not hangs.
            raise DispatcherError(grpc.StatusCode.CANCELLED, "the client was closed") from None

    def submit(self, trajectory: TrajectoryLike) -> concurrent.futures.Future[Ack]:
        """Queues ``trajectory``, blocking while ``max_in_flight`` are unanswered; returns a
        future of its :class:`Ack`. See :meth:`AsyncRolloutClient.submit`."""
        async def submit() -> concurrent.futures.Future[Ack]:
            answer = await self._client.submit(trajectory)
            result: concurrent.futures.Future[Ack] = concurrent.futures.Future()

            def forward(done: asyncio.Future) -> None:
                if done.cancelled():
                    result.cancel()
                elif done.exception() is not None:
                    result.set_exception(done.exception())
                else:
                    result.set_result(done.result())

            answer.add_done_callback(forward)
            return result

        return self._run(submit())

    def send(self, trajectory: TrajectoryLike, *, timeout: Optional[float] = None) -> Ack:
        """One trajectory's :class:`Ack`. See :meth:`AsyncRolloutClient.send`."""
        return self._run(self._client.send(trajectory, timeout=timeout))

    def send_all(self, trajectories: Iterable[TrajectoryLike], *, timeout: Optional[float] = None) -> list[Ack]:
        """Their answers, in order. See :meth:`AsyncRolloutClient.send_all`."""
        return self._run(self._client.send_all(list(trajectories), timeout=timeout))

    def flush(self, *, timeout: Optional[float] = None) -> None:
        """See :meth:`AsyncRolloutClient.flush`."""
        self._run(self._client.flush(timeout=timeout))

    def status(self) -> DispatcherStatus:
        """See :meth:`AsyncRolloutClient.status`."""
        return self._run(self._client.status())

    def statistics(self) -> DispatcherStatistics:
        """See :meth:`AsyncRolloutClient.statistics`."""
        return self._run(self._client.statistics())

    def policy_version(self) -> int:
        """See :meth:`AsyncRolloutClient.policy_version`."""
        return self._run(self._client.policy_version())

    def wait_for_policy_version(self, version: int, *, timeout: Optional[float] = None,
                                poll_interval: float = 0.5) -> DispatcherStatus:
        """See :meth:`AsyncRolloutClient.wait_for_policy_version`."""
        return self._run(self._client.wait_for_policy_version(version, timeout=timeout,
                                                              poll_interval=poll_interval))

    def close(self, *, timeout: Optional[float] = None) -> None:
        """See :meth:`AsyncRolloutClient.close`; then cancels what other threads still wait for
        (they raise :class:`DispatcherError` CANCELLED) and stops the background thread.
        Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        try:
            self._run(self._client.close(timeout=timeout))
        finally:
            with self._lock:
                self._closed = True
            asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


async def _cancel_other_tasks() -> None:
    """Cancels every task of the running loop but this one and waits for them to end."""
    current = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not current]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
