"""A verifiable multi-turn tool-use task: look a key up with a tool and answer with its value.

Each task hides a table of ten digits (key -> value) that only a lookup tool can read. An episode:

    system prompt               16 fixed tokens, shared by every episode (the tool's description)
    user:      USER k           "what is the value of key k?"
    assistant: x                the tool call: look up key x (any token; a digit is a key)
    tool:      TOOL v           the table's value for x, or ERR when x is no key
    assistant: y                the answer

The reward is 1 when the episode looked up the asked key (x == k) and answered its value
(y == table[k]), else 0: like tau2-bench's, the verifier checks the action as well as the answer,
so a lucky guess after a wrong lookup earns nothing. The vocabulary has 14 tokens; an untrained
model earns about 2-5% (it must pick the right one of 14 tokens twice); the policy that echoes the
asked key into the call and the tool's value into the answer earns 100%.

A GRPO group is one task: ``group_size`` episodes from the same prompt (a branch point), and in each
episode ``answers`` answers sampled after the same tool result (a second branch point, mid-episode),
every answer its own trajectory. Everything here is plain Python and deterministic given its random
generator; the sampler (a model) is the caller's.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

DIGITS = 10  # tokens 0-9: the keys and the values
BOS, USER, TOOL, ERR = 10, 11, 12, 13
VOCAB_SIZE = 14
TOKEN_NAMES = [str(d) for d in range(DIGITS)] + ["BOS", "USER", "TOOL", "ERR"]
SYSTEM_TOKENS = 16


def system_prompt(length: int = SYSTEM_TOKENS) -> list[int]:
    """The fixed system prompt every episode starts with: BOS and a fixed pseudo-random text."""
    rng = random.Random("lookup-task system prompt")
    return [BOS] + [rng.randrange(VOCAB_SIZE) for _ in range(length - 1)]


@dataclass(frozen=True)
class Task:
    """One problem: the asked key and the hidden table."""

    id: str
    key: int
    table: tuple[int, ...]

    @staticmethod
    def sample(rng: random.Random, id: str) -> "Task":
        return Task(id, rng.randrange(DIGITS), tuple(rng.randrange(DIGITS) for _ in range(DIGITS)))

    def prompt(self, system: list[int]) -> list[int]:
        """The context of the tool call: the system prompt and the question."""
        return system + [USER, self.key]

    def tool(self, call: int) -> list[int]:
        """The tool's turn after the call `call`: TOOL and the looked-up value (ERR for no key)."""
        return [TOOL, self.table[call] if 0 <= call < DIGITS else ERR]

    def reward(self, call: int, answer: int) -> float:
        """1 for the asked key's lookup and its value as the answer, else 0."""
        return float(call == self.key and answer == self.table[self.key])


def describe(tokens: list[int]) -> str:
    """The tokens by name, for printing an episode."""
    return " ".join(TOKEN_NAMES[t] if 0 <= t < VOCAB_SIZE else f"<{t}>" for t in tokens)
