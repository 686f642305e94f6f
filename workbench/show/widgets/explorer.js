// Policy explorer front end: draws the Python state and sends clicks to Python as requests.
// All decisions, estimates and history live in Python; here only drawing, zoom and pan.
// Every figure arrives as text from Python (workbench.units): nothing is formatted here.
//
// `render` builds the panels, each a small function that returns its element and what it
// draws when which traitlets change; every listener goes through one `Scope` per view, and
// the cleanup `render` returns removes them all (window listeners, the resize observer,
// every `model.on`, pending timers and requests) and empties the view, whose elements take
// their own listeners with them.

// --- listeners: one scope per view, removed together ---------------------------------------

// What the live views on this page hold, by kind (the browser test reads it to check that a
// removed view leaves nothing behind: tests/test_browser.py).
globalThis.__sacwbListeners ??= { views: 0, window: 0, document: 0, observers: 0, model: 0 };
const LIVE = globalThis.__sacwbListeners;

// The page-wide kind of an event target, counted in LIVE ("" for elements inside the view).
function targetKind(target) {
  if (target === window) return "window";
  if (target === document) return "document";
  return "";
}

// Everything one view listens to: DOM listeners (on one AbortSignal), model handlers,
// resize observers and timers, each removed by `dispose`.
function createScope(model) {
  const controller = new AbortController();
  const handlers = [];
  const observers = [];
  const timers = new Set();
  const held = { window: 0, document: 0 };
  LIVE.views += 1;
  return {
    signal: controller.signal,
    on(event, callback) {
      model.on(event, callback);
      handlers.push([event, callback]);
      LIVE.model += 1;
    },
    listen(target, type, callback, options = {}) {
      target.addEventListener(type, callback, { ...options, signal: controller.signal });
      const kind = targetKind(target);
      if (kind) {
        held[kind] += 1;
        LIVE[kind] += 1;
      }
    },
    observe(element, callback) {
      const observer = new ResizeObserver(callback);
      observer.observe(element);
      observers.push(observer);
      LIVE.observers += 1;
    },
    later(callback, ms) {
      const id = setTimeout(() => {
        timers.delete(id);
        callback();
      }, ms);
      timers.add(id);
      return id;
    },
    cancel(id) {
      clearTimeout(id);
      timers.delete(id);
    },
    dispose() {
      if (controller.signal.aborted) return;
      controller.abort();
      for (const [event, callback] of handlers) model.off(event, callback);
      for (const observer of observers) observer.disconnect();
      for (const id of timers) clearTimeout(id);
      LIVE.views -= 1;
      LIVE.model -= handlers.length;
      LIVE.observers -= observers.length;
      LIVE.window -= held.window;
      LIVE.document -= held.document;
      handlers.length = 0;
      observers.length = 0;
      timers.clear();
    },
  };
}

// Requests to Python (`PolicyExplorer.act`): anywidget's `invoke`, answered when the action is
// done, given up when the view goes away; a plain message where a front end has no `invoke`.
function requester(model, experimental, scope) {
  if (typeof experimental?.invoke !== "function") return (request) => model.send(request);
  return (request) => {
    const pending = new AbortController();
    const stop = () => pending.abort();
    scope.signal.addEventListener("abort", stop, { once: true });
    experimental
      .invoke("act", request, { signal: pending.signal })
      .catch((error) => {
        if (!pending.signal.aborted) console.warn("[sacwb]", request.type, error);
      })
      .finally(() => scope.signal.removeEventListener("abort", stop));
  };
}

// --- elements --------------------------------------------------------------------------------

// `h(tag, attrs, ...children)`: an element; `on…` attributes are its listeners, which go
// with it (a redrawn panel drops its old elements, the cleanup empties the view)
function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key.startsWith("on")) {
      if (value) node.addEventListener(key.slice(2), value);
    } else if (value !== undefined && value !== null) {
      node.setAttribute(key, value);
    }
  }
  for (const child of children.flat()) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";

