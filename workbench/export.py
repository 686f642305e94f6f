"""Export a policy as code a training job can use without the workbench.

Entry points: `export(policy, fmt, graph=None) -> str` for the formats in `FORMATS` and
`write_export(text, path, overwrite=False)`.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.files import write_file
from workbench.graph import JointGraph
from workbench.policy import COMPUTE_INTENSIVE_OPS, MATMUL_OPS, Policy, validate

LINE_LENGTH = 100
# Set on a block by the generated `apply_ac`, so a model is never checkpointed twice.
WRAPPED_MARKER = "_sac_workbench_checkpointed"


def export(policy: Policy, fmt: str, graph: JointGraph | None = None) -> str:
    """`policy` as `fmt` text. With a traced `graph`, selectors and overrides are first
    checked against it, so a typo fails here rather than silently in the training job."""
    if fmt not in FORMATS:
        raise WorkbenchError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if graph is not None:
        validate(graph, policy)
    return FORMATS[fmt](policy, graph)


def write_export(text: str, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Write `text` (see `workbench.files.write_file`). An existing file is kept unless
    `overwrite`: exported code is often edited by hand afterwards."""
    return write_file(path, text, overwrite=overwrite)


# ---------------------------------------------------------------------------------------------
# Literals: everything that came from the user goes through these, so quotes, backslashes and
# newlines in module names or selectors cannot break the generated code.


def py_str(text: str) -> str:
    """A double-quoted, pure-ASCII Python literal that evaluates to `text`."""
    return '"' + "".join(_escape(ch) for ch in text) + '"'


def _escape(ch: str) -> str:
    if ch in '"\\':
        return "\\" + ch
    if " " <= ch <= "~":
        return ch
    return ascii(ch)[1:-1]  # \n, \x7f, \u2028, \U0001f600, ...


def _comment(text: str) -> str:
    """One comment line: control characters, backslashes and non-ASCII are escaped, so
    nothing in `text` can end the comment early."""
    return "# " + "".join(ch if " " <= ch <= "~" and ch != "\\" else ascii(ch)[1:-1] for ch in text)


def _json_header(policy: Policy) -> list[str]:
    lines = json.dumps(policy.to_json(), indent=2, ensure_ascii=True).splitlines()
    return ["# Policy (SAC Workbench JSON) this file was generated from:"] + [
        f"#   {line}" for line in lines
    ]


def _items(entries: Iterable[str], indent: str = "    ") -> list[str]:
    return [f"{indent}{entry}," for entry in entries]


def _op_set(name: str, ops: Iterable[str]) -> list[str]:
    return [
        f"{name} = frozenset(",
        "    {",
        *_items(map(py_str, sorted(ops)), " " * 8),
        "    }",
        ")",
    ]


def _selector_table(policy: Policy) -> list[str]:
    rows = []
    for s in policy.selectors:
        parts = [py_str(s.module_pattern), py_str(s.op_pattern), py_str(s.action)]
        one_line = f"    ({', '.join(parts)}),"
        if len(one_line) <= LINE_LENGTH:
            rows.append(one_line)
        else:
            rows += ["    (", *_items(parts, " " * 8), "    ),"]
    if not rows:
        return ["SELECTORS: list[tuple[str, str, str]] = []"]
    return ["SELECTORS: list[tuple[str, str, str]] = [", *rows, "]"]


def _override_table(policy: Policy) -> list[str]:
    rows = []
    for key, action in sorted(policy.overrides.items()):
        one_line = f"    {py_str(key)}: {py_str(action)},"
        if len(one_line) <= LINE_LENGTH:
            rows.append(one_line)
        else:
            rows += [f"    {py_str(key)}: (", f"        {py_str(action)}", "    ),"]
    if not rows:
        return ["OVERRIDES: dict[str, str] = {}"]
    return ["OVERRIDES: dict[str, str] = {", *rows, "}"]


