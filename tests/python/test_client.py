"""dta.RolloutClient and dta.AsyncRolloutClient against a real dta-dispatcher on loopback:
acknowledgements (sync and asyncio), rejections naming the field while the stream goes on,
duplicate ids, the token, kill -9 and restart of the dispatcher mid-stream (nothing lost, nothing
stored twice), giving up on an unreachable dispatcher, and the policy version."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

import dta
from dta import _wire
from dta.client import (Ack, AsyncRolloutClient, DispatcherError, RolloutClient, TrajectoryRejected)
from dta.v1 import dispatcher_pb2, dispatcher_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
VOCAB = 100
# Every client in these tests gives up within a minute, whatever happens to the dispatcher.
BOUNDED = dict(call_timeout=10, retry_for=30)


def tool(name: str) -> Path:
    path = Path(os.environ.get("DTA_BUILD_DIR", REPO / "build")) / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} does not exist: build it with scripts/build.sh (or set DTA_BUILD_DIR)")
    return path


def secret(path: Path, text: str) -> Path:
    """A credential file as dta requires it: the user's own, mode 0600."""
    path.write_text(text)
    path.chmod(0o600)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dispatcher:
    """A dta-dispatcher process on a loopback port, restartable on the same log and port."""

    def __init__(self, directory: Path, *flags: str) -> None:
        self.wal = directory / "dispatcher.wal"
        self.log = directory / "dispatcher.log"
        self.address = f"127.0.0.1:{free_port()}"
        self.flags = ["--batch_rollouts=4", f"--vocab_size={VOCAB}", *flags]
        self.process: subprocess.Popen | None = None

    def start(self) -> "Dispatcher":
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "a") as log:
            self.process = subprocess.Popen([tool("dta-dispatcher"), f"--wal={self.wal}", f"--listen={self.address}",
                                             *self.flags], stdout=log, stderr=log)
        give_up = time.monotonic() + 30
        while "listening on" not in self.log.read_text()[offset:]:
            if self.process.poll() is not None or time.monotonic() > give_up:
                self.stop()
                pytest.fail(f"dta-dispatcher did not start:\n{self.log.read_text()}")
            time.sleep(0.02)
        return self

    @property
    def trainer_metadata(self) -> tuple[tuple[str, str], ...]:
        """The trainers' credential: the token the dispatcher created beside its log."""
        token = Path(f"{self.wal}.trainer-token").read_text().strip()
        return (("authorization", f"Bearer {token}"),)

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@pytest.fixture
def dispatcher(tmp_path):
    """Starts a dispatcher with the given flags (once per test) and stops it afterwards."""
    started: list[Dispatcher] = []

    def start(*flags: str) -> Dispatcher:
        started.append(Dispatcher(tmp_path, *flags).start())
        return started[-1]

    yield start
    for d in started:
        d.stop()


def make(i: int, prefix: str = "t", group: str | None = None) -> dta.Trajectory:
    """A valid trajectory: a shared prompt, a few generated tokens, a reward."""
    rng = random.Random(i)
    n = 3 + i % 7
    return dta.Trajectory(id=f"{prefix}{i}", group=group if group is not None else f"g{i % 3}",
                          tokens=[1, 2, 3] + [rng.randrange(VOCAB) for _ in range(n)],
                          loss_mask=[0, 0, 0] + [1] * n,
                          logprobs=[0.0] * 3 + [-rng.randrange(4096) / 1024 for _ in range(n)],  # exact in float32
                          versions=[-1] * 3 + [0] * n, reward=rng.random(), metadata={"turn": str(i % 2)})


def test_wire_round_trip_and_fields_the_wire_cannot_carry():
    t = make(5)
    t.advantages = [0.5] * len(t.tokens)
    t.ref_logprobs = [-0.25] * len(t.tokens)
    message = _wire.to_proto(t)
    assert message.group_id == t.group and list(message.loss_mask) == [bool(m) for m in t.loss_mask]
    assert _wire.from_proto(message) == t
    no_reward = make(6)
    no_reward.reward = None
    assert not _wire.to_proto(no_reward).HasField("reward")
    assert _wire.from_proto(_wire.to_proto(no_reward)).reward is None
    for field, value in [("tokens", [1, 2**31]), ("loss_mask", [0, 2]), ("logprobs", [0.0, "x"])]:
        bad = dta.Trajectory(id="bad", tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0])
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=f"trajectory 'bad': field '{field}'"):
            _wire.to_proto(bad)


