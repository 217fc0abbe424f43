"""The prefix tree of a batch of rollouts and its statistics (core/tree over the extension).

Example::

    tree = dta.PrefixTree([[1, 2, 3, 4], [1, 2, 5], [1, 2]])
    tree.stats().compression        # 9 rollout tokens / 5 tree tokens = 1.8
    tree.segment(1)                 # [1, 2]: node 1 holds the shared prefix

Nodes are numbered in lexicographic DFS preorder, the root (an empty node) being 0, so a node's
subtree is the id range ``[v, subtree_end(v))`` and parents come before their children
(docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch  # noqa: F401  (loads LibTorch, which the extension links, before it)

from . import _core
from .trajectory import Trajectory

__all__ = ["Partition", "PrefixTree", "TreeStats"]


@dataclass(frozen=True)
class TreeStats:
    """How much a batch shares, in the papers' terms (core/tree/tree_stats.h).

    Attributes:
        num_rollouts: Rollouts in the batch.
        num_nodes: Nodes, the root excluded.
        num_leaves: Nodes without children.
        num_prefix_rollouts: Rollouts ending at an internal node (a prefix of another rollout).
        num_duplicate_rollouts: Rollouts equal to an earlier one.
        rollout_tokens: Every rollout's length, summed.
        tree_tokens: Unique tokens (the tree's).
        leaf_tokens: Tokens of the distinct leaf sequences (prefix rollouts collapsed into leaves).
        longest_rollout: The longest root-to-leaf path, in tokens.
        max_children: The widest branch.
        max_level: The deepest leaf, in nodes.
        compression: C = rollout tokens / tree tokens (AReaL-DTA).
        prefix_sharing: S = 1 - 1/C.
        leaf_compression: Leaf tokens / tree tokens.
        potential_overlap_ratio: POR = 1 - tree tokens / leaf tokens (Tree Training).
        dense_attention_work: Sum over every rollout's tokens of their context length.
        tree_attention_work: The same over unique tokens.
        attention_compression: C_attn = dense / tree attention work.
    """

    num_rollouts: int
    num_nodes: int
    num_leaves: int
    num_prefix_rollouts: int
    num_duplicate_rollouts: int
    rollout_tokens: int
    tree_tokens: int
    leaf_tokens: int
    longest_rollout: int
    max_children: int
    max_level: int
    compression: float
    prefix_sharing: float
    leaf_compression: float
    potential_overlap_ratio: float
    dense_attention_work: float
    tree_attention_work: float
    attention_compression: float


@dataclass(frozen=True)
class Partition:
    """A batch split across ranks by AReaL-DTA's DFS-contiguous cut (core/partition/partition.h).

    ``groups[k]`` holds rank k's rollouts (indices into the tree's rollouts) in lexicographic order;
    ``cost[k]`` is what the split balanced (tree tokens, or the time model's cost), ``tree_tokens[k]``
    the tree tokens of rank k's own prefix tree; ``extra_tokens`` the prefix tokens computed on more
    than one rank; ``imbalance`` the largest cost over the mean.
    """

    groups: list[list[int]]
    cost: list[int]
    tree_tokens: list[int]
    max_cost: int
    extra_tokens: int
    imbalance: float


class PrefixTree:
    """The frozen prefix tree (radix trie) of a batch; immutable.

    Rollout r of the tree is the r-th sequence given. Node and rollout arguments out of range
    raise IndexError.
    """

    def __init__(self, rollouts: Iterable[Trajectory | Sequence[int]]) -> None:
        """Builds the tree of trajectories or token lists (in that order).

        Raises:
            ValueError: A sequence is empty or holds a negative token id (naming its index).
            TypeError: A token is not an integer in int32's range.
        """
        sequences = [list(r.tokens) if isinstance(r, Trajectory) else list(r) for r in rollouts]
        self._tree = _core.PrefixTree(sequences)

    def stats(self) -> TreeStats:
        """The tree's statistics, O(nodes + rollouts)."""
        return TreeStats(**self._tree.stats())

    @property
    def num_nodes(self) -> int:
        """Nodes, the root included."""
        return self._tree.num_nodes

    @property
    def num_rollouts(self) -> int:
        return self._tree.num_rollouts

    @property
    def tree_tokens(self) -> int:
        """Unique tokens: the sum of the segments' lengths."""
        return self._tree.num_tree_tokens

    @property
    def rollout_tokens(self) -> int:
        """Every rollout's length, summed."""
        return self._tree.num_rollout_tokens

    def parent(self, node: int) -> int:
        """The node's parent; -1 for the root."""
        return self._tree.parent(node)

    def children(self, node: int) -> list[int]:
        """Children in increasing order of their first token."""
        return self._tree.children(node)

    def segment(self, node: int) -> list[int]:
        """The node's tokens."""
        return self._tree.segment(node)

    def depth(self, node: int) -> int:
        """Position of the node's first token in every rollout through it."""
        return self._tree.depth(node)

    def level(self, node: int) -> int:
        """Nodes from the root to this one, the root excluded."""
        return self._tree.level(node)

    def is_leaf(self, node: int) -> bool:
        return self._tree.is_leaf(node)

    def subtree_end(self, node: int) -> int:
        """One past the last node of the node's subtree."""
        return self._tree.subtree_end(node)

    def num_rollouts_through(self, node: int) -> int:
        """Rollouts that pass through or end at the node (every rollout for the root)."""
        return self._tree.num_rollouts_through(node)

    def rollouts_ending_at(self, node: int) -> list[int]:
        """Rollouts that end exactly at the end of the node, in increasing order."""
        return self._tree.rollouts_ending_at(node)

    def end_node(self, rollout: int) -> int:
        """The node at which the rollout ends."""
        return self._tree.end_node(rollout)

    def rollout(self, rollout: int) -> list[int]:
        """The rollout's tokens, gathered from the segments on its path."""
        return self._tree.rollout_tokens(rollout)

    def lcp(self, a: int, b: int) -> int:
        """Length of the longest common prefix of two rollouts."""
        return self._tree.lcp(a, b)

    def serialized_tokens(self) -> list[int]:
        """Every node's tokens in node order: Tree Training's DFS serialization."""
        return self._tree.serialized_tokens()

    def partition(self, groups: int, per_token: int = 1, per_key: int = 0) -> Partition:
        """The rollouts split into ``groups`` DFS-contiguous shares minimising the largest share's cost.

        A share costs ``per_token`` for each token of its own prefix tree plus ``per_key`` for each
        key that token attends to (a token at depth d attends to d + 1): the defaults balance tree
        tokens, weights fitted on a GPU (``bench/balance_by_time.py``) balance predicted time, as
        ``dta-dispatcher --balance_per_token --balance_per_key`` does.

        Raises:
            ValueError: groups < 1, a negative weight, both weights 0, or a cost that overflows.
        """
        return Partition(**self._tree.partition(groups, per_token, per_key))

    def __repr__(self) -> str:
        return (f"PrefixTree({self.num_rollouts} rollouts, {self.rollout_tokens} rollout tokens, "
                f"{self.tree_tokens} tree tokens, {self.num_nodes} nodes)")
