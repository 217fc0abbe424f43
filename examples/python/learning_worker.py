#!/usr/bin/env python3
"""An on-policy rollout worker that learns the lookup task (lookup_task.py) through dta's services.

Step by step: it samples a batch of GRPO groups from the policy of version v (a transformers model),
streams the batch to dta-dispatcher, waits for the trainers to commit step v + 1 and publish its
weights (``latest.json`` in their ``--checkpoint_dir``), loads them, and samples the next batch:
every batch comes from the newest weights, as on-policy GRPO trains. It prints one line per step
(the batch's mean reward, how many tool calls looked up the asked key, the trainers' loss and
timings) and can write them as JSON Lines (``--records``).

Sampling is seeded (``--seed``; a torch generator on the model's device) and batched per turn, so
two runs whose trainers publish the same weights sample the same tokens: with float64 weights, dense
and dta trainers agree to ~1e-13 and runs from one seed earn the same rewards at every step.

    # a dispatcher for 8 x 8 x 2 = 128 trajectories a step, and dta-trainer ranks with
    # --model=INITIAL --checkpoint_dir=CKPT --dtype=float64 --checkpoint_dtype=model (see
    # learning_demo.py, which starts them all)
    .venv/bin/python examples/python/learning_worker.py --dispatcher=127.0.0.1:50051 \\
        --model=INITIAL --checkpoint_dir=CKPT --steps=40

Exit status: 0 after --steps steps, 1 when the dispatcher refused a trajectory or the trainers did
not publish in time, 2 on bad flags.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import dta
import lookup_task
from lookup_task import Task
from rollout_worker import PROMPT_VERSION, Published, load_published

DTYPES = ("float64", "float32", "bfloat16")


@dataclass
class Options:
    dispatcher: str
    model: str  # the initial weights (a Hugging Face directory), also the trainers' --model
    checkpoint_dir: str  # the trainers' --checkpoint_dir
    steps: int = 40
    groups: int = 8  # tasks per step, one GRPO group each
    group_size: int = 8  # episodes per task
    answers: int = 2  # answers sampled per episode after its tool result
    seed: int = 1
    device: str = "cpu"
    dtype: str = "float64"
    token: Optional[str] = None  # the dispatcher's rollout token, if it has one
    timeout_s: float = 600.0  # the most a step may wait for the trainers
    label: str = ""  # printed before every line

    @property
    def batch_rollouts(self) -> int:
        """Trajectories per step: the dispatcher's --batch_rollouts."""
        return self.groups * self.group_size * self.answers


class Sampler:
    """The policy: a transformers causal LM and a seeded generator."""

    def __init__(self, model_dir: str, dtype: str, device: str, seed: int) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch = torch
        transformers.utils.logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def sample(self, contexts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[float]]]:
        """`n` next tokens for each context (all of one length, one batched forward) with their
        log-probabilities."""
        torch = self.torch
        with torch.no_grad():
            logits = self.model(torch.tensor(contexts, device=self.device)).logits[:, -1]
            logp = torch.log_softmax(logits.double(), dim=-1)
            tokens = torch.multinomial(logp.exp(), n, replacement=True, generator=self.generator)
            return tokens.tolist(), logp.gather(1, tokens).tolist()


@dataclass
class Batch:
    trajectories: list[dta.Trajectory]
    lookups: float  # fraction of episodes whose call looked up the asked key
    example: str  # one episode, by token names


