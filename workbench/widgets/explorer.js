// Policy explorer front end: draws the Python state and forwards clicks as messages.
// All decisions, estimates and history live in Python; nothing here computes them.

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
const s = (tag, attrs = {}) => {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
};

function gib(bytes) {
  return bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(2)} GiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

function render({ model, el }) {
  const send = (msg) => model.send(msg);
  el.classList.add("sacwb");

  // --- toolbar -----------------------------------------------------------------------
  const preset = h("select", { class: "sacwb-preset", title: "preset: what every op gets unless you say otherwise",
    onchange: () => send({ type: "preset", name: preset.value }) });
  const profile = h("select", { class: "sacwb-profile", title: "device profile for the time estimate",
    onchange: () => { model.set("profile", profile.value); model.save_changes(); } });
  const allLayers = h("input", { type: "checkbox", class: "sacwb-all-layers",
    onchange: () => { model.set("all_layers", allLayers.checked); model.save_changes(); } });
  const button = (label, type, title) =>
    h("button", { class: `sacwb-${type}`, title, onclick: () => send({ type }) }, label);
  const undo = button("↶ Undo", "undo", "undo the last change");
  const redo = button("↷ Redo", "redo", "redo");
  const reset = button("Reset", "reset", "drop every edit, keep the preset");
  const overview = h("button", { class: "sacwb-overview", title: "back to the module overview",
    onclick: () => send({ type: "show", view: "overview" }) }, "⌂ Overview");
  const run = h("button", { class: "sacwb-run", title: "remat with torch's pass and measure for real",
    onclick: () => send({ type: "run" }) }, "▶ Run");
  const toolbar = h("div", { class: "sacwb-toolbar" },
    h("label", {}, "Preset ", preset),
    h("label", { title: "a click flips the op in every identical layer" }, allLayers, " apply to all identical layers"),
    h("label", {}, "Profile ", profile), undo, redo, reset, overview, run);

  const message = h("div", { class: "sacwb-message" });
  const status = h("div", { class: "sacwb-status" });
  const hint = h("div", { class: "sacwb-hint" },
    "Click a module box to open it; click an op to flip save ↔ recompute (shift-click only selects it).");

  // --- graph -------------------------------------------------------------------------
  const graph = h("div", { class: "sacwb-graph" });
  graph.addEventListener("click", (event) => {
    const target = event.target.closest("g.node, g.cluster");
    if (!target || !target.id) return;
    send({ type: "click", id: target.id, shift: event.shiftKey });
  });

  // --- side panel --------------------------------------------------------------------
  const metrics = h("div", { class: "sacwb-metrics" });
  const details = h("div", { class: "sacwb-details" });
  const moduleSel = h("select", { class: "sacwb-switch-module" });
  const opSel = h("select", { class: "sacwb-switch-op" });
  const actionSel = h("select", { class: "sacwb-switch-action" },
    h("option", { value: "save" }, "save"), h("option", { value: "recompute" }, "recompute"));
  const selectorList = h("ul", { class: "sacwb-selectors" });
  const selectorText = h("input", { type: "text", class: "sacwb-selector-text", size: 30,
    placeholder: "layers.*.attention.wo::aten.mm.default" });
  const selectorAction = h("select", { class: "sacwb-selector-action" },
    h("option", { value: "save" }, "save"), h("option", { value: "recompute" }, "recompute"));
  const selectorEntry = h("div", {}, selectorAction, " ", selectorText, " ",
    h("button", { class: "sacwb-selector-add", title: "MODULE_PATTERN::OP_OVERLOAD; ** spans modules",
      onclick: () => send({ type: "selector", select: selectorText.value, action: selectorAction.value }) }, "Add"));
  const switches = h("div", { class: "sacwb-switches" },
    h("div", { class: "sacwb-title" }, "Selectors and op-type switches"),
    selectorEntry,
    h("div", {}, actionSel, " every ", opSel, " in ", moduleSel, " ",
      h("button", { class: "sacwb-switch-apply", onclick: () => send({ type: "switch",
        module: moduleSel.value, op: opSel.value, action: actionSel.value }) }, "Apply")),
    selectorList);
  const scatter = h("div", { class: "sacwb-history" });
  const budget = h("input", { type: "range", class: "sacwb-budget", step: "any",
    oninput: () => { budgetText.textContent = gib(Number(budget.value)); } });
  const budgetText = h("span", { class: "sacwb-budget-text" });
  const suggester = h("div", { class: "sacwb-suggest" },
    h("div", { class: "sacwb-title" }, "Suggest a policy for a memory budget"),
    h("div", {}, budget, " ", budgetText, " ",
      h("button", { class: "sacwb-suggest-go", title: "the solver's cheapest policy under this peak",
        onclick: () => send({ type: "suggest", budget: Math.round(Number(budget.value)) }) }, "Suggest"),
      " ",
      h("button", { class: "sacwb-sweep", title: "add the solver's memory-vs-time front to the history",
        onclick: () => send({ type: "sweep" }) }, "Sweep front")));
  const exportFmt = h("select", { class: "sacwb-export-format",
    onchange: () => { model.set("export_format", exportFmt.value); model.save_changes(); } });
  const exportPath = h("input", { type: "text", class: "sacwb-export-path", size: 28 });
  const code = h("pre", { class: "sacwb-code" });
  const copy = h("button", { class: "sacwb-copy", onclick: () => navigator.clipboard?.writeText(code.textContent) }, "Copy");
  const save = h("button", { class: "sacwb-save", onclick: () => send({ type: "save_export", path: exportPath.value }) }, "Save");
  const exporter = h("div", { class: "sacwb-export" },
    h("div", { class: "sacwb-title" }, "Export"), h("div", {}, exportFmt, " ", exportPath, " ", save, " ", copy), code);
  const side = h("div", { class: "sacwb-side" }, metrics, details, suggester, switches, scatter, exporter);

  el.append(toolbar, hint, message, status, h("div", { class: "sacwb-main" }, graph, side));

  // --- drawing from state ------------------------------------------------------------
  const fill = (select, values, current, blank = "") => {
    select.replaceChildren(...values.map((v) => h("option", { value: v }, v || blank)));
    select.value = current;
  };

  const drawGraph = () => {
    graph.innerHTML = model.get("svg");
    const chosen = model.get("selected_id");
    if (chosen) graph.querySelector(`#${CSS.escape(chosen)}`)?.classList.add("sacwb-selected");
  };

  const drawMetrics = () => {
    const m = model.get("metrics");
    metrics.replaceChildren(
      h("div", { class: "sacwb-title" }, "Estimate (what-if, exact)"),
      h("table", {},
        h("tr", {}, h("td", {}, "peak memory"), h("td", { class: "sacwb-peak" }, m.peak ?? "-")),
        h("tr", {}, h("td", {}, "kept for backward"), h("td", { class: "sacwb-saved" }, m.saved ?? "-")),
        h("tr", {}, h("td", {}, "recompute"), h("td", {}, `${m.recompute ?? "-"} (${m.recomputed_nodes ?? 0} ops)`)),
        h("tr", {}, h("td", {}, `step on ${m.profile}`), h("td", {}, m.step ?? "-")),
        h("tr", {}, h("td", {}, "throughput"), h("td", {}, m.tokens_per_second_text ?? "-"))));
  };

  const drawDetails = () => {
    const d = model.get("details");
    if (!d || !d.name) {
      details.replaceChildren(h("div", { class: "sacwb-title" }, "Selected op"), h("div", {}, "none: click an op"));
      return;
    }
    const row = (k, v) => h("tr", {}, h("td", {}, k), h("td", {}, v));
    details.replaceChildren(
      h("div", { class: "sacwb-title" }, `Selected: ${d.name}`),
      h("table", {}, row("op", d.op), row("module", d.module), row("layer", d.layer ?? "-"),
        row("shape", `${d.shape} ${d.dtype}`), row("size", d.bytes), row("FLOPs", d.flops),
        row("decision", `${d.decision}${d.can_flip ? "" : " (cannot flip)"}`), row("why", d.reason),
        row("preset says", d.preset_decision),
        row("read by backward", d.backward_consumers.length ? d.backward_consumers.join(", ") : "no"),
        row("source", d.source)));
  };

  const drawSelectors = () => {
    const policy = model.get("policy_json");
    selectorList.replaceChildren(...(policy.selectors ?? []).map((sel, i) =>
      h("li", {}, `${sel.action}: ${sel.select} `,
        h("button", { class: "sacwb-remove", onclick: () => send({ type: "remove_selector", index: i }) }, "✕"))));
  };

  const drawHistory = () => {
    const points = model.get("history");
    const W = 300, H = 190, pad = 38;
    const svg = s("svg", { width: W, height: H, class: "sacwb-scatter" });
    if (points.length) {
      const xs = points.map((p) => p.step_seconds), ys = points.map((p) => p.peak_bytes);
      const [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
      const X = (v) => pad + ((v - x0) / (x1 - x0 || 1)) * (W - pad - 10);
      const Y = (v) => H - pad + 10 - ((v - y0) / (y1 - y0 || 1)) * (H - pad - 10);
      const front = points.filter((p) => p.pareto && !p.measured).sort((a, b) => a.step_seconds - b.step_seconds);
      if (front.length > 1) {
        svg.append(s("polyline", { points: front.map((p) => `${X(p.step_seconds)},${Y(p.peak_bytes)}`).join(" "),
          class: "sacwb-front" }));
      }
      const current = JSON.stringify(model.get("policy_json"));
      for (const p of points) {
        const attrs = { class: `sacwb-point${p.pareto ? " pareto" : ""}${p.measured ? " measured" : ""}${JSON.stringify(p.policy) === current ? " current" : ""}` };
        const mark = p.measured
          ? s("rect", { ...attrs, x: X(p.step_seconds) - 5, y: Y(p.peak_bytes) - 5, width: 10, height: 10 })
          : s("circle", { ...attrs, cx: X(p.step_seconds), cy: Y(p.peak_bytes), r: 5 });
        const title = s("title");
        title.textContent = `${p.name}${p.measured ? " (measured)" : ""}: ${gib(p.peak_bytes)}, ${(p.step_seconds * 1e3).toFixed(2)} ms`;
        mark.append(title);
        mark.addEventListener("click", () => send({ type: "restore", index: p.index }));
        svg.append(mark);
      }
      const label = (text, x, y, anchor = "start") => { const t = s("text", { x, y, "text-anchor": anchor }); t.textContent = text; return t; };
      svg.append(label(gib(y1), 2, 16), label(gib(y0), 2, H - pad + 10), label("step time →", W - 4, H - 6, "end"));
    }
    scatter.replaceChildren(h("div", { class: "sacwb-title" }, "History: memory vs step time"),
      h("div", { class: "sacwb-hint" }, "● estimate  ■ measured  — Pareto front; click a point to restore it"), svg);
  };

  const drawControls = () => {
    fill(preset, model.get("presets"), model.get("policy_json").preset);
    fill(profile, model.get("profiles"), model.get("profile"));
    fill(exportFmt, model.get("export_formats"), model.get("export_format"));
    fill(moduleSel, model.get("modules"), moduleSel.value || model.get("modules")[0], "(anywhere)");
    fill(opSel, model.get("ops"), opSel.value || "aten.mm.default");
    allLayers.checked = model.get("all_layers");
    undo.disabled = !model.get("can_undo");
    redo.disabled = !model.get("can_redo");
    run.disabled = model.get("running");
    exportPath.value = model.get("export_path");
    code.textContent = model.get("export_code");
    message.textContent = model.get("message");
    status.textContent = model.get("running") ? `⏳ ${model.get("status")}` : model.get("status");
  };

  const drawBudget = () => {
    const range = model.get("budget_range");
    if (range.min === undefined) return;
    budget.min = range.min;
    budget.max = range.max;
    if (!budget.dataset.touched) budget.value = model.get("metrics").peak_bytes ?? range.max;
    budgetText.textContent = gib(Number(budget.value));
  };
  budget.addEventListener("change", () => { budget.dataset.touched = "1"; });

  const drawAll = () => {
    drawBudget(); drawControls(); drawGraph(); drawMetrics(); drawDetails(); drawSelectors(); drawHistory(); };
  drawAll();
  for (const name of ["svg", "selected_id"]) model.on(`change:${name}`, drawGraph);
  model.on("change:view", () => { graph.scrollTop = 0; graph.scrollLeft = 0; });
  model.on("change:metrics", drawMetrics);
  model.on("change:details", drawDetails);
  model.on("change:policy_json", () => { drawSelectors(); drawControls(); drawHistory(); });
  model.on("change:history", drawHistory);
  for (const name of ["message", "status", "running", "can_undo", "can_redo", "export_code", "export_format", "profile", "all_layers", "export_path"]) {
    model.on(`change:${name}`, drawControls);
  }
}

export default { render };
