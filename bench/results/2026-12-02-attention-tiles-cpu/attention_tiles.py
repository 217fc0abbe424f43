"""The tree-attention kernels' computed tiles against the visible query-key pairs of a batch.

Builds the prefix tree of a dta-workload JSONL file, lays its tokens out in DFS order (children in
first-seen order) and gives each key j its key_end (the end of its subtree: the kernels' mask, key
j visible to query rows [j, key_end[j])). The leading run of tokens every rollout shares (the
system prompt) is the cached prefix, seen by every row; the rest is one chunk. A kernel computes,
per key tile, every query tile from the diagonal one to the last row any key of the tile reaches,
and every prefix tile for every query tile. Prints computed / visible pairs at the Hopper kernels'
tile shapes (forward and dQ 128 x 128, dK/dV 64 queries x 128 keys) and smaller ones, and the
same for a causal chain of the chunk's length.

Usage: python3 attention_tiles.py ROLLOUTS.jsonl
"""
import json
import math
import sys


def tree_layout(path):
    children, count = [{}], 1
    with open(path) as f:
        for line in f:
            node = 0
            for token in json.loads(line)["tokens"]:
                child = children[node].get(token)
                if child is None:
                    child = count
                    count += 1
                    children.append({})
                    children[node][token] = child
                node = child
    order, end, stack = [], {}, [(0, False)]
    while stack:
        node, done = stack.pop()
        if done:
            end[node] = len(order)
            continue
        if node != 0:
            order.append(node)
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(list(children[node].values())))
    return [end[n] for n in order]


def main():
    key_end = tree_layout(sys.argv[1])
    total = len(key_end)
    prefix = 0
    while prefix < total and key_end[prefix] == total and (
            prefix + 1 == total or key_end[prefix + 1] == total):
        prefix += 1
    chunk = [e - prefix for e in key_end[prefix:]]
    n = len(chunk)
    visible = sum(e - j for j, e in enumerate(chunk)) + prefix * n
    print(f"{sys.argv[1]}: {total} tree tokens, a shared prefix of {prefix}, a chunk of {n}")
    for bm, bn in [(128, 128), (64, 128), (128, 64), (64, 64)]:
        tiles = sum((max(chunk[k:k + bn]) + bm - 1) // bm - k // bm for k in range(0, n, bn))
        prefix_tiles = math.ceil(prefix / bn) * math.ceil(n / bm)
        chain = sum(math.ceil(n / bm) - k // bm for k in range(0, n, bn))
        chain_visible = n * (n + 1) / 2 + prefix * n
        print(f"  {bm} queries x {bn} keys: computed / visible {(tiles + prefix_tiles) * bm * bn / visible:.3f}"
              f" ({tiles} chunk tiles, {prefix_tiles} prefix tiles); a causal chain of {n} on the"
              f" same prefix {(chain + prefix_tiles) * bm * bn / chain_visible:.3f}")


if __name__ == "__main__":
    main()
