"""Pictures: colours and legend per decision, stable SVG ids, folded layers, layer views,
policy diffs, determinism, the networkx export, plots and the `render` CLI command."""

from __future__ import annotations

import html
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from graph_facts import read_by_backward
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cost.estimate import estimate
from workbench.decide.decider import decide
from workbench.decide.policy import Policy, Selector
from workbench.decide.tags import Tag, Why
from workbench.errors import WorkbenchError
from workbench.rewrite.remat import remat
from workbench.show.viz import (
    VIEWS,
    Element,
    diff,
    expand,
    near_changes,
    overview,
    pareto_front,
    parse_view,
    plot_layer_saved_bytes,
    plot_memory_timeline,
    plot_tradeoff,
    remat_diff,
    render_overview,
    render_view,
    save_figure,
    svg_id,
    to_networkx,
    whole_graph,
)
from workbench.show.viz import render as render_module
from workbench.show.viz.arrange import (
    GAIN,
    LEGIBLE_PX,
    MAX_SCALE,
    arrange,
    drawn_size,
    fit_scale,
    laid_out,
    on_screen,
)
from workbench.show.viz.render import op_elements
from workbench.show.viz.style import (
    BLUE,
    DECISION_KINDS,
    KIND_STYLE,
    ORANGE,
    PURPLE,
    SKY,
    VERMILLION,
    node_kind,
)

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def four_layers() -> JointGraph:
    return trace(load_workload("llama3-debug", layers=4, seq=32), mode="real")


@pytest.fixture(scope="module")
def two_layers(small_graphs: dict) -> JointGraph:
    return small_graphs["llama3-debug"][1]


def mixed_policy() -> Policy:
    """Preset choices plus a user save, recompute and offload, so every kind shows up (the
    offload in layer 0: the last layer's are refused)."""
    return Policy(
        preset="default",
        selectors=[
            Selector("layers.*.feed_forward.w1::aten.mm.default", "recompute"),
            Selector("layers.*.attention_norm::aten.mul.Tensor", "save"),
            Selector("layers.0.attention.wv::aten.mm.default", "offload"),
        ],
    )


def svg_nodes(svg: str) -> dict[str, ET.Element]:
    """`<g class="node">` elements by id."""
    root = ET.fromstring(svg)
    return {g.get("id", ""): g for g in root.iter(f"{SVG}g") if g.get("class") == "node"}


def fill_of(group: ET.Element) -> str:
    for shape in group.iter():
        if shape.tag in (f"{SVG}path", f"{SVG}polygon") and shape.get("fill") not in (None, "none"):
            return shape.get("fill", "").upper()
    raise AssertionError("node has no filled shape")


def test_colours_and_legend_follow_each_decision_kind(two_layers: JointGraph) -> None:
    decisions = decide(two_layers, mixed_policy())
    view = expand(two_layers, decisions, "layer:0")
    svg = view.svg()
    kinds_seen = set()
    for element_id, group in svg_nodes(svg).items():
        if view.elements[element_id].kind != "op":
            continue
        name = view.elements[element_id].name
        kind = node_kind(two_layers.nodes[name], decisions.get(name))
        kinds_seen.add(kind)
        assert fill_of(group) == KIND_STYLE[kind][0]["fillcolor"].upper(), name
    assert {*DECISION_KINDS, "offload"} <= kinds_seen
    text = html.unescape(svg)
    for kind in (*DECISION_KINDS, "offload", "backward"):
        colour, words = KIND_STYLE[kind][0]["fillcolor"], KIND_STYLE[kind][1]
        assert words in text, f"legend lacks {words!r}"
        assert f'fill="{colour.lower()}">███' in text.lower()
    forced = [n for n, d in decisions.items() if d.forced and two_layers.nodes[n].layer == 0]
    dot = expand(two_layers, decisions, "layer:0").dot.source
    for name in forced:
        line = next(ln for ln in dot.splitlines() if f'id="{svg_id("n", name)}"' in ln)
        assert "peripheries=2" in line and "forced:" in line


