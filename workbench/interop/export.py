"""Export a policy as code a training job can use without the workbench.

Entry points: `export(policy, fmt, graph=None) -> str` for the formats in `FORMATS` and
`write_export(text, path, overwrite=False)`.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
import os
import shlex
import textwrap
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from workbench.capture.graph import JointGraph
from workbench.decide import EMBEDDED
from workbench.decide.decider import decide, rules_of, validate
from workbench.decide.engine import written_later_keys
from workbench.decide.policy import Policy
from workbench.decide.presets import PRESETS
from workbench.decide.tags import Why
from workbench.errors import WorkbenchError
from workbench.files import write_file

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
# Generated Python: the policy's tables, the source of the rules verbatim (the files of
# `workbench.decide.EMBEDDED`, the very rules `decide` applies), and an entry point: eager
# `policy_fn` + `apply_ac`, or `tag_graph`.

_RULES_HEADER = "# --- The rules: SAC Workbench's {} files, verbatim ---"
_POLICY_HEADER = "# --- This policy ---"


def rules_source() -> tuple[list[str], str]:
    """The embedded rule files (`workbench.decide.EMBEDDED`) as their top-level imports of
    torch and the standard library, and their code after those imports, in order, each
    under a line naming its file (no module docstrings, no `from __future__`, none of their
    imports of each other): what every Python export embeds."""
    imports: list[str] = []
    bodies: list[str] = []
    for name in EMBEDDED:
        source = inspect.getsource(importlib.import_module(name))
        tree = ast.parse(source)
        own = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        first_code = next(
            node for node in tree.body if node.lineno > own[-1].lineno and node not in own
        )
        lines = source.splitlines()
        for node in own:
            statement = ast.get_source_segment(source, node) or ""
            if not statement.startswith(("from __future__", "from workbench", "import workbench")):
                imports.append(statement)
        body = "\n".join(lines[_first_line(first_code, lines) :]).strip("\n")
        bodies.append(f"# --- {name.replace('.', '/')}.py ---\n\n\n{body}\n")
    return imports, "\n\n".join(bodies)


def _first_line(node: ast.stmt, lines: list[str]) -> int:
    """0-based line where `node` starts, including the comment block just above it."""
    start = node.lineno - 1
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    return start


def _import_block(statements: Iterable[str]) -> list[str]:
    """Merged, sorted `import`/`from … import` lines, stdlib first, then torch (isort order)."""
    plain: set[str] = set()
    names: dict[str, set[str]] = {}
    for statement in statements:
        for node in ast.parse(statement).body:
            if isinstance(node, ast.Import):
                plain.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names.setdefault(node.module, set()).update(a.name for a in node.names)
    sections: list[list[str]] = [[], []]
    for module in sorted(plain):
        sections[module.split(".")[0] == "torch"].append(f"import {module}")
    for module in sorted(names):
        members = sorted(names[module], key=lambda n: (not n[:1].isupper(), n))
        line = f"from {module} import {', '.join(members)}"
        if len(line) > LINE_LENGTH:
            line = "\n".join([f"from {module} import (", *_items(members), ")"])
        sections[module.split(".")[0] == "torch"].append(line)
    return [*sections[0], "", *sections[1]]


_POLICY_FN = '''
_RULE = preset_rule(PRESET)
# The module stack kept by apply_ac's hooks, and one op counter each for the original forward
# and the recompute (`ctx.is_recompute`). Reset at the start of every layer forward.
_STACK: list[str] = []
_COUNTERS: dict[bool, OpCounter] = {False: OpCounter(), True: OpCounter()}


def current_module() -> str:
    """Path of the innermost module running now, e.g. `layers.0.attention.wq`."""
    return _STACK[-1] if _STACK else ""


def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save or recompute `func`'s output by the rules above (see `eager_tag`)."""
    row = (str(func), current_module(), op_name(func), is_random(func), mutates(func), None, (),
           None)  # fmt: skip
    facts = _COUNTERS[bool(ctx.is_recompute)].facts(row)
    return eager_tag(facts, _RULE, PRESET, SELECTORS, OVERRIDES, WRITTEN_LATER).policy


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
        _COUNTERS.update({False: OpCounter(), True: OpCounter()})
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