function s(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

// A select's options, and its value
function fill(select, values, current, blank = "") {
  select.replaceChildren(...values.map((v) => h("option", { value: v }, v || blank)));
  select.value = current;
}

// A select of the three actions, calling `onchange(action)` when one is picked
function actionSelect(cls, value, onchange) {
  const sel = h(
    "select",
    { class: cls, onchange: onchange ? () => onchange(sel.value) : null },
    h("option", { value: "save" }, "save"),
    h("option", { value: "recompute" }, "recompute"),
    h("option", { value: "offload" }, "offload"),
  );
  if (value) sel.value = value;
  return sel;
}

// What the tool bar, the message line and the other controls show: redrawn on any of these
const CONTROLS = [
  "message",
  "status",
  "running",
  "run_refusal",
  "can_undo",
  "can_redo",
  "export_code",
  "export_format",
  "profile",
  "all_layers",
  "export_path",
  "fsdp_reshard",
  "has_fsdp",
  "policy_json",
];

// --- the tool bar and the message lines ------------------------------------------------------

function toolbarPanel({ model, request, store }) {
  const button = (label, type, title) =>
    h("button", { class: `sacwb-${type}`, title, onclick: () => request({ type }) }, label);
  const preset = h("select", {
    class: "sacwb-preset",
    title: "preset: what every op gets unless a selector or override says otherwise",
    onchange: () => request({ type: "preset", name: preset.value }),
  });
  const profile = h("select", {
    class: "sacwb-profile",
    title: "device profile of the time estimate",
    onchange: () => store("profile", profile.value),
  });
  const allLayers = h("input", {
    type: "checkbox",
    class: "sacwb-all-layers",
    onchange: () => store("all_layers", allLayers.checked),
  });
  const reshard = h("input", {
    type: "checkbox",
    class: "sacwb-fsdp-reshard",
    onchange: () => request({ type: "fsdp", reshard: reshard.checked }),
  });
  const reshardLabel = h(
    "label",
    {
      class: "sacwb-fsdp",
      title:
        "FSDP reshard after forward: redo each parameter's all-gather in backward (checked) or keep the gathered weights from forward to backward",
    },
    reshard,
    " FSDP reshard",
  );
  const undo = button("↶", "undo", "undo the last change");
  const redo = button("↷", "redo", "redo the change undone");
  const run = h("button", { class: "sacwb-run", onclick: () => request({ type: "run" }) }, "▶ Run");
  const element = h(
    "div",
    { class: "sacwb-toolbar" },
    h("label", {}, "Preset ", preset),
    h(
      "label",
      { title: "apply to all identical layers: a click flips the op in every one of them" },
      allLayers,
      " all layers",
    ),
    reshardLabel,
    profile,
    undo,
    redo,
    button("Reset", "reset", "drop every edit, keep the preset"),
    h(
      "button",
      {
        class: "sacwb-overview",
        title: "back to the module overview",
        onclick: () => request({ type: "show", view: "overview" }),
      },
      "⌂ Overview",
    ),
    ...searchBox(request),
    button("▲ Go to peak", "peak", "open the view where the estimated peak happens"),
    run,
  );
  const draw = () => {
    fill(preset, model.get("presets"), model.get("policy_json").preset);
    fill(profile, model.get("profiles"), model.get("profile"));
    allLayers.checked = model.get("all_layers");
    reshard.checked = model.get("fsdp_reshard");
    reshardLabel.style.display = model.get("has_fsdp") ? "" : "none";
    undo.disabled = !model.get("can_undo");
    redo.disabled = !model.get("can_redo");
    // a graph Run cannot measure (fake tensors): disabled, saying why
    const refusal = model.get("run_refusal");
    run.disabled = model.get("running") || Boolean(refusal);
    run.title = refusal || "remat with torch's pass and measure for real";
  };
  return { element, watch: [[CONTROLS, draw]] };
}

// The search box and its button: Enter again moves to the next match
function searchBox(request) {
  const find = () => request({ type: "search", query: box.value });
  const box = h("input", {
    type: "search",
    class: "sacwb-search",
    size: 12,
    placeholder: "find: mm_4, mm, wo…",
    title: "node name, op or module; Enter again for the next match",
    onkeydown: (e) => {
      if (e.key === "Enter") find();
    },
  });
  return [box, h("button", { class: "sacwb-search-go", onclick: find }, "Find")];
}

function messagePanel({ model }) {
  const message = h("div", { class: "sacwb-message" });
  const status = h("div", { class: "sacwb-status" });
  const draw = () => {
    const busy = model.get("running");
    message.textContent = model.get("message");
    // busy: a pulsing dot (a glyph DejaVu Sans has; tests/test_explorer_panel.py checks)
    status.classList.toggle("sacwb-busy", busy);
    status.textContent = busy ? `● ${model.get("status")}` : model.get("status");
  };
  return { elements: [message, status], watch: [[CONTROLS, draw]] };
}

// --- the picture: zoom, pan, fit and focus ---------------------------------------------------

// Labels never shrink below LEGIBLE_PX when the view is fitted or focused (the picture
// is panned instead), nor grow past MAX_SCALE times their size.
const LEGIBLE_PX = 9;
const MAX_SCALE = 1.5;
// The panel's width goes to Python in steps of this many pixels (no layout per pixel)
const PANEL_WIDTH_STEP = 50;

// Where in a span of `size` from `lo` a window of `span` centred near `c` goes: centred
// when the span is larger, else as near `c` as the span's edges allow
function along(c, lo, size, span) {
  if (span >= size) return lo + (size - span) / 2;
  return Math.min(Math.max(c - span / 2, lo), lo + size - span);
}

// The picture's viewport: the whole picture (`full`), the box shown, in picture units, the
// panel's size it was shown at, and whether it is fitted (not zoomed or panned since)
function createViewport(graph) {
  const view = { full: null, box: null, name: null, focused: 0, fitted: false, at: null };
  const panel = () => [graph.clientWidth || 800, graph.clientHeight || 600];
  const setBox = (box, fitted = false) => {
    view.box = box;
    view.fitted = fitted;
    view.at = panel();
    graph.querySelector("svg")?.setAttribute("viewBox", box.join(" "));
  };
  const minScale = () => {
    const sizes = [...graph.querySelectorAll("g.node text")]
      .map((t) => Number(t.getAttribute("font-size")) || 0)
      .filter((f) => f > 0);
    return LEGIBLE_PX / (sizes.length ? Math.min(...sizes) : 10);
  };
  // pixels per picture unit that show the box [x, y, w, h] whole
  const fitting = (b) => {
    const [gw, gh] = panel();
    return Math.min(gw / b[2], gh / b[3]);
  };
  // show the picture at `scale` around the point (cx, cy), never past its edges where it fits
  const showAt = (scale, cx, cy, fitted = false) => {
    const [gw, gh] = panel();
    const [x, y, w, ht] = view.full;
    const bw = gw / scale;
    const bh = gh / scale;
    setBox([along(cx, x, w, bw), along(cy, y, ht, bh), bw, bh], fitted);
  };
  // Fit: the whole picture, or where it is too big to read whole, its top left at a
  // legible scale (drag to see the rest)
  const fit = () => {
    if (!view.full) return;
    const [x, y, w, ht] = view.full;
    const scale = Math.max(Math.min(fitting(view.full), MAX_SCALE), minScale());
    const [gw, gh] = panel();
    showAt(scale, x + Math.min(w, gw / scale) / 2, y + Math.min(ht, gh / scale) / 2, true);
  };
  // The panel changed size: a fitted picture is fitted again, else the same centre is shown
  // at the same scale (labels keep their size)
  const refit = () => {
    if (!view.full || !view.box) return;
    if (view.fitted || !view.at) {
      fit();
      return;
    }
    const scale = view.at[0] / view.box[2];
    const [gw, gh] = panel();
    const [bx, by, bw, bh] = view.box;
    setBox([bx + bw / 2 - gw / scale / 2, by + bh / 2 - gh / scale / 2, gw / scale, gh / scale]);
  };
  const zoomBy = (factor, cx = 0.5, cy = 0.5) => {
    const v = view.box;
    if (!v) return;
    const w = v[2] * factor;
    const hgt = v[3] * factor;
    setBox([v[0] + (v[2] - w) * cx, v[1] + (v[3] - hgt) * cy, w, hgt]);
  };
  return { view, setBox, panel, minScale, fitting, showAt, fit, refit, zoomBy };
}

// The box of drawn elements `ids`, in picture units (null when none is drawn)
function boxOf(graph, ids) {
  const svg = graph.querySelector("svg");
  const ctm = svg?.getScreenCTM();
  if (!ctm) return null;
  const inverse = ctm.inverse();
  let box = null;
  for (const id of ids) {
    const r = svg.querySelector(`#${CSS.escape(id)}`)?.getBoundingClientRect();
    if (!r || (!r.width && !r.height)) continue;
    const a = new DOMPoint(r.left, r.top).matrixTransform(inverse);
    const b = new DOMPoint(r.right, r.bottom).matrixTransform(inverse);
    box = box
      ? [Math.min(box[0], a.x), Math.min(box[1], a.y), Math.max(box[2], b.x), Math.max(box[3], b.y)]
      : [a.x, a.y, b.x, b.y];
  }
  return box && [box[0], box[1], box[2] - box[0], box[3] - box[1]];
}

// Focus (search, Go to peak): the element and its neighbours (`focus.ids`) whole and
// legible; the whole picture when it is legible whole
function applyFocus(model, graph, port) {
  const { view } = port;
  const focus = model.get("focus");
  if (!focus?.id || focus.serial === view.focused || view.name !== model.get("view")) return;
  if (!view.full) return;
  const target = boxOf(graph, [focus.id]);
  if (!target) return;
  view.focused = focus.serial;
  if (port.fitting(view.full) >= port.minScale()) {
    port.fit();
    return;
  }
  const near = boxOf(graph, focus.ids?.length ? focus.ids : [focus.id]) || target;
  const scale = Math.min(Math.max(port.fitting(near), port.minScale()), MAX_SCALE);
  const [gw, gh] = port.panel();
  const fits = near[2] <= gw / scale && near[3] <= gh / scale;
  const c = fits ? near : target;
  port.showAt(scale, c[0] + c[2] / 2, c[1] + c[3] / 2);
}

// The selected op and the ops that stand for the peak, outlined
function markGraph(model, graph) {
  for (const node of graph.querySelectorAll(".sacwb-selected, .sacwb-peak-node")) {
    node.classList.remove("sacwb-selected", "sacwb-peak-node");
  }
  const chosen = model.get("selected_id");
  if (chosen) graph.querySelector(`#${CSS.escape(chosen)}`)?.classList.add("sacwb-selected");
  for (const id of model.get("peak_ids")) {
    graph.querySelector(`#${CSS.escape(id)}`)?.classList.add("sacwb-peak-node");
  }
}

// Python's picture in the panel: the same view keeps its box, another one is fitted
function drawPicture(model, graph, port) {
  const { view } = port;
  let sameView = view.name === model.get("view");
  graph.innerHTML = model.get("svg");
  const svg = graph.querySelector("svg");
  if (svg) {
    const vb = (svg.getAttribute("viewBox") || "0 0 100 100").split(/[\s,]+/).map(Number);
    // the same view arranged anew (another panel aspect) is fitted again
    const shape = (b) => b[2] / b[3];
    if (view.full && Math.abs(Math.log(shape(vb) / shape(view.full))) > 0.1) sameView = false;
    view.full = vb;
    svg.removeAttribute("width");
    svg.removeAttribute("height");
    svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
    // a fitted picture is fitted again (its layout may have changed size); one the user
    // zoomed or panned keeps its box
    if (sameView && view.box && !view.fitted) port.setBox(view.box);
    else port.fit();
  }
  view.name = model.get("view");
}

// Drag to pan (a drag is no click), scroll to zoom, click a box or an op
function panAndZoom({ scope, request }, graph, port) {
  const { view } = port;
  let drag = null;
  let dragged = false;
  scope.listen(graph, "mousedown", (e) => {
    if (!view.box) return;
    drag = { x: e.clientX, y: e.clientY, box: [...view.box] };
    dragged = false;
  });
  scope.listen(window, "mouseup", () => {
    drag = null;
  });
  scope.listen(graph, "mousemove", (e) => {
    if (!drag) return;
    const dx = e.clientX - drag.x;
    const dy = e.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 4) dragged = true;
    if (!dragged) return;
    const scaleX = drag.box[2] / (graph.clientWidth || 1);
    const scaleY = drag.box[3] / (graph.clientHeight || 1);
    const k = Math.max(scaleX, scaleY);
    port.setBox([drag.box[0] - dx * k, drag.box[1] - dy * k, drag.box[2], drag.box[3]]);
  });
  const zoom = (e) => {
    if (!view.box) return;
    e.preventDefault();
    const r = graph.getBoundingClientRect();
    const factor = e.deltaY < 0 ? 0.85 : 1 / 0.85;
    port.zoomBy(factor, (e.clientX - r.left) / r.width, (e.clientY - r.top) / r.height);
  };
  scope.listen(graph, "wheel", zoom, { passive: false });
  scope.listen(graph, "click", (event) => {
    if (dragged) {
      dragged = false;
      return;
    }
    const target = event.target.closest("g.node, g.cluster");
    if (!target?.id) return;
    request({ type: "click", id: target.id, shift: event.shiftKey });
  });
}

