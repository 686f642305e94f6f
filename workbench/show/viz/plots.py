"""Matplotlib plots of plain numbers: memory over the step, saved bytes per layer, and the
memory-vs-step-time trade-off with its Pareto front.

Entry points: `plot_memory_timeline`, `plot_layer_saved_bytes`, `plot_tradeoff`,
`pareto_front(points)`, `plot_plan` and `plan_front` (the planner's layouts) and
`save_figure(fig, path)` (deterministic SVG/PDF/PNG; `figure_format` checks a path before
the work that draws it). Figures are bare `Figure`s drawn by Agg: the global pyplot backend
is left alone.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from workbench.errors import WorkbenchError
from workbench.files import write_file
from workbench.show.viz.style import BLUE, ORANGE, PURPLE, SKY, VERMILLION, YELLOW

__all__ = [
    "PALETTE",
    "PLAN_KEYS",
    "TRADEOFF_KEYS",
    "figure_format",
    "pareto_front",
    "plan_front",
    "plot_layer_saved_bytes",
    "plot_memory_timeline",
    "plot_plan",
    "plot_tradeoff",
    "save_figure",
]

PALETTE = [BLUE, ORANGE, "#009E73", VERMILLION, SKY, PURPLE, YELLOW, "#999999"]
TRADEOFF_KEYS = ("name", "peak_bytes", "step_seconds", "measured")


def _unit(max_bytes: float) -> tuple[float, str]:
    """GiB when the largest value reaches 1 GiB, else MiB: readable axes."""
    return (2**30, "GiB") if max_bytes >= 2**30 else (2**20, "MiB")


def plot_memory_timeline(
    timeline: Mapping[str, Sequence[int]],
    measured: Sequence[int] | None = None,
    peak_index: int | None = None,
    reserved: Sequence[int] | None = None,
) -> Figure:
    """Stacked area of live bytes per category (params, activations, grads, ...) over the
    ops of one step; `measured` as a black line; `reserved` (what the caching allocator
    holds, `Estimate.allocator().reserved_timeline`) as a dashed line above the allocated
    bytes; the peak (default: the highest total) marked with a dashed line and its value."""
    if not timeline:
        raise WorkbenchError("memory timeline is empty: give at least one category of bytes")
    lengths = {name: len(values) for name, values in timeline.items()}
    steps = next(iter(lengths.values()))
    lines = {"measured": measured, "reserved": reserved}
    if len(set(lengths.values())) != 1 or any(
        v is not None and len(v) != steps for v in lines.values()
    ):
        raise WorkbenchError(
            f"memory timeline series differ in length: {lengths}"
            + "".join(f", {k} {len(v)}" for k, v in lines.items() if v is not None)
        )
    totals = [sum(values[i] for values in timeline.values()) for i in range(steps)]
    scale, unit = _unit(max(totals + list(measured or [0]) + list(reserved or [0])))
    if peak_index is None:
        peak_index = max(range(steps), key=totals.__getitem__)
    if not 0 <= peak_index < steps:
        raise WorkbenchError(f"peak_index {peak_index} is outside 0..{steps - 1}")
    fig = Figure(figsize=(9, 4.5))
    ax = fig.add_subplot()
    x = list(range(steps))
    ax.stackplot(
        x,
        *[[v / scale for v in values] for values in timeline.values()],
        labels=list(timeline),
        colors=PALETTE[: len(timeline)],
        alpha=0.85,
    )
    if measured is not None:
        ax.plot(x, [v / scale for v in measured], color="black", lw=1.2, label="measured")
    if reserved is not None:
        label = f"reserved (caching allocator), peak {max(reserved) / scale:.2f} {unit}"
        ax.plot(x, [v / scale for v in reserved], color="black", lw=1.2, ls=":", label=label)
    peak = totals[peak_index] / scale
    ax.axvline(peak_index, color="black", ls="--", lw=0.8)
    # the peak's own height: a spike one op wide is narrower than a pixel of the stack
    ax.plot([peak_index], [peak], marker="v", ms=6, color="black", ls="", label="_peak")
    ax.annotate(
        f"estimated peak {peak:.2f} {unit}\nat op {peak_index}",
        (peak_index, peak),
        xytext=(8, -4),
        textcoords="offset points",
        va="top",
    )
    ax.set_xlabel("op index in execution order (forward, then backward)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title("Memory over one training step")
    ax.set_xlim(0, max(steps - 1, 1))
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_layer_saved_bytes(per_layer: Mapping[int | str, int]) -> Figure:
    """Bars: bytes kept for backward in each layer (or any named group)."""
    if not per_layer:
        raise WorkbenchError("per-layer saved bytes are empty")
    scale, unit = _unit(max(per_layer.values()))
    fig = Figure(figsize=(max(5.0, 0.28 * len(per_layer) + 2), 3.8))
    ax = fig.add_subplot()
    labels = [str(k) for k in per_layer]
    ax.bar(labels, [v / scale for v in per_layer.values()], color=BLUE)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"kept for backward ({unit})")
    ax.set_title("Activations kept for backward, per layer")
    if len(labels) > 16:
        ax.tick_params(axis="x", labelrotation=90, labelsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _check_points(points: Sequence[Mapping[str, Any]]) -> None:
    for i, point in enumerate(points):
        missing = [k for k in TRADEOFF_KEYS if k not in point]
        if missing:
            raise WorkbenchError(
                f"trade-off point {i} lacks {', '.join(missing)}; each point needs "
                f"{', '.join(TRADEOFF_KEYS)}"
            )


def pareto_front(points: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Points no other point beats on both peak memory and step time (lower is better),
    sorted by peak memory. Ties on both count once, the first given."""
    _check_points(points)
    ordered = sorted(points, key=lambda p: (p["peak_bytes"], p["step_seconds"]))
    front: list[Mapping[str, Any]] = []
    for point in ordered:
        if not front or point["step_seconds"] < front[-1]["step_seconds"]:
            front.append(point)
    return front


