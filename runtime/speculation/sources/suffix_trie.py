"""A suffix trie of bounded depth with occurrence counts and suffix links: every substring of
the inserted texts up to ``depth`` tokens is a node, counted once per occurrence.

Appending a token extends the text's ``depth`` most recent suffixes by one node each (O(depth)
per token, at most ``depth`` new nodes), so the trie grows incrementally and its memory is
bounded by depth x inserted tokens. Removing a text again undoes exactly its counts and
drops the nodes that reach zero, so a store of recent texts stays bounded.

Node set is closed under prefixes and suffixes (depth truncation keeps both), which makes
Aho-Corasick-style matching with suffix links exact: ``longest_suffix`` finds the longest
suffix of any token sequence present in the trie in O(len) amortized.
"""
from __future__ import annotations

from typing import Iterable


class Node:
    """One substring. Most nodes (every substring that occurred once) have at most one child,
    so a lone child is held in two slots and a dict is made only for a second one: ~100 bytes
    a node instead of ~300."""

    __slots__ = ("_token", "_child", "_children", "count", "continued", "depth", "link", "last")

    def __init__(self, depth: int, link: "Node | None"):
        self._token = -1                                # the lone child's token (-1: none)
        self._child: Node | None = None
        self._children: dict[int, Node] | None = None   # all children, once there are two or more
        self.count = 0          # occurrences of this node's string
        self.continued = 0      # occurrences followed by a token: the sum of the children's counts
        self.depth = depth      # the string's length
        self.link = link        # the node of the string without its first token (the root's is None)
        self.last = -1          # when it last occurred (the trie's clock): breaks count ties by recency

    def child(self, token: int) -> "Node | None":
        if self._children is not None:
            return self._children.get(token)
        return self._child if token == self._token else None

    def add_child(self, token: int, node: "Node") -> None:
        if self._children is not None:
            self._children[token] = node
        elif self._child is None:
            self._token, self._child = token, node
        else:
            self._children = {self._token: self._child, token: node}
            self._token, self._child = -1, None

    def remove_child(self, token: int) -> None:
        if self._children is None:
            self._token, self._child = -1, None
        else:
            del self._children[token]

    def children(self) -> list[tuple[int, "Node"]]:
        if self._children is not None:
            return list(self._children.items())
        return [] if self._child is None else [(self._token, self._child)]


class SuffixTrie:
    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node(0, None)
        self.clock = 0

    def start(self) -> list[Node]:
        """A fresh text's open suffixes (none yet): pass it to ``append``/``remove``."""
        return []

    def append(self, open_suffixes: list[Node], token: int) -> list[Node]:
        """Counts one more token of a text whose open suffixes (lengths 1..depth, shortest
        first) are ``open_suffixes``; returns the text's open suffixes after it."""
        self.clock += 1
        extended: list[Node] = []
        shorter = self.root
        for node in (self.root, *open_suffixes):
            if node.depth == self.depth:
                break
            child = node.child(token)
            if child is None:
                child = Node(node.depth + 1, shorter)
                node.add_child(token, child)
            child.count += 1
            child.last = self.clock
            node.continued += 1
            extended.append(child)
            shorter = child
        return extended

    def remove(self, open_suffixes: list[Node], token: int) -> list[Node]:
        """Undoes ``append`` for the same text and token, in the same order; nodes whose count
        reaches zero leave the trie."""
        shortened: list[Node] = []
        for node in (self.root, *open_suffixes):
            if node.depth == self.depth:
                break
            child = node.child(token)
            child.count -= 1
            node.continued -= 1
            if child.count == 0:
                node.remove_child(token)
            shortened.append(child)
        return shortened

    def extend(self, tokens: Iterable[int]) -> None:
        """Counts a whole text."""
        open_suffixes = self.start()
        for token in tokens:
            open_suffixes = self.append(open_suffixes, token)

    def retract(self, tokens: Iterable[int]) -> None:
        """Uncounts a whole text counted by ``extend``."""
        open_suffixes = self.start()
        for token in tokens:
            open_suffixes = self.remove(open_suffixes, token)

    def longest_suffix(self, tokens: Iterable[int]) -> Node:
        """The node of the longest suffix of ``tokens`` that is in the trie (the root if none)."""
        node = self.root
        for token in tokens:
            while True:
                child = node.child(token) if node.depth < self.depth else None
                if child is not None:
                    node = child
                    break
                if node.link is None:  # the root: the token occurs nowhere
                    break
                node = node.link
        return node