// The panel's width / height and its width go to Python (in one message), which arranges
// views to show the most of them legibly; the picture shown fits the new size at once
function watchPanel({ scope, model }, graph, port) {
  const sendPanel = () => {
    const [gw, gh] = [graph.clientWidth, graph.clientHeight];
    if (!gw || !gh) return;
    port.refit();
    const aspect = Math.round((gw / gh) * 10) / 10;
    const width = Math.round(gw / PANEL_WIDTH_STEP) * PANEL_WIDTH_STEP;
    const shape = Math.abs(aspect - model.get("graph_aspect")) > 0.05;
    if (!shape && width === model.get("graph_width")) return;
    model.set("graph_aspect", aspect);
    model.set("graph_width", width);
    model.save_changes();
  };
  let resizing = null;
  scope.observe(graph, () => {
    scope.cancel(resizing);
    resizing = scope.later(sendPanel, 200);
  });
}

function graphPanel(ctx) {
  const { model } = ctx;
  const graph = h("div", { class: "sacwb-graph" });
  const port = createViewport(graph);
  const tool = (cls, title, onclick, label) => h("button", { class: cls, title, onclick }, label);
  const tools = h(
    "div",
    { class: "sacwb-graph-tools" },
    tool("sacwb-zoom-in", "zoom in (or scroll over the graph)", () => port.zoomBy(0.7), "+"),
    tool("sacwb-zoom-out", "zoom out", () => port.zoomBy(1 / 0.7), "−"),
    tool(
      "sacwb-fit",
      "fit the whole picture, as far as its labels stay legible",
      () => port.fit(),
      "Fit",
    ),
    h(
      "span",
      { class: "sacwb-hint" },
      " drag to pan · scroll to zoom · click a box to open it, an op to flip it (shift-click selects)",
    ),
  );
  panAndZoom(ctx, graph, port);
  watchPanel(ctx, graph, port);
  const mark = () => markGraph(model, graph);
  const focus = () => applyFocus(model, graph, port);
  const draw = () => {
    drawPicture(model, graph, port);
    mark();
    focus();
  };
  return {
    elements: [tools, graph],
    watch: [
      [["svg"], draw],
      [["selected_id", "peak_ids"], mark],
      [["focus"], focus],
    ],
  };
}

