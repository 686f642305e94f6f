"""What each drawn element of a picture stands for, so that a front end never reads SVG ids,
titles or legend text back: every `View` carries a map from element id to `Element`.

Entry points: `Element` (op, recomputed copy, module box, folded layers' frame, backward
summary, outside input) and `Elements`, the map `View.elements` holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Element", "ElementKind", "Elements"]

ElementKind = Literal["op", "copy", "module", "layers", "backward", "input"]


@dataclass(frozen=True)
class Element:
    """One drawn element (a Graphviz node or cluster: an SVG `<g id=...>`).

    `name` is the traced node an op stands for (a recomputed copy: its original's), or the
    module a box, frame, backward summary or outside input stands for; a folded box names
    its first layer's module (`layers.0.attention` for `layers.0–31.attention`), the module
    a click on it opens. `label` is its title as drawn, `layers` the layers a folded box or
    frame stands for, `nodes` the forward ops it holds, `collective` whether it is a
    communication op (drawn as a hexagon).
    """

    kind: ElementKind
    name: str
    label: str = ""
    layers: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    collective: bool = False


Elements = dict[str, Element]  # element id -> what it stands for, in drawing order