def plot_tradeoff(points: Sequence[Mapping[str, Any]]) -> Figure:
    """Peak memory against step time for each tried policy: estimated points hollow circles,
    measured ones filled squares, the Pareto front as a dashed step line."""
    if not points:
        raise WorkbenchError("no trade-off points to plot")
    front = pareto_front(points)
    scale, unit = _unit(max(p["peak_bytes"] for p in points))
    fig = Figure(figsize=(7, 5))
    ax = fig.add_subplot()
    for measured, marker, label in ((False, "o", "estimated"), (True, "s", "measured")):
        chosen = [p for p in points if bool(p["measured"]) == measured]
        if chosen:
            ax.scatter(
                [p["step_seconds"] for p in chosen],
                [p["peak_bytes"] / scale for p in chosen],
                marker=marker,
                s=60,
                facecolors=BLUE if measured else "none",
                edgecolors=BLUE,
                label=label,
                zorder=3,
            )
    by_time = sorted(front, key=lambda p: p["step_seconds"])
    ax.step(
        [p["step_seconds"] for p in by_time],
        [p["peak_bytes"] / scale for p in by_time],
        where="post",
        color=ORANGE,
        ls="--",
        lw=1.5,
        label="Pareto front (best trade-offs)",
        zorder=2,
    )
    for p in points:
        ax.annotate(
            str(p["name"]),
            (p["step_seconds"], p["peak_bytes"] / scale),
            xytext=(5, 5),
            textcoords="offset points",
            fontsize="small",
        )
    ax.margins(0.12)
    ax.set_xlabel("step time (s)")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title("Memory vs step time per policy (lower left is better)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def figure_format(path: str | Path, flag: str = "path") -> str:
    """The format a figure file's suffix names, checked before the work that draws it: one
    matplotlib writes (`FigureCanvasBase.get_supported_filetypes`), else a one-line error
    naming `flag` and the suffixes it takes."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    fmt = Path(path).suffix.lstrip(".").lower()
    if not str(path) or fmt not in formats:
        raise WorkbenchError(
            f"{flag} {str(path)!r}: cannot draw a figure as {'.' + fmt if fmt else 'it'}; end "
            f"the file name with one of {', '.join('.' + f for f in formats)}"
        )
    return fmt


def save_figure(fig: Figure, path: str | Path, overwrite: bool = False) -> Path:
    """Save with no date and a fixed SVG hash salt: the same data give identical files.
    An existing file is kept unless `overwrite`."""
    target = Path(path)
    fmt = figure_format(target)
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt)
    buffer = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "sac-workbench"}):
        fig.savefig(buffer, format=fmt, metadata=metadata)
    return write_file(target, buffer.getvalue(), overwrite=overwrite)


PLAN_KEYS = ("peak_bytes", "est_tokens_per_second_per_gpu", "feasible")


def plan_front(configs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The layouts that fit and that no other fitting one beats on both tokens/s per GPU
    (higher) and peak memory (lower), fastest first."""
    for i, config in enumerate(configs):
        missing = [k for k in PLAN_KEYS if k not in config]
        if missing:
            raise WorkbenchError(f"plan config {i} lacks {', '.join(missing)}")
    rate = "est_tokens_per_second_per_gpu"
    ordered = sorted(
        (c for c in configs if c["feasible"]), key=lambda c: (-c[rate], c["peak_bytes"])
    )
    front: list[Mapping[str, Any]] = []
    for config in ordered:
        if not front or config["peak_bytes"] < front[-1]["peak_bytes"]:
            front.append(config)
    return front


def plot_plan(configs: Sequence[Mapping[str, Any]], memory_bytes: int) -> Figure:
    """Peak memory per GPU against tokens/s per GPU for each planned layout (`plan --json`'s
    configs): those that fit filled, the rest hollow, the GPU's memory as a line and the
    feasible front as a dashed step line, its fastest layout named (fsdp x tp x pp schedule)."""
    if not configs:
        raise WorkbenchError("no planned layouts to plot")
    front = plan_front(configs)
    rate = "est_tokens_per_second_per_gpu"
    scale, unit = _unit(max(max(c["peak_bytes"] for c in configs), memory_bytes))
    fig = Figure(figsize=(7, 5))
    ax = fig.add_subplot()
    for feasible, label in ((True, "fits"), (False, "over memory")):
        chosen = [c for c in configs if bool(c["feasible"]) == feasible]
        if chosen:
            ax.scatter(
                [c[rate] for c in chosen],
                [c["peak_bytes"] / scale for c in chosen],
                s=40,
                facecolors=BLUE if feasible else "none",
                edgecolors=BLUE if feasible else VERMILLION,
                label=label,
                zorder=3,
            )
    ax.axhline(memory_bytes / scale, color=VERMILLION, lw=1, label="GPU memory")
    if front:
        ax.step(
            [c[rate] for c in front],
            [c["peak_bytes"] / scale for c in front],
            where="post",
            color=ORANGE,
            ls="--",
            lw=1.5,
            label="feasible front",
            zorder=2,
        )
        best = front[0]  # the fastest that fits is named (a long front's names would overlap)
        if {"fsdp", "tp", "pp"} <= set(best):
            ep = f" ep {best['ep']}" if best.get("ep", 1) > 1 else ""
            name = f"{best['fsdp']}x{best['tp']}x{best['pp']}{ep} {best.get('schedule') or ''}"
            ax.annotate(
                name.rstrip(),
                (best[rate], best["peak_bytes"] / scale),
                xytext=(5, 5),
                textcoords="offset points",
                fontsize="small",
            )
    ax.margins(0.08)
    ax.set_xlabel("estimated tokens/s per GPU")
    ax.set_ylabel(f"peak memory per GPU ({unit})")
    ax.set_title("Planned layouts: memory vs throughput (upper left is worse)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
