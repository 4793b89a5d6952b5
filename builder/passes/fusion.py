"""Declarative fusions: pattern + replacement + check, reporting their match count."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx_graphsurgeon as gs

from ..frontend.checkpoint import ArchConfig
from .base import PassContext, PassError, PassResult
from .pattern import Captures, Pattern, match


@dataclass(frozen=True)
class Match:
    root: gs.Node          # the node whose output the fusion replaces
    captures: Captures

    def __getitem__(self, name: str):
        return self.captures[name]

    @property
    def scope(self) -> str:
        """The hierarchical scope of the root node (``/model/layers.0/self_attn``)."""
        return self.root.name.rsplit("/", 1)[0] if "/" in self.root.name else ""


@dataclass(frozen=True)
class Fusion:
    """Rewrites every tensor produced as ``pattern`` says into what ``replace`` builds.

    ``check`` returns a reason to skip a structural match (or None); ``replace`` returns the
    new nodes, the last of which must produce the root's output tensor. ``expected`` says
    how many matches a model of the given architecture must give: any other count is an
    error, since a fusion that silently matches less (or more) than it should leaves a slow or
    wrong engine.
    """

    name: str
    root_op: str
    pattern: Pattern
    replace: Callable[[Match, gs.Graph, PassContext], list[gs.Node]]
    check: Callable[[Match, PassContext], str | None] = lambda m, ctx: None
    expected: Callable[[ArchConfig], int] | None = None

    def __call__(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        matches, skipped = [], {}
        for node in list(graph.nodes):
            if node.op != self.root_op or len(node.outputs) != 1:
                continue
            captures = match(self.pattern, node.outputs[0])
            if captures is None:
                continue
            found = Match(root=node, captures=captures)
            reason = self.check(found, ctx)
            if reason:
                skipped[node.name] = reason
                continue
            matches.append(found)
        names = {node.name for node in graph.nodes}
        for found in matches:
            output = found.root.outputs[0]
            new_nodes = self.replace(found, graph, ctx)
            found.root.outputs.clear()  # detach the old producer; cleanup drops what is now dead
            new_nodes[-1].outputs = [output]
            for node in new_nodes:
                node.name = _unique(node.name, names)
            graph.nodes.extend(new_nodes)
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        stats = {"matches": len(matches)}
        if skipped:
            stats["skipped"] = skipped
        if ctx.arch is not None and self.expected is not None:
            want = self.expected(ctx.arch)
            stats["expected"] = want
            if len(matches) != want:
                detail = f"; skipped: {skipped}" if skipped else ""
                raise PassError(f"{self.name} matched {len(matches)} of the {want} sites a "
                                f"{ctx.arch.architecture} with {ctx.arch.num_layers} layers has{detail}")
        return PassResult(graph=graph, modified=bool(matches), stats=stats)


def shared_node(graph: gs.Graph, name: str, build: Callable[[], gs.Node]) -> gs.Variable:
    """The output of the one node named ``name`` in ``graph``, made by ``build`` the first time
    (for what every match of a fusion needs once, e.g. an int64 view of position_ids)."""
    for node in graph.nodes:
        if node.name == name:
            return node.outputs[0]
    node = build()
    graph.nodes.append(node)
    return node.outputs[0]


def new_node(op: str, name: str, inputs: list, attrs: dict | None = None, outputs: list | None = None) -> gs.Node:
    return gs.Node(op=op, name=name, attrs=attrs or {}, inputs=inputs, outputs=outputs or [])


def _unique(name: str, taken: set[str]) -> str:
    candidate, k = name, 1
    while candidate in taken:
        candidate, k = f"{name}_{k}", k + 1
    taken.add(candidate)
    return candidate