def _can_recompute(policy: Policy) -> bool:
    return (
        policy.preset != "none"
        or any(s.action == "recompute" for s in policy.selectors)
        or "recompute" in policy.overrides.values()
    )


# ---------------------------------------------------------------------------------------------
# Generated Python: the policy's tables, then the rules of `workbench.policy.decide` restated
# with torch alone. The same rule code serves the eager `policy_fn` and the FX `tag_graph`.

_PRESET_RULES: dict[str, list[str]] = {
    "none": [
        '    """Preset `none`: keep every activation."""',
        "    return CheckpointPolicy.PREFER_SAVE",
    ],
    "full": [
        '    """Preset `full`: recompute every activation."""',
        "    return CheckpointPolicy.PREFER_RECOMPUTE",
    ],
    "default": [
        '    """Preset `default`: save the compute-intensive ops, recompute the rest."""',
        "    if op in SAVE_OPS:",
        "        return CheckpointPolicy.PREFER_SAVE",
        "    return CheckpointPolicy.PREFER_RECOMPUTE",
    ],
    "eager": [
        '    """Preset `eager` (torchtitan\'s eager SAC): outside the layers keep everything;',
        '    inside, save the compute-intensive ops but recompute every second matmul."""',
        "    if layer is None:",
        "        return CheckpointPolicy.PREFER_SAVE",
        "    if op in MATMUL_OPS and matmul_index % 2 == 0:",
        "        return CheckpointPolicy.PREFER_RECOMPUTE",
        "    if op in SAVE_OPS:",
        "        return CheckpointPolicy.PREFER_SAVE",
        "    return CheckpointPolicy.PREFER_RECOMPUTE",
    ],
}

_RULES = '''

MUST = {"save": CheckpointPolicy.MUST_SAVE, "recompute": CheckpointPolicy.MUST_RECOMPUTE}
RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
_LAYER_RE = re.compile(r"(?<=\\.)\\d+(?=\\.|$)")


def layer_of(module: str) -> int | None:
    """Index of the repeated block a module path is in (`layers.3.attention` -> 3)."""
    match = _LAYER_RE.search(module)
    return int(match.group()) if match else None


def layer_pattern(module: str) -> str:
    """`layers.3.attention` -> `layers.*.attention`: the path all identical layers share."""
    return _LAYER_RE.sub("*", module, count=1)


def op_name(target: Any) -> str:
    """`aten.mm.default` for an OpOverload; a plain callable's name (`getitem`) otherwise."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def module_matches(pattern: str, module: str) -> bool:
    """fnmatch per dotted component; `**` matches any number of components."""
    return _match(pattern.split(".") if pattern else [], module.split(".") if module else [])


def _match(pattern: list[str], parts: list[str]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_match(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    if not parts or not fnmatch.fnmatchcase(parts[0], pattern[0]):
        return False
    return _match(pattern[1:], parts[1:])


def is_random(target: Any) -> bool:
    """Random ops are always saved: torch's remat pass cannot replay their RNG."""
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
    )


def mutates(target: Any) -> bool:
    """In-place ops: the graph saves them (a remat copy would mutate twice)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    arguments = target._schema.arguments
    return any(a.alias_info is not None and a.alias_info.is_write for a in arguments)


def requested(module: str, op: str, index: int, matmul_index: int) -> CheckpointPolicy:
    """The preset's choice, then selectors (later ones win), then overrides (a key naming one
    layer wins over a `layers.*` key). `index`: this op's occurrence in its module, from 0;
    `matmul_index`: the matmul count of the layer so far, from 1."""
    policy = preset_policy(layer_of(module), op, matmul_index)
    for module_pattern, op_pattern, action in SELECTORS:
        if module_matches(module_pattern, module) and fnmatch.fnmatchcase(op, op_pattern):
            policy = MUST[action]
    for key in (f"{layer_pattern(module)}::{op}#{index}", f"{module}::{op}#{index}"):
        if key in OVERRIDES:
            policy = MUST[OVERRIDES[key]]
    return policy
'''

