#!/usr/bin/env python3
"""An AReaL-style asynchronous rollout worker that streams its trajectories to dta-dispatcher.

Each task is a GRPO group: ``--group_size`` episodes of it run concurrently (at most
``--concurrency`` episodes in all), each a multi-turn, tool-calling conversation that may branch
(two continuations sampled from the same prefix, as tree search or retries do). Every trajectory
goes to the dispatcher through :class:`dta.AsyncRolloutClient` while more episodes run, and tokens
are tagged with the policy version of the weights that generated them.

Two policies:

- synthetic (the default): random tokens from a seeded generator behind a short simulated latency,
  so nothing is downloaded; it exercises the shape of the data (a system prompt shared by
  everything, a task shared by its group, turns, tool calls, branches) and the asynchronous
  plumbing; a moved policy version is only logged;
- ``--model=HF_DIR --checkpoint_dir=DIR``: a transformers causal LM samples every completion (with
  its log-probabilities), and when the trainers commit a step it reloads the weights dta-trainer
  published (``DIR/latest.json``'s ``model_path``) into that model, waiting for the checkpoint of the
  new version, as an inference engine does.

    mkdir -p -m 700 /tmp/dta-worker     # a private directory: the trainer token is created there
    build/bin/dta-dispatcher --wal=/tmp/dta-worker/d.wal --batch_rollouts=16 --vocab_size=1024 &
    .venv/bin/python examples/python/rollout_worker.py --dispatcher=127.0.0.1:50051 \\
        --groups=8 --group_size=4 --vocab_size=1024     # the venv has dta (scripts/build.sh)

``--until_version=V`` repeats the tasks (new groups each round) until the policy version reaches V.

Exit status: 0 when every trajectory was answered (rejections are reported, not fatal), 1 when the
dispatcher could not be reached or refused the worker, 2 on bad flags.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import dta
from dta.client import Ack, DispatcherError

PROMPT_VERSION = -1  # versions[] of tokens no policy generated (prompts, tool results)


_stdout_lock = threading.Lock()


def say(line: str) -> None:
    """One line to stdout in one write: the reloads print from a worker thread, and print()'s text and
    newline are two writes another thread's line could fall between."""
    with _stdout_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


@dataclass
class Policy:
    """Stands in for the inference engine: its weights' version and a token sampler."""

    vocab_size: int
    latency_s: float
    version: int = 0

    async def generate(self, rng: random.Random, context: list[int],
                       max_new_tokens: int) -> tuple[list[int], list[float], list[int]]:
        """Samples a completion: tokens, their log-probabilities and the policy version of each."""
        await asyncio.sleep(self.latency_s * rng.random())
        n = rng.randint(1, max_new_tokens)
        tokens = [rng.randrange(self.vocab_size) for _ in range(n)]
        logprobs = [-rng.expovariate(2.0) for _ in range(n)]
        return tokens, logprobs, [self.version] * n

    async def follow(self, version: int, poll_s: float) -> None:
        """The trainers committed a step: a real engine would reload its weights here."""
        say(f"policy version {self.version} -> {version}: reloading weights (synthetic policy: "
            "nothing to load)")
        self.version = version


@dataclass(frozen=True)
class Published:
    """Weights dta-trainer published and a model now holds."""

    version: int  # their policy version
    path: Path  # their directory (a Hugging Face model)
    tensors: int  # tensors loaded


