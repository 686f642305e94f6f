// Policy explorer front end: draws the Python state and forwards clicks as messages.
// All decisions, estimates and history live in Python; here only drawing, zoom and pan.
// Every figure arrives as text from Python (workbench.units): nothing is formatted here.

const h = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
};

const SVG_NS = "http://www.w3.org/2000/svg";
const s = (tag, attrs = {}, text = null) => {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
};

// A scatter of peak memory against step time; `plot` (from Python) gives its title, axis
// ranges and labelled ticks. Marks are circles (estimates) or squares (measured); clicking
// one restores its policy.
function scatterPlot(points, plot, current, onPick) {
  const W = 320, H = 206, L = 58, B = 34, T = 22, R = 10;
  const svg = s("svg", { width: W, height: H, class: "sacwb-scatter" });
  const { x, y } = plot;
  const X = (v) => L + ((v - x.lo) / (x.hi - x.lo)) * (W - L - R);
  const Y = (v) => H - B - ((v - y.lo) / (y.hi - y.lo)) * (H - B - T);
  svg.append(s("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "sacwb-axis" }),
    s("line", { x1: L, y1: T, x2: L, y2: H - B, class: "sacwb-axis" }));
  for (const [v, text] of x.ticks) {
    svg.append(s("line", { x1: X(v), y1: H - B, x2: X(v), y2: H - B + 4, class: "sacwb-axis" }),
      s("text", { x: X(v), y: H - B + 14, "text-anchor": "middle", class: "sacwb-tick-x" }, text));
  }
  for (const [v, text] of y.ticks) {
    svg.append(s("line", { x1: L - 4, y1: Y(v), x2: L, y2: Y(v), class: "sacwb-axis" }),
      s("text", { x: L - 6, y: Y(v) + 3, "text-anchor": "end", class: "sacwb-tick-y" }, text));
  }
  // the y axis' title sits above it, where no tick label reaches
  svg.append(s("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "sacwb-axis-label" }, plot.x_label),
    s("text", { x: 4, y: 10, "text-anchor": "start", class: "sacwb-axis-label sacwb-axis-label-y" }, "peak memory ↑"));
  const front = points.filter((p) => p.pareto).sort((a, b) => a.step_seconds - b.step_seconds);
  if (front.length > 1) {
    svg.append(s("polyline", { points: front.map((p) => `${X(p.step_seconds)},${Y(p.peak_bytes)}`).join(" "),
      class: "sacwb-front" }));
  }
  for (const p of points) {
    const cls = `sacwb-point${p.pareto ? " pareto" : ""}${p.measured ? " measured" : ""}${JSON.stringify(p.policy) === current ? " current" : ""}`;
    const mark = p.measured
      ? s("rect", { class: cls, x: X(p.step_seconds) - 5, y: Y(p.peak_bytes) - 5, width: 10, height: 10 })
      : s("circle", { class: cls, cx: X(p.step_seconds), cy: Y(p.peak_bytes), r: 5 });
    mark.append(s("title", {}, `${p.name}: ${p.peak}, ${p.step}${p.measured ? ` measured on ${p.profile}` : ""}`));
    mark.addEventListener("click", () => onPick(p.index));
    svg.append(mark);
  }
  return h("div", { class: "sacwb-plot" }, h("div", { class: "sacwb-subtitle" }, plot.title), svg);
}

function render({ model, el }) {
  const send = (msg) => model.send(msg);
  el.classList.add("sacwb");

  // --- toolbar -----------------------------------------------------------------------
  const preset = h("select", { class: "sacwb-preset", title: "preset: what every op gets unless a selector or override says otherwise",
    onchange: () => send({ type: "preset", name: preset.value }) });
  const profile = h("select", { class: "sacwb-profile", title: "device profile for the time estimate",
    onchange: () => { model.set("profile", profile.value); model.save_changes(); } });
  const allLayers = h("input", { type: "checkbox", class: "sacwb-all-layers",
    onchange: () => { model.set("all_layers", allLayers.checked); model.save_changes(); } });
  const reshard = h("input", { type: "checkbox", class: "sacwb-fsdp-reshard",
    onchange: () => send({ type: "fsdp", reshard: reshard.checked }) });
  const reshardLabel = h("label", { class: "sacwb-fsdp", title: "FSDP: redo each parameter's all-gather in backward (checked) or keep the gathered weights from forward to backward" },
    reshard, " reshard after forward");
  const button = (label, type, title) =>
    h("button", { class: `sacwb-${type}`, title, onclick: () => send({ type }) }, label);
  const undo = button("↶ Undo", "undo", "undo the last change");
  const redo = button("↷ Redo", "redo", "redo");
  const reset = button("Reset", "reset", "drop every edit, keep the preset");
  const overview = h("button", { class: "sacwb-overview", title: "back to the module overview",
    onclick: () => send({ type: "show", view: "overview" }) }, "⌂ Overview");
  const peakButton = button("▲ Go to peak", "peak", "open the view where the estimated peak happens");
  const run = h("button", { class: "sacwb-run", title: "remat with torch's pass and measure for real",
    onclick: () => send({ type: "run" }) }, "▶ Run");
  const searchBox = h("input", { type: "search", class: "sacwb-search", size: 18,
    placeholder: "find: mm_4, mm, wo…", title: "node name, op or module; Enter again for the next match",
    onkeydown: (e) => { if (e.key === "Enter") send({ type: "search", query: searchBox.value }); } });
  const searchGo = h("button", { class: "sacwb-search-go", onclick: () => send({ type: "search", query: searchBox.value }) }, "Find");
  const toolbar = h("div", { class: "sacwb-toolbar" },
    h("label", {}, "Preset ", preset),
    h("label", { title: "a click flips the op in every identical layer" }, allLayers, " apply to all identical layers"),
    reshardLabel,
    h("label", {}, "Profile ", profile), undo, redo, reset, overview, searchBox, searchGo, peakButton, run);

  const message = h("div", { class: "sacwb-message" });
  const status = h("div", { class: "sacwb-status" });

  // --- graph with zoom and pan -------------------------------------------------------
  const legend = h("div", { class: "sacwb-legend" });
  const graph = h("div", { class: "sacwb-graph" });
  const zoomBy = (factor, cx = 0.5, cy = 0.5) => {
    const v = view.box; if (!v) return;
    const w = v[2] * factor, hgt = v[3] * factor;
    setBox([v[0] + (v[2] - w) * cx, v[1] + (v[3] - hgt) * cy, w, hgt]);
  };
  const zoomIn = h("button", { class: "sacwb-zoom-in", title: "zoom in (or scroll over the graph)", onclick: () => zoomBy(0.7) }, "+");
  const zoomOut = h("button", { class: "sacwb-zoom-out", title: "zoom out", onclick: () => zoomBy(1 / 0.7) }, "−");
  const fit = h("button", { class: "sacwb-fit", title: "fit the whole picture, as far as its labels stay legible", onclick: () => fitView() }, "Fit");
  const graphTools = h("div", { class: "sacwb-graph-tools" }, zoomIn, zoomOut, fit,
    h("span", { class: "sacwb-hint" }, " drag to pan · scroll to zoom · click a box to open it, an op to flip it (shift-click selects)"));
  const view = { full: null, box: null, name: null, focused: 0 };
  const setBox = (box) => {
    view.box = box;
    graph.querySelector("svg")?.setAttribute("viewBox", box.join(" "));
  };
  // Labels never shrink below LEGIBLE_PX when the view is fitted or focused (the picture
  // is panned instead), nor grow past MAX_SCALE times their size.
  const LEGIBLE_PX = 9, MAX_SCALE = 1.5;
  const panel = () => [graph.clientWidth || 800, graph.clientHeight || 600];
  const minScale = () => {
    const sizes = [...graph.querySelectorAll("g.node text")].map((t) => Number(t.getAttribute("font-size")) || 0).filter((f) => f > 0);
    return LEGIBLE_PX / (sizes.length ? Math.min(...sizes) : 10);
  };
  // pixels per picture unit that show the box [x, y, w, h] whole
  const fitting = (b) => { const [gw, gh] = panel(); return Math.min(gw / b[2], gh / b[3]); };
  // show the picture at `scale` around the point (cx, cy), never past its edges where it fits
  const showAt = (scale, cx, cy) => {
    const [gw, gh] = panel(), [x, y, w, h] = view.full;
    const bw = gw / scale, bh = gh / scale;
    const along = (c, lo, size, span) => (span >= size ? lo + (size - span) / 2 : Math.min(Math.max(c - span / 2, lo), lo + size - span));
    setBox([along(cx, x, w, bw), along(cy, y, h, bh), bw, bh]);
  };
  // Fit: the whole picture, or where it is too big to read whole, its top left at a
  // legible scale (drag to see the rest)
  const fitView = () => {
    if (!view.full) return;
    const [x, y, w, h] = view.full, whole = fitting(view.full);
    const scale = Math.max(Math.min(whole, MAX_SCALE), minScale());
    const [gw, gh] = panel();
    showAt(scale, x + Math.min(w, gw / scale) / 2, y + Math.min(h, gh / scale) / 2);
  };
  // the box of drawn elements, in picture units
  const boxOf = (ids) => {
    const svg = graph.querySelector("svg"), ctm = svg?.getScreenCTM();
    if (!ctm) return null;
    const inverse = ctm.inverse();
    let box = null;
    for (const id of ids) {
      const r = svg.querySelector(`#${CSS.escape(id)}`)?.getBoundingClientRect();
      if (!r || (!r.width && !r.height)) continue;
      const a = new DOMPoint(r.left, r.top).matrixTransform(inverse), b = new DOMPoint(r.right, r.bottom).matrixTransform(inverse);
      box = box ? [Math.min(box[0], a.x), Math.min(box[1], a.y), Math.max(box[2], b.x), Math.max(box[3], b.y)] : [a.x, a.y, b.x, b.y];
    }
    return box && [box[0], box[1], box[2] - box[0], box[3] - box[1]];
  };
  // Focus (search, Go to peak): the element and its neighbours (`focus.ids`) whole and
  // legible; the whole picture when it is legible whole
  const applyFocus = () => {
    const focus = model.get("focus");
    if (!focus?.id || focus.serial === view.focused || view.name !== model.get("view") || !view.full) return;
    const target = boxOf([focus.id]);
    if (!target) return;
    view.focused = focus.serial;
    if (fitting(view.full) >= minScale()) { fitView(); return; }
    const near = boxOf(focus.ids?.length ? focus.ids : [focus.id]) || target;
    const scale = Math.min(Math.max(fitting(near), minScale()), MAX_SCALE);
    const [gw, gh] = panel();
    const fits = near[2] <= gw / scale && near[3] <= gh / scale;
    const c = fits ? near : target;
    showAt(scale, c[0] + c[2] / 2, c[1] + c[3] / 2);
  };
  // the panel's width / height goes to Python, which arranges views to fill it
  const sendAspect = () => {
    const [gw, gh] = [graph.clientWidth, graph.clientHeight];
    if (!gw || !gh) return;
    const aspect = Math.round((gw / gh) * 10) / 10;
    if (Math.abs(aspect - model.get("graph_aspect")) > 0.05) { model.set("graph_aspect", aspect); model.save_changes(); }
  };
  let resizing = null;
  new ResizeObserver(() => { clearTimeout(resizing); resizing = setTimeout(sendAspect, 200); }).observe(graph);
  let drag = null, dragged = false;
  graph.addEventListener("mousedown", (e) => { if (view.box) { drag = { x: e.clientX, y: e.clientY, box: [...view.box] }; dragged = false; } });
  window.addEventListener("mouseup", () => { drag = null; });
  graph.addEventListener("mousemove", (e) => {
    if (!drag) return;
    const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 4) dragged = true;
    if (!dragged) return;
    const scale = drag.box[2] / (graph.clientWidth || 1), scaleY = drag.box[3] / (graph.clientHeight || 1);
    const k = Math.max(scale, scaleY);
    setBox([drag.box[0] - dx * k, drag.box[1] - dy * k, drag.box[2], drag.box[3]]);
  });
  graph.addEventListener("wheel", (e) => {
    if (!view.box) return;
    e.preventDefault();
    const r = graph.getBoundingClientRect();
    zoomBy(e.deltaY < 0 ? 0.85 : 1 / 0.85, (e.clientX - r.left) / r.width, (e.clientY - r.top) / r.height);
  }, { passive: false });
  graph.addEventListener("click", (event) => {
    if (dragged) { dragged = false; return; }
    const target = event.target.closest("g.node, g.cluster");
    if (!target || !target.id) return;
    send({ type: "click", id: target.id, shift: event.shiftKey });
  });

  // --- side panel --------------------------------------------------------------------
  const metrics = h("div", { class: "sacwb-metrics" });
  const timeline = h("div", { class: "sacwb-timeline" });
  const details = h("div", { class: "sacwb-details" });
  const policyRows = h("div", { class: "sacwb-policy" });
  const moduleSel = h("select", { class: "sacwb-switch-module" });
  const opSel = h("select", { class: "sacwb-switch-op" });
  const actionSelect = (cls, value, onchange) => {
    const sel = h("select", { class: cls, onchange: onchange ? () => onchange(sel.value) : null },
      h("option", { value: "save" }, "save"), h("option", { value: "recompute" }, "recompute"),
      h("option", { value: "offload" }, "offload"));
    if (value) sel.value = value;
    return sel;
  };
  const actionSel = actionSelect("sacwb-switch-action");
  const selectorText = h("input", { type: "text", class: "sacwb-selector-text", size: 30,
    placeholder: "layers.*.attention.wo::aten.mm.default" });
  const selectorAction = actionSelect("sacwb-selector-action");
  const number = (cls, placeholder, value, width) => h("input", { type: "number", min: 0, class: cls, placeholder, value, style: `width: ${width}` });
  const offloadBudget = number("sacwb-offload-budget", "no limit", undefined, "8em");
  const offloadPrefetch = number("sacwb-offload-prefetch", "1", 1, "3em");
  const offloadDefer = number("sacwb-offload-defer", "0", 0, "3em");
  const offloadRow = h("div", { class: "sacwb-offload", title: "host budget in bytes (empty: no limit); reload N layers early; free the device copy M layers late" },
    "offload: budget ", offloadBudget, " prefetch ", offloadPrefetch, " defer ", offloadDefer, " ",
    h("button", { class: "sacwb-offload-set", onclick: () => send({ type: "offload",
      budget_bytes: offloadBudget.value === "" ? null : Number(offloadBudget.value),
      prefetch_layers: Number(offloadPrefetch.value || 1), defer_layers: Number(offloadDefer.value || 0) }) }, "Set"));
  const switches = h("div", { class: "sacwb-switches" },
    h("div", { class: "sacwb-title" }, "Add a selector or an op-type switch"),
    h("div", {}, selectorAction, " ", selectorText, " ",
      h("button", { class: "sacwb-selector-add", title: "MODULE_PATTERN::OP_OVERLOAD; ** spans modules",
        onclick: () => send({ type: "selector", select: selectorText.value, action: selectorAction.value }) }, "Add")),
    h("div", {}, actionSel, " every ", opSel, " in ", moduleSel, " ",
      h("button", { class: "sacwb-switch-apply", onclick: () => send({ type: "switch",
        module: moduleSel.value, op: opSel.value, action: actionSel.value }) }, "Apply")),
    offloadRow);
  const scatter = h("div", { class: "sacwb-history" });
  const budgetText = h("span", { class: "sacwb-budget-text" });
  // the slider walks Python's stops (bytes and their text); Suggest sends the bytes
  const stop = () => {
    const range = model.get("budget_range"), i = Number(budget.value);
    return { bytes: range.stops?.[i], text: range.texts?.[i] ?? "" };
  };
  const budget = h("input", { type: "range", class: "sacwb-budget", min: 0, step: 1,
    oninput: () => { budget.dataset.touched = "1"; budgetText.textContent = stop().text; } });
  const budgetNote = h("div", { class: "sacwb-hint sacwb-budget-note" });
  const suggestGo = h("button", { class: "sacwb-suggest-go", title: "the solver's cheapest policy under this peak",
    onclick: () => send({ type: "suggest", budget: stop().bytes }) }, "Suggest");
  const sweep = h("button", { class: "sacwb-sweep", title: "add the solver's memory-vs-time front to the history",
    onclick: () => send({ type: "sweep" }) }, "Sweep front");
  const hostBudget = h("input", { type: "number", min: 0, step: 0.25, class: "sacwb-host-budget", style: "width: 5em",
    title: "host memory Suggest and Sweep may offload to, in GiB (0: no offload)",
    onchange: () => send({ type: "host_budget", bytes: Math.round(Math.max(0, Number(hostBudget.value || 0)) * 2 ** 30) }) });
  const suggester = h("div", { class: "sacwb-suggest" },
    h("div", { class: "sacwb-title" }, "Suggest a policy for a memory budget"),
    h("div", {}, budget, " ", budgetText, " ", suggestGo, " ", sweep),
    budgetNote,
    h("label", { class: "sacwb-host" }, "host budget ", hostBudget, " GiB (0: no offload)"));
  const exportFmt = h("select", { class: "sacwb-export-format",
    onchange: () => { model.set("export_format", exportFmt.value); model.save_changes(); } });
  const exportPath = h("input", { type: "text", class: "sacwb-export-path", size: 30 });
  const code = h("pre", { class: "sacwb-code" });
  const copyNote = h("span", { class: "sacwb-copy-note" });
  const flash = (text) => { copyNote.textContent = text; setTimeout(() => { copyNote.textContent = ""; }, 2500); };
  const copyFallback = () => {
    const range = document.createRange(); range.selectNodeContents(code);
    const sel = window.getSelection(); sel.removeAllRanges(); sel.addRange(range);
    const ok = document.execCommand && document.execCommand("copy");
    flash(ok ? "copied ✓" : "selected: press Ctrl+C to copy");
  };
  const copy = h("button", { class: "sacwb-copy", onclick: () => {
    if (navigator.clipboard?.writeText) {
      navigator.clipboard.writeText(code.textContent).then(() => flash("copied ✓"), copyFallback);
    } else copyFallback();
  } }, "Copy");
  const save = h("button", { class: "sacwb-save", onclick: () => send({ type: "save_export", path: exportPath.value }) }, "Save");
  const exporter = h("div", { class: "sacwb-export" },
    h("div", { class: "sacwb-title" }, "Export"), h("div", {}, exportFmt, " ", exportPath, " ", save, " ", copy, " ", copyNote), code);
  const side = h("div", { class: "sacwb-side" }, metrics, timeline, details, policyRows, suggester, switches, scatter, exporter);

  // --- a pipelined job: the stages side by side (Python's SVG); a click opens one -----
  const strip = h("div", { class: "sacwb-stages", title: "click a stage to open its graph",
    onclick: (e) => {
      const cell = e.target.closest?.("[data-stage]");
      if (cell) send({ type: "stage", stage: Number(cell.dataset.stage) });
    } });
  const drawStages = () => {
    strip.innerHTML = model.get("stages_svg");
    strip.style.display = model.get("stages_svg") ? "" : "none";
  };

  el.append(strip, toolbar, message, status,
    h("div", { class: "sacwb-main" }, h("div", { class: "sacwb-left" }, legend, graphTools, graph), side));

  // --- drawing from state ------------------------------------------------------------
  const fill = (select, values, current, blank = "") => {
    select.replaceChildren(...values.map((v) => h("option", { value: v }, v || blank)));
    select.value = current;
  };

  const markGraph = () => {
    for (const node of graph.querySelectorAll(".sacwb-selected, .sacwb-peak-node")) node.classList.remove("sacwb-selected", "sacwb-peak-node");
    const chosen = model.get("selected_id");
    if (chosen) graph.querySelector(`#${CSS.escape(chosen)}`)?.classList.add("sacwb-selected");
    for (const id of model.get("peak_ids")) graph.querySelector(`#${CSS.escape(id)}`)?.classList.add("sacwb-peak-node");
  };

  const drawGraph = () => {
    let sameView = view.name === model.get("view");
    graph.innerHTML = model.get("svg");
    const svg = graph.querySelector("svg");
    if (svg) {
      const vb = (svg.getAttribute("viewBox") || "0 0 100 100").split(/[\s,]+/).map(Number);
      // the same view arranged anew (another panel aspect) is fitted again
      const shape = (b) => b[2] / b[3];
      if (view.full && Math.abs(Math.log(shape(vb) / shape(view.full))) > 0.1) sameView = false;
      view.full = vb;
      svg.removeAttribute("width"); svg.removeAttribute("height");
      svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
      if (sameView && view.box) setBox(view.box); else fitView();
    }
    view.name = model.get("view");
    markGraph();
    applyFocus();
  };

  const drawLegend = () => {
    const lg = model.get("legend");
    legend.replaceChildren(h("div", { class: "sacwb-title" }, lg.title ?? ""),
      ...(lg.lines ?? []).map((line) => h("div", { class: "sacwb-legend-line" }, line)),
      h("div", { class: "sacwb-legend-rows" }, ...(lg.rows ?? []).map(([colour, words]) =>
        h("span", { class: "sacwb-legend-row" }, h("span", { class: "sacwb-swatch", style: `background: ${colour}` }), words))));
  };

  const drawMetrics = () => {
    const m = model.get("metrics");
    metrics.replaceChildren(
      h("div", { class: "sacwb-title" }, "Estimate (what-if, exact)"),
      h("table", {},
        h("tr", {}, h("td", {}, "peak memory"), h("td", { class: "sacwb-peak" }, m.peak ?? "-")),
        h("tr", {}, h("td", {}, "host memory"), h("td", { class: "sacwb-host-peak" }, m.host_text ?? "-")),
        h("tr", {}, h("td", {}, "peak at"), h("td", { class: "sacwb-peak-at" }, m.peak_node ?? "-")),
        h("tr", {}, h("td", {}, "kept for backward"), h("td", { class: "sacwb-saved" }, m.saved ?? "-")),
        h("tr", {}, h("td", {}, "recompute"), h("td", {}, `${m.recompute ?? "-"} (${m.recomputed_nodes ?? 0} ops)`)),
        h("tr", {}, h("td", {}, `step on ${m.profile}`), h("td", {}, m.step ?? "-")),
        h("tr", {}, h("td", {}, "throughput"), h("td", {}, m.tokens_per_second_text ?? "-"))),
      h("div", { class: "sacwb-hint sacwb-peak-counts" }, `peak memory: ${m.peak_counts ?? "-"}`),
      h("div", { class: "sacwb-hint sacwb-time-basis" }, `step time: ${m.time_basis ?? "-"}`),
      drawBaselines());
  };

  // the eager baselines (no AC, eager SAC, full AC as eager runs them), once asked
  const drawBaselines = () => {
    const rows = model.get("baselines") ?? [];
    if (!rows.length) {
      return h("button", { class: "sacwb-baselines", onclick: () => send({ type: "baselines" }),
        title: "run no AC, eager SAC and eager full AC as eager runs them, under torch's memory trackers (once per graph)" },
        "Eager baselines");
    }
    return h("table", { class: "sacwb-baselines-table" },
      h("tr", {}, h("th", {}, "eager"), h("th", {}, "peak"), h("th", {}, "reserved"), h("th", {}, "at")),
      ...rows.map((r) => h("tr", { title: r.rule }, h("td", {}, r.name), h("td", {}, r.peak),
        h("td", {}, r.reserved), h("td", {}, r.at))));
  };

  const drawTimeline = () => {
    const t = model.get("timeline");
    const values = t.values ?? [];
    const placed = t.placed ?? {};
    const rows = Math.max(1, ...Object.values(placed).map((p) => p.row + 1));
    const W = t.width ?? 320, top = 10 * rows, H = 60 + top, pad = 2;
    const svg = s("svg", { width: W, height: H, class: "sacwb-timeline-plot" });
    if (values.length > 1 && t.max > 0) {
      const X = (f) => pad + f * (W - 2 * pad), Y = (v) => H - pad - (v / t.max) * (H - 2 * pad - top);
      const pts = values.map((v, i) => `${X(i / (values.length - 1))},${Y(v)}`);
      svg.append(s("polygon", { points: `${X(0)},${H - pad} ${pts.join(" ")} ${X(1)},${H - pad}`, class: "sacwb-timeline-area" }));
      const measured = t.measured ?? [];  // a loaded memory snapshot's line (`load_snapshot`)
      if (measured.length > 1) {
        const line = measured.map((v, i) => `${X(i / (measured.length - 1))},${Y(v)}`);
        svg.append(s("polyline", { points: line.join(" "), class: "sacwb-timeline-measured" }));
      }
      const marks = t.marks ?? {}, labels = t.labels ?? {};
      for (const [kind, f] of Object.entries(marks)) {
        const cls = kind === "peak" ? "sacwb-mark-peak" : "sacwb-mark-selected";
        const { row = 0, anchor = "start" } = placed[kind] ?? {};
        svg.append(s("line", { x1: X(f), x2: X(f), y1: 10 * row + 1, y2: H - pad, class: cls }));
        svg.append(s("text", { x: X(f) + (anchor === "start" ? 2 : -2), y: 10 * row + 9, "text-anchor": anchor,
          class: `${cls} sacwb-mark-label` }, labels[kind] ?? kind));
      }
    }
    const key = t.measured_label ? h("div", { class: "sacwb-hint sacwb-timeline-key" }, `line: ${t.measured_label}`) : "";
    timeline.replaceChildren(h("div", { class: "sacwb-subtitle" }, `live memory over the step (${t.steps ?? 0} ops)`), svg, key);
  };

  const drawDetails = () => {
    const d = model.get("details");
    if (!d || !d.name) {
      details.replaceChildren(h("div", { class: "sacwb-title" }, "Selected op"), h("div", {}, "none: click an op or search"));
      return;
    }
    const row = (k, v) => h("tr", {}, h("td", {}, k), h("td", {}, v));
    details.replaceChildren(
      h("div", { class: "sacwb-title" }, `Selected: ${d.name}`),
      h("table", {}, row("op", d.op), row("module", d.module), row("layer", d.layer ?? "-"),
        row("shape", `${d.shape} ${d.dtype}`), row("size", d.bytes), row("FLOPs", d.flops),
        row("decision", `${d.action} (${d.decision})${d.can_flip ? "" : " (cannot flip)"}`), row("why", d.reason),
        row("offload", d.offload ?? "-"),
        row("preset says", d.preset_decision),
        row("read by backward", d.backward_consumers.length ? d.backward_consumers.join(", ") : "no"),
        row("source", d.source)));
  };

  const drawPolicy = () => {
    const policy = model.get("policy_json");
    const remove = (msg, what) => h("button", { class: "sacwb-remove", title: `remove this ${what}`, onclick: () => send(msg) }, "✕");
    const rows = [h("tr", { class: "sacwb-row-preset" }, h("td", {}, "preset"), h("td", {}, policy.preset ?? "-"), h("td", {}))];
    (policy.selectors ?? []).forEach((sel, i) => rows.push(h("tr", { class: "sacwb-row-selector" },
      h("td", {}, actionSelect("sacwb-row-action", sel.action, (a) => send({ type: "edit_selector", index: i, action: a }))),
      h("td", { class: "sacwb-key" }, sel.select), h("td", {}, remove({ type: "remove_selector", index: i }, "selector")))));
    for (const [key, action] of Object.entries(policy.overrides ?? {})) {
      rows.push(h("tr", { class: "sacwb-row-override" },
        h("td", {}, actionSelect("sacwb-row-action", action, (a) => send({ type: "override", key, action: a }))),
        h("td", { class: "sacwb-key" }, key), h("td", {}, remove({ type: "override", key }, "override"))));
    }
    const offload = model.get("offload_text");
    if (offload) rows.push(h("tr", { class: "sacwb-row-offload" }, h("td", {}, "offload"), h("td", {}, offload), h("td", {})));
    const count = (policy.selectors ?? []).length + Object.keys(policy.overrides ?? {}).length;
    policyRows.replaceChildren(
      h("div", { class: "sacwb-title" }, `Policy: preset ${policy.preset}, ${(policy.selectors ?? []).length} selectors, ${Object.keys(policy.overrides ?? {}).length} overrides`),
      h("div", { class: "sacwb-hint" }, count ? "later rows win; overrides win over selectors" : "no edits yet: click ops, add selectors or Suggest"),
      h("table", { class: "sacwb-policy-rows" }, rows));
  };

  const drawHistory = () => {
    const points = model.get("history");
    const current = JSON.stringify(model.get("policy_json"));
    const pick = (index) => send({ type: "restore", index });
    const parts = [h("div", { class: "sacwb-title" }, "History: peak memory vs step time"),
      h("div", { class: "sacwb-hint" }, "● estimate  ■ measured  - - Pareto front; click a point to restore it")];
    for (const plot of model.get("history_plots")) {
      parts.push(scatterPlot(points.filter((p) => p.measured === plot.measured), plot, current, pick));
    }
    scatter.replaceChildren(...parts);
  };

  const drawControls = () => {
    fill(preset, model.get("presets"), model.get("policy_json").preset);
    fill(profile, model.get("profiles"), model.get("profile"));
    fill(exportFmt, model.get("export_formats"), model.get("export_format"));
    fill(moduleSel, model.get("modules"), moduleSel.value || model.get("modules")[0], "(anywhere)");
    fill(opSel, model.get("ops"), opSel.value || "aten.mm.default");
    allLayers.checked = model.get("all_layers");
    reshard.checked = model.get("fsdp_reshard");
    reshardLabel.style.display = model.get("has_fsdp") ? "" : "none";
    undo.disabled = !model.get("can_undo");
    redo.disabled = !model.get("can_redo");
    const busy = model.get("running");
    run.disabled = busy; suggestGo.disabled = busy; sweep.disabled = busy;
    exportPath.value = model.get("export_path");
    code.textContent = model.get("export_code");
    message.textContent = model.get("message");
    // busy: a pulsing dot (a glyph DejaVu Sans has; tests/test_explorer_panel.py checks)
    status.classList.toggle("sacwb-busy", busy);
    status.textContent = busy ? `● ${model.get("status")}` : model.get("status");
  };

  const drawBudget = () => {
    if (document.activeElement !== hostBudget) hostBudget.value = model.get("suggest_host_budget_bytes") / 2 ** 30;
    const stops = model.get("budget_range").stops ?? [];
    if (!stops.length) return;
    budget.max = stops.length - 1;
    if (!budget.dataset.touched) {
      // the stop nearest the current peak
      const peak = model.get("metrics").peak_bytes ?? stops[stops.length - 1];
      const nearest = stops.reduce((best, b, i) => (Math.abs(b - peak) < Math.abs(stops[best] - peak) ? i : best), 0);
      budget.value = nearest;
    }
    budgetText.textContent = stop().text;
    budgetNote.textContent = model.get("budget_range").note ?? "";
  };

  const drawAll = () => {
    drawStages(); drawBudget(); drawControls(); drawLegend(); drawGraph(); drawMetrics(); drawTimeline(); drawDetails(); drawPolicy(); drawHistory(); };
  drawAll();
  model.on("change:svg", drawGraph);
  model.on("change:stages_svg", drawStages);
  for (const name of ["selected_id", "peak_ids"]) model.on(`change:${name}`, markGraph);
  model.on("change:focus", applyFocus);
  model.on("change:legend", drawLegend);
  model.on("change:metrics", () => { drawMetrics(); drawBudget(); });
  model.on("change:baselines", drawMetrics);
  model.on("change:timeline", drawTimeline);
  model.on("change:details", drawDetails);
  model.on("change:policy_json", () => { drawPolicy(); drawControls(); drawHistory(); });
  model.on("change:offload_text", drawPolicy);
  model.on("change:history", drawHistory);
  model.on("change:history_plots", drawHistory);
  model.on("change:budget_range", drawBudget);
  model.on("change:suggest_host_budget_bytes", drawBudget);
  for (const name of ["message", "status", "running", "can_undo", "can_redo", "export_code", "export_format", "profile", "all_layers", "export_path", "fsdp_reshard", "has_fsdp"]) {
    model.on(`change:${name}`, drawControls);
  }
}

export default { render };
