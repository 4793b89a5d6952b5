"""A small declarative matcher over onnx-graphsurgeon graphs.

A pattern describes how a tensor is produced, from the tensor backwards:
``Op("Mul", (Tensor("x"), Constant("w")), commutative=True)`` matches a tensor made by a
Mul of any tensor and a constant, in either order, and binds ``x`` and ``w``. A name bound
twice must bind the same tensor, which is how ``x * rsqrt(mean(x**2))`` says "the same x".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import onnx_graphsurgeon as gs

Captures = dict[str, object]


@dataclass(frozen=True)
class Tensor:
    """Any tensor, bound to ``name``."""
    name: str


@dataclass(frozen=True)
class Constant:
    """A constant tensor (initializer), bound to ``name``."""
    name: str


@dataclass(frozen=True)
class Op:
    """A tensor produced by a node of type ``op``; ``inputs`` None means any inputs."""
    op: str
    inputs: tuple["Pattern", ...] | None = None
    name: str | None = None  # binds the node
    commutative: bool = False
    where: Callable[[gs.Node], bool] | None = None


@dataclass(frozen=True)
class Optional:
    """``inner``, possibly behind one single-input ``op`` node (e.g. a Cast)."""
    op: str
    inner: "Pattern"


@dataclass(frozen=True)
class Either:
    """The first of ``options`` that matches."""
    options: tuple["Pattern", ...]


Pattern = Union[Tensor, Constant, Op, Optional, Either]


def producer(tensor) -> gs.Node | None:
    return tensor.inputs[0] if isinstance(tensor, gs.Variable) and len(tensor.inputs) == 1 else None


def constant_value(tensor):
    """The numpy value of a constant tensor (an initializer or a Constant node's output), else None."""
    if isinstance(tensor, gs.Constant):
        return tensor.values
    node = producer(tensor)
    if node is not None and node.op == "Constant" and "value" in node.attrs:
        return node.attrs["value"].values
    return None


def match(pattern: Pattern, tensor, captures: Captures | None = None) -> Captures | None:
    """Bindings if ``tensor`` is produced as ``pattern`` says, else None."""
    captures = {} if captures is None else captures
    if isinstance(pattern, (Tensor, Constant)):
        if isinstance(pattern, Constant) and constant_value(tensor) is None:
            return None
        return _bind(captures, pattern.name, tensor)
    if isinstance(pattern, Optional):
        node = producer(tensor)
        if node is not None and node.op == pattern.op and len(node.inputs) >= 1:
            found = match(pattern.inner, node.inputs[0], dict(captures))
            if found is not None:
                return found
        return match(pattern.inner, tensor, dict(captures))
    if isinstance(pattern, Either):
        for option in pattern.options:
            found = match(option, tensor, dict(captures))
            if found is not None:
                return found
        return None
    node = producer(tensor)
    if node is None or node.op != pattern.op or (pattern.where and not pattern.where(node)):
        return None
    if pattern.name:
        captures = _bind(captures, pattern.name, node)
        if captures is None:
            return None
    if pattern.inputs is None:
        return captures
    if len(node.inputs) != len(pattern.inputs):
        return None
    orders = [node.inputs]
    if pattern.commutative and len(node.inputs) == 2:
        orders.append(node.inputs[::-1])
    for inputs in orders:
        found: Captures | None = dict(captures)
        for sub, tensor_in in zip(pattern.inputs, inputs):
            found = match(sub, tensor_in, found)
            if found is None:
                break
        if found is not None:
            return found
    return None


def _bind(captures: Captures, name: str, value) -> Captures | None:
    if name in captures:
        return captures if captures[name] is value else None
    return {**captures, name: value}


def ancestors_include(tensor, target_name: str, limit: int = 64) -> bool:
    """Whether ``target_name`` (a graph input) feeds ``tensor`` within ``limit`` nodes."""
    stack, seen = [tensor], set()
    while stack and len(seen) < limit:
        current = stack.pop()
        if current.name == target_name:
            return True
        node = producer(current)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(node.inputs)
    return False