def load_published(model, checkpoint_dir: Path, version: int) -> Published | None:
    """Loads the newest weights dta-trainer published in `checkpoint_dir` (``latest.json`` names
    their ``model_path``) into the transformers `model`, in its dtype, if they are of policy
    `version` or later; None when they are not published yet. RuntimeError if they are not the
    model's weights."""
    import torch
    from safetensors.torch import load_file

    latest_file = Path(checkpoint_dir) / "latest.json"
    if not latest_file.exists():
        return None
    latest = json.loads(latest_file.read_text())
    if latest["policy_version"] < version:
        return None
    model_path = Path(latest["model_path"])
    index = json.loads((model_path / "model.safetensors.index.json").read_text())
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(model_path / shard))
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        missing, unexpected = model.load_state_dict({name: t.to(dtype) for name, t in state.items()},
                                                    strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{model_path}: not this model's weights (missing {missing}, unexpected {unexpected})")
    return Published(latest["policy_version"], model_path, len(state))


class TransformersPolicy(Policy):
    """A transformers causal LM that samples every completion and reloads the weights the trainers
    publish: ``latest.json`` in the checkpoint directory names the newest ``model_path``."""

    def __init__(self, model_dir: str, checkpoint_dir: str, version: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        super().__init__(vocab_size=self.model.config.vocab_size, latency_s=0.0, version=version)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.lock = threading.Lock()  # sampling and reloading never overlap

    def _sample(self, seed: int, context: list[int], n: int) -> tuple[list[int], list[float], int]:
        torch = self.torch
        generator = torch.Generator().manual_seed(seed)
        tokens, logprobs = [], []
        with self.lock, torch.no_grad():
            version = self.version
            ids, past = torch.tensor([context]), None
            for _ in range(n):
                out = self.model(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
                past = out.past_key_values
                logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(logp[token]))
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        return tokens, logprobs, version

    async def generate(self, rng: random.Random, context: list[int],
                       max_new_tokens: int) -> tuple[list[int], list[float], list[int]]:
        n = rng.randint(1, max_new_tokens)
        tokens, logprobs, version = await asyncio.to_thread(self._sample, rng.randrange(2**63), context, n)
        return tokens, logprobs, [version] * n

    def reload(self, version: int) -> bool:
        """Loads the newest published weights if they are of `version` or later; False if the
        trainers have not published them yet."""
        with self.lock:
            loaded = load_published(self.model, self.checkpoint_dir, version)
            if loaded is None:
                return False
            previous, self.version = self.version, loaded.version
        say(f"policy version {previous} -> {self.version}: reloaded {loaded.tensors} tensors from {loaded.path}")
        return True

    async def follow(self, version: int, poll_s: float) -> None:
        # The trainers save after they commit: wait for the checkpoint of this version (or later).
        while self.version < version and not await asyncio.to_thread(self.reload, version):
            await asyncio.sleep(poll_s)


@dataclass
class Conversation:
    """The token stream of one conversation so far, with the per-token training data."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add_context(self, tokens: list[int]) -> None:
        """Tokens the model reads but does not produce (prompts, tool results): not trained."""
        self.tokens += tokens
        self.loss_mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [PROMPT_VERSION] * len(tokens)

    def add_generated(self, tokens: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.tokens += tokens
        self.loss_mask += [1] * len(tokens)
        self.logprobs += logprobs
        self.versions += versions

    def fork(self) -> "Conversation":
        return Conversation(list(self.tokens), list(self.loss_mask), list(self.logprobs), list(self.versions))


@dataclass
class Task:
    id: str
    prompt: list[int]


async def arun_episode(policy: Policy, system_prompt: list[int], task: Task, sample: int, seed: int,
                       max_turns: int) -> list[dta.Trajectory]:
    """One episode of ``task``, like AReaL's ``RolloutWorkflow.arun_episode``: assistant turns that
    call a tool and read its result, until the assistant answers or ``max_turns``; at one turn the
    episode may branch into two continuations. Returns one trajectory per branch, with a reward."""
    rng = random.Random(f"{seed}/{task.id}/{sample}")
    start = Conversation()
    start.add_context(system_prompt + task.prompt)
    branches = [start]
    branch_turn = rng.randrange(max_turns) if rng.random() < 0.5 else -1
    for turn in range(max_turns):
        if turn == branch_turn:
            branches = [c.fork() for c in branches for _ in range(2)]
        for conversation in branches:
            conversation.add_generated(*await policy.generate(rng, conversation.tokens, max_new_tokens=24))
        if turn == max_turns - 1 or rng.random() < 0.3:
            break  # the assistant answered
        for conversation in branches:  # the tool call's result
            conversation.add_context([rng.randrange(policy.vocab_size) for _ in range(rng.randint(2, 12))])
    trajectories = []
    for b, c in enumerate(branches):
        reward = float(c.tokens[-1] % 2 == 0) + 0.1 * rng.random()  # a synthetic verifier
        trajectories.append(dta.Trajectory(
            id=f"{task.id}-s{sample}-b{b}", group=task.id, tokens=c.tokens, loss_mask=c.loss_mask,
            logprobs=c.logprobs, versions=c.versions, reward=reward,
            metadata={"task": task.id, "sample": str(sample), "branch": str(b)}))
    return trajectories


@dataclass
class Progress:
    episodes: int = 0
    trajectories: int = 0
    accepted: int = 0
    already_accepted: int = 0
    rejected: int = 0
    started: float = field(default_factory=time.monotonic)

    def count(self, ack: Ack) -> None:
        if not ack.accepted:
            self.rejected += 1
            say(f"rejected {ack.id}: {ack.reason}")
        elif ack.already_accepted:
            self.already_accepted += 1
        else:
            self.accepted += 1

    def line(self, policy: Policy) -> str:
        return (f"episodes={self.episodes} trajectories={self.trajectories} accepted={self.accepted} "
                f"already_accepted={self.already_accepted} rejected={self.rejected} "
                f"policy_version={policy.version} seconds={time.monotonic() - self.started:.1f}")


async def follow_policy(client: dta.AsyncRolloutClient, policy: Policy, poll_s: float) -> None:
    """Follows the trainers: a committed step moves the policy version, and the policy reloads."""
    async for version in client.policy_versions(poll_interval=poll_s):
        if version > policy.version:
            await policy.follow(version, poll_s)


async def run(args: argparse.Namespace) -> int:
    token = open(args.token_file).read().strip() if args.token_file else None
    roots = open(args.tls_roots, "rb").read() if args.tls_roots else None
    rng = random.Random(args.seed)
    if args.model:
        policy: Policy = TransformersPolicy(args.model, args.checkpoint_dir, version=0)
        vocab_size = policy.vocab_size  # the dispatcher's --vocab_size must be at least this
        say(f"policy: {args.model} ({policy.vocab_size} tokens), reloading from {args.checkpoint_dir}")
    else:
        policy = Policy(args.vocab_size, latency_s=args.latency_ms / 1000)
        vocab_size = args.vocab_size
    system_prompt = [rng.randrange(vocab_size) for _ in range(args.system_tokens)]
    task_prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(8, 64))] for _ in range(args.groups)]
    progress = Progress()
    slots = asyncio.Semaphore(args.concurrency)  # AReaL's max_concurrent_rollouts

    async with dta.AsyncRolloutClient(args.dispatcher, token=token, root_certificates=roots,
                                      max_in_flight=args.max_in_flight, retry_for=args.retry_s) as client:
        version = await client.policy_version()
        say(f"dispatcher {args.dispatcher}: policy version {version}")
        if version > policy.version:
            await policy.follow(version, args.poll_s)
        follower = asyncio.create_task(follow_policy(client, policy, args.poll_s))

        async def episode(task: Task, sample: int) -> None:
            async with slots:
                trajectories = await arun_episode(policy, system_prompt, task, sample, args.seed, args.max_turns)
            # Submitted while the next episodes run; the answers are awaited here, per episode.
            answers = [await client.submit(t) for t in trajectories]
            for answer in await asyncio.gather(*answers):
                progress.count(answer)
            progress.episodes += 1
            progress.trajectories += len(trajectories)

        async def group(task: Task) -> None:
            await asyncio.gather(*(episode(task, s) for s in range(args.group_size)))
            say(f"{task.id} done: {progress.line(policy)}")

        try:
            round_ = 0
            while True:  # one round of every task; more until the policy reaches --until_version
                suffix = f"-r{round_}" if round_ else ""
                tasks = [Task(f"task{g}{suffix}", prompt) for g, prompt in enumerate(task_prompts)]
                await asyncio.gather(*(group(task) for task in tasks))
                round_ += 1
                if policy.version >= args.until_version:
                    break
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
    say(f"done: {progress.line(policy)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dispatcher", default="127.0.0.1:50051", help="host:port of dta-dispatcher")
    parser.add_argument("--token_file", help="file holding the rollout token (the dispatcher's --rollout_token_file)")
    parser.add_argument("--tls_roots", help="PEM root certificates to trust (TLS)")
    parser.add_argument("--groups", type=int, default=8, help="tasks, one GRPO group each")
    parser.add_argument("--group_size", type=int, default=4, help="episodes per task")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes generating at once")
    parser.add_argument("--vocab_size", type=int, default=1024, help="token ids are below this")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max_turns", type=int, default=4, help="assistant turns per episode")
    parser.add_argument("--system_tokens", type=int, default=200, help="length of the shared system prompt")
    parser.add_argument("--latency_ms", type=float, default=20.0, help="simulated generation latency per turn")
    parser.add_argument("--max_in_flight", type=int, default=64, help="unanswered trajectories at most")
    parser.add_argument("--poll_s", type=float, default=1.0, help="how often to ask for the policy version")
    parser.add_argument("--retry_s", type=float, default=600.0, help="give up after this long without an answer")
    parser.add_argument("--model", help="a Hugging Face causal LM directory that samples the completions "
                        "(default: a synthetic policy); needs --checkpoint_dir")
    parser.add_argument("--checkpoint_dir", help="dta-trainer's --checkpoint_dir: the weights to reload")
    parser.add_argument("--until_version", type=int, default=0,
                        help="repeat the tasks until the policy version reaches this (0: one round)")
    args = parser.parse_args()
    if bool(args.model) != bool(args.checkpoint_dir):
        parser.error("--model and --checkpoint_dir go together")
    if min(args.groups, args.group_size, args.concurrency, args.vocab_size, args.max_turns,
           args.system_tokens, args.max_in_flight) < 1:
        parser.error("counts and sizes must be positive")
    try:
        return asyncio.run(run(args))
    except DispatcherError as error:
        print(f"rollout_worker: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