def test_every_svg_id_says_what_it_stands_for(two_layers: JointGraph) -> None:
    view = whole_graph(two_layers, decide(two_layers, Policy("default")))
    drawn = svg_nodes(view.svg())
    assert set(drawn) == set(view.elements)  # every element described, nothing more
    ops = [view.elements[i] for i in drawn if view.elements[i].kind == "op"]
    assert sorted(e.name for e in ops) == sorted(i.name for i in two_layers.ops())
    assert all(e.nodes == (e.name,) for e in ops)
    odd = ("layers.0.attention", "a:b", "x-1.y", "layers.0–3.ffn", "a-2e-b", "a.b")
    ids = [svg_id("m", name) for name in odd]
    assert len(set(ids)) == len(odd)  # distinct names keep distinct ids
    assert not any(":" in i or "." in i for i in ids)


def test_identical_layers_fold_into_one_box(four_layers: JointGraph) -> None:
    decisions = decide(four_layers, Policy("default"))
    data = overview(four_layers, decisions)
    folded = data.group("layers.0–3 ×4")
    assert folded.layers == (0, 1, 2, 3)
    kept = estimate(four_layers, decisions).saved_by_node
    per_layer = [
        sum(b for n, b in kept.items() if four_layers.nodes[n].layer == layer) for layer in range(4)
    ]
    assert folded.saved_bytes == sum(per_layer) > 0
    assert data.saved_bytes == estimate(four_layers, decisions).saved_activation_bytes
    assert len({*per_layer}) == 1
    svg = render_overview(four_layers, decisions).svg()
    assert "layers.0–3 ×4" in svg
    assert len([i for i in svg_nodes(svg) if i.startswith("n-")]) == 0  # no op nodes


def test_overview_elements_say_what_each_box_and_frame_opens(four_layers: JointGraph) -> None:
    view = render_overview(four_layers, decide(four_layers, Policy("default")))
    drawn = svg_nodes(view.svg())
    root = ET.fromstring(view.svg())
    clusters = {g.get("id") for g in root.iter(f"{SVG}g") if g.get("class") == "cluster"}
    assert set(view.elements) == set(drawn) | clusters  # every box and frame, nothing more
    frame = view.elements[svg_id("g", "layers.0–3")]
    assert (frame.kind, frame.name, frame.label, frame.layers) == (
        "layers",
        "layers.0",
        "layers.0–3 ×4",
        (0, 1, 2, 3),
    )
    forward = {i.name for i in four_layers.ops() if i.layer is not None and i.phase == "forward"}
    assert set(frame.nodes) == forward
    box = view.elements[svg_id("m", "layers.0–3.attention")]
    assert (box.kind, box.name, box.label, box.layers) == (
        "module",
        "layers.0.attention",
        "attention",
        (0, 1, 2, 3),
    )
    assert {four_layers.nodes[n].layer for n in box.nodes} == {0, 1, 2, 3}
    assert view.elements[svg_id("m", "norm")] == Element(
        "module", "norm", "norm", (), tuple(view.elements[svg_id("m", "norm")].nodes)
    )
    bare = view.svg(legend=False)
    assert svg_nodes(bare).keys() == drawn.keys() and "identical layers" not in bare
    assert "identical layers" in html.unescape(view.svg())


def test_collectives_are_named_by_the_view(rank_debug: JointGraph) -> None:
    view = expand(rank_debug, decide(rank_debug, Policy("default")), "layer:0")
    hexagons = {
        i
        for i, g in svg_nodes(view.svg()).items()
        if [len(p.get("points", "").split()) for p in g.iter(f"{SVG}polygon")][:1] == [7]
    }
    assert hexagons and set(view.collectives) == hexagons
    assert all(view.elements[i].name in rank_debug.nodes for i in hexagons)
    anywhere = op_elements(rank_debug)
    assert {i for i, e in anywhere.items() if e.kind == "op"} == {
        svg_id("n", i.name) for i in rank_debug.ops()
    }
    assert set(view.collectives) <= {i for i, e in anywhere.items() if e.collective}
    assert all(anywhere[i].kind == "backward" for i in view.elements if i.startswith("b-"))


def test_a_changed_layer_breaks_the_fold(four_layers: JointGraph) -> None:
    decisions = dict(decide(four_layers, Policy("default")))
    name = next(i.name for i in four_layers.ops() if i.layer == 2 and i.op == "aten.mm.default")
    decisions[name] = Tag(CheckpointPolicy.MUST_RECOMPUTE, Why.OVERRIDE, "test")
    titles = [g.title for g in overview(four_layers, decisions).groups]
    assert {"layers.0–1 ×2", "layers.2", "layers.3"} <= set(titles)


