"""Export a policy as code a training job can use without the workbench.

Entry points: `export(policy, fmt, graph=None) -> str` for the formats in `FORMATS` and
`write_export(text, path, overwrite=False)`. The Python formats are the templates of
`workbench.interop.templates` under the policy's constants and the rules, verbatim
(`rules_source`); the torchtitan one is `workbench.interop.torchtitan_options`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path

from workbench.capture.graph import JointGraph
from workbench.capture.ops import block_container
from workbench.decide import EMBEDDED
from workbench.decide.decider import rules_of, validate
from workbench.decide.engine import written_later_keys
from workbench.decide.policy import Policy
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError
from workbench.files import write_file
from workbench.interop.graph_notes import comment, forced_notes, parallel_notes
from workbench.interop.templates.constants import WRAPPED_MARKER
from workbench.interop.torchtitan_options import torchtitan_options

__all__ = ["FORMATS", "export", "py_str", "rules_source", "torchtitan_options", "write_export"]

LINE_LENGTH = 100
TEMPLATES = "workbench.interop.templates"


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


def _json_header(policy: Policy) -> list[str]:
    lines = json.dumps(policy.to_json(), indent=2, ensure_ascii=True).splitlines()
    return ["# Policy (SAC Workbench JSON) this file was generated from:"] + [
        f"#   {line}" for line in lines
    ]


def _items(entries: Iterable[str], indent: str = "    ") -> list[str]:
    return [f"{indent}{entry}," for entry in entries]


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
# Generated Python: a template's docstring, the policy's tables, the source of the rules
# verbatim (the files of `workbench.decide.EMBEDDED`, the very rules `decide` applies), and
# the template's code: eager `policy_fn` + `apply_ac`, or `tag_graph`.

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
        _, own, body = _module_parts(name)
        imports += own
        bodies.append(f"# --- {name.replace('.', '/')}.py ---\n\n\n{body}\n")
    return imports, "\n\n".join(bodies)


def _module_parts(name: str) -> tuple[str, list[str], str]:
    """Module `name`'s source cut where an export joins it: its docstring as written (quotes
    included), its top-level imports but `from __future__` and those of workbench modules
    (the export defines those names itself), and its code after its imports."""
    source = inspect.getsource(importlib.import_module(name))
    tree = ast.parse(source)
    own = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    first_code = next(
        node for node in tree.body if node.lineno > own[-1].lineno and node not in own
    )
    lines = source.splitlines()
    imports = []
    for node in own:
        statement = ast.get_source_segment(source, node) or ""
        if not statement.startswith(("from __future__", "from workbench", "import workbench")):
            imports.append(statement)
    docstring = ""
    if ast.get_docstring(tree) is not None:
        docstring = ast.get_source_segment(source, tree.body[0]) or ""
    body = "\n".join(lines[_first_line(first_code, lines) :]).strip("\n")
    return docstring, imports, body


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


def _python_module(
    policy: Policy, graph: JointGraph | None, template: str, extra_constants: list[str]
) -> str:
    """The template `workbench.interop.templates.<template>` as an export of `policy`: its
    docstring, the policy as JSON, notes on the traced `graph`, the imports, the policy's
    constants, the rules verbatim, then the template's code."""
    docstring, imports, body = _module_parts(f"{TEMPLATES}.{template}")
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
        provenance = [comment(f"Checked against the traced graph of {graph.model_name}.")]
        provenance += [comment(line) for line in parallel_notes(policy, graph)]
        if template == "graph_pass":
            for note in forced_notes(policy, graph):
                provenance += [comment(line) for line in textwrap.wrap(note, LINE_LENGTH - 4)]
    lines = [
        docstring,
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
        *_registered_elsewhere(policy),
    ]
    return "\n".join(lines) + "\n\n# --- Entry point ---\n\n\n" + body + "\n"


