"""What each panel of the explorer shows, computed in plain Python from the library's answers:
the front end draws these dicts and formats no figure itself (bytes, FLOPs and seconds come
as text from `workbench.units`).

Entry points: `metrics_panel`, `timeline_panel` (and `with_measured`, a loaded memory
snapshot's line beside the estimate's), `details_panel`, `legend_panel`,
`peak_twins` / `peak_ids` / `peak_words` (what stands for the estimate's peak), `run_status`,
`offload_line`,
`budget_slider`, `history_plots`, `search_matches` (what the search box finds) and
`newly_forced` (the message line after a flip).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workbench.capture.graph import JointGraph, NodeInfo
from workbench.cost.calibrate import time_basis
from workbench.cost.estimate import Estimate, Estimator
from workbench.cost.profiles import get_profile
from workbench.decide.decider import Decisions, decidable, rules_of
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.show.viz import View
from workbench.show.viz.render import EDGE_WORDS, OFFLOAD_EDGE_WORDS
from workbench.show.viz.style import COLLECTIVE_WORDS, OUTLINES
from workbench.show.widgets.policy_state import policy_label
from workbench.units import (
    byte_ticks,
    format_bytes,
    format_flops,
    format_seconds,
    second_ticks,
)

__all__ = [
    "BUDGET_STOPS",
    "NEWLY_FORCED_NAMED",
    "TIMELINE_POINTS",
    "budget_slider",
    "details_panel",
    "downsample",
    "history_plots",
    "legend_panel",
    "match_words",
    "metrics_panel",
    "offload_line",
    "newly_forced",
    "peak_counts",
    "place_labels",
    "peak_ids",
    "peak_twins",
    "peak_words",
    "run_status",
    "search_matches",
    "timeline_panel",
    "with_measured",
]

TIMELINE_POINTS = 240  # columns of the small memory timeline under the metrics
TIMELINE_WIDTH = 320  # its width in pixels; its labels are 9 px Helvetica
LABEL_CHAR_PX = 5.5  # the widest average character of such a label, digits and capitals
NEWLY_FORCED_NAMED = 3  # nodes a flip's message names when it forces others
BUDGET_STOPS = 101  # positions of the memory-budget slider, every 1 % of its range


def peak_counts(est: Estimate) -> str:
    """What the estimate's peak counts, in words beside it: device memory only (host copies
    of offloaded activations are the host row), optimizer state included when it is held,
    and cuBLAS's workspaces on a GPU."""
    state = est.peak_breakdown.get("optimizer", 0)
    held = f"with optimizer state ({format_bytes(state)})" if state else "without optimizer state"
    workspaces = est.peak_breakdown.get("workspaces", 0)
    blas = f" and cuBLAS's workspaces ({format_bytes(workspaces)})" if workspaces else ""
    return f"device memory of the whole step {held}{blas}"


def metrics_panel(
    est: Estimate, profile: str, estimator: Estimator | None = None
) -> dict[str, Any]:
    """The estimate's headline figures on `profile`, each as a number and as text; the host
    row is the host bytes offloaded activations hold at most (`Estimate.host_peak_bytes`);
    `time_basis` what the step time rests on (`calibrate.time_basis`, of `estimator`)."""
    step = est.step_seconds[profile]
    if estimator is not None:
        basis = time_basis(estimator.profiles, estimator.calibration).get(profile, "")
    else:
        basis = time_basis([get_profile(profile)])[profile]
    offloaded = len(est.transfers)
    return {
        "peak_bytes": est.peak_bytes,
        "peak": format_bytes(est.peak_bytes),
        "peak_counts": peak_counts(est),
        "host_peak_bytes": est.host_peak_bytes,
        "host_peak": format_bytes(est.host_peak_bytes),
        "host_text": (
            f"{format_bytes(est.host_peak_bytes)} at most, {offloaded} offloaded activations "
            f"({format_bytes(est.offloaded_bytes)})"
            if est.offloaded_bytes
            else "0 B: nothing offloaded"
        ),
        "peak_node": est.peak_node,
        "saved_bytes": est.saved_activation_bytes,
        "saved": format_bytes(est.saved_activation_bytes),
        "recompute_flops": est.recompute_flops,
        "recompute": format_flops(est.recompute_flops),
        "recomputed_nodes": len(est.recomputed_nodes),
        "profile": profile,
        "step_seconds": step,
        "step": format_seconds(step),
        "tokens_per_second": est.tokens / step if step else 0.0,
        "tokens_per_second_text": f"{est.tokens / step:,.0f} tokens/s" if step else "-",
        "time_basis": basis,
    }