def test_layer_view_holds_exactly_that_layers_forward_ops(four_layers: JointGraph) -> None:
    decisions = decide(four_layers, Policy("default"))
    view = expand(four_layers, decisions, "layer:2")
    shown = {e.name for e in view.elements.values() if e.kind == "op"}
    expected = {i.name for i in four_layers.ops() if i.layer == 2 and i.phase == "forward"}
    assert shown == expected
    summaries = [e.name for e in view.elements.values() if e.kind == "backward"]
    assert summaries and all(module.startswith("layers.2") for module in summaries[:-1])
    module = expand(four_layers, decisions, "module:layers.1.feed_forward")
    names = {e.name for e in module.elements.values() if e.kind == "op"}
    assert names and all(
        four_layers.nodes[n].module.startswith("layers.1.feed_forward") for n in names
    )
    with pytest.raises(WorkbenchError, match="layers are 0–3"):
        expand(four_layers, decisions, "layer:9")


def test_layer_view_after_remat_links_copies_to_originals(two_layers: JointGraph) -> None:
    result = remat(two_layers, Policy("default"))
    dot = expand(two_layers, result.decisions, "layer:0", gm=result.gm).dot.source
    copies = [n.name for n in result.gm.graph.nodes if n.name.endswith("_recomputed")]
    in_layer = [c for c in copies if two_layers.nodes[c.removesuffix("_recomputed")].layer == 0]
    assert in_layer
    for copy in in_layer:
        original = copy.removesuffix("_recomputed")
        edge = f'"{svg_id("n", original)}" -> "{svg_id("n", copy)}"'
        assert any(edge in ln and "style=dashed" in ln for ln in dot.splitlines()), copy


def test_diff_lists_exactly_the_flipped_nodes(two_layers: JointGraph) -> None:
    before = decide(two_layers, Policy("default"))
    saved = read_by_backward(two_layers)
    kept = next(n for n, d in before.items() if n in saved and not d.recompute)
    dropped = next(n for n, d in before.items() if n in saved and d.recompute)
    after = dict(before)
    after[kept] = Tag(CheckpointPolicy.MUST_RECOMPUTE, Why.OVERRIDE, "a")
    after[dropped] = Tag(CheckpointPolicy.MUST_SAVE, Why.OVERRIDE, "b")
    changed = diff(two_layers, before, after)
    rows = {r.node: r for r in changed.rows}
    flipped = {n for n, r in rows.items() if {r.before, r.after} == {"save", "recompute"}}
    assert flipped == {kept, dropped}
    k, d = two_layers.nodes[kept], two_layers.nodes[dropped]
    assert (rows[kept].before, rows[kept].after) == ("save", "recompute")
    # the rows add up to the estimates' difference in saved activation bytes
    est_before, est_after = estimate(two_layers, before), estimate(two_layers, after)
    assert changed.saved_bytes_delta == (
        est_after.saved_activation_bytes - est_before.saved_activation_bytes
    )
    assert rows[kept].saved_bytes_delta == -est_before.saved_by_node.get(kept, 0)
    assert rows[kept].recompute_flops_delta == k.flops
    assert rows[dropped].recompute_flops_delta == -d.flops
    assert changed.totals() == {
        "changed": len(rows),
        "saved_bytes_delta": changed.saved_bytes_delta,
        "recompute_flops_delta": k.flops - d.flops,
    }
    table = changed.markdown()
    assert kept in table and dropped in table and table.count("\n| ") == 1 + len(rows)
    assert (
        overview(two_layers, after).saved_bytes - overview(two_layers, before).saved_bytes
        == changed.saved_bytes_delta
    )
    assert diff(two_layers, before, before).rows == []
    svg = changed.render(two_layers).svg()
    assert "CHANGED 1 op:" in svg and f"{len(rows)} activations changed" in svg
    layer = two_layers.nodes[kept].layer
    if layer is not None:
        assert "changed: save → recompute" in changed.render(two_layers, f"layer:{layer}").svg()