def _registered_elsewhere(policy: Policy) -> list[str]:
    """The registration of the policy's preset (and of the preset it offloads) where it is
    not one of the rule files' (`register_preset` in a notebook, a test or a user's module):
    its source verbatim, decorator included, so the export registers it as the workbench
    did. Its code may use what the rule files define (`CheckpointPolicy`, `OpFacts`, ...)."""
    embedded = set(EMBEDDED)
    lines: list[str] = []
    for name in dict.fromkeys([policy.preset, PRESETS[policy.preset].offloads]):
        if name is None or PRESETS[name].rule.__module__ in embedded:
            continue
        factory = PRESETS[name].rule
        try:
            source = textwrap.dedent(inspect.getsource(factory)).strip("\n")
        except (OSError, TypeError):
            raise WorkbenchError(
                f"preset {name!r} is registered in {factory.__module__}, whose source cannot "
                "be read: the Python exports carry a preset's registration verbatim; register "
                "it in a file"
            ) from None
        header = f"# --- preset {name!r}, registered in {factory.__module__} ---"
        lines += ["", "", header, "", "", source]
    return lines


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
        "eager_sac",
        [
            "# False when the policy never recomputes: then apply_ac leaves the model alone.",
            f"WRAP_LAYERS = {wrap}",
            f"WRAPPED_MARKER = {py_str(WRAPPED_MARKER)}",
            *_written_later_table(graph),
            *_layers_attr(policy, graph),
        ],
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
        keys = written_later_keys(rules_of(graph).tables)
    if not keys:
        return [*lines, "WRITTEN_LATER: frozenset[str] = frozenset()"]
    rows = _items(map(py_str, sorted(keys)), " " * 8)
    return [*lines, "WRITTEN_LATER: frozenset[str] = frozenset(", "    {", *rows, "    }", ")"]


def _layers_attr(policy: Policy, graph: JointGraph | None) -> list[str]:
    """`LAYERS_ATTR`: the container of the traced graph's blocks, `apply_ac`'s default; and
    the overrides eager SAC never applies, said."""
    container = None
    if graph is not None:
        container = block_container(info.module for info in graph.nodes.values())
    origin = "the block container of the traced graph" if container else "torchtitan's name"
    lines = [f"# apply_ac's default blocks: {origin}."]
    unseen = _unseen_overrides(policy, container or "layers")
    if unseen:
        text = (
            f"Overrides eager SAC never applies ({len(unseen)} of {len(policy.overrides)}): "
            "apply_ac wraps only the blocks, where autograd saves what backward reads, and "
            "getitem and detach are never dispatched: " + ", ".join(unseen)
        )
        lines += [comment(line) for line in textwrap.wrap(text, LINE_LENGTH - 2)]
    return [*lines, f"LAYERS_ATTR = {py_str(container or 'layers')}"]


# Graph ops eager SAC is never asked about: torch's SAC ignores aten.detach, and getitem is
# Python unpacking a multi-output op's tuple, not a dispatched op.
NEVER_DISPATCHED = frozenset({"aten.detach.default", "getitem"})


def _unseen_overrides(policy: Policy, container: str) -> list[str]:
    """`KEY (action)` of each override outside `container` or naming an op never dispatched.

    >>> _unseen_overrides(Policy("full", overrides={"norm::aten.mul.Tensor#0": "save"}), "layers")
    ['norm::aten.mul.Tensor#0 (save)']
    """
    unseen = []
    for key, action in sorted(policy.overrides.items()):
        module, _, op = key.partition("::")
        if not module.startswith(f"{container}.") or op.rpartition("#")[0] in NEVER_DISPATCHED:
            unseen.append(f"{key} ({action})")
    return unseen


def _graph_pass(policy: Policy, graph: JointGraph | None) -> str:
    """Graph SAC: `tag_graph(gm)` writing the tags `decide` would, before torch's remat pass."""
    return _python_module(
        policy,
        graph,
        "graph_pass",
        [
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
    )


def _torchtitan(policy: Policy, graph: JointGraph | None) -> str:
    return torchtitan_options(policy, graph)


def _json(policy: Policy, graph: JointGraph | None) -> str:
    return json.dumps(policy.to_json(), indent=2)


FORMATS: dict[str, Callable[[Policy, JointGraph | None], str]] = {
    "policy_fn": _policy_fn,
    "graph_pass": _graph_pass,
    "torchtitan": _torchtitan,
    "json": _json,
}
