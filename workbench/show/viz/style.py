"""How pictures look: the colour-blind-safe palette, node kinds, legend rows and units.

Entry points: `node_kind(info, decision)`, `KIND_STYLE`, `COLLECTIVE_STYLE`,
`legend_label(rows)`, `svg_id` and the label helpers `short_shape`, `forced_words`, `signed`.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from typing import Literal

from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import COLLECTIVE_OPS, NodeInfo
from workbench.decide.tags import Tag, Why

__all__ = [
    "BLUE",
    "COLLECTIVE_STYLE",
    "COLLECTIVE_WORDS",
    "DECISION_KINDS",
    "FADED",
    "FSDP_WORDS",
    "GREEN",
    "GREY",
    "KIND_STYLE",
    "Kind",
    "ORANGE",
    "OUTLINES",
    "PURPLE",
    "SKY",
    "VERMILLION",
    "WHITE",
    "YELLOW",
    "forced_words",
    "is_collective",
    "kind_rows",
    "legend_label",
    "node_kind",
    "short_shape",
    "signed",
    "svg_id",
    "swatch",
]

Kind = Literal[
    "must_save",
    "prefer_save",
    "must_recompute",
    "prefer_recompute",
    "offload",
    "forced_save",
    "untagged",
    "backward",
    "recomputed_copy",
]

# Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
BLUE, SKY, VERMILLION, ORANGE = "#0072B2", "#56B4E9", "#D55E00", "#E69F00"
PURPLE, YELLOW, GREY, WHITE = "#CC79A7", "#F0E442", "#DDDDDD", "#FFFFFF"
GREEN = "#009E73"  # Okabe-Ito bluish green
FADED = "#F2F2F2"

# kind -> (graphviz node attributes, plain words for the legend)
KIND_STYLE: dict[Kind, tuple[dict[str, str], str]] = {
    "prefer_save": ({"fillcolor": SKY}, "saved for backward (preset chose)"),
    "must_save": (
        {"fillcolor": BLUE, "fontcolor": WHITE},
        "saved for backward (you chose: MUST_SAVE)",
    ),
    "forced_save": (
        {"fillcolor": PURPLE, "peripheries": "2"},
        "saved, forced (layer boundary, random op or in-place op)",
    ),
    "prefer_recompute": ({"fillcolor": ORANGE}, "recomputed in backward (preset chose)"),
    "must_recompute": (
        {"fillcolor": VERMILLION, "fontcolor": WHITE},
        "recomputed in backward (you chose: MUST_RECOMPUTE)",
    ),
    "offload": (
        {"fillcolor": GREEN, "fontcolor": WHITE},
        "offloaded to host memory, reloaded before backward (MUST_CPU_OFFLOAD)",
    ),
    "untagged": ({"fillcolor": WHITE}, "forward op, no decision given"),
    "backward": ({"fillcolor": GREY, "fontcolor": "#444444"}, "backward op"),
    "recomputed_copy": (
        {"fillcolor": YELLOW, "style": "filled,dashed"},
        "copy recomputed in backward by remat (dashed edge from its original)",
    ),
}
# The explorer's outlines over the picture (drawn by its stylesheet, `explorer.css`): the
# selected op, and the ops that stand for the estimated peak (Go to peak), each with its look
# (a solid or dashed outline) and its words for the legend.
OUTLINES: dict[str, tuple[str, str, str]] = {
    "selected": ("#DD0000", "solid", "red outline: the selected op"),
    "peak": ("#000000", "dashed", "black dashed outline: where the estimated peak happens"),
}

# Communication ops (all-gather, reduce-scatter, all-reduce, wait) of a per-rank graph: a
# shape of their own, so the fill colour still tells their save/recompute decision.
COLLECTIVE_STYLE: dict[str, str] = {"shape": "hexagon", "style": "filled"}
COLLECTIVE_WORDS = "hexagon: communication op (all-gather, reduce-scatter, all-reduce, wait)"


def is_collective(info: NodeInfo) -> bool:
    return info.op in COLLECTIVE_OPS


DECISION_KINDS: tuple[Kind, ...] = (
    "prefer_save",
    "must_save",
    "forced_save",
    "prefer_recompute",
    "must_recompute",
)


_POLICY_KIND: dict[CheckpointPolicy, Kind] = {
    CheckpointPolicy.MUST_SAVE: "must_save",
    CheckpointPolicy.PREFER_SAVE: "prefer_save",
    CheckpointPolicy.MUST_RECOMPUTE: "must_recompute",
    CheckpointPolicy.PREFER_RECOMPUTE: "prefer_recompute",
    CheckpointPolicy.MUST_CPU_OFFLOAD: "offload",
    CheckpointPolicy.PREFER_CPU_OFFLOAD: "offload",
}


# Tags nobody chose by a row of their own: a preset's rule (graph trainer's write MUST_SAVE
# and MUST_RECOMPUTE) and the policy's FSDP default. Drawn as the preset's choice, whatever
# their MUST or PREFER: "you chose" is said of selectors and overrides only.
_DEFAULTS = (Why.PRESET, Why.FSDP, Why.UNTAGGED)
_AS_DEFAULT: dict[Kind, Kind] = {"must_save": "prefer_save", "must_recompute": "prefer_recompute"}


def node_kind(info: NodeInfo, decision: Tag | None) -> Kind:
    """What colour a node gets: its decision (a MUST tag nobody chose, a preset's or the FSDP
    default's, as the preset's choice), or backward / untagged."""
    if info.phase == "backward":
        return "backward"
    if decision is None:
        return "untagged"
    if decision.forced:
        return "forced_save"
    kind = _POLICY_KIND.get(decision.policy, "prefer_save")
    return _AS_DEFAULT.get(kind, kind) if decision.why in _DEFAULTS else kind


def forced_words(decision: Tag) -> str:
    """`forced: layer boundary`: the short form of a forced decision's reason."""
    return f"forced: {decision.why.value}"