def test_sync_client_streams_and_every_trajectory_is_acknowledged(dispatcher):
    d = dispatcher()
    trajectories = [make(i) for i in range(19)]
    with RolloutClient(d.address, max_in_flight=3, **BOUNDED) as client:
        acks = client.send_all(trajectories, timeout=60)
        futures = [client.submit(make(i, prefix="f")) for i in range(7)]
        more = [f.result(timeout=60) for f in futures]
        one = client.send(make(0, prefix="one"), timeout=60)
        statistics = client.statistics()
        status = client.status()
    assert [a.id for a in acks] == [t.id for t in trajectories]
    assert all(a.accepted and not a.already_accepted for a in acks + more + [one])
    assert [a.id for a in more] == [f"f{i}" for i in range(7)]
    assert statistics.accepted == 27 and statistics.rejected == 0
    assert status.serving and status.pending_trajectories == 27 and status.committed_steps == 0
    with pytest.raises(DispatcherError) as closed:
        client.send(make(1, prefix="late"))
    assert closed.value.code == grpc.StatusCode.CANCELLED


def test_async_client_streams_concurrent_episodes(dispatcher):
    d = dispatcher()

    async def main() -> tuple[list[Ack], dta.client.DispatcherStatistics]:
        async with AsyncRolloutClient(d.address, max_in_flight=5, **BOUNDED) as client:
            async def episode(group: int) -> list[Ack]:
                return [await client.send(make(group * 10 + k, prefix="e", group=f"q{group}"), timeout=60)
                        for k in range(7)]

            acks = [a for group in await asyncio.gather(*(episode(g) for g in range(3))) for a in group]
            acks += await client.send_all([make(i, prefix="b") for i in range(11)], timeout=60)
            await client.flush(timeout=60)
            return acks, await client.statistics()

    acks, statistics = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(acks) == 32 and all(a.accepted and not a.already_accepted for a in acks)
    assert len({a.id for a in acks}) == 32
    assert statistics.accepted == 32


def test_rejections_name_the_field_and_the_stream_goes_on(dispatcher):
    d = dispatcher()
    good = [make(i) for i in range(4)]
    bad_token = make(10)
    bad_token.tokens[4] = VOCAB  # outside the vocabulary
    short_mask = make(11)
    short_mask.loss_mask.pop()
    first_trained = make(12)
    first_trained.loss_mask[0] = 1
    no_reward = make(13)
    no_reward.reward = None
    taken = make(14)
    taken.id = good[0].id  # an id accepted before, other content
    resend = make(1)  # identical to good[1]
    batch = [good[0], bad_token, good[1], short_mask, first_trained, good[2], no_reward, taken, resend, good[3]]
    with RolloutClient(d.address, **BOUNDED) as client:
        acks = client.send_all(batch, timeout=60)
        statistics = client.statistics()
    expected = [None, "tokens", None, "loss_mask", "loss_mask", None, "reward", "id", None, None]
    assert [a.id for a in acks] == [t.id for t in batch]
    for ack, field in zip(acks, expected):
        assert ack.accepted == (field is None), ack
        assert ack.field == (field or "")
        if field is not None:
            assert ack.reason.startswith(f"field '{field}'"), ack.reason
            with pytest.raises(TrajectoryRejected, match=field) as raised:
                ack.check()
            assert raised.value.ack is ack
    assert acks[8].already_accepted and acks[8].check() is acks[8]
    assert not any(a.already_accepted for a in acks[:8])
    assert statistics.accepted == 4 and statistics.already_accepted == 1 and statistics.rejected == 5
    assert statistics.rejected_by_field == {"tokens": 1, "loss_mask": 2, "reward": 1, "id": 1}


