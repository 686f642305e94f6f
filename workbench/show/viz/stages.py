"""The stages of a pipelined job side by side: each stage's rank, layers, the pipelined peak of
its rank, the microbatches in flight there, and a bar against the per-GPU budget.

Entry points: `stage_rows(estimate, labels, budget_bytes)` (the figures, one dict per stage,
read from `PipelineEstimate` alone) and `StageStrip` (`.svg()`, shown by notebooks as SVG).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workbench.cost.stages import PipelineEstimate
from workbench.errors import WorkbenchError, check_int
from workbench.show.viz.style import BLUE, GREY, SKY, VERMILLION, WHITE
from workbench.units import format_bytes, format_count, format_seconds

__all__ = ["StageStrip", "layers_words", "stage_rows", "stage_strip"]

_CELL_W, _CELL_H, _GAP, _TOP, _PAD = 168, 112, 8, 40, 8
# what the cells' peak is, under the title: the open stage's explorer shows another quantity
_NOTE = (
    "rank peak: the pipelined peak of the stage's rank over the schedule (stages of one rank "
    "share it); click a stage to open its graph"
)
_BAR_Y, _BAR_H = 88, 12


def layers_words(layers: Sequence[int], first: bool, last: bool) -> str:
    """What a stage holds, in words: its layer range and the embedding or the output.

    >>> layers_words([0, 1], True, False), layers_words([4], False, True)
    ('embedding + layers 0–1', 'layer 4 + norm, output')
    >>> layers_words([], False, True)
    'norm, output'
    """
    parts = ["embedding"] if first else []
    if len(layers) == 1:
        parts.append(f"layer {layers[0]}")
    elif layers:
        parts.append(f"layers {layers[0]}–{layers[-1]}")
    if last:
        parts.append("norm, output")
    return " + ".join(parts) or "no layers"


def stage_rows(
    estimate: PipelineEstimate,
    labels: Sequence[str],
    budget_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """One row per stage, in stage order: `stage`, `rank`, `layers`, `peak_bytes` (the
    pipelined peak of its rank, `schedule.stages`), `inflight_microbatches`, the policy's label, and
    with a budget the peak's share of it (`budget_fraction`) and whether it fits."""
    layout = estimate.layout
    if len(labels) != layout.n_stages:
        raise WorkbenchError(
            f"the strip needs one policy label per stage ({layout.n_stages}), got {len(labels)}"
        )
    if budget_bytes is not None:
        check_int("budget", budget_bytes, 1, 2**62, "bytes per GPU (None: no budget)")
    rows = []
    for row in estimate.schedule.stages:
        stage = row.stage
        layers = list(layout.layers[stage])
        first, last = stage == 0, stage == layout.n_stages - 1
        peak = row.peak_bytes
        rows.append(
            {
                "stage": stage,
                "rank": row.rank,
                "layers": layers,
                "holds": layers_words(layers, first, last),
                "peak_bytes": peak,
                "peak": format_bytes(peak),
                "inflight_microbatches": row.inflight_microbatches,
                "policy": labels[stage],
                "budget_fraction": peak / budget_bytes if budget_bytes else None,
                "fits": peak <= budget_bytes if budget_bytes else None,
            }
        )
    return sorted(rows, key=lambda r: r["stage"])