def test_recompute_figures_are_what_remat_recomputes(two_layers: JointGraph) -> None:
    """One recompute figure everywhere, the estimate's: FLOPs backward runs again. wq's
    matmul tagged recompute while its view is saved runs once (backward reads the view's
    storage): the boxes, the op view and a diff all leave it out, as the estimate does."""
    from workbench.units import format_flops

    wq = "layers.*.attention.wq::aten"
    useless = Policy(
        "default",
        overrides={f"{wq}.mm.default#0": "recompute", f"{wq}._unsafe_view.default#0": "save"},
    )
    for policy in (Policy("default"), Policy("full"), useless):
        decisions = decide(two_layers, policy)
        est = estimate(two_layers, decisions)
        tagged = sum(two_layers.nodes[n].flops for n, d in decisions.items() if d.recompute)
        shown = overview(two_layers, decisions)
        boxes = sum(b.recompute_flops for g in shown.groups for b in g.boxes.values())
        assert shown.recompute_flops == boxes == est.recompute_flops, policy
        assert sum(est.recompute_flops_by_node.values()) == est.recompute_flops
        layer = expand(two_layers, decisions, "layer:0").svg()
        ops = [n for n, i in two_layers.nodes.items() if i.layer == 0 and i.phase == "forward"]
        here = sum(est.recompute_flops_by_node.get(n, 0) for n in ops)
        assert f"run again in backward here: {format_flops(here)}" in html.unescape(layer)
        if policy is useless:
            assert tagged > 0 == est.recompute_flops
            assert "recompute: none" in render_overview(two_layers, decisions).svg()
    before, after = decide(two_layers, Policy("default")), decide(two_layers, Policy("full"))
    changed = diff(two_layers, before, after)
    assert changed.recompute_flops_delta == (
        estimate(two_layers, after).recompute_flops - estimate(two_layers, before).recompute_flops
    )


def test_remat_diff_reports_no_longer_kept_activations(two_layers: JointGraph) -> None:
    result = remat(two_layers, Policy("default"))
    changed = remat_diff(two_layers, result)
    freed = -sum(r.saved_bytes_delta for r in changed.rows if r.before == "kept")
    assert freed == result.report.bytes_no_longer_saved
    assert any(r.after == "recomputed" for r in changed.rows)


def test_renders_are_byte_identical(two_layers: JointGraph, tmp_path: Path) -> None:
    for view in ("overview", "layer:1"):
        first = render_view(two_layers, decide(two_layers, Policy("eager")), view).svg()
        second = render_view(two_layers, decide(two_layers, Policy("eager")), view).svg()
        assert first == second
    fig = plot_tradeoff(
        [
            {"name": "a", "peak_bytes": 2**30, "step_seconds": 1.0, "measured": True},
            {"name": "b", "peak_bytes": 2**29, "step_seconds": 2.0, "measured": False},
        ]
    )
    # the same path twice (a file's mark names the path it was written to)
    one = save_figure(fig, tmp_path / "a.svg").read_bytes()
    two = save_figure(fig, tmp_path / "a.svg", overwrite=True).read_bytes()
    assert one == two
    assert b"<dc:date>" not in one


def test_networkx_export_carries_facts_decisions_and_saved_edges(two_layers: JointGraph) -> None:
    decisions = decide(two_layers, Policy("default"))
    graph = to_networkx(two_layers, decisions)
    assert graph.number_of_nodes() == len(two_layers.nodes)
    mm = next(i for i in two_layers.ops() if i.op == "aten.mm.default")
    facts = graph.nodes[mm.name]
    assert (facts["op"], facts["bytes"], facts["flops"], facts["shapes"]) == (
        mm.op,
        mm.bytes,
        mm.flops,
        mm.shapes,
    )
    assert facts["policy"] == decisions[mm.name].policy.name
    assert facts["reason"] == decisions[mm.name].reason
    saved_sources = {u for u, _, s in graph.edges(data="saved") if s}
    assert saved_sources == read_by_backward(two_layers)
    result = remat(two_layers, decisions)
    after = to_networkx(two_layers, decisions, result.gm)
    copies = [n for n, original in after.nodes(data="original") if original]
    assert copies and all(after.nodes[c]["recomputed"] for c in copies)
    links = [(u, v) for u, v, k in after.edges(data="kind") if k == "recomputed_copy"]
    assert links and all(v == f"{u}_recomputed" for u, v in links)
    assert {u for u, _, s in after.edges(data="saved") if s} == read_by_backward(
        two_layers, result.gm
    )