function legendPanel({ model }) {
  const element = h("div", { class: "sacwb-legend" });
  // a colour sample, or (a third item: its look, solid or dashed) an outline the explorer draws
  const swatch = (colour, look) =>
    look
      ? h("span", {
          class: "sacwb-swatch sacwb-outline",
          style: `border-color: ${colour}; border-style: ${look}`,
        })
      : h("span", { class: "sacwb-swatch", style: `background: ${colour}` });
  const row = ([colour, words, look]) =>
    h("span", { class: "sacwb-legend-row" }, swatch(colour, look), words);
  const draw = () => {
    const lg = model.get("legend");
    element.replaceChildren(
      h("div", { class: "sacwb-title" }, lg.title ?? ""),
      ...(lg.lines ?? []).map((line) => h("div", { class: "sacwb-legend-line" }, line)),
      h("div", { class: "sacwb-legend-rows" }, ...(lg.rows ?? []).map(row)),
    );
  };
  return { element, watch: [[["legend"], draw]] };
}

// --- the estimate panel ----------------------------------------------------------------------

// The eager baselines (no AC, eager SAC, full AC as eager runs them), once asked
function baselinesTable({ model, request }) {
  const rows = model.get("baselines") ?? [];
  if (!rows.length) {
    return h(
      "button",
      {
        class: "sacwb-baselines",
        onclick: () => request({ type: "baselines" }),
        title:
          "run no AC, eager SAC and eager full AC as eager runs them, under torch's memory trackers (once per graph)",
      },
      "Eager baselines",
    );
  }
  const cells = (...texts) => texts.map((t) => h("td", {}, t));
  return h(
    "table",
    { class: "sacwb-baselines-table" },
    h(
      "tr",
      {},
      h("th", {}, "eager"),
      h("th", {}, "peak"),
      h("th", {}, "reserved"),
      h("th", {}, "at"),
    ),
    ...rows.map((r) =>
      h(
        "tr",
        { title: r.rule },
        ...cells(r.name, r.peak),
        h("td", { title: r.streams ? `reserved per stream: ${r.streams}` : r.rule }, r.reserved),
        ...cells(r.at),
      ),
    ),
  );
}