def rollouts(sampler: Sampler, tasks: list[Task], system: list[int], version: int, options: Options) -> Batch:
    """Every task's group: group_size tool calls from its prompt, the tool's results, then
    `answers` answers after each; one trajectory per answer."""
    prompts = [task.prompt(system) for task in tasks for _ in range(options.group_size)]
    calls, call_logprobs = sampler.sample(prompts, 1)
    contexts = [p + [c[0]] + tasks[i // options.group_size].tool(c[0]) for i, (p, c) in enumerate(zip(prompts, calls))]
    answers, answer_logprobs = sampler.sample(contexts, options.answers)
    trajectories = []
    for i, context in enumerate(contexts):
        task, prompt = tasks[i // options.group_size], prompts[i]
        for b, (answer, logprob) in enumerate(zip(answers[i], answer_logprobs[i])):
            trajectories.append(dta.Trajectory(
                id=f"{task.id}-e{i % options.group_size}-a{b}", group=task.id, tokens=context + [answer],
                loss_mask=[0] * len(prompt) + [1, 0, 0, 1],
                logprobs=[0.0] * len(prompt) + [call_logprobs[i][0], 0.0, 0.0, logprob],
                versions=[PROMPT_VERSION] * len(prompt) + [version, PROMPT_VERSION, PROMPT_VERSION, version],
                reward=task.reward(calls[i][0], answer)))
    lookups = sum(c[0] == tasks[i // options.group_size].key for i, c in enumerate(calls)) / len(calls)
    task, first = tasks[0], trajectories[0]
    call, value, answer = (lookup_task.TOKEN_NAMES[t] for t in (first.tokens[-4], first.tokens[-2], first.tokens[-1]))
    example = (f"asked key {task.key} (its value {task.table[task.key]}), called lookup({call}), the tool said "
               f"{value}, answered {answer}: reward {first.reward:g}")
    return Batch(trajectories, lookups, example)


async def wait_for_weights(sampler: Sampler, checkpoint_dir: str, version: int, timeout_s: float) -> Published:
    """Loads the weights of `version` (or later) once the trainers have published them."""
    give_up = time.monotonic() + timeout_s
    while (loaded := load_published(sampler.model, Path(checkpoint_dir), version)) is None:
        if time.monotonic() > give_up:
            raise TimeoutError(f"no checkpoint of policy version {version} in {checkpoint_dir} after {timeout_s} s")
        await asyncio.sleep(0.01)
    return loaded


async def learn(options: Options, log: Callable[[str], None] = print) -> list[dict]:
    """Runs options.steps on-policy steps; returns one record per step."""
    rng = random.Random(options.seed)
    system = lookup_task.system_prompt()
    sampler = Sampler(options.model, options.dtype, options.device, options.seed)
    records: list[dict] = []
    async with dta.AsyncRolloutClient(options.dispatcher, token=options.token, retry_for=options.timeout_s,
                                      max_in_flight=max(64, options.batch_rollouts)) as client:
        version = await client.policy_version()
        if version > 0:  # the trainers have stepped already: start from their newest weights
            version = (await wait_for_weights(sampler, options.checkpoint_dir, version, options.timeout_s)).version
        started = time.monotonic()
        for step in range(1, options.steps + 1):
            began = time.monotonic()
            tasks = [Task.sample(rng, f"v{version}-task{g}") for g in range(options.groups)]
            batch = await asyncio.to_thread(rollouts, sampler, tasks, system, version, options)
            sampled = time.monotonic()
            rejected = [a for a in await client.send_all(batch.trajectories) if not a.accepted]
            if rejected:
                raise RuntimeError(f"the dispatcher refused {len(rejected)} trajectories: {rejected[0]}")
            await client.wait_for_policy_version(version + 1, timeout=options.timeout_s, poll_interval=0.01)
            loaded = await wait_for_weights(sampler, options.checkpoint_dir, version + 1, options.timeout_s)
            trained = (await client.statistics()).recent_steps[-1]
            rewards = [t.reward for t in batch.trajectories]
            record = {"step": step, "policy_version": version, "reward": sum(rewards) / len(rewards),
                      "lookups": batch.lookups, "loss": trained.loss, "compression": trained.compression,
                      "rollout_tokens": trained.rollout_tokens, "tree_tokens": trained.tree_tokens,
                      "train_s": trained.seconds, "sample_s": sampled - began,
                      "step_s": time.monotonic() - began, "elapsed_s": time.monotonic() - started}
            records.append(record)
            log(f"{options.label}step {step:3d}  reward {record['reward']:.3f}  lookups {batch.lookups:.2f}  "
                f"tokens {trained.rollout_tokens} ({trained.tree_tokens} in the tree)  train {trained.seconds:.2f} s  "
                f"step {record['step_s']:.2f} s  elapsed {record['elapsed_s']:.0f} s")
            if step in (1, options.steps):
                log(f"{options.label}  an episode of policy version {version}: {batch.example}")
            version = loaded.version
    return records


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the task and of sampling (shared with learning_demo.py)."""
    parser.add_argument("--steps", type=int, default=40, help="training steps (batches)")
    parser.add_argument("--groups", type=int, default=8, help="tasks per step, one GRPO group each")
    parser.add_argument("--group_size", type=int, default=8, help="episodes per task (from the same prompt)")
    parser.add_argument("--answers", type=int, default=2, help="answers per episode (from the same tool result)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the tasks and the sampling")
    parser.add_argument("--device", default="cpu", help="where the policy samples (cpu, cuda, cuda:N)")
    parser.add_argument("--dtype", default="float64", choices=DTYPES, help="the policy's dtype")
    parser.add_argument("--timeout_s", type=float, default=600.0, help="the most a step may wait for the trainers")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dispatcher", default="127.0.0.1:50051", help="host:port of dta-dispatcher")
    parser.add_argument("--token_file", help="file holding the rollout token (the dispatcher's --rollout_token_file)")
    parser.add_argument("--model", required=True, help="the initial weights: the trainers' --model")
    parser.add_argument("--checkpoint_dir", required=True, help="the trainers' --checkpoint_dir")
    parser.add_argument("--records", help="write the steps' records here (JSON Lines)")
    add_flags(parser)
    args = parser.parse_args()
    if min(args.steps, args.groups, args.group_size, args.answers) < 1:
        parser.error("counts must be positive")
    options = Options(dispatcher=args.dispatcher, model=args.model, checkpoint_dir=args.checkpoint_dir,
                      steps=args.steps, groups=args.groups, group_size=args.group_size, answers=args.answers,
                      seed=args.seed, device=args.device, dtype=args.dtype, timeout_s=args.timeout_s,
                      token=open(args.token_file).read().strip() if args.token_file else None)
    print(f"the dispatcher's --batch_rollouts must be {options.batch_rollouts}", flush=True)
    try:
        records = asyncio.run(learn(options, lambda line: print(line, flush=True)))
    except (dta.DispatcherError, RuntimeError, TimeoutError, asyncio.TimeoutError) as error:
        print(f"learning_worker: {error}", file=sys.stderr)
        return 1
    if args.records:
        Path(args.records).write_text("".join(json.dumps(r) + "\n" for r in records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