@dataclass
class StageStrip:
    """The stages side by side, as one SVG: a cell per stage (click target `data-stage`),
    the open one outlined, bars scaled to the budget (or to the largest peak without one)."""

    rows: list[dict[str, Any]]
    title: str
    budget_bytes: int | None = None
    selected: int | None = None

    def svg(self) -> str:
        cells = _PAD * 2 + len(self.rows) * (_CELL_W + _GAP) - _GAP
        # the title and the note each on one line
        width = max(cells, _PAD * 2 + round(6.6 * max(len(self.title), len(_NOTE))))
        height = _TOP + _CELL_H + _PAD
        scale = max([self.budget_bytes or 0] + [r["peak_bytes"] for r in self.rows]) or 1
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" class="stage-strip" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" '
            'font-size="11">',
            f'<text x="{_PAD}" y="14" font-size="12">{html.escape(self.title)}</text>',
            f'<text x="{_PAD}" y="30" fill="#555">{html.escape(_NOTE)}</text>',
        ]
        for i, row in enumerate(self.rows):
            parts.append(self._cell(row, _PAD + i * (_CELL_W + _GAP), scale))
        parts.append("</svg>")
        return "\n".join(parts)

    def _repr_svg_(self) -> str:
        return self.svg()

    def _cell(self, row: dict[str, Any], x: int, scale: int) -> str:
        stage, y = row["stage"], _TOP
        is_open = stage == self.selected
        over = row["fits"] is False
        lines = [
            f"stage {stage} · rank {row['rank']}" + (" · open" if is_open else ""),
            row["holds"],
            f"rank peak {row['peak']}",
            f"{format_count(row['inflight_microbatches'], 'microbatch', 'microbatches')} in flight",
            f"policy {row['policy']}",
        ]
        texts = "".join(
            f'<text x="{x + 6}" y="{y + 15 + 14 * k}"'
            + (' font-weight="bold"' if k == 0 else "")
            + f">{html.escape(line)}</text>"
            for k, line in enumerate(lines)
        )
        bar_w = (_CELL_W - 12) * row["peak_bytes"] / scale
        budget = ""
        if self.budget_bytes:
            bx = x + 6 + (_CELL_W - 12) * self.budget_bytes / scale
            budget = (
                f'<line x1="{bx:.1f}" y1="{y + _BAR_Y - 3}" x2="{bx:.1f}" '
                f'y2="{y + _BAR_Y + _BAR_H + 3}" stroke="black" stroke-width="1.5"/>'
            )
        share = (
            f"{row['budget_fraction']:.0%} of budget"
            if row["budget_fraction"] is not None
            else "of the largest peak"
        )
        return (
            f'<g id="stage-{stage}" class="stage-cell" data-stage="{stage}" '
            'style="cursor:pointer">'
            f"<title>open stage {stage} ({html.escape(row['holds'])}): rank peak "
            f"{html.escape(row['peak'])}, {html.escape(share)}</title>"
            f'<rect x="{x}" y="{y}" width="{_CELL_W}" height="{_CELL_H}" rx="4" fill="{WHITE}" '
            f'stroke="{BLUE if is_open else GREY}" stroke-width="{3 if is_open else 1}"/>'
            f"{texts}"
            f'<rect x="{x + 6}" y="{y + _BAR_Y}" width="{_CELL_W - 12}" height="{_BAR_H}" '
            f'fill="{GREY}"/>'
            f'<rect class="stage-bar" x="{x + 6}" y="{y + _BAR_Y}" width="{bar_w:.1f}" '
            f'height="{_BAR_H}" fill="{VERMILLION if over else SKY}"/>'
            f"{budget}</g>"
        )


def stage_strip(
    estimate: PipelineEstimate,
    labels: Sequence[str],
    budget_bytes: int | None = None,
    selected: int | None = None,
) -> StageStrip:
    """The strip of `estimate`'s stages: title with the schedule and the job's peak."""
    rows = stage_rows(estimate, labels, budget_bytes)
    layout = estimate.layout
    worst = max(rows, key=lambda r: r["peak_bytes"])
    title = (
        f"{layout.pipeline.schedule} · pp {layout.pipeline.pp} · "
        f"{format_count(layout.n_stages, 'stage')} · "
        f"{format_count(layout.microbatches, 'microbatch', 'microbatches')} · "
        f"peak {worst['peak']} (rank {worst['rank']})"
        + (f" · budget {format_bytes(budget_bytes)} per GPU" if budget_bytes else "")
        + f" · step {format_seconds(estimate.schedule.step_seconds)} on {estimate.profile}"
    )
    return StageStrip(rows, title, budget_bytes, selected)