def test_plots_return_figures_with_their_artists() -> None:
    timeline = {"params": [100 * 2**20] * 5, "activations": [0, 50, 90, 40, 0]}
    fig = plot_memory_timeline(timeline, measured=[100 * 2**20] * 5)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 2
    assert "MiB" in ax.get_ylabel() and [t.get_text() for t in ax.get_legend().texts] == [
        "params",
        "activations",
        "measured",
    ]
    assert any("peak" in t.get_text() for t in ax.texts)
    spike = {"params": [2**20] * 400, "temporaries": [0] * 200 + [2**20] + [0] * 199}
    marked = plot_memory_timeline(spike).axes[0]  # a one-op peak, marked at its height
    assert [
        (tuple(line.get_xdata()), tuple(line.get_ydata()))
        for line in marked.lines
        if line.get_marker() == "v"
    ] == [((200,), (2.0,))]
    with pytest.raises(WorkbenchError, match="differ in length"):
        plot_memory_timeline({"a": [1, 2], "b": [1]})
    with pytest.raises(WorkbenchError, match="reserved 1"):
        plot_memory_timeline({"a": [1, 2]}, reserved=[1])
    both = plot_memory_timeline(timeline, reserved=[120 * 2**20] * 5).axes[0]
    legend = [t.get_text() for t in both.get_legend().texts]
    assert legend[-1] == "reserved (caching allocator), peak 120.00 MiB"
    bars = plot_layer_saved_bytes({0: 2**30, 1: 2**31, 2: 2**30}).axes[0]
    assert len(bars.patches) == 3 and "GiB" in bars.get_ylabel()
    points = [
        {"name": "none", "peak_bytes": 9, "step_seconds": 1.0, "measured": True},
        {"name": "full", "peak_bytes": 3, "step_seconds": 3.0, "measured": False},
        {"name": "mid", "peak_bytes": 5, "step_seconds": 2.0, "measured": False},
        {"name": "worse", "peak_bytes": 6, "step_seconds": 2.5, "measured": True},
    ]
    assert [p["name"] for p in pareto_front(points)] == ["full", "mid", "none"]
    scatter = plot_tradeoff(points).axes[0]
    labels = [t.get_text() for t in scatter.get_legend().texts]
    assert labels == ["estimated", "measured", "Pareto front (best trade-offs)"]
    assert len(scatter.collections) == 2 and len(scatter.lines) == 1
    with pytest.raises(WorkbenchError, match="lacks step_seconds"):
        pareto_front([{"name": "x", "peak_bytes": 1, "measured": False}])


def test_huge_layouts_are_refused_without_force(
    two_layers: JointGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render_module, "MAX_LAYOUT_NODES", 100)
    with pytest.raises(WorkbenchError, match="overview"):
        whole_graph(two_layers)
    assert whole_graph(two_layers, force=True).nodes > 100


