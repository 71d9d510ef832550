"""The shape of a proposal: a chain, or a tree of drafts under the last emitted token.

A proposal's nodes are numbered 0..g-1 in an order where every parent comes before its
children; `parents[j]` is node j's parent, or -1 where it hangs from the root (the last
emitted token, which the target's verify pass takes first). A chain is parents = j - 1.
The verify pass runs over [root, node 0, ..., node g-1]: pass row 0 is the root and row
j + 1 is node j, so node j is judged against the target's distribution at its parent's
row. These functions are plain Python over the parent list: a proposal has a few nodes.
"""

from __future__ import annotations

from dataclasses import dataclass


def chain(g: int) -> list[int]:
    """The parents of a chain of g drafts."""
    return list(range(-1, g - 1))


def check(parents: list[int]) -> None:
    """Refuse a parent list that is not a tree in parent-first order."""
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(
                f"node {j}'s parent is {parent}: a parent must be -1 (the root) or an earlier node"
            )


def is_chain(parents: list[int] | None) -> bool:
    return parents is None or parents == chain(len(parents))


def depths(parents: list[int]) -> list[int]:
    """Each node's depth: 1 for the root's children (the position after the root)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for the root, node -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def first_path(parents: list[int]) -> list[int]:
    """The path that takes each node's first child: the drafter's first choice at each
    step, which a chain-only verify keeps of a tree."""
    path, node = [], -1
    while True:
        child = next((j for j, p in enumerate(parents) if p == node), None)
        if child is None:
            return path
        path.append(child)
        node = child


def ranks(parents: list[int]) -> list[int]:
    """Each node's place among its parent's children, 0 for the first: the order in which
    a verify tries siblings (the drafter's order of preference, or of its draws)."""
    seen: dict[int, int] = {}
    out = []
    for parent in parents:
        out.append(seen.get(parent, 0))
        seen[parent] = out[-1] + 1
    return out


def walk(parents: list[int], path: list[int]) -> list[tuple[int, int]]:
    """What a verify's walk met at the root and at each accepted node (`path`): (how many
    children it had, the rank of the one accepted, -1 where none was: the walk ended)."""
    out = []
    for i, node in enumerate([-1, *path]):
        children = [j for j, p in enumerate(parents) if p == node]
        taken = path[i] if i < len(path) else None
        out.append((len(children), children.index(taken) if taken is not None else -1))
    return out


def ancestry(parents: list[int]) -> list[list[bool]]:
    """(g + 1) x (g + 1): row i, column k is True where pass row k is pass row i or one of
    its ancestors (row 0, the root, is every row's ancestor): the attention mask among a
    tree's own rows."""
    rows = [[True] + [False] * len(parents)]
    for j, parent in enumerate(parents):
        row = list(rows[parent + 1])
        row[j + 1] = True
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Shape:
    """The tree a policy asks a drafter for: `parents`, the shape its model of acceptance
    found best (siblings in order of preference). A drafter that places its branches by
    its own probabilities (drafters.treedraft) keeps within it: at most as many nodes at
    each depth, and as many children of one node as its widest node has."""

    parents: tuple[int, ...]
    # At temperature 0, where nothing is drawn and the drafter may place the nodes itself
    # (drafters.treedraft.grow), the levels it may run: a fixed γ's tree may be as deep as
    # its chain would be. 0: the shape's own depth (auto priced the passes of that one).
    depth: int = 0

    @property
    def nodes(self) -> int:
        return len(self.parents)

    @property
    def at_depth(self) -> list[int]:
        """How many nodes at depth 1, 2, ..."""
        out: list[int] = []
        for d in depths(list(self.parents)):
            out += [0] * (d - len(out))
            out[d - 1] += 1
        return out

    @property
    def width(self) -> int:
        return max(ranks(list(self.parents)), default=-1) + 1

    def __str__(self) -> str:
        """What the stats show: the nodes at each depth, e.g. '3+2+2+1'."""
        return "+".join(map(str, self.at_depth))
