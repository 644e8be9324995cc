"""Reading the Dynamo graph: node targets, module names and example values."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

_ROOT = re.compile(r"^L\['[^']*'\]\.?")
_INDEX = re.compile(r"\[(\d+)\]")
_SUBSCRIPT = re.compile(r"\[['\"]([^'\"]+)['\"]\]")


def normalize_fqn(dynamo_path: str) -> str:
    """Dynamo's ``L['self'].layers[0].attn`` -> ``layers.0.attn`` (as ``named_modules()`` spells it)."""
    path = _ROOT.sub("", dynamo_path)
    path = _INDEX.sub(r".\1", path)
    path = _SUBSCRIPT.sub(r".\1", path)
    path = path.replace("._modules.", ".").replace("_modules.", "")
    return path.strip(".")


def module_fqn(node: fx.Node) -> str:
    """FQN of the innermost module a node was traced in ("" at the root or when unknown)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return normalize_fqn(path)


def example_value(node) -> torch.Tensor | None:
    """The fake tensor Dynamo recorded for ``node`` (None for non-nodes or non-tensors)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


def shape_str(t: torch.Tensor | None) -> str:
    if t is None:
        return "?"
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def size_hint(dim) -> int:
    """A concrete int for a possibly symbolic size (its hint), for size heuristics only."""
    if isinstance(dim, int):
        return dim
    try:
        return int(dim.node.hint) if dim.node.hint is not None else int(dim)
    except Exception:  # unbacked symbol without a hint
        return 0


def is_call(node: fx.Node, functions: tuple = (), methods: tuple = ()) -> bool:
    """True when ``node`` calls one of ``functions`` or a Tensor method named in ``methods``."""
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in methods
    return False