_POLICY_FN = '''
# What the running layer forward has done so far: the module stack kept by apply_ac's hooks,
# and how often each (module, op) and each matmul ran, counted apart for the original forward
# and the recompute (`ctx.is_recompute`). Reset at the start of every layer forward.
_STACK: list[str] = []
_COUNTS: collections.Counter[tuple[bool, str, str]] = collections.Counter()
_MATMULS: collections.Counter[bool] = collections.Counter()


def current_module() -> str:
    """Path of the innermost module running now, e.g. `layers.0.attention.wq`."""
    return _STACK[-1] if _STACK else ""


def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save or recompute `func`'s output, as the graph policy does for the same op (in-place
    ops aside, see below)."""
    module, op = current_module(), op_name(func)
    index = _COUNTS[(ctx.is_recompute, module, op)]
    _COUNTS[(ctx.is_recompute, module, op)] += 1
    if op in MATMUL_OPS:
        _MATMULS[ctx.is_recompute] += 1
    if is_random(func):
        return CheckpointPolicy.MUST_SAVE
    if mutates(func):
        # Unlike the graph, recompute: eager SAC caches an op's output before autograd bumps
        # the version of an in-place op, so a saved in-place op fails in backward ("Tensor
        # cached during selective activation checkpoint has been mutated"). The recompute
        # mutates the freshly recomputed tensor, so it stays correct.
        return CheckpointPolicy.PREFER_RECOMPUTE
    return requested(module, op, index, _MATMULS[ctx.is_recompute])


def context_fn() -> Any:
    """Fresh SAC contexts for each checkpoint call; `policy_fn` is looked up at call time."""
    return create_selective_checkpoint_contexts(policy_fn)


def apply_ac(model: torch.nn.Module, layers_attr: str = "layers") -> torch.nn.Module:
    """Checkpoint every block of `model.<layers_attr>` with `policy_fn`, in place.

    Each block's forward is replaced by a non-reentrant `checkpoint` of the original (module
    names and state_dict keys stay), and the block's submodules get forward hooks that keep
    the module stack `policy_fn` reads. Nothing outside the blocks is checkpointed. Returns
    `model`; deep-copy it first to keep an unwrapped one.
    """
    if not WRAP_LAYERS:
        return model
    blocks = functools.reduce(getattr, layers_attr.split("."), model)
    for name, block in blocks.named_children():
        path = f"{layers_attr}.{name}"
        if getattr(block, WRAPPED_MARKER, False):
            raise RuntimeError(f"{path} is already checkpointed by apply_ac")
        for sub_path, sub in block.named_modules(prefix=path):
            if sub is not block:
                sub.register_forward_pre_hook(functools.partial(_enter, sub_path))
                sub.register_forward_hook(_leave, always_call=True)
        block.forward = _checkpointed(block.forward, path)
        setattr(block, WRAPPED_MARKER, True)
    return model


def _enter(path: str, module: torch.nn.Module, args: Any) -> None:
    _STACK.append(path)


def _leave(module: torch.nn.Module, args: Any, output: Any) -> None:
    if _STACK:
        _STACK.pop()


def _checkpointed(forward: Callable[..., Any], path: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        # Runs for the forward and again for the recompute, which may stop early (an
        # exception): every run starts from a clean stack and fresh counts.
        _STACK[:] = [path]
        _COUNTS.clear()
        _MATMULS.clear()
        try:
            return forward(*args, **kwargs)
        finally:
            _STACK.clear()

    @functools.wraps(forward)
    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return checkpointed_forward
'''

