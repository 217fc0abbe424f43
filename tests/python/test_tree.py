"""dta.PrefixTree: the structure and statistics of a known tree (docs/architecture.md's example), and
the statistics of random batches against a brute-force count over distinct prefixes."""
from __future__ import annotations

import random

import pytest

import dta


def test_known_tree():
    r0, r1, r2 = [1, 2, 3, 4], [1, 2, 5], [1, 2]
    tree = dta.PrefixTree([r0, dta.Trajectory(id="r1", tokens=r1, loss_mask=[0, 1, 1], logprobs=[0, 0, 0]), r2])
    # Node ids in lexicographic preorder: 0 root, 1 [1 2], 2 [3 4], 3 [5].
    assert tree.num_nodes == 4 and tree.num_rollouts == 3
    assert [tree.segment(v) for v in range(4)] == [[], [1, 2], [3, 4], [5]]
    assert [tree.parent(v) for v in range(4)] == [-1, 0, 1, 1]
    assert tree.children(1) == [2, 3] and tree.children(0) == [1]
    assert [tree.depth(v) for v in range(4)] == [0, 0, 2, 2]
    assert [tree.level(v) for v in range(4)] == [0, 1, 2, 2]
    assert [tree.is_leaf(v) for v in range(4)] == [False, False, True, True]
    assert [tree.subtree_end(v) for v in range(4)] == [4, 4, 3, 4]
    assert [tree.num_rollouts_through(v) for v in range(4)] == [3, 3, 1, 1]
    assert tree.rollouts_ending_at(1) == [2] and tree.rollouts_ending_at(2) == [0]
    assert [tree.end_node(r) for r in range(3)] == [2, 3, 1]
    assert [tree.rollout(r) for r in range(3)] == [r0, r1, r2]
    assert tree.lcp(0, 1) == 2 and tree.lcp(0, 0) == 4
    assert tree.serialized_tokens() == [1, 2, 3, 4, 5]
    s = tree.stats()
    assert (s.rollout_tokens, s.tree_tokens, s.leaf_tokens) == (9, 5, 7)
    assert (s.num_nodes, s.num_leaves, s.num_prefix_rollouts, s.num_duplicate_rollouts) == (3, 2, 1, 0)
    assert (s.longest_rollout, s.max_children, s.max_level) == (4, 2, 2)
    assert s.compression == pytest.approx(9 / 5) and s.prefix_sharing == pytest.approx(1 - 5 / 9)
    assert s.leaf_compression == pytest.approx(7 / 5) and s.potential_overlap_ratio == pytest.approx(1 - 5 / 7)
    # Attention work: each token's context length (position + 1).
    assert s.dense_attention_work == (1 + 2 + 3 + 4) + (1 + 2 + 3) + (1 + 2)
    assert s.tree_attention_work == (1 + 2) + (3 + 4) + 3
    assert s.attention_compression == pytest.approx(19 / 13)
    assert "5 tree tokens" in repr(tree)


def brute_force_stats(rollouts: list[list[int]]) -> dict[str, float]:
    """The statistics from their definitions, over the set of distinct non-empty prefixes."""
    prefixes = {tuple(r[:k]) for r in rollouts for k in range(1, len(r) + 1)}
    ends = {tuple(r) for r in rollouts}
    next_tokens: dict[tuple[int, ...], set[int]] = {}
    for p in prefixes:
        next_tokens.setdefault(p[:-1], set()).add(p[-1])
    # A radix-trie node ends at every prefix that a rollout ends at or where rollouts diverge.
    boundaries = {p for p in prefixes if p in ends or len(next_tokens.get(p, ())) != 1}
    leaves = {p for p in boundaries if p not in next_tokens}

    def level(p: tuple[int, ...]) -> int:
        return sum(1 for k in range(1, len(p) + 1) if p[:k] in boundaries)

    return {
        "rollout_tokens": sum(len(r) for r in rollouts),
        "tree_tokens": len(prefixes),
        "num_nodes": len(boundaries),
        "num_leaves": len(leaves),
        "leaf_tokens": sum(len(p) for p in leaves),
        "num_prefix_rollouts": sum(1 for r in rollouts if tuple(r) in next_tokens),
        "num_duplicate_rollouts": len(rollouts) - len(ends),
        "longest_rollout": max(len(r) for r in rollouts),
        "max_children": max(len(v) for v in next_tokens.values()),
        "max_level": max(level(p) for p in leaves),
        "dense_attention_work": sum(len(r) * (len(r) + 1) / 2 for r in rollouts),
        "tree_attention_work": sum(len(p) for p in prefixes),
    }


@pytest.mark.parametrize("seed", range(8))
def test_random_batches_match_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 50])  # small vocabularies make deep shared prefixes
    rollouts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(rng.randrange(1, 25))]
    rollouts += [list(rng.choice(rollouts)) for _ in range(2)]  # duplicates
    rollouts += [rng.choice(rollouts)[: rng.randrange(1, 5)]]   # a prefix of another
    rng.shuffle(rollouts)
    tree = dta.PrefixTree(rollouts)
    stats = tree.stats()
    want = brute_force_stats(rollouts)
    for name, value in want.items():
        assert getattr(stats, name) == value, name
    assert stats.compression == pytest.approx(want["rollout_tokens"] / want["tree_tokens"])
    assert [tree.rollout(r) for r in range(len(rollouts))] == rollouts
    assert sorted(tree.serialized_tokens()) == sorted(p[-1] for p in {tuple(r[:k]) for r in rollouts
                                                                       for k in range(1, len(r) + 1)})


def test_bad_input_and_indices():
    with pytest.raises(ValueError, match="rollout 1: rollout has no tokens"):
        dta.PrefixTree([[1, 2], []])
    with pytest.raises(ValueError, match="rollout 0: token 1 has negative id -2"):
        dta.PrefixTree([[1, -2]])
    with pytest.raises(TypeError):
        dta.PrefixTree([[1, 2**40]])
    tree = dta.PrefixTree([[1, 2, 3]])
    with pytest.raises(IndexError, match="node 2 is outside"):
        tree.segment(2)
    with pytest.raises(IndexError, match="rollout -1 is outside"):
        tree.end_node(-1)


def test_partition_balances_tree_tokens_or_a_time_model():
    """PrefixTree.partition: DFS-contiguous shares (lexicographic within each), balancing tree tokens
    by default and tokens plus attended keys with weights; bad weights raise ValueError."""
    long_a, long_b = [1] * 40, [2] * 40
    shorts = [[10 + i] * 8 for i in range(10)]
    tree = dta.PrefixTree([*shorts, long_b, long_a])
    by_tokens = tree.partition(2)
    assert sorted(by_tokens.groups[0]) == [10, 11] and by_tokens.cost == [80, 80] == by_tokens.tree_tokens
    by_time = tree.partition(2, per_token=1, per_key=1)
    assert by_time.groups[0] == [11]  # the [1] * 40 path alone; the other long one with the shorts
    path = lambda n: n + n * (n + 1) // 2  # noqa: E731
    assert by_time.cost == [path(40), path(40) + 10 * path(8)] and by_time.tree_tokens == [40, 120]
    assert by_time.max_cost == max(by_time.cost) and by_time.extra_tokens == 0
    assert sorted(r for g in by_time.groups for r in g) == list(range(12))
    for bad in [dict(per_token=0, per_key=0), dict(per_token=-1)]:
        with pytest.raises(ValueError, match="per_key"):
            tree.partition(2, **bad)
    with pytest.raises(ValueError, match="num_groups"):
        tree.partition(0)