def test_the_token_is_required_when_the_dispatcher_has_one(dispatcher, tmp_path):
    secret(tmp_path / "token", "s3cret\n")
    d = dispatcher(f"--rollout_token_file={tmp_path / 'token'}")
    for token in (None, "wrong"):
        with RolloutClient(d.address, token=token, **BOUNDED) as client:
            started = time.monotonic()
            with pytest.raises(DispatcherError) as refused:
                client.send(make(0), timeout=60)
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(DispatcherError) as later:  # the client stays failed
                client.send(make(1), timeout=60)
            assert later.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(DispatcherError) as status:
                client.status()
            assert status.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() - started < 10  # not retried
    with RolloutClient(d.address, token="s3cret", **BOUNDED) as client:
        assert client.send(make(0), timeout=60).accepted
        assert client.status().pending_trajectories == 1


def test_a_rogue_local_process_cannot_train_commit_or_abort(dispatcher, tmp_path):
    """The trainers' calls need the trainer credential even on loopback: a local process without
    it (or with the rollout token) can neither register, take a batch, nor report a step."""
    secret(tmp_path / "rollout.token", "rollout-secret\n")
    d = dispatcher(f"--rollout_token_file={tmp_path / 'rollout.token'}")
    token_file = Path(f"{d.wal}.trainer-token")
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert f"trainers present the token in {token_file}" in d.log.read_text()
    with grpc.insecure_channel(d.address) as channel:
        stub = dispatcher_pb2_grpc.DispatcherStub(channel)
        calls = [
            (stub.RegisterTrainer, dispatcher_pb2.RegisterTrainerRequest(world_size=1, trainer_id="rogue")),
            (stub.FetchPartition, dispatcher_pb2.FetchPartitionRequest(step=0)),
            (stub.ReportStep, dispatcher_pb2.ReportStepRequest(
                report=dispatcher_pb2.StepReport(step=0, phase=dispatcher_pb2.StepReport.FAILED))),
        ]
        for call, request in calls:
            for metadata, code in [((), grpc.StatusCode.UNAUTHENTICATED),
                                   ((("authorization", "Bearer rollout-secret"),), grpc.StatusCode.PERMISSION_DENIED)]:
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, timeout=30, metadata=metadata)
                assert refused.value.code() == code, (call, metadata)
        assert stub.RegisterTrainer(calls[0][1], timeout=30, metadata=d.trainer_metadata).generation >= 0


