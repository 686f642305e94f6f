"""Export to torchtitan's graph trainer: the `--compile.*` options that say a policy, for
one torchtitan version, and what they cannot say.

Entry points: `torchtitan_options(policy, graph=None, version=None) -> str`,
`torchtitan_version(name)`, `installed_torchtitan()` and `TORCHTITAN_VERSIONS`. Each
version's options and memory policies as read in its
torchtitan/experiments/graph_trainer/configs.py (GraphTrainerCompileConfig) and
memory_policy.py; tests check the installed one against its config class.
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
from dataclasses import dataclass

from workbench.capture.graph import JointGraph
from workbench.decide.decider import decide, validate
from workbench.decide.policy import Policy
from workbench.decide.presets import MEMORY_POLICIES, graph_trainer_preset, preset_record
from workbench.decide.tags import Why
from workbench.errors import WorkbenchError
from workbench.interop.graph_notes import FORCED_NAMED, comment, parallel_notes

__all__ = [
    "TORCHTITAN_MAIN_COMMIT",
    "TORCHTITAN_MAIN_DATE",
    "TORCHTITAN_VERSIONS",
    "TorchtitanVersion",
    "installed_torchtitan",
    "torchtitan_options",
    "torchtitan_version",
]


@dataclass(frozen=True)
class TorchtitanVersion:
    """What one torchtitan version's graph trainer accepts."""

    name: str
    memory_policies: tuple[str, ...]  # `--compile.memory_policy` choices
    save_ops_option: bool  # has `--compile.full_recompute_save_ops` (used by `full` only)
    source: str
    snapshot: str = ""  # for a branch: the commit and date read, which the export states


# The commit of pytorch/torchtitan's main branch "main" means here: its graph trainer
# options as read there (configs.py, memory_policy.py); main adds and removes memory
# policies at different dates (`cpu_offload_all` existed only from 2026-04-27 to 05-07).
TORCHTITAN_MAIN_COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"
TORCHTITAN_MAIN_DATE = "2026-08-21"

TORCHTITAN_VERSIONS: dict[str, TorchtitanVersion] = {
    "0.3.0": TorchtitanVersion(
        "0.3.0",
        MEMORY_POLICIES,
        save_ops_option=False,
        source="torchtitan 0.3.0 (PyPI), torchtitan/experiments/graph_trainer/configs.py "
        "(GraphTrainerCompileConfig.memory_policy)",
    ),
    "main": TorchtitanVersion(
        "main",
        MEMORY_POLICIES,
        save_ops_option=True,
        source=f"pytorch/torchtitan main at {TORCHTITAN_MAIN_COMMIT[:8]}, torchtitan/"
        "experiments/graph_trainer/configs.py (GraphTrainerCompileConfig.memory_policy, "
        ".full_recompute_save_ops, .cpu_offload_*)",
        snapshot=f"main at commit {TORCHTITAN_MAIN_COMMIT} ({TORCHTITAN_MAIN_DATE})",
    ),
}
TORCHTITAN_NEWEST_RELEASE = "0.3.0"


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
        target = TORCHTITAN_VERSIONS[name]
        return target, f"torchtitan {target.snapshot or name} (asked for)"
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
    preset = preset_record(policy.preset)  # its memory policy and how the two differ
    memory_policy = preset.memory_policy or "none"
    difference = preset.memory_policy_note or "no torchtitan memory policy decides as it does."
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
        comment(f"For {which}: option names as in {target.source}."),
        comment(f"Preset {policy.preset!r} -> memory_policy {memory_policy!r}: {difference}"),
        *(comment(note) for note in notes),
        *(comment(f"cannot express {what}: {why}") for what, why in unexpressed),
        *(comment(line) for line in (parallel_notes(policy, graph) if graph else [])),
    ]
    if save_ops:
        lines.append(
            "# Selectors as graph trainer matches them: MODULE_FQN_PATTERN by fnmatch per "
            "dotted component (as the workbench), OP one exact overload."
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
    preset = graph_trainer_preset(memory_policy)
    if preset is None:
        return []
    decisions = decide(graph, Policy(preset))
    written = [n for n, d in decisions.items() if d.why is Why.WRITTEN_INPUT]
    if not written:
        return []
    named = ", ".join(written[:FORCED_NAMED]) + (" ..." if len(written) > FORCED_NAMED else "")
    why = (
        f"graph trainer's own {memory_policy!r} tagging recomputes {len(written)} nodes whose "
        f"recompute would not see what forward saw ({named}; e.g. "
        f"{decisions[written[0]].detail_words}), so its loss and gradients would differ from "
        "eager's"
    )
    return [("a sound run on this graph", why)]


# Graph trainer's offload options (`cpu_offload_budget_gb`, `_prefetch_n_layers`,
# `_defer_n_layers`: the same in 0.3.0 and the main snapshot, whose cpu_offload.py is 0.3.0's).
def _offload_options(policy: Policy) -> list[str]:
    """graph trainer's `cpu_offload_*` options for the policy's offload options. Its budget
    is a float in GiB (`* 1024**3`) and 0 there means no limit (it skips the check): the
    exact float (`repr`, which a power-of-two scale keeps exact up to 2**53 bytes), never a
    rounding that could turn a small budget into 0 and so into no limit."""
    budget = policy.offload.budget_bytes
    gib = "0" if budget is None else repr(budget / 2**30)
    return [
        f"--compile.cpu_offload_budget_gb {gib}",
        f"--compile.cpu_offload_prefetch_n_layers {policy.offload.prefetch_layers}",
        f"--compile.cpu_offload_defer_n_layers {_titan_defer(policy)}",
    ]


# torchtitan 0.3.0's apply_cpu_offload_pass refuses defer 0 (its own lint: the free it leaves
# after the copy names a later reader), so the export asks for at least this many layers
# (`workbench.interop.titan_offload.OFFLOAD_PLACEMENT`, row `defer 0`).
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


def _full_recompute_save_ops(
    policy: Policy, target: TorchtitanVersion
) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Selectors torchtitan takes as `full_recompute_save_ops` ("save these, recompute the
    rest" under `full`), notes on selectors that change nothing, and what cannot be said."""
    save_ops: list[str] = []
    notes: list[str] = []
    unexpressed: list[tuple[str, str]] = []
    full = preset_record(policy.preset).memory_policy == "full"
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
        elif _save_ops_refusal(s.select) is not None:
            unexpressed.append((what, str(_save_ops_refusal(s.select))))
        else:
            save_ops.append(s.select)
    for key, action in sorted(policy.overrides.items()):
        unexpressed.append((f"override {key} -> {action}", "torchtitan has no per-op overrides"))
    return save_ops, notes, unexpressed


def _save_ops_refusal(select: str) -> str | None:
    """Why graph trainer's `full_recompute_save_ops` would not take the selector `select`
    as the workbench means it, or None: it matches the module path component by component,
    as many components as the path (no `**`), and resolves OP to one op overload through
    `torch.ops` (no wildcards).

    >>> _save_ops_refusal("layers.*.attention.wo::aten.mm.default") is None
    True
    >>> _save_ops_refusal("layers.*.attention.wo::aten.mm.*")
    "its op 'aten.mm.*' is a pattern: graph trainer takes one overload (aten.mm.default)"
    """
    module, _, op = select.rpartition("::")
    if "**" in module.split("."):
        return f"its module pattern {module!r} has '**': graph trainer matches one component each"
    if any(c in op for c in "*?[") or op.count(".") != 2:
        return f"its op {op!r} is a pattern: graph trainer takes one overload (aten.mm.default)"
    return None
