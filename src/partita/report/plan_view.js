// partita plan viewer (report/html.py): draws the Plan's JSON (#plan-data) into #app.
// Plain DOM and SVG, no library, no network.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("plan-data").textContent);
  const app = document.getElementById("app");

  function h(tag, attrs) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") el.textContent = v;
      else if (k === "onclick") el.addEventListener("click", v);
      else if (k === "style") el.style.cssText = v;
      else el.setAttribute(k, v);
    }
    for (let i = 2; i < arguments.length; i++) add(el, arguments[i]);
    return el;
  }
  function add(el, ...kids) {
    for (const kid of kids) {
      if (kid === null || kid === undefined || kid === false) continue;
      if (Array.isArray(kid)) add(el, ...kid);
      else el.appendChild(typeof kid === "string" || typeof kid === "number"
        ? document.createTextNode(String(kid)) : kid);
    }
    return el;
  }
  function svg(tag, attrs) {
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") el.textContent = v; else el.setAttribute(k, v);
    }
    return el;
  }
  // as partition.plan.format_bytes
  function fmtBytes(n) {
    if (n >= 1048576) return (n / 1048576).toFixed(2) + " MiB";
    if (n >= 1024) return (n / 1024).toFixed(1) + " KiB";
    return n + " B";
  }
  function table(head, rows, attrs) {
    return h("table", attrs, h("thead", null, h("tr", null, head.map((c) =>
      h("th", { class: /^(n|calls|bytes|count|per device|peak)$/.test(c) ? "num" : null }, c)))),
    h("tbody", null, rows));
  }
  const num = (v) => h("td", { class: "num" }, v);

  // --- colours: one per sharding (replicated grey), one per tile ---------------------------
  const PALETTE = ["#8ec5ff", "#ffb677", "#9be3b0", "#d7b4ff", "#ff9fb2", "#f3e27a", "#7fe0dc",
    "#c9b29b", "#b5c7ff", "#ffc9e5", "#c4e88f", "#ffd3a1"];
  const uses = D.shardings.map(() => 0);
  D.values.forEach((v) => { uses[v[3]] += 1; });
  const order = D.shardings.map((_, i) => i).sort((a, b) => uses[b] - uses[a]);
  const colour = {};
  let next = 0;
  for (const sid of order) {
    const s = D.shardings[sid];
    const replicated = s.dims && s.dims.every((d) => d.length === 0) && !s.partial.length;
    colour[sid] = replicated ? "#dfe3e8" : PALETTE[next++ % PALETTE.length];
  }
  function chip(sid) {
    const s = D.shardings[sid];
    const partial = s.partial && s.partial.length ? "border:1px dashed #555;" : "";
    return h("span", { class: "shd", style: "background:" + colour[sid] + ";" + partial,
      title: "sharding " + s.text }, s.text);
  }
  const tileColour = (k) => "hsl(" + ((k * 137.5) % 360).toFixed(0) + ",70%,82%)";
  function badge(kind, text) { return h("span", { class: "badge k-" + kind }, text); }

  // --- header, warnings, totals ------------------------------------------------------------
  const nDev = D.mesh.ids.length;
  add(app, h("h1", null, D.title));
  add(app, h("div", { class: "sub" }, D.mesh.text + ": " + nDev + " devices, ids " +
    D.mesh.ids.join(" ") + "; " + D.inputs.length + " inputs, " + D.outputs.length +
    " outputs (listed at the end)"));
  const warnings = D.warnings.concat(D.replicated);
  add(app, warnings.length
    ? h("div", { class: "warn", id: "warnings" }, h("b", null, warnings.length + " warning(s)"),
      h("ul", null, warnings.map((w) => h("li", null, w))))
    : h("div", { class: "warn ok", id: "warnings" },
      "No involuntary full rematerialization and no op run replicated."));
  const calls = Object.values(D.by_kind).reduce((a, k) => a + k[1], 0);
  const mem = D.memory;
  add(app, h("div", { class: "cards" },
    h("div", { class: "card" }, h("div", { class: "big" }, D.collectives.length), "collectives (" +
      calls + " calls, " + D.buckets.length + " fused buckets)"),
    h("div", { class: "card" }, h("div", { class: "big" }, fmtBytes(D.bytes)),
      "moved per device per run"),
    mem && h("div", { class: "card" }, h("div", { class: "big" }, fmtBytes(mem.peak)),
      "peak memory per device (estimate)"),
    h("div", { class: "card" }, h("div", { class: "big" }, D.values_total),
      "values in the program")));

  const kinds = Object.keys(D.by_kind).sort();
  const axes = Object.keys(D.by_axes).sort();
  add(app, h("div", { class: "cards" },
    h("div", null, h("h3", null, "Bytes per collective kind"), table(["kind", "n", "calls", "bytes"],
      kinds.map((k) => h("tr", null, h("td", null, badge(k, k)), num(D.by_kind[k][0]),
        num(D.by_kind[k][1]), num(fmtBytes(D.by_kind[k][2])))), { id: "by-kind" })),
    h("div", null, h("h3", null, "Bytes per mesh axis"), table(["mesh axes", "n", "bytes"],
      axes.map((a) => h("tr", null, h("td", null, a), num(D.by_axes[a][0]),
        num(fmtBytes(D.by_axes[a][1])))), { id: "by-axes" }))));

  // --- memory over the program --------------------------------------------------------------
  add(app, h("h2", { id: "memory" }, "Memory per device over the program"));
  if (!mem) {
    add(app, h("p", { class: "muted" }, "No per-device program attached: no memory estimate."));
  } else {
    const W = 1000, H = 220, L = 60, B = 22, T = 14;
    const chart = svg("svg", { viewBox: "0 0 " + (W + L + 10) + " " + (H + B + T), width: "100%",
      id: "memory-chart", role: "img" });
    const xs = (i) => L + (W * i) / Math.max(1, mem.ops - 1);
    const ys = (b) => T + H - (H * b) / Math.max(1, mem.peak);
    const series = [["inputs", 2, "#9db9e6"], ["gathered", 3, "#f4b183"], ["other", 4, "#a9d8a4"]];
    const base = mem.points.map(() => 0);
    for (const [name, col, fill] of series) {
      const top = mem.points.map((p, j) => base[j] + p[col]);
      const up = mem.points.map((p, j) => xs(p[0]) + "," + ys(top[j]).toFixed(1));
      const down = mem.points.map((p, j) => xs(p[0]) + "," + ys(base[j]).toFixed(1)).reverse();
      chart.appendChild(svg("polygon", { points: up.concat(down).join(" "), fill: fill,
        stroke: "none" })).appendChild(svg("title", { text: name }));
      top.forEach((t, j) => { base[j] = t; });
    }
    for (let k = 0; k <= 4; k++) {
      const b = (mem.peak * k) / 4;
      chart.appendChild(svg("line", { x1: L, x2: L + W, y1: ys(b), y2: ys(b), stroke: "#e3e6ea" }));
      chart.appendChild(svg("text", { x: L - 4, y: ys(b) + 4, "text-anchor": "end",
        text: fmtBytes(Math.round(b)) }));
    }
    const px = xs(mem.peak_at);
    chart.appendChild(svg("line", { x1: px, x2: px, y1: T, y2: T + H, stroke: "#c00",
      "stroke-dasharray": "4 3" }));
    chart.appendChild(svg("text", { x: Math.min(px + 4, L + W - 260), y: T + 10, fill: "#c00",
      text: "peak " + fmtBytes(mem.peak) + " after %" + mem.peak_node }));
    chart.appendChild(svg("text", { x: L, y: T + H + 16, text: "op 0" }));
    chart.appendChild(svg("text", { x: L + W, y: T + H + 16, "text-anchor": "end",
      text: "op " + (mem.ops - 1) + " of the per-device program" }));
    add(app, chart);
    add(app, h("div", { class: "legend" }, series.map(([name, , fill]) => h("span", null,
      h("span", { class: "sw", style: "background:" + fill }), name + " " +
      fmtBytes(mem.at_peak[name] || 0) + " at the peak"))));
    const liveRow = (v) => h("tr", null, h("td", { class: "mono" }, "%" + v[0]),
      h("td", null, v[1]), num(fmtBytes(v[2])));
    add(app, h("details", null, h("summary", null, "Live at the peak: " + mem.live_count +
      " values; the largest " + mem.live.slice(0, 3).map((v) => "%" + v[0] + " " +
      fmtBytes(v[2])).join(", ")), table(["value", "kind", "bytes"], mem.live.map(liveRow),
    { id: "live-at-peak" })));
  }

  // --- the program by source line ----------------------------------------------------------
  const program = h("section", { id: "program" });
  add(app, program);
  add(program, h("h2", null, "The program by source line"));
  add(program, h("p", { class: "sub" }, "Click a line to see its values, their shardings and " +
    "their tiles on the mesh. Shardings: " + D.shardings.length + " distinct" +
    (D.values.length < D.values_total ? "; the first " + D.values.length + " of " +
      D.values_total + " values are listed" : "") + "."));
  // one entry per user line "file.py:LINE in fn"; every other value (inputs, annotations'
  // in_specs / out_specs, partita's own ops) in one entry at the end
  const LINE = /^(.*?):(\d+)(?: in (.*))?$/;
  const isLine = D.sources.map((t) => LINE.test(t));
  const lines = new Map();
  const lineOf = (src) => {
    const key = src >= 0 && isLine[src] ? src : -1;
    if (!lines.has(key)) lines.set(key, { src: key, values: [], colls: [] });
    return lines.get(key);
  };
  D.values.forEach((v, i) => lineOf(v[4]).values.push(i));
  D.collectives.forEach((c, i) => lineOf(c.source).colls.push(i));
  const files = new Map();
  const other = "(inputs, and values without a line of yours)";
  for (const ln of [...lines.values()].sort((a, b) => (a.src < 0) - (b.src < 0))) {
    const m = ln.src < 0 ? null : LINE.exec(D.sources[ln.src]);
    ln.no = m ? parseInt(m[2], 10) : 0;
    ln.text = m ? D.sources[ln.src] : "(no source line)";
    const file = m ? m[1] : other;
    if (!files.has(file)) files.set(file, []);
    files.get(file).push(ln);
  }
  const detail = h("div", { class: "detail", id: "line-detail" },
    h("p", { class: "muted" }, "Select a line on the left."));
  const list = h("div", { class: "lines", id: "lines" });
  let selected = null;
  for (const [file, lns] of files) {
    add(list, h("div", { class: "file" }, file));
    lns.sort((a, b) => a.no - b.no);
    for (const ln of lns) {
      const sids = [...new Set(ln.values.map((i) => D.values[i][3]))].slice(0, 8);
      const perKind = {};
      ln.colls.forEach((i) => {
        const c = D.collectives[i];
        perKind[c.kind] = (perKind[c.kind] || 0) + c.bytes;
      });
      const row = h("div", { class: "line", "data-source": ln.text },
        h("div", { class: "src" }, ln.text),
        h("div", null, sids.map((s) => h("span", { class: "sw", style: "background:" + colour[s],
          title: D.shardings[s].text }))," " + ln.values.length + " values ",
        Object.keys(perKind).map((k) => badge(k, k + " " + fmtBytes(perKind[k])))));
      row.addEventListener("click", () => {
        if (selected) selected.classList.remove("sel");
        row.classList.add("sel");
        selected = row;
        showLine(ln);
      });
      add(list, row);
    }
  }
  add(program, h("div", { class: "grid2" }, list, detail));
  // "#line=gpt.py:58 in forward" in the address selects that line (links, screenshots)
  if (location.hash.startsWith("#line=")) {
    const want = decodeURIComponent(location.hash.slice(6));
    for (const row of list.querySelectorAll(".line")) {
      if (row.getAttribute("data-source") === want) {
        row.click();  // and the program's view comes first, below the totals
        app.insertBefore(program, document.getElementById("memory"));
        list.scrollTop = row.offsetTop - 40;
        break;
      }
    }
  }

  function tilesOf(sid, shape, caption) {
    const s = D.shardings[sid];
    const box = h("div", { class: "tilebox" }, h("div", null, chip(sid), " ", caption));
    if (!s.tiles) return add(box, h("div", { class: "muted" }, "several results: no picture"));
    // the mesh: one cell per device, coloured by the tile it holds
    const ms = D.mesh.shape;
    const rows = ms.length > 1 ? ms[0] : 1;
    const cols = nDev / rows;
    const mrows = [];
    for (let r = 0; r < rows; r++) {
      const cells = [];
      for (let c = 0; c < cols; c++) {
        const pos = r * cols + c;
        cells.push(h("td", { style: "background:" + tileColour(s.tiles[pos]) },
          "dev " + D.mesh.ids[pos], h("br"), h("span", { class: "muted" }, "tile " + s.tiles[pos])));
      }
      mrows.push(h("tr", null, cells));
    }
    add(box, h("div", { class: "muted" }, "mesh " + D.mesh.axes.join(" × ") + ":"),
      h("table", { class: "mesh-grid" }, h("tbody", null, mrows)));
    // the tensor: one cell per tile with its index range and devices
    const ts = s.tile_shape;
    const trows = ts.length ? ts[0] : 1;
    const tcols = ts.slice(1).reduce((a, b) => a * b, 1);
    const body = [];
    for (let r = 0; r < trows; r++) {
      const cells = [];
      for (let c = 0; c < tcols; c++) {
        const k = r * tcols + c;
        let rest = k;
        const coords = ts.map(() => 0);
        for (let d = ts.length - 1; d >= 0; d--) { coords[d] = rest % ts[d]; rest = Math.floor(rest / ts[d]); }
        const ranges = shape ? coords.map((t, d) => {
          const chunk = Math.ceil(shape[d] / ts[d]);
          return Math.min(t * chunk, shape[d]) + ":" + Math.min((t + 1) * chunk, shape[d]);
        }).join(", ") : "";
        const devs = D.mesh.ids.filter((_, p) => s.tiles[p] === k);
        cells.push(h("td", { style: "background:" + tileColour(k) }, "[" + ranges + "]", h("br"),
          "dev " + devs.join(" ")));
      }
      body.push(h("tr", null, cells));
    }
    add(box, h("div", { class: "muted" }, "tensor tiles (" + (ts.join(" × ") || "1") + "):"),
      h("table", { class: "tensor-grid" }, h("tbody", null, body)));
    if (s.partial.length) add(box, h("div", { class: "muted" }, "partial over " +
      s.partial.join(", ") + ": the devices of a tile hold partial values"));
    return box;
  }

  function showLine(ln) {
    detail.textContent = "";
    add(detail, h("h3", null, ln.text));
    if (ln.colls.length) {
      add(detail, h("div", null, "Collectives of this line:"), collTable(ln.colls, "line-collectives"));
    }
    const seen = new Set();
    const boxes = [];
    for (const i of ln.values) {
      const v = D.values[i];
      const key = v[3] + "|" + v[2];
      if (seen.has(key) || boxes.length >= 12 || !D.shardings[v[3]].tiles) continue;
      seen.add(key);
      boxes.push(tilesOf(v[3], v[6], v[2] + " (e.g. %" + v[0] + ")"));
    }
    add(detail, h("h3", null, "Tiles on the mesh (one per sharding and shape)"),
      h("div", { class: "tiles" }, boxes));
    const shown = ln.values.slice(0, 300);
    add(detail, h("div", null, ln.values.length + " values" +
      (shown.length < ln.values.length ? " (the first 300)" : "") + ":"));
    add(detail, table(["value", "op", "shape", "sharding"], shown.map((i) => {
      const v = D.values[i];
      return h("tr", null, h("td", { class: "mono" }, "%" + v[0] + (v[5] ? " " + v[5] : "")),
        h("td", { class: "mono" }, v[1]), h("td", { class: "mono" }, v[2]), h("td", null, chip(v[3])));
    }), { id: "line-values" }));
  }

  function collTable(ids, id) {
    const full = id === "collectives";  // the line's view leaves out the wide columns
    return table(["#", "kind", "mesh axes"].concat(full ? ["bytes", "per device"] : ["bytes"],
      ["value"], full ? ["bucket", "source", "reason"] : ["reason"]), ids.map((i) => {
      const c = D.collectives[i];
      return h("tr", { id: full ? "c" + i : null, "data-kind": c.kind, "data-bytes": c.bytes },
        num(i), h("td", null, badge(c.kind, c.kind), c.detail ? " (" + c.detail + ")" : ""),
        h("td", null, c.axes.join("×") || "-"), full && num(c.bytes + " B"),
        num(fmtBytes(c.bytes)),
        h("td", { class: "mono" }, c.dtype + "[" + c.shape.join(", ") + "] %" + c.value +
          (c.name ? " " + c.name : "")),
        full && num(c.bucket < 0 ? "" : c.bucket),
        full && h("td", { class: "mono" }, c.source < 0 ? "" : D.sources[c.source]),
        h("td", { class: "reason", title: "groups " + c.groups }, c.reason));
    }), { id: id });
  }

  add(app, h("h2", null, "Every collective (" + D.collectives.length + ")"));
  add(app, collTable(D.collectives.map((_, i) => i), "collectives"));
  add(app, h("h2", null, "Inputs and outputs"));
  add(app, h("div", { class: "cards" },
    table(["input", "sharding"], D.inputs.map((x) => h("tr", null,
      h("td", { class: "mono" }, x[0]), h("td", { class: "mono" }, x[1]))), { id: "inputs" }),
    table(["output", "sharding"], D.outputs.map((x, i) => h("tr", null, num(i),
      h("td", { class: "mono" }, x))), { id: "outputs" })));
  app.firstChild.nodeType === 3 && app.removeChild(app.firstChild);
  document.body.setAttribute("data-rendered", "ok");
  // milliseconds from the start of the page's navigation to here (tests/test_plan_html.py)
  document.body.setAttribute("data-render-ms", performance.now().toFixed(0));
})();