def refused_start(directory: Path, *flags: str) -> subprocess.CompletedProcess:
    """dta-dispatcher started with `flags` on a log in `directory`, expected to refuse (exit 2)."""
    run = subprocess.run([tool("dta-dispatcher"), f"--wal={directory / 'dispatcher.wal'}",
                          f"--listen=127.0.0.1:{free_port()}", "--batch_rollouts=4", f"--vocab_size={VOCAB}",
                          *flags], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    return run


@pytest.mark.parametrize("flag", ["rollout_token_file", "trainer_token_file", "metrics_token_file"])
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_every_token_file_must_be_private(tmp_path, flag, mode):
    """One rule for every credential file: the user's own and closed to group and others (0644 and
    0640 alike), refused naming the flag, the file and its mode; the dispatcher does not start."""
    token = secret(tmp_path / "token", "s3cret\n")
    token.chmod(mode)
    extra = ["--metrics_listen=127.0.0.1:0"] if flag == "metrics_token_file" else []
    run = refused_start(tmp_path, f"--{flag}={token}", *extra)
    assert f"--{flag}: {token} is open to group or others (mode {mode:04o}" in run.stderr
    assert "listening on" not in run.stderr


def test_credentials_and_logs_another_user_planted_are_refused(tmp_path):
    """Another local user who creates the trainer token or the log before the dispatcher starts
    (e.g. in /tmp) learns nothing: both are refused naming the owner, and a token is only created in
    a directory that only its owner can write (so never in /tmp itself)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    run = refused_start(shared)
    assert f"will not create {shared / 'dispatcher.wal.trainer-token'}" in run.stderr
    assert "writable by group or others (mode 1777" in run.stderr
    assert not (shared / "dispatcher.wal.trainer-token").exists()
    if os.geteuid() != 0:
        pytest.skip("planting a file of another user needs root")
    for planted in ("dispatcher.wal.trainer-token", "dispatcher.wal"):
        private = tmp_path / planted.replace(".", "_")
        private.mkdir()
        secret(private / planted, "the attacker knows this\n")
        os.chown(private / planted, 65534, 65534)
        run = refused_start(private)
        assert f"{private / planted} is owned by uid 65534" in run.stderr
        assert "mode 0600" in run.stderr
        assert "the attacker knows this" not in run.stderr


def test_the_client_backs_off_while_the_dispatcher_is_full(dispatcher):
    """A dispatcher at its limit of open Ingest streams (or of memory for trajectories not yet
    stored) ends a new stream RESOURCE_EXHAUSTED: the client backs off and resends instead of
    failing, and the trajectory is stored once room returns."""
    d = dispatcher("--max_ingest_streams=1")
    with grpc.insecure_channel(d.address) as channel:
        stub = dispatcher_pb2_grpc.DispatcherStub(channel)
        holding = threading.Event()

        def requests():  # an open stream: one trajectory, then nothing until told to end
            yield dispatcher_pb2.IngestRequest(trajectory=_wire.to_proto(make(1)))
            holding.wait(timeout=60)

        held = stub.Ingest(requests())
        # Its answer proves the dispatcher counts the stream (a stream is opened lazily: on a
        # loaded machine the client's could otherwise come first and take the one slot).
        assert next(held).outcome == dispatcher_pb2.IngestResponse.ACCEPTED
        held_done = concurrent.futures.ThreadPoolExecutor(1).submit(lambda: list(held))
        with RolloutClient(d.address, **BOUNDED) as client:
            sent = concurrent.futures.ThreadPoolExecutor(1).submit(client.send, make(0), timeout=60)
            time.sleep(1.0)  # several refused attempts, backed off
            assert not sent.done(), sent.exception()
            holding.set()
            held_done.result(timeout=30)
            assert sent.result(timeout=60).accepted
            assert client.status().pending_trajectories == 2


def test_tls_with_the_token(dispatcher, tmp_path):
    key, cert, token = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    secret(token, "s3cret")
    d = dispatcher(f"--tls_cert={cert}", f"--tls_key={key}", f"--rollout_token_file={token}")
    with RolloutClient(d.address, token="s3cret", root_certificates=cert.read_bytes(), **BOUNDED) as client:
        assert client.send(make(0), timeout=60).accepted
        assert client.status().pending_trajectories == 1
    with RolloutClient(d.address, root_certificates=cert.read_text(), **BOUNDED) as client:
        with pytest.raises(DispatcherError) as refused:
            client.send(make(1), timeout=60)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    # Plaintext to a TLS port never gets an answer.
    with RolloutClient(d.address, token="s3cret", call_timeout=0.5, retry_for=1) as client:
        with pytest.raises(DispatcherError) as plaintext:
            client.send(make(2), timeout=60)
        assert plaintext.value.code == grpc.StatusCode.UNAVAILABLE


def test_kill_nine_and_restart_mid_stream_loses_and_duplicates_nothing(dispatcher):
    """The client streams 240 trajectories through a window of 8 while the dispatcher is killed
    with SIGKILL twice and restarted on the same log and port: every trajectory is answered
    ACCEPTED exactly once to the caller, and the log holds each exactly once."""
    d = dispatcher()
    total = 240
    trajectories = [make(i, prefix="k") for i in range(total)]
    acks: list[Ack] = []
    stats: dict[str, int] = {}

    async def main() -> None:
        async with AsyncRolloutClient(d.address, max_in_flight=8, call_timeout=5, retry_for=60) as client:
            futures = []

            async def produce() -> None:
                for t in trajectories:
                    futures.append(await client.submit(t))

            producer = asyncio.create_task(produce())
            for kill_at in (60, 150):
                # Kill mid-stream, with trajectories in flight.
                while not producer.done() and (sum(f.done() for f in futures) < kill_at
                                               or all(f.done() for f in futures)):
                    await asyncio.sleep(0.002)
                assert not all(f.done() for f in futures)
                await asyncio.to_thread(d.kill9)
                await asyncio.sleep(0.3)  # the stream breaks while nothing listens
                await asyncio.to_thread(d.start)
            await producer
            acks.extend(await asyncio.gather(*futures))
            statistics = await client.statistics()
            status = await client.status()
            stats.update(accepted=statistics.accepted, already=statistics.already_accepted,
                         pending=status.pending_trajectories)

    asyncio.run(asyncio.wait_for(main(), 180))
    assert [a.id for a in acks] == [t.id for t in trajectories]
    assert all(a.accepted for a in acks), [a for a in acks if not a.accepted][:3]
    # Stored exactly once each: the log replays to `total` accepted and pending trajectories.
    assert stats["accepted"] == total and stats["pending"] == total
    assert d.log.read_text().count("listening on") == 3
    print(f"resent and answered as already accepted: {sum(a.already_accepted for a in acks)}")


class SilentFirstStream(dispatcher_pb2_grpc.DispatcherServicer):
    """A fake dispatcher whose first Ingest stream reads and never answers (a hung process behind
    an open connection); later streams accept everything."""

    def __init__(self) -> None:
        self.streams: list[list[str]] = []
        self.lock = threading.Lock()

    def Ingest(self, requests, context):
        with self.lock:
            self.streams.append([])
            ids = self.streams[-1]
            silent = len(self.streams) == 1
        for request in requests:
            ids.append(request.trajectory.id)
            if silent:
                while context.is_active():
                    time.sleep(0.01)
                return
            yield dispatcher_pb2.IngestResponse(id=request.trajectory.id, outcome=dispatcher_pb2.IngestResponse.ACCEPTED)


def test_a_stream_without_answers_is_abandoned_after_call_timeout_and_resent():
    fake = SilentFirstStream()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    dispatcher_pb2_grpc.add_DispatcherServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        trajectories = [make(i, prefix="s") for i in range(5)]
        with RolloutClient(f"127.0.0.1:{port}", call_timeout=1, retry_for=30) as client:
            started = time.monotonic()
            acks = client.send_all(trajectories, timeout=60)
            elapsed = time.monotonic() - started
    finally:
        server.stop(grace=None)
    assert [a.id for a in acks] == [t.id for t in trajectories] and all(a.accepted for a in acks)
    assert 1 <= elapsed < 10
    assert len(fake.streams) == 2 and fake.streams[0] == ["s0"]
    assert fake.streams[1] == [t.id for t in trajectories]  # resent from the first unanswered


def test_an_unreachable_dispatcher_fails_after_retry_for():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with RolloutClient(address, call_timeout=0.5, retry_for=1.5) as client:
        with pytest.raises(DispatcherError) as send:
            client.send(make(0), timeout=60)
        with pytest.raises(DispatcherError) as later:
            client.submit(make(1))
    assert send.value.code == grpc.StatusCode.UNAVAILABLE and "not acknowledged" in send.value.details
    assert later.value is send.value
    assert 1.5 <= time.monotonic() - started < 15
    with RolloutClient(address, call_timeout=0.5, retry_for=1.0) as client:
        started = time.monotonic()
        with pytest.raises(DispatcherError) as status:
            client.status()
        assert 1.0 <= time.monotonic() - started < 10
    assert status.value.code == grpc.StatusCode.UNAVAILABLE and "no answer for 1 s" in status.value.details


def register_trainer(d: Dispatcher) -> int:
    """Registers a one-rank trainer; returns its generation."""
    with grpc.insecure_channel(d.address) as channel:
        return dispatcher_pb2_grpc.DispatcherStub(channel).RegisterTrainer(
            dispatcher_pb2.RegisterTrainerRequest(world_size=1, trainer_id="test"), timeout=30,
            metadata=d.trainer_metadata).generation


def commit_step(d: Dispatcher, step: int, generation: int) -> int:
    """Plays a one-rank trainer for one step: fetch the batch, report PREPARED, get COMMIT."""
    with grpc.insecure_channel(d.address) as channel:
        stub = dispatcher_pb2_grpc.DispatcherStub(channel)
        request = dispatcher_pb2.FetchPartitionRequest(step=step, generation=generation)
        give_up = time.monotonic() + 60
        while True:  # the call waits up to 2 s for the batch, then says UNAVAILABLE: ask again
            try:
                fetched = stub.FetchPartition(request, timeout=30, metadata=d.trainer_metadata)
                break
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > give_up:
                    raise
        assert len(fetched.partition.trajectories) == 4
        report = dispatcher_pb2.StepReport(step=step, generation=generation, phase=dispatcher_pb2.StepReport.PREPARED)
        decision = stub.ReportStep(dispatcher_pb2.ReportStepRequest(report=report), timeout=30,
                                   metadata=d.trainer_metadata)
        assert decision.decision == dispatcher_pb2.ReportStepResponse.COMMIT
        return decision.policy_version


def test_policy_version_follows_committed_steps(dispatcher):
    d = dispatcher("--initial_policy_version=5")
    generation = register_trainer(d)

    async def main() -> None:
        async with AsyncRolloutClient(d.address, **BOUNDED) as client:
            assert await client.policy_version() == 5
            assert (await client.wait_for_policy_version(5, timeout=10)).policy_version == 5
            with pytest.raises(TimeoutError):
                await client.wait_for_policy_version(6, timeout=0.3, poll_interval=0.05)
            versions = client.policy_versions(poll_interval=0.05)
            assert await anext(versions) == 5
            waiting = asyncio.create_task(client.wait_for_policy_version(7, timeout=60, poll_interval=0.05))
            acks = await client.send_all([make(i, prefix="p") for i in range(8)], timeout=60)
            assert all(a.accepted for a in acks)
            assert await asyncio.to_thread(commit_step, d, 0, generation) == 6
            assert await asyncio.wait_for(anext(versions), 30) == 6
            assert not waiting.done()
            assert await asyncio.to_thread(commit_step, d, 1, generation) == 7
            status = await waiting
            assert status.policy_version == 7 and status.committed_steps == 2 and status.pending_trajectories == 0
            statistics = await client.statistics()
            assert statistics.committed_steps == 2 and statistics.trained_rollouts == 8
            assert [s.step for s in statistics.recent_steps] == [0, 1]

    asyncio.run(asyncio.wait_for(main(), 120))
    with RolloutClient(d.address, **BOUNDED) as client:
        assert client.policy_version() == 7
        assert client.wait_for_policy_version(7, timeout=10).committed_steps == 2


def test_close_ends_calls_other_threads_wait_in(dispatcher):
    """A thread waiting for a policy version that never comes, and a batch with one trajectory the
    wire cannot carry: close() ends the first (CANCELLED) instead of leaving it blocked, and
    send_all refuses the second naming it before queueing any."""
    d = dispatcher()
    client = RolloutClient(d.address, **BOUNDED)
    bad = make(2, prefix="c")
    bad.tokens = [1, 2**31] + bad.tokens[2:]
    with pytest.raises(ValueError, match=r"trajectory 1: trajectory 'c2': field 'tokens'"):
        client.send_all([make(1, prefix="c"), bad])
    assert client.status().pending_trajectories == 0
    outcome = []

    def wait() -> None:
        try:
            client.wait_for_policy_version(100, poll_interval=0.05)
        except DispatcherError as error:
            outcome.append(error.code)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    client.close(timeout=5)
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert outcome == [grpc.StatusCode.CANCELLED]
    with pytest.raises(DispatcherError):
        client.status()
    client.close()  # idempotent


def test_rollout_worker_example_streams_episodes_and_reloads_weights(dispatcher):
    d = dispatcher()
    worker = subprocess.Popen([sys.executable, str(REPO / "examples" / "python" / "rollout_worker.py"),
                               f"--dispatcher={d.address}", "--groups=5", "--group_size=4", f"--vocab_size={VOCAB}",
                               "--seed=3", "--concurrency=4", "--latency_ms=200", "--poll_s=0.05", "--retry_s=30"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # A trainer commits the first batch while the worker is still generating.
        assert commit_step(d, 0, register_trainer(d)) == 1
        output, _ = worker.communicate(timeout=120)
    finally:
        worker.kill()
        worker.wait()
    assert worker.returncode == 0, output
    assert "policy version 0 -> 1: reloading weights" in output
    with RolloutClient(d.address, **BOUNDED) as client:
        statistics = client.statistics()
    # Every episode yields one trajectory per branch of its conversation: at least one.
    accepted = int(re.search(r"^done: episodes=20 .* accepted=(\d+) ", output, re.M).group(1))
    assert accepted == statistics.accepted >= 20
    assert statistics.rejected == 0 and statistics.committed_steps == 1


def scrape(url: str, token: str | None = None) -> tuple[int, str]:
    """GET url; the HTTP status and body."""
    import urllib.error
    import urllib.request
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def metrics_url(d: Dispatcher) -> str:
    found = re.search(r"metrics on (http://\S+/metrics)", d.log.read_text())
    assert found, d.log.read_text()
    return found.group(1)


def samples(exposition: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(exposition) for s in family.samples}


def test_metrics_and_tensorboard_show_the_queue_rejections_and_steps(dispatcher, tmp_path):
    """--metrics_listen serves Prometheus text (parsed by prometheus_client) from the live state;
    --tensorboard_dir gets each committed step's compression, imbalance, throughput and queue depth."""
    from event_files import read_scalars

    board = tmp_path / "board"
    d = dispatcher("--metrics_listen=127.0.0.1:0", f"--tensorboard_dir={board}")
    url = metrics_url(d)
    status, body = scrape(url)
    assert status == 200, body
    before = samples(body)
    assert before[("dta_dispatcher_pending_trajectories", ())] == 0
    assert before[("dta_dispatcher_rejected_total", ())] == 0
    bad = make(20)
    bad.tokens[4] = VOCAB
    with RolloutClient(d.address, **BOUNDED) as client:
        acks = client.send_all([make(i) for i in range(6)] + [bad], timeout=60)
    assert [a.accepted for a in acks] == [True] * 6 + [False]
    queued = samples(scrape(url)[1])
    assert queued[("dta_dispatcher_pending_trajectories", ())] == 6
    assert queued[("dta_dispatcher_accepted_total", ())] == 6
    assert queued[("dta_dispatcher_rejected_total", (("field", "tokens"),))] == 1
    assert ("dta_step_compression", ()) not in queued  # no step yet
    commit_step(d, 0, register_trainer(d))
    give_up = time.monotonic() + 30
    while not (board.exists() and 0 in read_scalars(board)):  # the event is written within a second
        assert time.monotonic() < give_up, "no step event"
        time.sleep(0.1)
    stepped = samples(scrape(url)[1])
    assert stepped[("dta_dispatcher_committed_steps_total", ())] == 1
    assert stepped[("dta_dispatcher_pending_trajectories", ())] == 2
    assert stepped[("dta_dispatcher_last_step", ())] == 0
    assert stepped[("dta_step_rollouts", ())] == 4 and stepped[("dta_step_compression", ())] > 1
    event = read_scalars(board)[0]
    assert event["rollouts"] == 4 and event["pending_trajectories"] == 2
    assert event["compression"] == pytest.approx(stepped[("dta_step_compression", ())], rel=1e-6)
    assert {"imbalance", "tokens_per_second", "tree_tokens", "extra_tokens"} <= set(event)
    assert scrape(url.replace("/metrics", "/other"))[0] == 404


def test_metrics_off_loopback_need_a_token(dispatcher, tmp_path):
    """A bearer token file guards /metrics (401 without it); off loopback it is required."""
    token = tmp_path / "metrics.token"
    secret(token, "scrape-secret\n")
    d = dispatcher("--metrics_listen=127.0.0.1:0", f"--metrics_token_file={token}")
    url = metrics_url(d)
    assert scrape(url)[0] == 401
    assert scrape(url, "wrong")[0] == 401
    status, body = scrape(url, "scrape-secret")
    assert status == 200 and "dta_dispatcher_serving 1" in body
    refused = subprocess.run([tool("dta-dispatcher"), f"--wal={tmp_path / 'other.wal'}", f"--listen=127.0.0.1:{free_port()}",
                              "--batch_rollouts=4", f"--vocab_size={VOCAB}", "--metrics_listen=0.0.0.0:0"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "--metrics_listen" in refused.stderr and "token" in refused.stderr, refused.stderr