_GRAPH_PASS = '''
def module_path(node: torch.fx.Node, in_loss: bool) -> str:
    """The module that ran the node: meta["custom"]["module"] (SAC Workbench tracing) or
    ["module_fqn"] (torchtitan), else the innermost nn_module_stack entry."""
    custom = node.meta.get("custom") or {}
    for key in ("module", "module_fqn"):
        if key in custom:
            return str(custom[key])
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        path = path[0] if isinstance(path, tuple) else str(path)
        path = re.sub(r"\\[(\\d+)\\]", r".\\1", path)  # dynamo: L['self'].layers[0]
        return path.removeprefix("L['self']").lstrip(".")
    return "loss" if in_loss else ""


def tag_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Write node.meta["recompute"] on every forward and loss node of a joint graph, in place.

    Reads meta["autograd_backward"] (backward nodes get no tag), the module path (see
    `module_path`) and meta["custom"]["phase_hint"] == "loss" (where the loss starts). Random
    ops and mutations are saved; getitem follows the op it unpacks; a recompute node with a
    recompute user in another layer is saved, or remat would chain recomputation across
    layers. Warns about selectors and overrides that match nothing. Returns `gm`.
    """
    tags: dict[torch.fx.Node, CheckpointPolicy] = {}
    ops: dict[torch.fx.Node, str] = {}
    layers: dict[torch.fx.Node, int | None] = {}
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    matmuls: collections.Counter[int | None] = collections.Counter()
    used_keys: set[str] = set()
    used_selectors: set[int] = set()
    in_loss = False
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        if node.op in ("placeholder", "output") or node.meta.get("autograd_backward"):
            continue
        in_loss = in_loss or (node.meta.get("custom") or {}).get("phase_hint") == "loss"
        module = module_path(node, in_loss)
        op = ops[node] = op_name(node.target) if node.op == "call_function" else node.op
        index = seen[(module, op)]
        seen[(module, op)] += 1
        layers[node] = layer_of(module)
        if op in MATMUL_OPS:
            matmuls[layers[node]] += 1
        tags[node] = requested(module, op, index, matmuls[layers[node]])
        if node.op == "call_function" and (is_random(node.target) or mutates(node.target)):
            tags[node] = CheckpointPolicy.MUST_SAVE
        used_keys |= {f"{layer_pattern(module)}::{op}#{index}", f"{module}::{op}#{index}"}
        used_selectors |= {
            i
            for i, (module_pattern, op_pattern, _) in enumerate(SELECTORS)
            if module_matches(module_pattern, module) and fnmatch.fnmatchcase(op, op_pattern)
        }
    for node, tag in tags.items():
        parent = node.args[0] if ops[node] == "getitem" and node.args else None
        if not isinstance(parent, torch.fx.Node) or parent not in tags:
            continue
        if (tags[parent] in RECOMPUTE) != (tag in RECOMPUTE):
            tags[node] = tags[parent]
    for node in reversed(list(tags)):
        if tags[node] in RECOMPUTE and any(
            user in tags and tags[user] in RECOMPUTE and layers[user] != layers[node]
            for user in node.users
        ):
            tags[node] = CheckpointPolicy.MUST_SAVE
    for node, tag in tags.items():
        node.meta["recompute"] = tag
    for i, (module_pattern, op_pattern, _) in enumerate(SELECTORS):
        if i not in used_selectors:
            warnings.warn(f"selector {module_pattern}::{op_pattern} matches no node", stacklevel=2)
    for key in sorted(set(OVERRIDES) - used_keys):
        warnings.warn(f"override {key} names no forward node", stacklevel=2)
    return gm
'''