def signed(text: str) -> str:
    return text if text.startswith("−") or text.startswith("0 ") else f"+{text}"


_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int64": "i64", "int32": "i32"}


def short_shape(info: NodeInfo) -> str:
    shapes = ", ".join("×".join(map(str, s)) or "scalar" for s in info.shapes)
    dtype = _DTYPES.get(info.dtype or "", info.dtype or "")
    return f"{shapes} {dtype}".strip()


_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


def svg_id(kind: str, name: str) -> str:
    """A Graphviz- and SVG-safe id: `KIND-` + the name with other characters as `-XX-` hex
    (`:` would be read as a port, `.` breaks CSS selectors). What an id stands for is in its
    view's `elements`, never read back from the id.

    >>> svg_id("n", "mm_4"), svg_id("m", "layers.0–1.ffn")
    ('n-mm_4', 'm-layers-2e-0-2013-1-2e-ffn')
    """
    return f"{kind}-" + _UNSAFE.sub(lambda m: f"-{ord(m.group()):02x}-", name)


def swatch(colour: str) -> str:
    """A colour sample as text: table cells would stretch with the legend's width."""
    if colour in (WHITE, FADED):
        return '<FONT COLOR="#888888">□□□</FONT>'
    return f'<FONT COLOR="{colour}">███</FONT>'


def legend_label(title: str, lines: Iterable[str], rows: Iterable[tuple[str, str]]) -> str:
    """A Graphviz HTML label: a title, plain lines, then one colour sample per meaning."""
    cells = [f"<B>{html.escape(title)}</B>"]
    cells += [html.escape(line) for line in lines]
    cells += [f"{swatch(colour)}  {html.escape(words)}" for colour, words in rows]
    body = "".join(f'<TR><TD ALIGN="LEFT">{cell}</TD></TR>' for cell in cells)
    return f'<<TABLE BORDER="0" CELLSPACING="1" CELLPADDING="1">{body}</TABLE>>'


# What the FSDP default adds to the preset's rows, on a graph with FSDP all-gathers: which
# choice colours them is said by the tags the view draws (`Why.FSDP`, its detail).
FSDP_WORDS: dict[Kind, str] = {
    "prefer_recompute": "; FSDP all-gathers: reshard after forward",
    "prefer_save": "; FSDP all-gathers: keep unsharded",
}


def kind_rows(kinds: Iterable[Kind], fsdp: Iterable[Kind] = ()) -> list[tuple[str, str]]:
    """(colour, words) per kind; the kinds in `fsdp` also say that the FSDP default chose
    them on this graph.

    >>> kind_rows(["prefer_recompute"], fsdp=["prefer_recompute"])[0][1]
    'recomputed in backward (preset chose; FSDP all-gathers: reshard after forward)'
    """
    chosen = set(fsdp)
    rows = []
    for kind in kinds:
        colour, words = KIND_STYLE[kind][0]["fillcolor"], KIND_STYLE[kind][1]
        if kind in chosen and kind in FSDP_WORDS:
            words = words.removesuffix(")") + FSDP_WORDS[kind] + ")"
        rows.append((colour, words))
    return rows
