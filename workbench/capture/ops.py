"""What an op and a module path are, as the rules and the trace both read them.

Entry points: `op_name(target)`, `is_random`, `mutates`, `reads_until_wait` (facts of an
OpOverload), `layer_of` / `layer_pattern` / `module_matches` (module paths), `NodeKey` (a
node's stable name, `MODULE::OP#k`), `storage_keys(node)` and `storage_inputs(node)`. Torch
and the standard library only: exports embed this file first.
"""

from __future__ import annotations

import fnmatch
import operator
import re
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"


WAIT = "_c10d_functional.wait_tensor.default"


_LAYER_RE = re.compile(r"(?<=\.)\d+(?=\.|$)")


def layer_of(module: str) -> int | None:
    """Index of the repeated block a module path belongs to.

    >>> layer_of("layers.3.attention"), layer_of("norm")
    (3, None)
    """
    match = _LAYER_RE.search(module)
    return int(match.group()) if match else None


def layer_pattern(module: str) -> str:
    """The path shared by identical layers.

    >>> layer_pattern("layers.3.attention.wq")
    'layers.*.attention.wq'
    """
    return _LAYER_RE.sub("*", module, count=1)


def op_key(module: str, op: str) -> str:
    """`MODULE::OP`: an op of a module, every occurrence (a `NodeKey` without its `#k`).

    >>> op_key("layers.*.attention.wq", "aten.mm.default")
    'layers.*.attention.wq::aten.mm.default'
    """
    return f"{module}::{op}"


class NodeKey(NamedTuple):
    """A decidable node's stable name, `MODULE::OP#k`: the k-th op `OP` (from 0) that module
    `MODULE` runs, in graph order; a `MODULE` written `layers.*...` names the op in every
    identical layer. Built (`text`) and read back (`parse`) here only.

    >>> key = NodeKey("layers.*.attention.wq", "aten.mm.default", 0)
    >>> key.text, key.pair
    ('layers.*.attention.wq::aten.mm.default#0', 'layers.*.attention.wq::aten.mm.default')
    >>> NodeKey.parse(key.text) == key, key.in_module("layers.3.attention.wq").text
    (True, 'layers.3.attention.wq::aten.mm.default#0')
    >>> NodeKey.parse("layers.*.wq::aten.mm.default"), NodeKey.parse("wq#0")
    (None, None)
    """

    module: str
    op: str
    k: int

    @property
    def text(self) -> str:
        return f"{self.pair}#{self.k}"

    @property
    def pair(self) -> str:
        """`MODULE::OP` (`op_key`): the key without its `#k`."""
        return op_key(self.module, self.op)

    def in_module(self, module: str) -> NodeKey:
        """The same op in another module path: `layers.3...` for `layers.*...`."""
        return self._replace(module=module)

    @classmethod
    def parse(cls, text: str) -> NodeKey | None:
        """The parts of `MODULE::OP#k`; None for a text of another form."""
        module, sep, rest = text.partition("::")
        op, mark, k = rest.rpartition("#")
        if not (sep and mark and k.isascii() and k.isdigit()):
            return None
        return cls(module, op, int(k))


def block_container(modules: Any) -> str | None:
    """The module path holding a model's repeated blocks: what precedes the block index in
    the paths that have one, the most common such prefix (None when no path has one).

    >>> block_container(["model.layers.0.mlp", "model.layers.1", "lm_head"])
    'model.layers'
    >>> block_container(["transformer.h.3.attn"]), block_container(["norm"])
    ('transformer.h', None)
    """
    counts: dict[str, int] = {}
    for module in modules:
        match = _LAYER_RE.search(module)
        if match:
            prefix = module[: match.start() - 1]
            counts[prefix] = counts.get(prefix, 0) + 1
    return max(counts, key=lambda p: counts[p]) if counts else None


def op_name(target: Any) -> str:
    """`aten.mm.default` for an OpOverload; a plain callable's name (`getitem`) otherwise."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def is_random(target: Any) -> bool:
    """Ops tagged nondeterministic_seeded: torch's remat pass cannot replay their RNG."""
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
    )


def mutates(target: Any) -> bool:
    """In-place ops: a recomputed copy would apply the mutation twice."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def reads_until_wait(target: Any) -> bool:
    """Collectives that run asynchronously: they read their input until the `wait_tensor`
    on their output, not only when they are called (every `_c10d_functional` op but the
    wait itself)."""
    name = op_name(target)
    return name.startswith("_c10d_functional.") and name != WAIT


def module_matches(pattern: str, module: str) -> bool:
    """fnmatch per dotted component, `**` spans any number of components. Linear in the
    product of the component counts (no backtracking), whatever the pattern.

    >>> module_matches("layers.*.attention", "layers.3.attention")
    True
    >>> module_matches("**.wq", "layers.3.attention.wq"), module_matches("**", "")
    (True, True)
    """
    pattern_parts = pattern.split(".") if pattern else []
    parts = module.split(".") if module else []
    # matched[j]: pattern_parts[i:] matches parts[j:], computed from the last component back.
    matched = [False] * len(parts) + [True]
    for component in reversed(pattern_parts):
        after = matched
        matched = [False] * (len(parts) + 1)
        for j in range(len(parts), -1, -1):
            if component == "**":
                matched[j] = after[j] or (j < len(parts) and matched[j + 1])
            else:
                matched[j] = (
                    j < len(parts) and after[j + 1] and fnmatch.fnmatchcase(parts[j], component)
                )
    return matched[0]


def storage_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose storages `node`'s output may share: its inputs, but for a getitem the
    inputs of the op whose tuple it unpacks. A multi-output op makes its outputs' storages
    itself unless it returns views of an input (`split`), so a getitem of `topk` owns its
    storage, and a getitem of `split` shares the split input's."""
    while node.target is operator.getitem and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node.all_input_nodes


def storage_keys(node: torch.fx.Node) -> set[Any]:
    """The storages behind a node's output tensors (one per tensor; views share their
    base's, in fake tensors as in real ones)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    return {StorageWeakRef(v.untyped_storage()) for v in values if isinstance(v, torch.Tensor)}