def _python_module(
    policy: Policy,
    graph: JointGraph | None,
    docstring: list[str],
    imports: list[str],
    extra_constants: list[str],
    body: str,
) -> str:
    constants = [f"PRESET = {py_str(policy.preset)}"]
    if policy.preset in ("default", "eager"):
        constants += [
            "# Compute-intensive ops the preset saves (torchtitan's save list); the rest is",
            "# recomputed.",
            *_op_set("SAVE_OPS", COMPUTE_INTENSIVE_OPS),
        ]
    constants += [
        "# Matmuls, counted per layer forward (the `eager` preset recomputes every second one).",
        *_op_set("MATMUL_OPS", MATMUL_OPS),
        "# (module pattern, op pattern, action): fnmatch per dotted module component, `**` for",
        "# any number of components. Later rows win over earlier ones.",
        *_selector_table(policy),
        "# `MODULE::OP#k` (the k-th such op in that module, from 0) -> action. A `layers.*` key",
        "# applies to every layer; a key naming one layer (`layers.3...`) wins over it.",
        *_override_table(policy),
        *extra_constants,
    ]
    provenance = []
    if graph is not None:
        provenance = [_comment(f"Checked against the traced graph of {graph.model_name}.")]
    lines = [
        *docstring,
        "",
        *_json_header(policy),
        *provenance,
        "",
        "from __future__ import annotations",
        "",
        *imports,
        "",
        *constants,
        "",
        "",
        "def preset_policy(layer: int | None, op: str, matmul_index: int) -> CheckpointPolicy:",
        *_PRESET_RULES[policy.preset],
        "",
    ]
    return "\n".join(lines) + _RULES + "\n" + body


def _policy_fn(policy: Policy, graph: JointGraph | None) -> str:
    """Eager SAC: `policy_fn` for create_selective_checkpoint_contexts plus `apply_ac`."""
    wrap = _can_recompute(policy)
    return _python_module(
        policy,
        graph,
        docstring=[
            '"""Eager selective activation checkpointing for one SAC Workbench policy.',
            "",
            "Entry points: `apply_ac(model)` and `policy_fn(ctx, func, *args, **kwargs)`.",
            '"""',
        ],
        imports=[
            "import collections",
            "import fnmatch",
            "import functools",
            "import re",
            "from collections.abc import Callable",
            "from typing import Any",
            "",
            "import torch",
            "from torch.utils.checkpoint import (",
            "    CheckpointPolicy,",
            "    checkpoint,",
            "    create_selective_checkpoint_contexts,",
            ")",
        ],
        extra_constants=[
            "# False when the policy never recomputes: then apply_ac leaves the model alone.",
            f"WRAP_LAYERS = {wrap}",
            f"WRAPPED_MARKER = {py_str(WRAPPED_MARKER)}",
        ],
        body=_POLICY_FN,
    )


def _graph_pass(policy: Policy, graph: JointGraph | None) -> str:
    """Graph SAC: `tag_graph(gm)` writing the tags `decide` would, before torch's remat pass."""
    return _python_module(
        policy,
        graph,
        docstring=[
            '"""Graph selective activation checkpointing for one SAC Workbench policy.',
            "",
            'Entry point: `tag_graph(gm)`, which writes node.meta["recompute"] for torch\'s',
            "remat pass (remat_using_tags_for_fwd_loss_bwd_graph).",
            '"""',
        ],
        imports=[
            "import collections",
            "import fnmatch",
            "import re",
            "import warnings",
            "from typing import Any",
            "",
            "import torch",
            "import torch.fx",
            "from torch.utils.checkpoint import CheckpointPolicy",
        ],
        extra_constants=[],
        body=_GRAPH_PASS,
    )


# ---------------------------------------------------------------------------------------------
# torchtitan graph_trainer. Option names and memory policies as read in pytorch/torchtitan,
# torchtitan/experiments/graph_trainer/configs.py (GraphTrainerCompileConfig) and
# memory_policy.py: `--compile.memory_policy` in none (newer versions only), default, full,
# eager, min_cut, sac_and_offload; `--compile.full_recompute_save_ops` takes
# `MODULE_FQN_PATTERN::OP` selectors joined by `|`, used by the `full` policy only.