function metricsPanel(ctx) {
  const { model } = ctx;
  const element = h("div", { class: "sacwb-metrics" });
  const row = (label, value, cls) =>
    h("tr", {}, h("td", {}, label), h("td", { class: cls }, value));
  const draw = () => {
    const m = model.get("metrics");
    element.replaceChildren(
      h("div", { class: "sacwb-title" }, "Estimate (what-if, exact)"),
      h(
        "table",
        {},
        row("peak memory", m.peak ?? "-", "sacwb-peak"),
        row("host memory", m.host_text ?? "-", "sacwb-host-peak"),
        row("peak at", m.peak_node ?? "-", "sacwb-peak-at"),
        row("kept for backward", m.saved ?? "-", "sacwb-saved"),
        row("recompute", `${m.recompute ?? "-"} (${m.recomputed_nodes ?? 0} ops)`),
        row(`step on ${m.profile}`, m.step ?? "-"),
        row("throughput", m.tokens_per_second_text ?? "-"),
      ),
      h("div", { class: "sacwb-hint sacwb-peak-counts" }, `peak memory: ${m.peak_counts ?? "-"}`),
      h("div", { class: "sacwb-hint sacwb-time-basis" }, `step time: ${m.time_basis ?? "-"}`),
      baselinesTable(ctx),
    );
  };
  return { element, watch: [[["metrics", "baselines"], draw]] };
}

// The timeline's area, a loaded snapshot's line and the peak and selected marks
function timelinePlot(t) {
  const values = t.values ?? [];
  const placed = t.placed ?? {};
  const rows = Math.max(1, ...Object.values(placed).map((p) => p.row + 1));
  const W = t.width ?? 320;
  const top = 10 * rows;
  const H = 60 + top;
  const pad = 2;
  const svg = s("svg", { width: W, height: H, class: "sacwb-timeline-plot" });
  if (values.length <= 1 || !(t.max > 0)) return svg;
  const X = (f) => pad + f * (W - 2 * pad);
  const Y = (v) => H - pad - (v / t.max) * (H - 2 * pad - top);
  const points = (series) => series.map((v, i) => `${X(i / (series.length - 1))},${Y(v)}`);
  const area = `${X(0)},${H - pad} ${points(values).join(" ")} ${X(1)},${H - pad}`;
  svg.append(s("polygon", { points: area, class: "sacwb-timeline-area" }));
  const measured = t.measured ?? []; // a loaded memory snapshot's line (`load_snapshot`)
  if (measured.length > 1) {
    const line = points(measured).join(" ");
    svg.append(s("polyline", { points: line, class: "sacwb-timeline-measured" }));
  }
  const labels = t.labels ?? {};
  for (const [kind, f] of Object.entries(t.marks ?? {})) {
    const cls = kind === "peak" ? "sacwb-mark-peak" : "sacwb-mark-selected";
    const { row = 0, anchor = "start" } = placed[kind] ?? {};
    const x = X(f) + (anchor === "start" ? 2 : -2);
    svg.append(s("line", { x1: X(f), x2: X(f), y1: 10 * row + 1, y2: H - pad, class: cls }));
    const label = { x, y: 10 * row + 9, "text-anchor": anchor, class: `${cls} sacwb-mark-label` };
    svg.append(s("text", label, labels[kind] ?? kind));
  }
  return svg;
}

function timelinePanel({ model }) {
  const element = h("div", { class: "sacwb-timeline" });
  const draw = () => {
    const t = model.get("timeline");
    const title = `live memory over the step (${t.steps ?? 0} ops)`;
    const key = t.measured_label
      ? h("div", { class: "sacwb-hint sacwb-timeline-key" }, `line: ${t.measured_label}`)
      : "";
    element.replaceChildren(h("div", { class: "sacwb-subtitle" }, title), timelinePlot(t), key);
  };
  return { element, watch: [[["timeline"], draw]] };
}

function detailsPanel({ model }) {
  const element = h("div", { class: "sacwb-details" });
  const row = (k, v) => h("tr", {}, h("td", {}, k), h("td", {}, v));
  const draw = () => {
    const d = model.get("details");
    if (!d?.name) {
      element.replaceChildren(
        h("div", { class: "sacwb-title" }, "Selected op"),
        h("div", {}, "none: click an op or search"),
      );
      return;
    }
    const consumers = d.backward_consumers;
    element.replaceChildren(
      h("div", { class: "sacwb-title" }, `Selected: ${d.name}`),
      h(
        "table",
        {},
        row("op", d.op),
        row("module", d.module),
        row("layer", d.layer ?? "-"),
        row("shape", `${d.shape} ${d.dtype}`),
        row("size", d.bytes),
        row("FLOPs", d.flops),
        row("decision", `${d.action} (${d.decision})${d.can_flip ? "" : " (cannot flip)"}`),
        row("why", d.reason),
        row("offload", d.offload ?? "-"),
        row("preset says", d.preset_decision),
        row("read by backward", consumers.length ? consumers.join(", ") : "no"),
        row("source", d.source),
      ),
    );
  };
  return { element, watch: [[["details"], draw]] };
}

// --- the policy and its edits ----------------------------------------------------------------

// The policy's rows: its preset, each selector and override (action changeable, removable),
// its offload options
function policyRows({ model, request }) {
  const policy = model.get("policy_json");
  const remove = (msg, what) =>
    h(
      "button",
      { class: "sacwb-remove", title: `remove this ${what}`, onclick: () => request(msg) },
      "✕",
    );
  const rows = [
    h(
      "tr",
      { class: "sacwb-row-preset" },
      h("td", {}, "preset"),
      h("td", {}, policy.preset ?? "-"),
      h("td", {}),
    ),
  ];
  (policy.selectors ?? []).forEach((sel, i) => {
    const edit = (a) => request({ type: "edit_selector", index: i, action: a });
    rows.push(
      h(
        "tr",
        { class: "sacwb-row-selector" },
        h("td", {}, actionSelect("sacwb-row-action", sel.action, edit)),
        h("td", { class: "sacwb-key" }, sel.select),
        h("td", {}, remove({ type: "remove_selector", index: i }, "selector")),
      ),
    );
  });
  for (const [key, action] of Object.entries(policy.overrides ?? {})) {
    const edit = (a) => request({ type: "override", key, action: a });
    rows.push(
      h(
        "tr",
        { class: "sacwb-row-override" },
        h("td", {}, actionSelect("sacwb-row-action", action, edit)),
        h("td", { class: "sacwb-key" }, key),
        h("td", {}, remove({ type: "override", key }, "override")),
      ),
    );
  }
  const offload = model.get("offload_text");
  if (offload) {
    rows.push(
      h(
        "tr",
        { class: "sacwb-row-offload" },
        h("td", {}, "offload"),
        h("td", {}, offload),
        h("td", {}),
      ),
    );
  }
  return rows;
}