def module_paths(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """The module that ran each node: meta["custom"]["module"] (SAC Workbench tracing) or
    ["module_fqn"] (torchtitan), else the innermost nn_module_stack entry; nodes from the
    first one marked meta["custom"]["phase_hint"] == "loss" on default to "loss"."""
    paths: dict[torch.fx.Node, str] = {}
    in_loss = False
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        if not node.meta.get("autograd_backward"):
            in_loss = in_loss or custom.get("phase_hint") == "loss"
        path = next((str(custom[k]) for k in ("module", "module_fqn") if k in custom), None)
        stack = node.meta.get("nn_module_stack")
        if path is None and stack:
            last = list(stack.values())[-1]
            last = last[0] if isinstance(last, tuple) else str(last)
            last = re.sub(r"\\[(\\d+)\\]", r".\\1", last)  # dynamo: L['self'].layers[0]
            path = last.removeprefix("L['self']").lstrip(".")
        paths[node] = path if path is not None else ("loss" if in_loss else "")
    return paths


def tag_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Write node.meta["recompute"] on every forward and loss node of a joint graph, in place.

    Reads meta["autograd_backward"] (backward nodes get no tag) and the module path (see
    `module_paths`); tags by `decide_ops`, offloaded nodes MUST_CPU_OFFLOAD. Warns about
    selectors and overrides that match nothing. Returns `gm`.
    """
    facts = op_facts(fx_rows(gm, module_paths(gm).__getitem__))
    offload = OffloadOptions(*OFFLOAD_OPTIONS)
    tags = decide_ops(facts, PRESET, SELECTORS, OVERRIDES, FSDP_RESHARD, offload)
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        if node.name in tags:
            node.meta["recompute"] = tags[node.name].policy
    for module_pattern, op_pattern, _ in SELECTORS:
        if not any(selector_matches(module_pattern, op_pattern, f.module, f.op) for f in facts):
            warnings.warn(f"selector {module_pattern}::{op_pattern} matches no node", stacklevel=2)
    used_keys = {key for f in facts for key in (f.key, f.layer_key)}
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
    rule_imports, rule_code = rules_source()
    constants = [
        f"PRESET = {py_str(policy.preset)}",
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
        provenance += [_comment(line) for line in parallel_notes(policy, graph)]
        if body is _GRAPH_PASS:
            for note in forced_notes(policy, graph):
                provenance += [_comment(line) for line in textwrap.wrap(note, LINE_LENGTH - 4)]
    lines = [
        *docstring,
        "",
        *_json_header(policy),
        *provenance,
        "",
        "from __future__ import annotations",
        "",
        *_import_block([*rule_imports, *imports]),
        "",
        _POLICY_HEADER,
        "",
        *constants,
        "",
        _RULES_HEADER.format(len(EMBEDDED)),
        "",
        rule_code,
    ]
    return "\n".join(lines) + "\n\n# --- Entry point ---\n" + body


def parallel_notes(policy: Policy, graph: JointGraph) -> list[str]:
    """What a per-rank graph's parallel setting means for `policy`: which collectives it
    saves and which it recomputes, and the FSDP reshard choice. Empty on one device."""
    if graph.world_size == 1:
        return []
    decisions = decide(graph, policy)
    saved: Counter[str] = Counter()
    redone: Counter[str] = Counter()
    for c in graph.collectives():
        tag = decisions.get(c.node)
        if tag is not None and c.kind != "wait":
            (redone if tag.recompute else saved)[f"{c.kind} ({c.mesh_dim or c.group})"] += 1
    fsdp = (
        "reshard after forward: FSDP all-gathers run again in backward"
        if policy.fsdp_reshard
        else "keep unsharded: gathered parameters stay from forward to backward"
    )
    config = graph.config
    return [
        f"Per-rank graph, fsdp {config.get('fsdp', 1)} x tp {config.get('tp', 1)} "
        f"(world size {graph.world_size}); FSDP: {fsdp}.",
        "Forward collectives saved: "
        + (", ".join(f"{n} {k}" for k, n in sorted(saved.items())) or "none")
        + ".",
        "Forward collectives recomputed in backward: "
        + (", ".join(f"{n} {k}" for k, n in sorted(redone.items())) or "none")
        + ".",
        "Eager SAC (policy_fn) sees no FSDP all-gathers: FSDP2's reshard_after_forward decides.",
    ]


def _policy_fn(policy: Policy, graph: JointGraph | None) -> str:
    """Eager SAC: `policy_fn` for create_selective_checkpoint_contexts plus `apply_ac`.
    Refuses a policy that offloads: eager SAC has no offload (torch 2.13's SAC caches only
    *_SAVE outputs and recomputes everything else, *_CPU_OFFLOAD included)."""
    if policy.offloads:
        raise WorkbenchError(
            f"policy_fn: offload (preset {policy.preset!r} or an 'offload' selector/override) "
            "is not expressible in eager SAC, which saves or recomputes only; export "
            "'graph_pass' (tags MUST_CPU_OFFLOAD) or 'torchtitan' (memory_policy "
            "sac_and_offload) instead"
        )
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
            "import functools",
            "from collections.abc import Callable",
            "from typing import Any",
            "import torch",
            "from torch.utils.checkpoint import CheckpointPolicy, checkpoint, "
            "create_selective_checkpoint_contexts",
        ],
        extra_constants=[
            "# False when the policy never recomputes: then apply_ac leaves the model alone.",
            f"WRAP_LAYERS = {wrap}",
            f"WRAPPED_MARKER = {py_str(WRAPPED_MARKER)}",
            *_written_later_table(graph),
        ],
        body=_POLICY_FN,
    )


def _written_later_table(graph: JointGraph | None) -> list[str]:
    """`WRITTEN_LATER`: the ops (layer keys) whose output forward writes in place later, which
    eager SAC must recompute (torch's SAC refuses a cached tensor written after caching)."""
    lines = [
        "# Ops whose output forward writes in place later (layer keys): recomputed, since",
        "# torch's SAC fails in backward on a saved tensor written after it was cached.",
    ]
    if graph is None:
        lines.append("# Exported without a traced graph: none known (export with the model).")
        keys: frozenset[str] = frozenset()
    else:
        keys = written_later_keys(rules_of(graph).plan)
    if not keys:
        return [*lines, "WRITTEN_LATER: frozenset[str] = frozenset()"]
    rows = _items(map(py_str, sorted(keys)), " " * 8)
    return [*lines, "WRITTEN_LATER: frozenset[str] = frozenset(", "    {", *rows, "    }", ")"]


FORCED_NAMED = 5  # forced nodes an export's comments name one by one


def forced_notes(policy: Policy, graph: JointGraph) -> list[str]:
    """What `decide` forces on the traced graph whatever the policy asks, by reason, and
    each save of the in-place rule (`Why.WRITTEN_INPUT`) with why: the comments of a
    `graph_pass` export, whose `tag_graph` forces the same in the training job."""
    decisions = decide(graph, policy)
    counts = Counter(d.why.value for d in decisions.values() if d.forced)
    if not counts:
        return []
    lines = [
        "Forced on this graph, whatever the policy asks: "
        + ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
        + "."
    ]
    written = [(n, d) for n, d in decisions.items() if d.why is Why.WRITTEN_INPUT]
    for name, tag in written[:FORCED_NAMED]:
        lines.append(f"Saved, written in place: {name} ({graph.nodes[name].module}): {tag.detail}")
    if len(written) > FORCED_NAMED:
        lines.append(f"... and {len(written) - FORCED_NAMED} more saved for that reason.")
    return lines


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
        imports=["import re", "import warnings", "import torch", "import torch.fx"],
        extra_constants=[
            "# FSDP parameter all-gathers: True recomputes each unshard chain in backward",
            "# (reshard after forward), False keeps the gathered copies until backward.",
            f"FSDP_RESHARD = {policy.fsdp_reshard}",
            "# CPU offload: host budget in bytes (None: no limit), applied largest first by",
            "# decide_ops; prefetch/defer are for the pass that turns the MUST_CPU_OFFLOAD tags",
            "# into copies: graph trainer's apply_cpu_offload_pass (prefetch_lookahead,",
            "# defer_n_layers; its 0.3.0 refuses defer 0: pass at least 1), run before",
            "# torch's remat pass, which rewrites them otherwise.",
            "# (budget_bytes, prefetch_layers, defer_layers)",
            f"OFFLOAD_OPTIONS = {tuple(policy.offload)!r}",
        ],
        body=_GRAPH_PASS,
    )


# ---------------------------------------------------------------------------------------------
# torchtitan graph_trainer: `--compile.*` options for one torchtitan version. Each version's
# options and memory policies as read in its torchtitan/experiments/graph_trainer/configs.py
# (GraphTrainerCompileConfig) and memory_policy.py; tests check the installed one against
# its config class.


@dataclass(frozen=True)
class TorchtitanVersion:
    """What one torchtitan version's graph trainer accepts."""

    name: str
    memory_policies: tuple[str, ...]  # `--compile.memory_policy` choices
    save_ops_option: bool  # has `--compile.full_recompute_save_ops` (used by `full` only)
    source: str


TORCHTITAN_VERSIONS: dict[str, TorchtitanVersion] = {
    "0.3.0": TorchtitanVersion(
        "0.3.0",
        ("default", "full", "eager", "sac_and_offload"),
        save_ops_option=False,
        source="torchtitan 0.3.0 (PyPI), torchtitan/experiments/graph_trainer/configs.py "
        "(GraphTrainerCompileConfig.memory_policy)",
    ),
    "main": TorchtitanVersion(
        "main",
        (
            "none",
            "default",
            "full",
            "eager",
            "min_cut",
            "sac_and_offload",
            "cpu_offload_all",
            "sac_and_paged_stash",
        ),  # fmt: skip
        save_ops_option=True,
        source="pytorch/torchtitan main after 0.3.0 (unreleased), torchtitan/experiments/"
        "graph_trainer/configs.py (GraphTrainerCompileConfig.memory_policy, "
        ".full_recompute_save_ops)",
    ),
}
TORCHTITAN_NEWEST_RELEASE = "0.3.0"
# Workbench preset -> (torchtitan memory_policy, how the two differ).
TORCHTITAN_POLICIES: dict[str, tuple[str, str]] = {
    "none": ("none", "torchtitan's 'none' saves everything, as the workbench's does."),
    "full": (
        "full",
        "torchtitan tags MUST_RECOMPUTE, recomputes in-place ops and leaves modules named "
        "lm_head*/loss* untagged; the workbench saves in-place ops and also tags the output "
        "projection and loss (preset 'titan-full' is torchtitan's).",
    ),
    "default": (
        "default",
        "torchtitan saves its own save list (MUST_SAVE, plus FSDP all-gathers without "
        "reshard-after-forward); the workbench saves COMPUTE_INTENSIVE_OPS (preset "
        "'titan-default' is torchtitan's).",
    ),
    "eager": (
        "eager",
        "torchtitan also alternates matmuls outside the layers; the workbench keeps "
        "everything outside the layers (preset 'titan-eager' is torchtitan's).",
    ),
    **{
        f"titan-{name}": (
            name,
            "the same tags node for node (workbench.decide.engine.decide_titan_ops), except random "
            "ops: the workbench saves them (torch's remat pass refuses to recompute them).",
        )
        for name in ("default", "full", "eager", "sac_and_offload")
    },
    "offload": (
        "sac_and_offload",
        "torchtitan offloads on top of its own 'default' by its own rules (its view-op list "
        "instead of storages; random and in-place ops and saved nodes backward never reads "
        "are tagged too); the workbench offloads on top of its 'default' (preset "
        "'titan-sac_and_offload' is torchtitan's).",
    ),
}
# Graph trainer's offload options (0.3.0 configs.py, GraphTrainerCompileConfig); main was
# not read for them: the same names are assumed there.
TORCHTITAN_OFFLOAD_GIB_DIGITS = 6


def installed_torchtitan() -> str | None:
    """The installed torchtitan's version (without a local `+...` part), or None."""
    try:
        return importlib.metadata.version("torchtitan").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def torchtitan_version(name: str | None = None) -> tuple[TorchtitanVersion, str]:
    """The version asked for, else the installed one, else the newest release known; and a
    line saying which and why."""
    if name is not None:
        if name not in TORCHTITAN_VERSIONS:
            raise WorkbenchError(
                f"unknown torchtitan version {name!r}; choose one of "
                f"{', '.join(TORCHTITAN_VERSIONS)}"
            )
        return TORCHTITAN_VERSIONS[name], f"torchtitan {name} (asked for)"
    installed = installed_torchtitan()
    if installed in TORCHTITAN_VERSIONS:
        return TORCHTITAN_VERSIONS[installed], f"torchtitan {installed} (installed)"
    newest = TORCHTITAN_VERSIONS[TORCHTITAN_NEWEST_RELEASE]
    why = "not installed" if installed is None else f"installed {installed} is not one known"
    return newest, f"torchtitan {newest.name} (newest release known; torchtitan {why})"


def torchtitan_options(
    policy: Policy, graph: JointGraph | None = None, version: str | None = None
) -> str:
    """`--compile.*` options of `version` (see `torchtitan_version`); what they cannot say
    becomes `#` lines pointing to the `graph_pass` export."""
    if graph is not None:
        validate(graph, policy)
    target, which = torchtitan_version(version)
    memory_policy, difference = TORCHTITAN_POLICIES[policy.preset]
    save_ops, notes, unexpressed = _full_recompute_save_ops(policy, target)
    if memory_policy not in target.memory_policies:
        unexpressed.insert(
            0,
            (
                f"preset {policy.preset!r}",
                f"torchtitan {target.name} has no memory_policy {memory_policy!r} (it has "
                f"{', '.join(target.memory_policies)})",
            ),
        )
    if memory_policy == "sac_and_offload":
        notes.extend(_offload_notes(policy))
    if graph is not None:
        unexpressed.extend(_titan_unsound(graph, memory_policy))
    lines = [
        "# torchtitan graph_trainer options (append to run_train.sh) for this policy:",
        "# " + json.dumps(policy.to_json(), separators=(",", ":")),
        _comment(f"For {which}: option names as in {target.source}."),
        _comment(f"Preset {policy.preset!r} -> memory_policy {memory_policy!r}: {difference}"),
        *(_comment(note) for note in notes),
        *(_comment(f"cannot express {what}: {why}") for what, why in unexpressed),
        *(_comment(line) for line in (parallel_notes(policy, graph) if graph else [])),
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
    if memory_policy in target.memory_policies:
        lines.append(f"--compile.memory_policy {memory_policy}")
    if memory_policy == "sac_and_offload" and memory_policy in target.memory_policies:
        lines.extend(_offload_options(policy))
    if not policy.fsdp_reshard:
        lines.append("--parallelism.fsdp_reshard_after_forward never")
    if save_ops:
        lines.append(f"--compile.full_recompute_save_ops {shlex.quote(' | '.join(save_ops))}")
    return "\n".join(lines) + "\n"


def _titan_unsound(graph: JointGraph, memory_policy: str) -> list[tuple[str, str]]:
    """The nodes graph trainer's own `memory_policy` tagging recomputes on this graph where a
    recompute would not see what forward saw (the workbench's `titan-*` preset saves them by
    `save_written_inputs`; graph trainer has no such rule)."""
    preset = f"titan-{memory_policy}"
    if preset not in PRESETS:
        return []
    decisions = decide(graph, Policy(preset))
    written = [n for n, d in decisions.items() if d.why is Why.WRITTEN_INPUT]
    if not written:
        return []
    named = ", ".join(written[:FORCED_NAMED]) + (" ..." if len(written) > FORCED_NAMED else "")
    why = (
        f"graph trainer's own {memory_policy!r} tagging recomputes {len(written)} nodes whose "
        f"recompute would not see what forward saw ({named}; e.g. "
        f"{decisions[written[0]].detail}), so its loss and gradients would differ from eager's"
    )
    return [("a sound run on this graph", why)]


def _offload_options(policy: Policy) -> list[str]:
    """graph trainer's `cpu_offload_*` options for the policy's offload options. Its budget
    is in GiB (`* 1024**3`) and 0 there means no limit (it skips the check)."""
    budget = policy.offload.budget_bytes
    gib = 0 if budget is None else round(budget / 2**30, TORCHTITAN_OFFLOAD_GIB_DIGITS)
    return [
        f"--compile.cpu_offload_budget_gb {gib:g}",
        f"--compile.cpu_offload_prefetch_n_layers {policy.offload.prefetch_layers}",
        f"--compile.cpu_offload_defer_n_layers {_titan_defer(policy)}",
    ]


# torchtitan 0.3.0's apply_cpu_offload_pass refuses defer 0 (its own lint: the free it leaves
# after the copy names a later reader), so the export asks for at least this many layers
# (`workbench.interop.titan.OFFLOAD_PLACEMENT`, row `defer 0`).
TORCHTITAN_MIN_DEFER_LAYERS = 1


def _titan_defer(policy: Policy) -> int:
    return max(policy.offload.defer_layers, TORCHTITAN_MIN_DEFER_LAYERS)


def _offload_notes(policy: Policy) -> list[str]:
    """How the offload options map and where their meanings differ."""
    budget = policy.offload.budget_bytes
    notes = [
        "offload budget: "
        + (
            "no limit (cpu_offload_budget_gb 0 is torchtitan's 'no limit')"
            if budget is None
            else f"{budget} bytes = {budget / 2**30:.6g} GiB (torchtitan's GB are GiB)"
        ),
        "defer: torchtitan frees an offloaded tensor at the end of the layer region N past "
        "its producer (at the earliest the region of its last forward reader), as the "
        "workbench does for N >= 1"
        + (
            "; the workbench's 0 (free right after that reader) has no torchtitan form: its "
            "0.3.0 pass refuses 0, so this asks for 1 (more device memory than estimated)."
            if policy.offload.defer_layers < TORCHTITAN_MIN_DEFER_LAYERS
            else "."
        ),
        "prefetch: the same rule (reload N layers before the offloaded tensor's own layer "
        "in backward).",
    ]
    return notes


def _torchtitan(policy: Policy, graph: JointGraph | None) -> str:
    return torchtitan_options(policy, graph)


def _full_recompute_save_ops(
    policy: Policy, target: TorchtitanVersion
) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Selectors torchtitan takes as `full_recompute_save_ops` ("save these, recompute the
    rest" under `full`), notes on selectors that change nothing, and what cannot be said."""
    save_ops: list[str] = []
    notes: list[str] = []
    unexpressed: list[tuple[str, str]] = []
    full = policy.preset in ("full", "titan-full")
    for s in policy.selectors:
        what = f"selector {s.select} -> {s.action}"
        redundant = "recompute" if full else "save" if policy.preset == "none" else None
        if s.action == "offload":
            why = "torchtitan chooses what to offload by its own rules (sac_and_offload)"
            unexpressed.append((what, why))
        elif s.action == redundant and not save_ops:
            notes.append(f"{what} changes nothing under {policy.preset!r} (dropped)")
        elif not target.save_ops_option:
            why = f"torchtitan {target.name} has no --compile.full_recompute_save_ops"
            unexpressed.append((what, why))
        elif not full or s.action != "save":
            why = "full_recompute_save_ops only adds saves to memory_policy 'full'"
            if full:
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