def downsample(values: list[int], width: int) -> list[int]:
    """At most `width` columns, each the largest value of its span (peaks stay visible).

    >>> downsample([1, 5, 2, 2, 9, 0], 3)
    [5, 2, 9]
    """
    if len(values) <= width:
        return list(values)
    return [
        max(values[i * len(values) // width : max((i + 1) * len(values) // width, i + 1)])
        for i in range(width)
    ]


def timeline_panel(
    est: Estimate, estimator: Estimator, decisions: Decisions, selected: str = ""
) -> dict[str, Any]:
    """Live bytes over the step (downsampled) with the peak marked, and the selected op where
    it runs and where it runs again (its recomputed copy, or its reload from host memory).
    Marks are fractions of the step; `labels` their words."""
    totals = est.totals()
    last = max(len(totals) - 1, 1)
    marks = {"peak": est.peak_index / last}
    labels = {"peak": f"peak {format_bytes(max(totals, default=0))}"}
    if selected:
        spots = [p for p, name in enumerate(est.order) if estimator.traced_node(name) == selected]
        decision = decisions.get(selected)
        if spots:
            marks["selected"], labels["selected"] = spots[0] / last, selected
        if len(spots) > 1 and decision is not None and (decision.recompute or decision.offload):
            again = "recomputed" if decision.recompute else "reloaded"
            marks[again], labels[again] = spots[-1] / last, again
    return {
        "values": downsample(totals, TIMELINE_POINTS),
        "max": max(totals, default=0),
        "steps": len(totals),
        "marks": marks,
        "labels": labels,
        "width": TIMELINE_WIDTH,
        "placed": place_labels(marks, labels, TIMELINE_WIDTH),
    }


def with_measured(timeline: dict[str, Any], measured: list[int], label: str) -> dict[str, Any]:
    """`timeline` (`timeline_panel`'s) with a measured line beside the estimate's: live bytes
    per step of the node order (`SnapshotComparison.measured_timeline`), downsampled as the
    estimate's, both drawn against the larger maximum; `label` says what was measured.

    >>> t = with_measured({"values": [1, 4], "max": 4}, [2, 6], "measured")
    >>> t["measured"], t["max"], t["measured_label"]
    ([2, 6], 6, 'measured')
    """
    top = max(measured, default=0)
    return {
        **timeline,
        "measured": downsample(measured, TIMELINE_POINTS),
        "max": max(timeline.get("max", 0), top),
        "measured_label": label,
    }


def place_labels(
    marks: dict[str, float], labels: dict[str, str], width: int
) -> dict[str, dict[str, Any]]:
    """Where each mark's label goes on a plot `width` pixels wide: right of its line, or
    left of it near the right edge (`anchor` start / end), on the first text row (`row` 0,
    1, ...) where it overlaps no label placed before it, marks from left to right.

    >>> place_labels({"peak": 0.5, "selected": 0.52}, {"peak": "peak 1 MiB", "selected": "mm"}, 320)
    {'peak': {'row': 0, 'anchor': 'start'}, 'selected': {'row': 1, 'anchor': 'start'}}
    """
    rows: list[list[tuple[float, float]]] = []
    placed: dict[str, dict[str, Any]] = {}
    for kind, fraction in sorted(marks.items(), key=lambda item: item[1]):
        x, text = fraction * width, len(labels.get(kind, kind)) * LABEL_CHAR_PX
        anchor = "start" if x + 2 + text <= width else "end"
        span = (x + 2, x + 2 + text) if anchor == "start" else (x - 2 - text, x - 2)
        row = next((k for k, taken in enumerate(rows) if _clear(span, taken)), len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append((span[0] - 3, span[1] + 3))
        placed[kind] = {"row": row, "anchor": anchor}
    return placed


def _clear(span: tuple[float, float], taken: list[tuple[float, float]]) -> bool:
    return all(span[1] < a or b < span[0] for a, b in taken)


def _offload_words(graph: JointGraph, decisions: Decisions, policy: Policy, name: str) -> str:
    """Whether the op's output may be offloaded, and why not."""
    if name not in decisions:
        return "-"
    refusal = rules_of(graph).offload_refusal(name, decisions, policy.preset)
    return "possible" if refusal is None else f"not possible: it {refusal.words}"


def details_panel(
    graph: JointGraph,
    estimator: Estimator,
    decisions: Decisions,
    preset_decisions: Decisions,
    policy: Policy,
    name: str,
) -> dict[str, Any]:
    """The selected node: what it is, its decision and why, what its preset alone says."""
    info = graph.nodes[name]
    decision = decisions.get(name)
    preset = preset_decisions.get(name)
    return {
        "name": name,
        "op": info.op,
        "phase": info.phase,
        "module": info.module,
        "layer": info.layer,
        "shape": " · ".join("×".join(map(str, s)) for s in info.shapes) or "-",
        "dtype": info.dtype or "-",
        "bytes": format_bytes(info.bytes),
        "flops": format_flops(info.flops),
        "backward_consumers": estimator.backward_readers(name),
        "source": info.source or "-",
        "decision": "-" if decision is None else decision.policy.name,
        "action": "-" if decision is None else decision.action,
        "reason": "-" if decision is None else decision.reason,
        "preset_decision": "-" if preset is None else preset.policy.name,
        "can_flip": decision is not None and not decision.forced,
        "offload": _offload_words(graph, decisions, policy, name),
    }


def legend_panel(
    model_name: str, view: str, picture: View, est: Estimate, policy: Policy
) -> dict[str, Any]:
    """Title, lines and colour samples beside the picture, read from the picture (its
    elements: folded layers, communication ops; its legend rows: every shade it can show,
    as the static render explains them), never from its text; then the explorer's own
    outlines (`style.OUTLINES`: the selected op, the peak), each row's third item its look."""
    lines = [
        f"kept for backward (whole step): {format_bytes(est.saved_activation_bytes)} · "
        f"peak {format_bytes(est.peak_bytes)} at {est.peak_node}"
    ]
    if view == "overview":
        for element in picture.elements.values():
            if element.kind == "layers" and len(element.layers) > 1:
                lines.append(
                    f"'{element.label}': {len(element.layers)} identical layers drawn once; "
                    "box figures are totals"
                )
        if policy.offloads:
            lines.append("box text: how many of the saved ops are offloaded to host memory")
        lines.append("click a box to open it; click a layer's frame to open the whole layer")
    else:
        lines += EDGE_WORDS
        if policy.offloads:
            lines.append(OFFLOAD_EDGE_WORDS)
        lines.append("click an op to flip it; shift-click selects only")
        if picture.collectives:
            lines.append(COLLECTIVE_WORDS)
    title = f"{model_name} · policy {policy_label(policy.to_json())}: {view}"
    rows = [[colour, words] for colour, words in picture.legend_rows]
    rows += [[colour, words, look] for colour, look, words in OUTLINES.values()]
    return {"title": title, "lines": lines, "rows": rows}


def peak_twins(graph: JointGraph, estimator: Estimator, peak_node: str) -> tuple[str, list[str]]:
    """The traced node the peak happens at (`Estimator.traced_node`: a recomputed copy, a replayed
    view or an offload step stands for its original), and the forward ops that stand for it
    in a picture: itself, or for a backward op the forward ops of its module."""
    name = estimator.traced_node(peak_node)
    info = graph.nodes[name]
    if decidable(info):
        return name, [name]
    return name, [n for n, i in graph.nodes.items() if decidable(i) and i.module == info.module]


def peak_ids(graph: JointGraph, estimator: Estimator, peak_node: str, picture: View) -> list[str]:
    """The drawn elements standing for the peak: its ops, the boxes holding them, and the
    backward summary of its module."""
    name, twins = peak_twins(graph, estimator, peak_node)
    module = graph.nodes[name].module
    targets = {name, *twins}
    return [
        element_id
        for element_id, element in picture.elements.items()
        if (element.kind in ("op", "copy", "module") and targets & set(element.nodes))
        or (element.kind == "backward" and element.name == module)
    ]


def peak_words(graph: JointGraph, decisions: Decisions, name: str, peak_node: str) -> str:
    """Where a view shows the peak: the op, its recomputed copy or host-memory step, or the
    forward ops of the module whose backward runs at the peak."""
    info = graph.nodes[name]
    if not decidable(info):
        return f"the backward of {info.module or 'top level'}; its forward ops are marked"
    if peak_node == name:
        return "this op"
    decision = decisions.get(name)
    if decision is not None and decision.offload:
        return "a host-memory step of this op (offload or reload)"
    return "its recomputed copy"


def offload_line(options: OffloadOptions) -> str:
    """A policy's offload options in words (its row under Policy).

    >>> offload_line(OffloadOptions(2**30, 1, 0))
    'host budget 1.0 GiB, prefetch 1 layer(s), defer 0'
    """
    budget = "no limit" if options.budget_bytes is None else format_bytes(options.budget_bytes)
    return (
        f"host budget {budget}, prefetch {options.prefetch_layers} layer(s), "
        f"defer {options.defer_layers}"
    )


def run_status(run_result: dict[str, Any], policy: Policy) -> str:
    """The last Run's result, said to be stale once the policy has changed since: measured
    and estimated peak of one quantity (`peak_counts` says which), and how the panel's peak
    differs from it (optimizer state the run does not hold: `optimizer_bytes`)."""
    r = run_result
    if not r:
        return ""
    differs = []
    if r.get("optimizer_bytes"):
        state = format_bytes(r["optimizer_bytes"])
        optimizer = {"adamw": "AdamW", "sgd": "SGD"}.get(r.get("optimizer", ""), "optimizer")
        differs.append(f"adds {optimizer} state {state}")
    if r.get("estimated_host_peak_bytes") and r["device"] == "cpu":
        differs.append("counts host copies apart (its host row)")
    panel = f"; the panel's peak memory {' and '.join(differs)}" if differs else ""
    line = (
        f"measured on {r['device']}: peak {format_bytes(r['peak_bytes'])}, estimated "
        f"{format_bytes(r['estimated_peak_bytes'])} ({r['peak_counts']}{panel}); "
        f"{format_seconds(r['step_seconds'])}/step, "
        f"{'bitwise equal to eager' if r['bitwise_equal'] else 'NOT bitwise equal'}"
    )
    if r["policy"] == policy.to_json():
        return line
    label = policy_label(r["policy"])
    return f"last Run was for {label} ({line}); Run again to measure this policy"


def budget_slider(low: int, high: int) -> dict[str, Any]:
    """The memory-budget slider: its range and `BUDGET_STOPS` positions, each a byte count
    and its text (the front end shows the text, Suggest sends the bytes), and `note`, why it
    starts where it does (the solver's floor: the lower peak of `full` and no AC)."""
    stops = sorted({low + (high - low) * k // (BUDGET_STOPS - 1) for k in range(BUDGET_STOPS)})
    note = (
        f"from {format_bytes(low)}, the lowest peak of full recompute or no AC: Suggest "
        "searches no lower budget, with or without a host budget"
    )
    return {
        "min": low,
        "max": high,
        "stops": stops,
        "texts": [format_bytes(b) for b in stops],
        "note": note,
    }


def _axis(
    values: list[float], ticks: Callable[[float, float], list[tuple[float, str]]], least: float
) -> dict[str, Any]:
    """A padded axis around `values` with labelled ticks (`least`: the padding of one value
    that is 0)."""
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.08 or lo * 0.05 or least
    lo, hi = lo - pad, hi + pad
    return {"lo": lo, "hi": hi, "ticks": [[v, text] for v, text in ticks(lo, hi)]}


def _byte_ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    return [(float(v), text) for v, text in byte_ticks(lo, hi)]


def history_plots(
    rows: list[dict[str, Any]], profile: str, per_gpu: bool = False
) -> list[dict[str, Any]]:
    """One scatter per kind of history point (estimated on `profile`, measured on a device):
    its title, axis words, and axes with their tick labels. `per_gpu`: a pipelined job's
    points, each a policy per stage with its largest rank peak and its pipelined step."""
    plots = []
    for measured in (False, True):
        points = [r for r in rows if r["measured"] == measured]
        if not points:
            continue
        where = points[0]["profile"] if measured else profile
        if per_gpu:
            title, x_label = (
                f"per GPU over the schedule, estimated on {where}",
                f"pipelined step time on {where} (estimate)",
            )
        elif measured:
            title, x_label = f"measured (Run) on {where}", f"step time measured on {where}"
        else:
            title, x_label = f"estimated on {where}", f"step time on {where} (estimate)"
        plots.append(
            {
                "measured": measured,
                "title": title,
                "x_label": x_label,
                "y_label": "peak per GPU ↑" if per_gpu else "peak memory ↑",
                "x": _axis([r["step_seconds"] for r in points], second_ticks, 1e-6),
                "y": _axis([r["peak_bytes"] for r in points], _byte_ticks, 1),
            }
        )
    return plots


def newly_forced(before: Decisions, after: Decisions, flipped: str) -> str:
    """What a flip forced elsewhere (a save no request can undo), for the message line:
    `; forced in turn: add_, add__1 saved (written in place (...))`, or nothing."""
    forced = [n for n, d in after.items() if d.forced and n != flipped and not before[n].forced]
    if not forced:
        return ""
    named, rest = ", ".join(forced[:NEWLY_FORCED_NAMED]), len(forced) - NEWLY_FORCED_NAMED
    more = f" and {rest} more" if rest > 0 else ""
    return f"; forced in turn: {named}{more} saved ({after[forced[0]].explanation})"


def search_matches(graph: JointGraph, text: str) -> list[str]:
    """Forward ops by node name (exact first), then op, then module containing `text` (lower
    case). Among op and module matches, the op a user most likely means comes first: an op
    named exactly (`mm`: aten.mm before aten.bmm), ops of a module whose own name is `text`
    (`wo`: layers.0.attention.wo, not a `wo`rd inside a longer name), compute ops (FLOPs)
    before the views and transposes around them; then graph order."""
    infos = [i for i in graph.nodes.values() if decidable(i)]

    def meant(info: NodeInfo, exact: bool) -> tuple[bool, bool]:
        return not exact, info.flops == 0

    exact = [i.name for i in infos if i.name.lower() == text]
    by_name = [i.name for i in infos if text in i.name.lower() and i.name not in exact]
    by_op = sorted(
        (i for i in infos if text in i.op.lower()),
        key=lambda i: meant(i, i.op.lower().split(".")[1:2] == [text]),
    )
    by_module = sorted(
        (i for i in infos if text in i.module.lower()),
        key=lambda i: meant(i, i.module.lower().rsplit(".", 1)[-1] == text),
    )
    ranked = exact + by_name + [i.name for i in by_op] + [i.name for i in by_module]
    return list(dict.fromkeys(ranked))


def match_words(info: NodeInfo, index: int, count: int, query: str) -> str:
    """Find's message: which op it opened, and where it stands among the matches."""
    return (
        f"{info.name} ({info.op} in {info.module or 'top level'}): "
        f"match {index + 1} of {count} for {query!r}"
        + ("; search again for the next" if count > 1 else "")
    )