def test_bad_view_lists_the_valid_views(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("layers:3", "layer:x", "diff:", "everything"):
        with pytest.raises(WorkbenchError, match="valid views are overview, layer:N"):
            parse_view(bad)
    argv = ["render", "--model", "llama3-debug", "--view", "bogus", "--out", "x.svg"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(v in err for v in VIEWS)


def test_render_cli_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "layer.svg"
    argv = ["render", "--model", "llama3-debug", "--layers", "2", "--seq", "32"]
    assert main([*argv, "--view", "layer:1", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"path", "view", "nodes", "edges", "seconds", "passes"}
    assert result["passes"] == {"pipeline": "workbench"}
    assert result["path"] == str(out) and result["view"] == "layer:1"
    assert result["nodes"] > 50 and result["edges"] > result["nodes"] / 2
    assert out.read_text().startswith("<?xml")
    diff_out = tmp_path / "diff.svg"
    assert main([*argv, "--view", "diff:eager", "--out", str(diff_out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["view"] == "diff:eager"
    assert "default → eager" in diff_out.read_text()


# --- pictures that fill their panel, legends from one table, diffs cropped (issue 27) -------


def svg_edges(svg: str) -> list[str]:
    """The titles (`tail->head`) of the drawn edges."""
    root = ET.fromstring(svg)
    return [
        html.unescape(g.findtext(f"{SVG}title") or "")
        for g in root.iter(f"{SVG}g")
        if g.get("class") == "edge"
    ]


def node_x(svg: str) -> dict[str, float]:
    """Each node's centre, left to right, in picture units (its first label line's x)."""
    return {i: float(next(g.iter(f"{SVG}text")).get("x", "")) for i, g in svg_nodes(svg).items()}


def test_views_are_arranged_to_fill_the_panel(
    four_layers: JointGraph, rank_debug: JointGraph
) -> None:
    """A module of 60 ops drawn top to bottom is a tall strip; in a 1.6:1 panel its chain
    wraps into columns, read left to right, and fits at a larger scale."""
    decisions = decide(four_layers, Policy("default"))
    view = "module:layers.0.attention"
    plain = render_view(four_layers, decisions, view)
    arranged = render_view(four_layers, decisions, view, aspect=1.6)
    assert plain.arrangement == "TB" and arranged.arrangement.startswith("TB/")
    panel = (1.6, 1.0)
    gain = fit_scale(drawn_size(arranged.dot), panel) / fit_scale(drawn_size(plain.dot), panel)
    assert gain >= GAIN
    svg = arranged.svg(legend=False)
    assert svg_nodes(svg).keys() == plain.elements.keys()  # the same elements, once each
    drawn = [e for e in svg_edges(svg) if "column-" not in e]
    assert sorted(drawn) == sorted(f"{u}->{v}" for u, v in plain.links)
    ops = [i for i, e in plain.elements.items() if e.kind == "op"]
    x = node_x(svg)
    assert x[ops[0]] < x[ops[-1]]  # the first op in the left column, the last in the right
    # a wide per-rank overview turns left to right; a layer keeps its arrangement on demand
    rank = render_view(rank_debug, decide(rank_debug, Policy("default")), "overview")
    turned = arrange(rank, 1.6)
    assert turned.arrangement == "LR"
    assert fit_scale(drawn_size(turned.dot), panel) > GAIN * fit_scale(drawn_size(rank.dot), panel)
    assert render_view(four_layers, decisions, "layer:1", arrangement="TB/3").arrangement == "TB/3"
    fitting = render_view(four_layers, decisions, "overview", aspect=1.6)
    assert fitting.arrangement == "TB"  # already fills the panel: left as it is


def test_a_panel_of_known_width_shows_the_most_of_a_picture_legibly(
    four_layers: JointGraph, rank_debug: JointGraph
) -> None:
    """Where no arrangement fits whole with labels legible, the one the panel shows the most
    of wins: never one cut at the right while the panel's bottom stays empty when another
    fills it. Every candidate is compared as the front end fits it (`on_screen`)."""
    cases = [
        (render_view(rank_debug, decide(rank_debug, Policy("default")), "overview"), 0.8),
        (render_view(four_layers, decide(four_layers, Policy("default")), "layer:0"), 1.1),
        (render_view(four_layers, None, "overview"), 1.6),
    ]
    for view, aspect in cases:
        for width in (300, 700, 1400):
            panel = (width, width / aspect)
            chosen = arrange(view, aspect, width)
            shown = on_screen(drawn_size(chosen.dot), panel, 0.9)
            others = ["TB", "LR", *(f"TB/{k}" for k in (2, 3, 4) if view.drawing)]
            for name in others:
                other = on_screen(drawn_size(laid_out(view, name).dot), panel, 0.9)
                assert round(shown[0], 3) >= round(other[0], 3), (view.nodes, width, name)
    assert on_screen((2000, 100), (500, 500), 0.9) == (500 / 1800, 0.9)  # cut, legible
    # the front end fits pictures with the same limits (explorer.js' constants)
    script = (Path(render_module.__file__).parents[1] / "widgets" / "explorer.js").read_text()
    for name, value in (("LEGIBLE_PX", LEGIBLE_PX), ("MAX_SCALE", MAX_SCALE)):
        assert f"const {name} = {value};" in script


def test_pictures_written_as_images_do_not_say_hover(
    two_layers: JointGraph, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import graphviz

    view = expand(two_layers, decide(two_layers, Policy("default")), "layer:0")
    assert "hover for node name" in html.unescape(view.svg())  # an SVG has its tooltips
    drawn: list[str] = []
    pipe = graphviz.Digraph.pipe

    def spy(self: graphviz.Digraph, *args: object, **kwargs: object) -> object:
        drawn.append(self.source)
        return pipe(self, *args, **kwargs)

    monkeypatch.setattr(graphviz.Digraph, "pipe", spy)
    for suffix in ("png", "pdf", "svg"):
        view.write(tmp_path / f"layer.{suffix}")
    png, pdf, svg = (html.unescape(source) for source in drawn)
    assert "hover" not in png and "hover" not in pdf and "hover for node name" in svg
    assert "box: op · output shape and dtype · output size" in png


def test_arrangements_refuse_what_they_cannot_draw(four_layers: JointGraph) -> None:
    overview_view = render_view(four_layers, None, "overview")
    with pytest.raises(WorkbenchError, match="wraps an op view's ranks; the overview is"):
        laid_out(overview_view, "TB/2")
    with pytest.raises(WorkbenchError, match="unknown arrangement 'BT'; choose one of TB, LR"):
        laid_out(overview_view, "BT")
    for aspect in (0.0, -1.0, float("nan")):
        with pytest.raises(WorkbenchError, match="panel aspect "):
            arrange(overview_view, aspect)


def test_around_names_an_element_and_its_drawn_neighbours(two_layers: JointGraph) -> None:
    view = expand(two_layers, decide(two_layers, Policy("default")), "layer:0")
    mm = next(
        n
        for n in two_layers.gm.graph.nodes
        if n.op == "call_function"
        and two_layers.nodes[n.name].layer == 0
        and two_layers.nodes[n.name].op == "aten.mm.default"
    )
    near = set(view.around(svg_id("n", mm.name)))
    drawn = {svg_id("n", n.name) for n in (*mm.all_input_nodes, *mm.users)} & set(view.elements)
    assert drawn and drawn | {svg_id("n", mm.name)} <= near
    assert all(
        (a, b) in view.links or (b, a) in view.links
        for a in near - {svg_id("n", mm.name)}
        for b in [svg_id("n", mm.name)]
    )


def test_legend_rows_come_from_the_renders_colour_table(two_layers: JointGraph) -> None:
    """Every shade a view can show is a legend row, as the static render explains it."""
    decisions = decide(two_layers, mixed_policy())
    view = expand(two_layers, decisions, "layer:0")
    colours = {colour.upper() for colour, _ in view.legend_rows}
    for kind in (*DECISION_KINDS, "offload", "backward"):
        colour, words = KIND_STYLE[kind][0]["fillcolor"], KIND_STYLE[kind][1]
        assert (colour, words) in view.legend_rows
        assert f"{words}" in html.unescape(view.svg())  # the static legend says the same
    assert {VERMILLION, BLUE, PURPLE} <= colours  # MUST_RECOMPUTE, MUST_SAVE, forced
    fills = {fill_of(g) for i, g in svg_nodes(view.svg()).items() if i.startswith("n-")}
    assert fills <= colours  # nothing drawn in a shade the legend leaves out
    boxes = render_overview(two_layers, decisions)
    assert [c for c, _ in boxes.legend_rows] == [SKY, ORANGE]


def test_a_diff_is_cropped_to_its_changed_ops_and_their_neighbours(
    two_layers: JointGraph,
) -> None:
    before = decide(two_layers, Policy("default"))
    after = decide(two_layers, mixed_policy())
    changed = diff(two_layers, before, after, ("default", "mixed"))
    whole = changed.render(two_layers, "layer:0")
    cropped = changed.render(two_layers, "layer:0", context=1)
    layer = {e.name for e in whole.elements.values() if e.kind == "op"}
    shown = {e.name for e in cropped.elements.values() if e.kind == "op"}
    rows = {r.node for r in changed.rows} & layer
    assert rows and rows <= shown < layer
    nodes = {n.name: n for n in two_layers.gm.graph.nodes}
    for name in shown - rows:  # every other op drawn is one edge from a changed one
        assert {m.name for m in (*nodes[name].all_input_nodes, *nodes[name].users)} & rows
    for name in layer - shown:  # and every op one edge from a changed one is drawn
        assert not {m.name for m in (*nodes[name].all_input_nodes, *nodes[name].users)} & rows
    assert near_changes(two_layers, sorted(layer), rows, 0) == sorted(rows)
    assert cropped.svg().count("changed: ") == whole.svg().count("changed: ")
    title = html.unescape(cropped.dot.graph_attr["label"])
    assert f"{len(shown)} of {len(layer)} drawn" in title
    with pytest.raises(WorkbenchError, match="crops a layer or module view, not the overview"):
        changed.render(two_layers, context=1)
    with pytest.raises(WorkbenchError, match="context must be 0 or more hops"):
        changed.render(two_layers, "layer:0", context=-1)
    with pytest.raises(WorkbenchError, match="no op changed in module norm; changes are in"):
        changed.render(two_layers, "module:norm", context=1)