function policyPanel(ctx) {
  const { model } = ctx;
  const element = h("div", { class: "sacwb-policy" });
  const draw = () => {
    const policy = model.get("policy_json");
    const selectors = (policy.selectors ?? []).length;
    const overrides = Object.keys(policy.overrides ?? {}).length;
    const hint =
      selectors + overrides
        ? "later rows win; overrides win over selectors"
        : "no edits yet: click ops, add selectors or Suggest";
    element.replaceChildren(
      h(
        "div",
        { class: "sacwb-title" },
        `Policy: preset ${policy.preset}, ${selectors} selectors, ${overrides} overrides`,
      ),
      h("div", { class: "sacwb-hint" }, hint),
      h("table", { class: "sacwb-policy-rows" }, policyRows(ctx)),
    );
  };
  return { element, watch: [[["policy_json", "offload_text"], draw]] };
}

// A number box of the offload row
function numberBox(cls, placeholder, value, width) {
  return h("input", {
    type: "number",
    min: 0,
    class: cls,
    placeholder,
    value,
    style: `width: ${width}`,
  });
}

function offloadRow({ request }) {
  const budget = numberBox("sacwb-offload-budget", "no limit", undefined, "8em");
  const prefetch = numberBox("sacwb-offload-prefetch", "1", 1, "3em");
  const defer = numberBox("sacwb-offload-defer", "0", 0, "3em");
  const set = () =>
    request({
      type: "offload",
      budget_bytes: budget.value === "" ? null : Number(budget.value),
      prefetch_layers: Number(prefetch.value || 1),
      defer_layers: Number(defer.value || 0),
    });
  return h(
    "div",
    {
      class: "sacwb-offload",
      title:
        "host budget in bytes (empty: no limit); reload N layers early; free the device copy M layers late",
    },
    "offload: budget ",
    budget,
    " prefetch ",
    prefetch,
    " defer ",
    defer,
    " ",
    h("button", { class: "sacwb-offload-set", onclick: set }, "Set"),
  );
}

// A selector by pattern, an op-type switch, the offload options
function switchesPanel(ctx) {
  const { model, request } = ctx;
  const moduleSel = h("select", { class: "sacwb-switch-module" });
  const opSel = h("select", { class: "sacwb-switch-op" });
  const actionSel = actionSelect("sacwb-switch-action");
  const selectorText = h("input", {
    type: "text",
    class: "sacwb-selector-text",
    size: 30,
    placeholder: "layers.*.attention.wo::aten.mm.default",
  });
  const selectorAction = actionSelect("sacwb-selector-action");
  const add = () =>
    request({ type: "selector", select: selectorText.value, action: selectorAction.value });
  const apply = () =>
    request({ type: "switch", module: moduleSel.value, op: opSel.value, action: actionSel.value });
  const element = h(
    "div",
    { class: "sacwb-switches" },
    h("div", { class: "sacwb-title" }, "Add a selector or an op-type switch"),
    h(
      "div",
      {},
      selectorAction,
      " ",
      selectorText,
      " ",
      h(
        "button",
        {
          class: "sacwb-selector-add",
          title: "MODULE_PATTERN::OP_OVERLOAD; ** spans modules",
          onclick: add,
        },
        "Add",
      ),
    ),
    h(
      "div",
      {},
      actionSel,
      " every ",
      opSel,
      " in ",
      moduleSel,
      " ",
      h("button", { class: "sacwb-switch-apply", onclick: apply }, "Apply"),
    ),
    offloadRow(ctx),
  );
  const draw = () => {
    fill(moduleSel, model.get("modules"), moduleSel.value || model.get("modules")[0], "(anywhere)");
    fill(opSel, model.get("ops"), opSel.value || "aten.mm.default");
  };
  return { element, watch: [[CONTROLS, draw]] };
}

// --- Suggest, the history and the export -----------------------------------------------------

// The budget slider walks Python's stops (bytes and their text); Suggest sends the bytes
function suggestPanel({ model, request }) {
  const budgetText = h("span", { class: "sacwb-budget-text" });
  const stop = () => {
    const range = model.get("budget_range");
    const i = Number(budget.value);
    return { bytes: range.stops?.[i], text: range.texts?.[i] ?? "" };
  };
  const budget = h("input", {
    type: "range",
    class: "sacwb-budget",
    min: 0,
    step: 1,
    oninput: () => {
      budget.dataset.touched = "1";
      budgetText.textContent = stop().text;
    },
  });
  const note = h("div", { class: "sacwb-hint sacwb-budget-note" });
  const go = h(
    "button",
    {
      class: "sacwb-suggest-go",
      title: "the solver's cheapest policy under this peak",
      onclick: () => request({ type: "suggest", budget: stop().bytes }),
    },
    "Suggest",
  );
  const sweep = h(
    "button",
    {
      class: "sacwb-sweep",
      title: "add the solver's memory-vs-time front to the history",
      onclick: () => request({ type: "sweep" }),
    },
    "Sweep front",
  );
  const host = hostBudgetBox(request);
  const element = h(
    "div",
    { class: "sacwb-suggest" },
    h("div", { class: "sacwb-title" }, "Suggest a policy for a memory budget"),
    h("div", {}, budget, " ", budgetText, " ", go, " ", sweep),
    note,
    h("label", { class: "sacwb-host" }, "host budget ", host, " GiB (0: no offload)"),
  );
  const drawBusy = () => {
    go.disabled = model.get("running");
    sweep.disabled = model.get("running");
  };
  const drawBudget = () => {
    if (document.activeElement !== host) {
      host.value = model.get("suggest_host_budget_bytes") / 2 ** 30;
    }
    const stops = model.get("budget_range").stops ?? [];
    if (!stops.length) return;
    budget.max = stops.length - 1;
    if (!budget.dataset.touched) {
      // the stop nearest where the range starts (a pipelined job's budget per GPU), else
      // nearest the current peak
      const range = model.get("budget_range");
      const peak = range.start ?? model.get("metrics").peak_bytes ?? stops[stops.length - 1];
      budget.value = nearestStop(stops, peak);
    }
    budgetText.textContent = stop().text;
    note.textContent = model.get("budget_range").note ?? "";
  };
  return {
    element,
    watch: [
      [["metrics", "budget_range", "suggest_host_budget_bytes"], drawBudget],
      [CONTROLS, drawBusy],
    ],
  };
}