TORCHTITAN_SOURCE = (
    "pytorch/torchtitan torchtitan/experiments/graph_trainer/configs.py "
    "(GraphTrainerCompileConfig.memory_policy, .full_recompute_save_ops)"
)
# Workbench preset -> (torchtitan memory_policy, how the two differ).
TORCHTITAN_POLICIES: dict[str, tuple[str, str]] = {
    "none": (
        "none",
        "'none' is registered in newer graph_trainer versions only; older ones have no "
        "no-recompute policy.",
    ),
    "full": (
        "full",
        "torchtitan tags MUST_RECOMPUTE and leaves modules named lm_head*/loss* untagged; the "
        "workbench also tags the output projection and loss.",
    ),
    "default": (
        "default",
        "torchtitan saves its own save list (MUST_SAVE, plus FSDP all-gathers without "
        "reshard-after-forward); the workbench saves COMPUTE_INTENSIVE_OPS.",
    ),
    "eager": (
        "eager",
        "torchtitan also alternates matmuls outside the layers; the workbench keeps "
        "everything outside the layers.",
    ),
}


def _torchtitan(policy: Policy, graph: JointGraph | None) -> str:
    """`--compile.*` options; what they cannot say becomes `#` lines pointing elsewhere."""
    memory_policy, difference = TORCHTITAN_POLICIES[policy.preset]
    save_ops, notes, unexpressed = _full_recompute_save_ops(policy)
    lines = [
        "# torchtitan graph_trainer options (append to run_train.sh) for this policy:",
        "# " + json.dumps(policy.to_json(), separators=(",", ":")),
        _comment(f"Option names confirmed in {TORCHTITAN_SOURCE}."),
        _comment(f"Preset {policy.preset!r} -> memory_policy {memory_policy!r}: {difference}"),
        *(_comment(note) for note in notes),
        *(_comment(f"cannot express {what}: {why}") for what, why in unexpressed),
    ]
    if save_ops:
        lines.append(
            "# Selector patterns as the workbench matches them (fnmatch per dotted component, "
            "** for any number); torchtitan's own matcher was not read."
        )
    if unexpressed:
        lines.append(
            "# For this policy as written, export format 'graph_pass' and run its tag_graph(gm) "
            "in place of torchtitan's memory-policy pass."
        )
    lines.append(f"--compile.memory_policy {memory_policy}")
    if save_ops:
        lines.append(f"--compile.full_recompute_save_ops {shlex.quote(' | '.join(save_ops))}")
    return "\n".join(lines) + "\n"


def _full_recompute_save_ops(
    policy: Policy,
) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Selectors torchtitan takes as `full_recompute_save_ops` ("save these, recompute the
    rest" under `full`), notes on selectors that change nothing, and what cannot be said."""
    save_ops: list[str] = []
    notes: list[str] = []
    unexpressed: list[tuple[str, str]] = []
    for s in policy.selectors:
        what = f"selector {s.select} -> {s.action}"
        redundant = {"full": "recompute", "none": "save"}.get(policy.preset)
        if s.action == redundant and not save_ops:
            notes.append(f"{what} changes nothing under {policy.preset!r} (dropped)")
        elif policy.preset != "full" or s.action != "save":
            why = "full_recompute_save_ops only adds saves to memory_policy 'full'"
            if policy.preset == "full":
                why = "a recompute selector after save selectors would undo some of them"
            unexpressed.append((what, why))
        elif "|" in s.select or not s.select.isprintable():
            unexpressed.append((what, "'|' and control characters do not survive the option"))
        else:
            save_ops.append(s.select)
    for key, action in sorted(policy.overrides.items()):
        unexpressed.append((f"override {key} -> {action}", "torchtitan has no per-op overrides"))
    return save_ops, notes, unexpressed


def _json(policy: Policy, graph: JointGraph | None) -> str:
    return json.dumps(policy.to_json(), indent=2)


FORMATS: dict[str, Callable[[Policy, JointGraph | None], str]] = {
    "policy_fn": _policy_fn,
    "graph_pass": _graph_pass,
    "torchtitan": _torchtitan,
    "json": _json,
}