// The index of the stop nearest `peak`
function nearestStop(stops, peak) {
  const gap = (i) => Math.abs(stops[i] - peak);
  return stops.reduce((best, _b, i) => (gap(i) < gap(best) ? i : best), 0);
}

// The host memory Suggest and Sweep may offload to, in GiB (sent in bytes)
function hostBudgetBox(request) {
  const box = h("input", {
    type: "number",
    min: 0,
    step: 0.25,
    class: "sacwb-host-budget",
    style: "width: 5em",
    title: "host memory Suggest and Sweep may offload to, in GiB (0: no offload)",
    onchange: () => {
      const gib = Math.max(0, Number(box.value || 0));
      request({ type: "host_budget", bytes: Math.round(gib * 2 ** 30) });
    },
  });
  return box;
}

// A scatter of peak memory against step time; `plot` (from Python) gives its title, axis
// ranges and labelled ticks. Marks are circles (estimates) or squares (measured); clicking
// one restores its policy.
function scatterPlot(points, plot, onPick) {
  const [W, H, L, B, T, R] = [320, 206, 58, 34, 22, 10];
  const svg = s("svg", { width: W, height: H, class: "sacwb-scatter" });
  const { x, y } = plot;
  const X = (v) => L + ((v - x.lo) / (x.hi - x.lo)) * (W - L - R);
  const Y = (v) => H - B - ((v - y.lo) / (y.hi - y.lo)) * (H - B - T);
  svg.append(
    s("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "sacwb-axis" }),
    s("line", { x1: L, y1: T, x2: L, y2: H - B, class: "sacwb-axis" }),
  );
  for (const [v, text] of x.ticks) {
    const at = { x: X(v), y: H - B + 14, "text-anchor": "middle", class: "sacwb-tick-x" };
    svg.append(
      s("line", { x1: X(v), y1: H - B, x2: X(v), y2: H - B + 4, class: "sacwb-axis" }),
      s("text", at, text),
    );
  }
  for (const [v, text] of y.ticks) {
    const at = { x: L - 6, y: Y(v) + 3, "text-anchor": "end", class: "sacwb-tick-y" };
    svg.append(
      s("line", { x1: L - 4, y1: Y(v), x2: L, y2: Y(v), class: "sacwb-axis" }),
      s("text", at, text),
    );
  }
  // the y axis' title sits above it, where no tick label reaches
  const xTitle = {
    x: (L + W - R) / 2,
    y: H - 4,
    "text-anchor": "middle",
    class: "sacwb-axis-label",
  };
  const yTitle = {
    x: 4,
    y: 10,
    "text-anchor": "start",
    class: "sacwb-axis-label sacwb-axis-label-y",
  };
  svg.append(s("text", xTitle, plot.x_label), s("text", yTitle, plot.y_label));
  const front = points.filter((p) => p.pareto).sort((a, b) => a.step_seconds - b.step_seconds);
  if (front.length > 1) {
    const line = front.map((p) => `${X(p.step_seconds)},${Y(p.peak_bytes)}`).join(" ");
    svg.append(s("polyline", { points: line, class: "sacwb-front" }));
  }
  for (const p of points) {
    const mark = pointMark(p, X(p.step_seconds), Y(p.peak_bytes));
    mark.addEventListener("click", () => onPick(p.index));
    svg.append(mark);
  }
  return h("div", { class: "sacwb-plot" }, h("div", { class: "sacwb-subtitle" }, plot.title), svg);
}

// One point of the history: a circle (estimated) or a square (measured), titled
function pointMark(p, cx, cy) {
  const kinds = [
    p.pareto ? " pareto" : "",
    p.measured ? " measured" : "",
    p.current ? " current" : "",
  ];
  const cls = `sacwb-point${kinds.join("")}`;
  const mark = p.measured
    ? s("rect", { class: cls, x: cx - 5, y: cy - 5, width: 10, height: 10 })
    : s("circle", { class: cls, cx, cy, r: 5 });
  const where = p.measured ? ` measured on ${p.profile}` : "";
  mark.append(s("title", {}, `${p.name}: ${p.peak}, ${p.step}${where}`));
  return mark;
}

// What the plots' marks mean: each mark drawn as the plot draws it (`.sacwb-point` classes)
function historyKey() {
  const mark = (kinds, words, square = false) => {
    const svg = s("svg", { width: 12, height: 12, class: "sacwb-key-mark" });
    const cls = `sacwb-point${kinds}`;
    svg.append(
      square
        ? s("rect", { class: cls, x: 1, y: 1, width: 10, height: 10 })
        : s("circle", { class: cls, cx: 6, cy: 6, r: 5 }),
    );
    return h("span", { class: "sacwb-key-row" }, svg, ` ${words}`);
  };
  return h(
    "div",
    { class: "sacwb-hint sacwb-history-key" },
    mark("", "a policy tried"),
    mark(" pareto", "on the Pareto front (dashed)"),
    mark(" measured", "measured by Run", true),
    mark(" current", "the current policy"),
    h("span", {}, " · click a point to restore it"),
  );
}

function historyPanel(ctx) {
  const { model, request } = ctx;
  const element = h("div", { class: "sacwb-history" });
  const draw = () => {
    const points = model.get("history");
    const pick = (index) => request({ type: "restore", index });
    const plots = model.get("history_plots").map((plot) =>
      scatterPlot(
        points.filter((p) => p.measured === plot.measured),
        plot,
        pick,
      ),
    );
    element.replaceChildren(
      h("div", { class: "sacwb-title" }, "History: peak memory vs step time"),
      historyKey(),
      ...plots,
    );
  };
  return { element, watch: [[["history", "history_plots"], draw]] };
}

// Copy the code: the clipboard where the page may use it, else the code selected
function copier({ scope }, code) {
  const note = h("span", { class: "sacwb-copy-note" });
  const flash = (text) => {
    note.textContent = text;
    scope.later(() => {
      note.textContent = "";
    }, 2500);
  };
  const fallback = () => {
    const range = document.createRange();
    range.selectNodeContents(code);
    const sel = window.getSelection();
    sel.removeAllRanges();
    sel.addRange(range);
    const ok = document.execCommand?.("copy");
    flash(ok ? "copied ✓" : "selected: press Ctrl+C to copy");
  };
  const copy = () => {
    if (navigator.clipboard?.writeText) {
      navigator.clipboard.writeText(code.textContent).then(() => flash("copied ✓"), fallback);
    } else {
      fallback();
    }
  };
  return [h("button", { class: "sacwb-copy", onclick: copy }, "Copy"), note];
}

function exportPanel(ctx) {
  const { model, request, store } = ctx;
  const format = h("select", {
    class: "sacwb-export-format",
    onchange: () => store("export_format", format.value),
  });
  const path = h("input", { type: "text", class: "sacwb-export-path", size: 30 });
  const code = h("pre", { class: "sacwb-code" });
  const save = h(
    "button",
    { class: "sacwb-save", onclick: () => request({ type: "save_export", path: path.value }) },
    "Save",
  );
  const [copy, note] = copier(ctx, code);
  const element = h(
    "div",
    { class: "sacwb-export" },
    h("div", { class: "sacwb-title" }, "Export"),
    h("div", {}, format, " ", path, " ", save, " ", copy, " ", note),
    code,
  );
  const draw = () => {
    fill(format, model.get("export_formats"), model.get("export_format"));
    path.value = model.get("export_path");
    code.textContent = model.get("export_code");
  };
  return { element, watch: [[CONTROLS, draw]] };
}

// A pipelined job: the stages side by side (Python's SVG); a click opens one
function stagesPanel({ model, request }) {
  const element = h("div", {
    class: "sacwb-stages",
    title: "click a stage to open its graph",
    onclick: (e) => {
      const cell = e.target.closest?.("[data-stage]");
      if (cell) request({ type: "stage", stage: Number(cell.dataset.stage) });
    },
  });
  const draw = () => {
    element.innerHTML = model.get("stages_svg");
    element.style.display = model.get("stages_svg") ? "" : "none";
  };
  return { element, watch: [[["stages_svg"], draw]] };
}

// --- the widget ------------------------------------------------------------------------------

// Draw every panel once, then again whenever a traitlet it shows changes: one model
// handler per traitlet, which runs the panels' draws in order
function watchAll(scope, panels) {
  const draws = new Map();
  for (const panel of panels) {
    for (const [names, draw] of panel.watch) {
      draw();
      for (const name of names) draws.set(name, [...(draws.get(name) ?? []), draw]);
    }
  }
  for (const [name, list] of draws) {
    scope.on(`change:${name}`, () => {
      for (const draw of list) draw();
    });
  }
}

function render({ model, el, experimental }) {
  const scope = createScope(model);
  const ctx = {
    model,
    scope,
    request: requester(model, experimental, scope),
    store: (name, value) => {
      model.set(name, value);
      model.save_changes();
    },
  };
  const stages = stagesPanel(ctx);
  const toolbar = toolbarPanel(ctx);
  const lines = messagePanel(ctx);
  const legend = legendPanel(ctx);
  const graph = graphPanel(ctx);
  const side = [
    metricsPanel,
    timelinePanel,
    detailsPanel,
    policyPanel,
    suggestPanel,
    switchesPanel,
    historyPanel,
    exportPanel,
  ].map((panel) => panel(ctx));
  el.classList.add("sacwb");
  el.append(
    stages.element,
    toolbar.element,
    ...lines.elements,
    h(
      "div",
      { class: "sacwb-main" },
      h("div", { class: "sacwb-left" }, legend.element, ...graph.elements),
      // as tall as the picture's column, scrolling within (never three times its height)
      h(
        "div",
        { class: "sacwb-side" },
        h("div", { class: "sacwb-side-panels" }, ...side.map((panel) => panel.element)),
      ),
    ),
  );
  watchAll(scope, [stages, toolbar, lines, legend, graph, ...side]);
  return () => {
    scope.dispose();
    el.replaceChildren();
  };
}

export default { render };
