/* plasmient-trace report: draws the four views from the JSON that report/html.py embeds.
 * Inlined into the page at build time; uses no library and fetches nothing.
 * The number formats mirror plasmient_trace/report/summary.py one-for-one: change both together. */
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("plasmient-data").textContent);
  var DEV = D.meta.device;  // "GPU", or "CPU" for a CPU-only run: the word the page uses for its devices
  var SVGNS = "http:" + "//www.w3.org/2000/svg";  // a namespace name, never fetched
  var BOUND_COLOR = {
    compute: "#2f6fb3", memory: "#e08214", latency: "#8e6cc4", communication: "#1b9e77", idle: "#e6e6e6", unknown: "#9aa0a6"
  };

  // ---- formats (mirror summary.py) ---------------------------------------------------------------
  function bad(x) { return x === null || x === undefined || (typeof x === "number" && isNaN(x)); }
  function group(intPart) { return intPart.replace(/\B(?=(\d{3})+(?!\d))/g, ","); }
  function fixedGrouped(x, d) {
    var s = x.toFixed(d), dot = s.indexOf(".");
    return dot < 0 ? group(s) : group(s.slice(0, dot)) + s.slice(dot);
  }
  function sigDecimals(ax, sig) { return Math.max(0, Math.min(12, sig - 1 - Math.floor(Math.log10(ax)))); }
  function fmtPct(x) {  // as summary.fmt_pct: two significant digits below 0.05%, so small is not 0.0%
    if (bad(x)) return "n/a";
    var v = x * 100, av = Math.abs(v);
    return (v !== 0 && av < 0.05 ? v.toFixed(sigDecimals(av, 2)) : v.toFixed(1)) + "%";
  }
  function fmtUsd(x) {
    if (bad(x)) return "n/a";
    var sign = x < 0 ? "-" : "", ax = Math.abs(x);
    if (ax >= 1 || ax === 0) return sign + "$" + fixedGrouped(ax, 2);
    if (ax >= 1e-3) return sign + "$" + ax.toFixed(sigDecimals(ax, 4));
    return sign + "$" + ax.toExponential(2);
  }
  function fmtSeconds(x) {
    if (bad(x)) return "n/a";
    var ax = Math.abs(x);
    if (ax < 1e-3) {  // as summary.fmt_seconds: two significant digits below 0.05 µs, so small is not 0.0 µs
      var v = x * 1e6, av = Math.abs(v);
      return (v !== 0 && av < 0.05 ? v.toFixed(sigDecimals(av, 2)) : v.toFixed(1)) + " µs";
    }
    if (ax < 1) return (x * 1e3).toFixed(2) + " ms";
    if (ax < 100) return x.toFixed(3) + " s";
    return fixedGrouped(x, 0) + " s";
  }
  function fmtGpuHours(x, device) {
    if (bad(x)) return "n/a";
    var ax = Math.abs(x), unit = " " + (device || "GPU") + "-h";
    if (ax >= 100) return fixedGrouped(x, 1) + unit;
    if (ax === 0) return "0" + unit;
    if (ax >= 1e-3) return x.toFixed(sigDecimals(ax, 4)) + unit;
    return x.toExponential(2) + unit;
  }
  function fmtSi(x, unit) {
    if (bad(x)) return "n/a";
    var p = ["", "k", "M", "G", "T", "P", "E"], i = 0, v = x;
    while (Math.abs(v) >= 1000 && i < p.length - 1) { v /= 1000; i++; }
    return v.toPrecision(3) + " " + p[i] + unit;
  }
  function fmtUs(us) { return fmtSeconds(us / 1e6); }
  function ellipsize(s, n) {
    if (!s || s.length <= n) return s || "";
    var h = Math.floor((n - 1) / 2);
    return s.slice(0, h) + "…" + s.slice(s.length - (n - 1 - h));
  }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) if (attrs[k] !== undefined && attrs[k] !== null) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  function raw(x) { return bad(x) ? "" : String(x); }
  window.plasmientFormat = { pct: fmtPct, usd: fmtUsd, seconds: fmtSeconds, gpuHours: fmtGpuHours };

  function mfuColor(mfu) {
    if (bad(mfu)) return "#bdbdbd";
    var base = D.bill.baseline_mfu || 0.46;
    var t = Math.max(0, Math.min(1, mfu / base));
    return "hsl(" + (t * 120).toFixed(0) + ",62%," + (58 + 6 * t).toFixed(0) + "%)";
  }
  function boundName(code) { return code >= 0 ? D.bounds[code] : "unknown"; }

  // ---- header --------------------------------------------------------------------------------------
  // kernels the span budget folded into their ops (a CPU's kernels are ops, drawn as their op spans: never folded)
  function foldedKernels(m) { return m.kernels === null ? 0 : Math.max(m.kernels - m.cpu_kernels - m.kernel_spans, 0); }
  function kernelsText(m) {
    if (m.kernels === null) return m.kernel_spans + " kernel spans";  // a step without its count: the total is unknown
    var cpu = m.cpu_kernels ? " (" + (m.cpu_kernels === m.kernels ? "all" : m.cpu_kernels) + " of them CPU ops)" : "";
    if (foldedKernels(m)) return m.kernels + " kernels" + cpu + " (" + m.kernel_spans + " drawn as spans, the rest folded into their ops)";
    return m.kernels + " kernels" + cpu;
  }

  (function meta() {
    var m = D.meta, box = document.getElementById("meta");
    var parts = [
      m.jobs.length ? "job " + m.jobs.join(", ") : null,
      m.traces + (m.traces === 1 ? " trace (step)" : " traces (steps)"),
      m.ranks + (m.ranks === 1 ? " rank" : " ranks"),
      m.hosts.length ? m.hosts.length + (m.hosts.length === 1 ? " node" : " nodes") : null,
      m.gpu_models.length || m.cpu_models.length ? m.gpu_models.concat(m.cpu_models).join(", ") : "device model unknown",
      m.spans + " spans", kernelsText(m)
    ];
    parts.forEach(function (p) { if (p) box.appendChild(el("span", null, p)); });
  })();

  // ---- (d) the bill ------------------------------------------------------------------------------
  var bill = D.bill;
  var gpusIn = document.getElementById("bill-gpus"), priceIn = document.getElementById("bill-price"),
      baseIn = document.getElementById("bill-baseline");
  gpusIn.value = String(bill.fleet_gpus);
  priceIn.value = String(bill.price_per_gpu_hour);
  baseIn.value = String(Math.round(bill.baseline_mfu * 1000) / 10);
  function setOut(id, value, text) {
    var e = document.getElementById(id);
    e.textContent = text;
    e.setAttribute("data-value", raw(value));
  }
  function computeBill() {
    var gpus = parseFloat(gpusIn.value), price = parseFloat(priceIn.value), base = parseFloat(baseIn.value) / 100;
    if (!(gpus >= 0)) gpus = NaN;
    if (!(price >= 0)) price = NaN;
    if (!(base > 0)) base = bill.baseline_mfu;
    var spend = gpus * price * 24;
    var idle = bad(bill.util) ? null : spend * (1 - bill.util);
    var wasteFrac = bad(bill.mfu) ? null : Math.max(0, 1 - bill.mfu / base);
    var wasted = wasteFrac === null ? null : spend * wasteFrac;
    setOut("bill-util", bill.util, fmtPct(bill.util));
    setOut("bill-mfu", bill.mfu, fmtPct(bill.mfu));
    setOut("bill-spend-day", spend, fmtUsd(spend));
    setOut("bill-idle-day", idle, fmtUsd(idle));
    setOut("bill-wasted-day", wasted, fmtUsd(wasted));
    setOut("bill-wasted-year", wasted === null ? null : wasted * 365, fmtUsd(wasted === null ? null : wasted * 365));
  }
  [gpusIn, priceIn, baseIn].forEach(function (i) { i.addEventListener("input", computeBill); });
  computeBill();
  // a measure known over part of the device time only (steps without it: live steps at step depth) says how much
  function billPart(label, value, part) {
    return !bad(value) && part < bill.device_s
      ? " (" + label + " over the " + fmtSeconds(part) + " of it whose steps have one, " + fmtPct(part / bill.device_s) + ")" : "";
  }
  document.getElementById("bill-note").textContent =
    "spend/day = " + DEV + "s × price × 24; idle/day = spend × (1 − util.resident); wasted/day = spend × max(0, 1 − MFU / baseline); " +
    "year = 365 days. util and MFU are the device-time weighted values measured over " + fmtSeconds(bill.device_s) +
    " of " + DEV + " time in this trace" +
    billPart("util", bill.util, bill.util_device_s) + billPart("MFU", bill.mfu, bill.mfu_device_s) +
    "; the price " +
    (bill.price_source === "trace" ? "is the one the trace was costed with" :
     bill.price_source === "argument" ? "was given when the report was built" : "is assumed (none in the trace): edit it") + "." +
    (bad(bill.mfu) ? " MFU is n/a, so wasted/day is not estimated from it: " + (bill.mfu_unknown_why || "it is unknown") +
     " (the steps table's wasted $ counts device time whose FLOPs are unknown as not shown to do useful work)." : "");

  // ---- diff (only on pages written by `plasmient diff --html`) -------------------------------------
  (function diffSection() {
    var X = D.diff;
    if (!X) return;
    document.getElementById("diff-section").hidden = false;
    document.getElementById("diff-sides").textContent = "A = " + X.a + " → B = " + X.b + " (this page)";
    function delta(fmt, x) { return bad(x) ? "n/a" : x === 0 ? "0" : (x > 0 ? "+" : "") + fmt(x); }
    function gflop(x) { return bad(x) ? "n/a" : x === 0 ? "0" : fmtSi(x, "FLOP"); }
    function pp(x) {  // as diff_cli._pp: two significant digits below 0.05 pp
      if (bad(x)) return "n/a";
      if (x === 0) return "0";
      var v = x * 100, av = Math.abs(v);
      return (x > 0 ? "+" : "") + (av < 0.05 ? v.toFixed(sigDecimals(av, 2)) : v.toFixed(1)) + " pp";
    }
    var T = X.totals, body = document.querySelector("#diff-totals tbody");
    function count(x) { return (x > 0 ? "+" : "") + x; }
    // a live run's step-depth steps export no kernels: the other totals and the tables are the full-depth steps'
    var sampled = T.detailed_steps && (T.detailed_steps.a !== T.steps.a || T.detailed_steps.b !== T.steps.b);
    [["steps", T.steps, String, count]].concat(sampled ? [["at full depth", T.detailed_steps, String, count]] : []).concat([
     ["MFU (step-weighted)", T.mfu, fmtPct, pp],
     ["device time (busy)", T.busy_s, fmtSeconds, function (x) { return delta(fmtSeconds, x); }],
     ["FLOPs", T.flops, gflop, function (x) { return delta(gflop, x); }],
     ["wasted", T.wasted_s, fmtSeconds, function (x) { return delta(fmtSeconds, x); }],
     ["wasted $", T.wasted_usd, fmtUsd, function (x) { return delta(fmtUsd, x); }]]).forEach(function (r) {
      var tr = el("tr", { "data-total": r[0] });
      tr.appendChild(el("td", null, r[0]));
      tr.appendChild(el("td", { "data-value": raw(r[1].a) }, r[2](r[1].a)));
      tr.appendChild(el("td", { "data-value": raw(r[1].b) }, r[2](r[1].b)));
      tr.appendChild(el("td", { "data-value": raw(r[1].delta) }, r[3](r[1].delta)));
      body.appendChild(tr);
    });
    var box = document.getElementById("diff-tables");
    if (sampled) {
      box.appendChild(el("p", { "class": "note", "id": "diff-sampled" }, "Device time, FLOPs, waste and the tables " +
        "are over the full-depth steps alone (A " + T.detailed_steps.a + " of " + T.steps.a + ", B " + T.detailed_steps.b +
        " of " + T.steps.b + "): the others ran at step depth and exported no kernels. MFU is over every step that has one."));
    }
    ["module", "op", "kernel"].forEach(function (dim) {
      var part = X[dim];
      box.appendChild(el("h3", null, "by " + dim + (dim === "module" ? " pattern" : " name")));
      var table = el("table", { "class": "diff", "data-dimension": dim }), head = el("tr");
      [dim, "time A", "time B", "Δ time", "Δ FLOPs", "MFU A → B", "Δ wasted", "Δ wasted $"].forEach(function (h) { head.appendChild(el("th", null, h)); });
      table.appendChild(el("thead")).appendChild(head);
      var tb = table.appendChild(el("tbody"));
      part.rows.forEach(function (r) {
        var tr = el("tr", { "data-name": r.name });
        function td(field, value, text) { tr.appendChild(el("td", { "data-field": field, "data-value": raw(value) }, text)); }
        td("name", null, r.name + (r.in_a ? "" : " (new)") + (r.in_b ? "" : " (gone)"));
        td("busy_s_a", r.busy_s_a, fmtSeconds(r.busy_s_a));
        td("busy_s_b", r.busy_s_b, fmtSeconds(r.busy_s_b));
        td("busy_s_delta", r.busy_s_delta, delta(fmtSeconds, r.busy_s_delta));
        td("flops_delta", r.flops_delta, delta(gflop, r.flops_delta));
        td("mfu", r.mfu_b, fmtPct(r.mfu_a) + " → " + fmtPct(r.mfu_b));
        tr.lastChild.title = "FLOP coverage " + fmtPct(r.coverage_a) + " → " + fmtPct(r.coverage_b) +
          " (MFU counts known FLOPs only; n/a where none is known)";
        td("wasted_s_delta", r.wasted_s_delta, delta(fmtSeconds, r.wasted_s_delta));
        td("wasted_usd_delta", r.wasted_usd_delta, delta(fmtUsd, r.wasted_usd_delta));
        tb.appendChild(tr);
      });
      if (part.total_rows > part.rows.length) {
        var more = el("tr", { "class": "more" });
        more.appendChild(el("td", { colspan: "8" }, "… " + (part.total_rows - part.rows.length) + " more (plasmient diff --json has every row)"));
        tb.appendChild(more);
      }
      box.appendChild(table);
    });
  })();

  // ---- steps table ----------------------------------------------------------------------------------
  (function steps() {
    var body = document.querySelector("#steps tbody"), MAX = 50;
    D.steps.slice(0, MAX).forEach(function (r) {
      var tr = el("tr", { "data-trace-id": r.trace_id, "data-step": raw(r.step) });
      function td(field, value, text) { tr.appendChild(el("td", { "data-field": field, "data-value": raw(value) }, text)); }
      td("step", r.step, r.step === null ? "n/a" : String(r.step));
      td("ranks", r.ranks, String(r.ranks));
      td("wall", r.wall_s, fmtSeconds(r.wall_s));
      td("coverage", r.coverage, fmtPct(r.coverage));
      td("util", r.util, fmtPct(r.util));
      td("mfu", r.mfu, fmtPct(r.mfu));
      td("gap", r.gap_gpu_hours, fmtGpuHours(r.gap_gpu_hours, r.device_type === "cpu" ? "CPU" : "GPU"));
      td("wasted_usd", r.wasted_usd, fmtUsd(r.wasted_usd));
      var c = el("td", { "class": "chain", "data-field": "culprit" });
      if (r.culprits.length) {
        // kernel on its own line, then op · module (layer numbers as *) · rank, then how often
        var top = r.culprits[0];
        c.setAttribute("title", top.chain);
        c.appendChild(el("span", { "class": "kernel", "data-part": "kernel" }, ellipsize(top.kernel || "—", 120)));
        var where = [top.op, top.module, top.rank === null || top.rank === undefined ? null : "rank " + top.rank].filter(function (x) { return x; });
        if (where.length) c.appendChild(el("span", { "class": "where", "data-part": "where" }, where.join(" · ")));
        if (top.count) c.appendChild(el("span", { "class": "where", "data-part": "calls" },
          top.count + (top.count === 1 ? " call" : " calls") + (top.layers > 1 ? " in " + top.layers + " modules" : "") +
          (bad(top.wasted_s) ? "" : " · " + (top.lower_bound ? "≥ " : "") + fmtSeconds(top.wasted_s) + " wasted")));
      } else c.appendChild(el("span", null, "—"));
      // The suggestion for the chain shown; the step's own one when no chain is known.
      var sugg = r.culprits.length && r.culprits[0].suggestion ? r.culprits[0].suggestion : r.suggestion;
      if (sugg) c.appendChild(el("span", { "class": "sugg" }, sugg));
      tr.appendChild(c);
      body.appendChild(tr);
    });
    if (D.steps.length > MAX) {
      var more = el("tr", { "class": "more" });
      more.appendChild(el("td", { colspan: "9" }, "… " + (D.steps.length - MAX) + " more steps (all are in the terminal summary and in the page's data block)"));
      body.appendChild(more);
    }
    document.getElementById("steps-note").textContent =
      "wall = the step's device window (from where the previous step's device work ended to its own last kernel). " +
      "coverage = share of busy device time whose FLOPs are known; MFU counts only those (n/a where none are). " +
      "gap = (util.resident − MFU) × wall × " + DEV + "s: " + DEV + "-hours the meter counts as busy that did no useful math. " +
      "wasted $ = the step's plasmient.cost.wasted_usd, priced at ingest: the cost of its device time not shown to do " +
      "work at the baseline MFU the trace was ingested with (per kernel, busy − ideal / baseline, all of it where the " +
      "FLOPs are unknown; plus idle), so it does not follow the baseline set above.";
  })();

  // ---- (a) icicle ------------------------------------------------------------------------------------
  var T = D.tree, N = T.parent.length;
  var children = [];
  for (var i = 0; i < N; i++) children.push([]);
  for (i = 0; i < N; i++) if (T.parent[i] >= 0) children[T.parent[i]].push(i);
  var ROW = 22, MIN_PX = 1.5, MAX_CELLS = 4000;
  var icicle = document.getElementById("icicle"), crumbs = document.getElementById("icicle-crumbs"),
      upBtn = document.getElementById("icicle-up"), detail = document.getElementById("icicle-detail");
  var zoomRoot = T.root;
  function nodeName(i) { return T.names[T.name[i]]; }
  // Module names are dotted paths (model.encoder.layer.3); the path above is in the cells above,
  // so a cell shows the last segment and the full path is in its tooltip and the detail panel.
  function cellName(i) {
    var n = nodeName(i);
    if (levelName(i) !== "module") return n;
    var dot = n.lastIndexOf(".");
    return dot > 0 && dot < n.length - 1 ? n.slice(dot + 1) : n;
  }
  function levelName(i) { return D.levels[T.level[i]]; }
  function nodeText(i) {
    return nodeName(i) + " · util " + fmtPct(T.util[i]) + " · MFU " + fmtPct(T.mfu[i]);
  }
  function showDetail(i) {
    detail.innerHTML = "";
    if (i < 0) return;
    detail.setAttribute("data-idx", String(i));
    detail.appendChild(el("div", { "class": "dname" }, levelName(i) + ": " + nodeName(i)));
    var dl = el("dl");
    var fields = [
      ["wall", fmtSeconds(T.wall[i]), T.wall[i]], [DEV + "s", bad(T.gpus[i]) ? "n/a" : String(T.gpus[i]), T.gpus[i]],
      ["util.resident", fmtPct(T.util[i]), T.util[i]], ["MFU", fmtPct(T.mfu[i]), T.mfu[i]],
      ["bound", T.bound[i] >= 0 ? D.bounds[T.bound[i]] : "n/a", null],
      ["FLOPs", fmtSi(T.flops[i], "FLOP"), T.flops[i]], ["bytes", fmtSi(T.bytes[i], "B"), T.bytes[i]],
      ["intensity", bad(T.ai[i]) ? "n/a" : T.ai[i].toPrecision(3) + " FLOP/B", T.ai[i]],
      ["cost", fmtUsd(T.cost[i]), T.cost[i]], ["wasted $", fmtUsd(T.wasted_usd[i]), T.wasted_usd[i]],
      ["wasted " + DEV + "-s", fmtSeconds(T.wasted_s[i]), T.wasted_s[i]],
      ["span id", T.span_id[i] || "—", null]
    ];
    fields.forEach(function (f) {
      dl.appendChild(el("dt", null, f[0]));
      dl.appendChild(el("dd", { "data-field": f[0], "data-value": raw(f[2]) }, f[1]));
    });
    detail.appendChild(dl);
  }
  function pathTo(i) { var p = []; while (i >= 0) { p.unshift(i); i = T.parent[i]; } return p; }
  function zoom(i) {
    if (i < 0 || i >= N) return;
    zoomRoot = i;
    renderIcicle();
  }
  function renderIcicle() {
    icicle.innerHTML = "";
    crumbs.innerHTML = "";
    if (N === 0 || zoomRoot < 0) { icicle.appendChild(el("div", { "class": "note" }, "no spans")); return; }
    var W = icicle.clientWidth || 1200;
    var cells = [], stack = [[zoomRoot, 0, 1, 0]], maxDepth = 0;
    while (stack.length) {
      var s = stack.pop(), n = s[0], x0 = s[1], x1 = s[2], depth = s[3];
      if ((x1 - x0) * W < MIN_PX) continue;
      cells.push(s);
      if (depth > maxDepth) maxDepth = depth;
      var ch = children[n];
      if (!ch.length) continue;
      var sum = 0;
      for (var j = 0; j < ch.length; j++) sum += T.value[ch[j]] || 0;
      var denom = Math.max(T.value[n] || 0, sum) || 1, x = x0, run = null;
      // Runs of children too narrow to draw become one "N small spans" cell, so that the blank
      // part under a span keeps meaning idle time, not "too small to see".
      var flush = function (d) {
        if (run && (run.x1 - run.x0) * W >= 1) cells.push([run.parent, run.x0, run.x1, d, run]);
        run = null;
      };
      for (j = 0; j < ch.length; j++) {
        var c = ch[j], v = T.value[c] || 0, w = (x1 - x0) * v / denom;
        if (w * W < MIN_PX) {
          if (!run) run = { parent: n, x0: x, x1: x, count: 0, u: 0, uw: 0, m: 0, mw: 0 };
          run.x1 = x + w; run.count++;
          if (!bad(T.util[c])) { run.u += T.util[c] * v; run.uw += v; }
          if (!bad(T.mfu[c])) { run.m += T.mfu[c] * v; run.mw += v; }
        } else {
          flush(depth + 1);
          stack.push([c, x, x + w, depth + 1]);
        }
        x += w;
      }
      flush(depth + 1);
    }
    if (cells.length > MAX_CELLS) {
      cells.sort(function (a, b) { return (b[2] - b[1]) - (a[2] - a[1]); });
      cells.length = MAX_CELLS;
    }
    maxDepth = 0;
    cells.forEach(function (c) { if (c[3] > maxDepth) maxDepth = c[3]; });
    icicle.style.height = ((maxDepth + 1) * ROW + 2) + "px";
    var frag = document.createDocumentFragment();
    cells.forEach(function (c) {
      var n = c[0], left = c[1] * W, width = Math.max(1, (c[2] - c[1]) * W), run = c[4];
      var util = run ? (run.uw ? run.u / run.uw : null) : T.util[n];
      var mfu = run ? (run.mw ? run.m / run.mw : null) : T.mfu[n];
      var name = run ? run.count + " small spans" : cellName(n);
      var cls = "cell" + (width < 150 ? " narrow" : "") + (width < 24 ? " tiny" : "") +
        (run || levelName(n) === "other" ? " other" : "");
      var d = el("div", {
        "class": cls, "data-idx": String(n), "data-level": run ? "merged" : levelName(n), "data-span-id": run ? "" : (T.span_id[n] || ""),
        "data-merged": run ? "1" : null, "data-util": raw(util), "data-mfu": raw(mfu),
        title: run ? run.count + " spans under " + nodeName(n) + ", each too narrow to draw · util " + fmtPct(util) + " · MFU " + fmtPct(mfu) + " (click to zoom in)"
                   : levelName(n) + " · " + nodeText(n)
      });
      d.style.left = left.toFixed(1) + "px";
      d.style.width = width.toFixed(1) + "px";
      d.style.top = (c[3] * ROW) + "px";
      d.style.background = mfuColor(mfu);
      d.appendChild(el("span", { "class": "nm" }, name));
      d.appendChild(el("span", { "class": "um", "data-field": "util" }, "util " + fmtPct(util)));
      d.appendChild(el("span", { "class": "um", "data-field": "mfu" }, "MFU " + fmtPct(mfu)));
      frag.appendChild(d);
    });
    icicle.appendChild(frag);
    icicle.setAttribute("data-root-idx", String(zoomRoot));
    icicle.setAttribute("data-root-level", levelName(zoomRoot));
    icicle.setAttribute("data-root-span-id", T.span_id[zoomRoot] || "");
    icicle.setAttribute("data-cells", String(cells.length));
    var path = pathTo(zoomRoot);
    path.forEach(function (p, k) {
      if (k) crumbs.appendChild(el("span", { "class": "sep" }, "›"));
      var label = ellipsize(cellName(p), 48);
      if (p === zoomRoot) crumbs.appendChild(el("span", { "class": "here", "data-idx": String(p), "data-level": levelName(p), title: nodeName(p) }, label));
      else crumbs.appendChild(el("a", { "data-idx": String(p), "data-level": levelName(p), title: nodeName(p) }, label));
    });
    upBtn.disabled = T.parent[zoomRoot] < 0;
    showDetail(zoomRoot);
  }
  icicle.addEventListener("click", function (ev) {
    var c = ev.target.closest(".cell");
    if (!c) return;
    var n = parseInt(c.getAttribute("data-idx"), 10);
    // A merged cell zooms into the span holding the small ones; clicking the current root zooms
    // out, as in a flame graph.
    if (c.hasAttribute("data-merged")) { if (n !== zoomRoot) zoom(n); return; }
    zoom(n === zoomRoot && T.parent[n] >= 0 ? T.parent[n] : n);
  });
  icicle.addEventListener("mouseover", function (ev) {
    var c = ev.target.closest(".cell");
    if (c && !c.hasAttribute("data-merged")) showDetail(parseInt(c.getAttribute("data-idx"), 10));
  });
  icicle.addEventListener("mouseleave", function () { showDetail(zoomRoot); });
  crumbs.addEventListener("click", function (ev) {
    var a = ev.target.closest("a[data-idx]");
    if (a) zoom(parseInt(a.getAttribute("data-idx"), 10));
  });
  upBtn.addEventListener("click", function () { if (T.parent[zoomRoot] >= 0) zoom(T.parent[zoomRoot]); });
  document.addEventListener("keydown", function (ev) {
    if (ev.key === "Escape" && zoomRoot >= 0 && T.parent[zoomRoot] >= 0) zoom(T.parent[zoomRoot]);
  });
  (function legend() {
    var lg = document.getElementById("mfu-legend"), stops = [];
    for (var k = 0; k <= 10; k++) stops.push(mfuColor(k / 10 * (D.bill.baseline_mfu || 0.46)));
    lg.appendChild(el("span", null, "MFU 0%"));
    var g = el("span", { "class": "grad" });
    g.style.background = "linear-gradient(to right," + stops.join(",") + ")";
    lg.appendChild(g);
    lg.appendChild(el("span", null, "≥ baseline " + fmtPct(D.bill.baseline_mfu)));
    lg.appendChild(el("span", { "class": "na" }));
    lg.appendChild(el("span", null, "n/a (peak unknown)"));
  })();
  document.getElementById("icicle-note").textContent =
    "Width, from fleet down to step: device time (wall × " + DEV + "s); below the step: " + DEV + "-resident time, so the empty part " +
    "under a step is time its " + DEV + " sat idle. Children are laid out in start order inside their parent. " +
    (T.spans_shown < T.spans_total
      ? "Showing the " + T.spans_shown + " largest of " + T.spans_total + " spans (and their ancestors); the rest are folded into " +
        T.folded_cells + " striped “… N more” cells carrying their summed time and weighted util/MFU."
      : "All " + T.spans_total + " spans are shown; cells narrower than a pixel are not drawn until you zoom in.");

  // ---- (b) timeline ----------------------------------------------------------------------------------
  var TL = D.timeline;
  (function legendBounds() {
    ["timeline-legend", "roofline-legend"].forEach(function (id) {
      var lg = document.getElementById(id);
      D.bounds.forEach(function (b) {
        if (id === "roofline-legend" && b === "idle") return;
        var s = el("span"), sw = el("span", { "class": "sw" });
        sw.style.background = BOUND_COLOR[b];
        s.appendChild(sw); s.appendChild(document.createTextNode(b + (b === "idle" && id === "timeline-legend" ? " (gaps)" : "")));
        lg.appendChild(s);
      });
    });
  })();
  var canvas = document.getElementById("timeline"), tip = document.getElementById("timeline-tip");
  var LABEL_W = 190, LANE_H = 14, LANE_GAP = 3, STEP_H = 14, AXIS_H = 34;
  var view = [0, TL.t_end_us || 1];
  var laneItems = [];  // per lane: indices of individually drawn kernels, in start order
  for (i = 0; i < TL.lanes.length; i++) laneItems.push([]);
  for (i = 0; i < TL.lane.length; i++) laneItems[TL.lane[i]].push(i);
  laneItems.forEach(function (l) { l.sort(function (a, b) { return TL.start[a] - TL.start[b]; }); });
  function laneLabel(l) {
    var L = TL.lanes[l], p = [];
    p.push(L.rank === null ? "rank ?" : "rank " + L.rank);
    if (DEV === "CPU") p.push("cpu");  // a CPU rank's ops that stand for kernels: one lane per rank
    else p.push(L.device === null ? "gpu ?" : "gpu " + L.device);
    if (L.stream !== null) p.push("stream " + L.stream);
    return p.join(" · ");
  }
  function niceStep(span, target) {
    var raw = span / target, mag = Math.pow(10, Math.floor(Math.log10(raw))), r = raw / mag;
    return (r < 1.5 ? 1 : r < 3.5 ? 2 : r < 7.5 ? 5 : 10) * mag;
  }
  function drawTimeline() {
    var W = canvas.parentElement.clientWidth || 1200;
    var H = AXIS_H + Math.max(1, TL.lanes.length) * (LANE_H + LANE_GAP) + 6;
    var dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(W * dpr); canvas.height = Math.round(H * dpr);
    canvas.style.height = H + "px";
    var g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, W, H);
    g.font = "11px 'DejaVu Sans', sans-serif";
    if (!TL.kernels_total) {
      g.fillStyle = "#656d76";
      g.fillText("no kernels in this trace (step-level sampling, or no device work)", 10, 16);
      canvas.setAttribute("data-drawn", "0");
      return;
    }
    var plotW = W - LABEL_W - 8, v0 = view[0], v1 = view[1], sc = plotW / (v1 - v0);
    function X(us) { return LABEL_W + (us - v0) * sc; }
    // step bands
    TL.steps.forEach(function (s, k) {
      var a = Math.max(X(s.start), LABEL_W), b = Math.min(X(s.end), W);
      if (b <= a) return;
      g.fillStyle = k % 2 ? "#dfe7f1" : "#c9d6e6";
      g.fillRect(a, 0, b - a, STEP_H);
      g.fillStyle = "#333";
      if (b - a > 50) g.fillText("step " + (s.step === null ? "?" : s.step), a + 3, 11);
    });
    // axis
    var stepUs = niceStep(v1 - v0, Math.max(2, plotW / 110));
    g.strokeStyle = "#d0d7de"; g.fillStyle = "#656d76";
    for (var t = Math.ceil(v0 / stepUs) * stepUs; t <= v1; t += stepUs) {
      var x = X(t);
      g.beginPath(); g.moveTo(x, STEP_H + 2); g.lineTo(x, H); g.stroke();
      g.fillText(fmtUs(t), x + 2, AXIS_H - 6);
    }
    var drawn = 0;
    for (var l = 0; l < TL.lanes.length; l++) {
      var y = AXIS_H + l * (LANE_H + LANE_GAP);
      g.fillStyle = "#444";
      g.fillText(ellipsize(laneLabel(l), 32), 4, y + LANE_H - 3);
      g.fillStyle = BOUND_COLOR.idle;
      g.fillRect(LABEL_W, y, plotW, LANE_H);
    }
    if (TL.mode === "binned") {
      for (i = 0; i < TL.bin_lane.length; i++) {
        var bx = X(TL.bin_start[i]), bw = Math.max(1, TL.bin_us * sc);
        if (bx + bw < LABEL_W || bx > W) continue;
        g.globalAlpha = 0.25 + 0.75 * TL.bin_occupancy[i];
        g.fillStyle = BOUND_COLOR[boundName(TL.bin_bound[i])];
        g.fillRect(Math.max(bx, LABEL_W), AXIS_H + TL.bin_lane[i] * (LANE_H + LANE_GAP), bw, LANE_H);
        drawn++;
      }
      g.globalAlpha = 1;
    }
    for (i = 0; i < TL.lane.length; i++) {
      var kx = X(TL.start[i]), kw = Math.max(1, TL.dur[i] * sc);
      if (kx + kw < LABEL_W || kx > W) continue;
      g.fillStyle = BOUND_COLOR[boundName(TL.bound[i])];
      g.fillRect(Math.max(kx, LABEL_W), AXIS_H + TL.lane[i] * (LANE_H + LANE_GAP), Math.min(kw, kx + kw - LABEL_W), LANE_H);
      drawn++;
    }
    canvas.setAttribute("data-drawn", String(drawn));
    canvas.setAttribute("data-view", v0 + "," + v1);
  }
  function usAt(px) {
    var W = canvas.clientWidth, plotW = W - LABEL_W - 8;
    return view[0] + (px - LABEL_W) / plotW * (view[1] - view[0]);
  }
  canvas.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    var r = canvas.getBoundingClientRect(), at = usAt(ev.clientX - r.left);
    var f = ev.deltaY > 0 ? 1.25 : 0.8, span = (view[1] - view[0]) * f;
    span = Math.max(span, 0.05);
    var frac = (at - view[0]) / (view[1] - view[0]);
    view = [at - frac * span, at - frac * span + span];
    drawTimeline();
  }, { passive: false });
  var drag = null;
  canvas.addEventListener("mousedown", function (ev) { drag = { x: ev.clientX, v: view.slice() }; canvas.style.cursor = "grabbing"; });
  window.addEventListener("mouseup", function () { drag = null; canvas.style.cursor = ""; });
  window.addEventListener("mousemove", function (ev) {
    if (!drag) return;
    var plotW = canvas.clientWidth - LABEL_W - 8, d = (ev.clientX - drag.x) / plotW * (drag.v[1] - drag.v[0]);
    view = [drag.v[0] - d, drag.v[1] - d];
    drawTimeline();
  });
  canvas.addEventListener("dblclick", function () { view = [0, TL.t_end_us || 1]; drawTimeline(); });
  canvas.addEventListener("mousemove", function (ev) {
    if (drag) return;
    var r = canvas.getBoundingClientRect(), px = ev.clientX - r.left, py = ev.clientY - r.top;
    var l = Math.floor((py - AXIS_H) / (LANE_H + LANE_GAP));
    if (px < LABEL_W || l < 0 || l >= TL.lanes.length) { tip.style.display = "none"; return; }
    var at = usAt(px), slack = 2 * (view[1] - view[0]) / (canvas.clientWidth - LABEL_W), items = laneItems[l], hit = -1;
    var lo = 0, hi = items.length - 1;
    while (lo <= hi) { var mid = (lo + hi) >> 1; if (TL.start[items[mid]] <= at + slack) lo = mid + 1; else hi = mid - 1; }
    for (var k = hi; k >= 0 && k > hi - 64; k--) {
      var it = items[k];
      if (TL.start[it] - slack <= at && TL.start[it] + TL.dur[it] + slack >= at) { hit = it; break; }
    }
    var text;
    if (hit >= 0) {
      text = TL.names[TL.name[hit]] + "\n" + fmtUs(TL.dur[hit]) + " · " + boundName(TL.bound[hit]) +
        (TL.kind ? " · " + (TL.kind[hit] || "") : "") + " · at " + fmtUs(TL.start[hit]);
    } else if (TL.mode === "binned") {
      text = laneLabel(l) + ": merged short kernels here (" + fmtUs(TL.bin_us) + " bins)";
    } else {
      text = laneLabel(l) + ": idle at " + fmtUs(at);
    }
    tip.textContent = text;
    tip.style.whiteSpace = "pre-wrap";
    tip.style.display = "block";
    tip.style.left = Math.min(px + 12, canvas.clientWidth - 300) + "px";
    tip.style.top = (py + 14) + "px";
  });
  canvas.addEventListener("mouseleave", function () { tip.style.display = "none"; });
  document.getElementById("timeline-note").textContent = !TL.kernels_total ? "" :
    (TL.mode === "binned"
      ? TL.kernels_total + " kernels: " + TL.drawn + " at least one bin (" + fmtUs(TL.bin_us) + ") long are drawn one by one; the shorter ones are merged into " +
        TL.bins_per_lane + " bins per lane, coloured by the bound holding most time in the bin, opacity = occupancy."
      : "All " + TL.kernels_total + " " + (TL.item === "ops" ? "ops (the CPU's kernels)" : "kernel spans") + " drawn one by one.") +
    (foldedKernels(D.meta)
      ? " The other " + foldedKernels(D.meta) + " kernels were folded into their ops by the span budget " +
        "(ingest with a larger --max-spans to draw them): a rank or stream with none left has no lane."
      : "") +
    " Grey = idle: the host gap before a step's first kernel is that step's idle time. Times are relative to the start of the first step's device window.";

  // ---- (c) roofline ------------------------------------------------------------------------------------
  function drawRoofline() {
    var R = D.roofline, svg = document.getElementById("roofline");
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var W = svg.clientWidth || 900, H = svg.clientHeight || 460, m = { l: 64, r: 16, t: 14, b: 40 };
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    function S(tag, attrs, text) {
      var e = document.createElementNS(SVGNS, tag);
      for (var k in attrs) e.setAttribute(k, attrs[k]);
      if (text !== undefined) e.textContent = text;
      svg.appendChild(e);
      return e;
    }
    var n = R.x ? R.x.length : 0;
    svg.setAttribute("data-points", String(n));
    if (!n) {
      S("text", { x: 20, y: 30 }, "no kernel has both a FLOP count and a byte count: nothing to place on a roofline");
      return;
    }
    var xs = R.x.slice(), ys = R.y.slice();
    R.roofs.forEach(function (r) {
      if (r.peak_flops) ys.push(r.peak_flops);
      if (r.peak_flops && r.peak_bandwidth) xs.push(r.peak_flops / r.peak_bandwidth);
    });
    var lx0 = Math.floor(Math.log10(Math.min.apply(null, xs)) - 0.3), lx1 = Math.ceil(Math.log10(Math.max.apply(null, xs)) + 0.3);
    var ly0 = Math.floor(Math.log10(Math.min.apply(null, ys)) - 0.3), ly1 = Math.ceil(Math.log10(Math.max.apply(null, ys)) + 0.3);
    var pw = W - m.l - m.r, ph = H - m.t - m.b;
    function X(v) { return m.l + (Math.log10(v) - lx0) / (lx1 - lx0) * pw; }
    function Y(v) { return m.t + ph - (Math.log10(v) - ly0) / (ly1 - ly0) * ph; }
    for (var e = lx0; e <= lx1; e++) {
      S("line", { x1: X(Math.pow(10, e)), x2: X(Math.pow(10, e)), y1: m.t, y2: m.t + ph, "class": "grid" });
      S("text", { x: X(Math.pow(10, e)) - 10, y: H - m.b + 16 }, "1e" + e);
    }
    for (e = ly0; e <= ly1; e++) {
      S("line", { x1: m.l, x2: m.l + pw, y1: Y(Math.pow(10, e)), y2: Y(Math.pow(10, e)), "class": "grid" });
      S("text", { x: 6, y: Y(Math.pow(10, e)) + 4 }, fmtSi(Math.pow(10, e), "FLOP/s"));
    }
    S("text", { x: m.l + pw / 2 - 120, y: H - 6 }, "arithmetic intensity (FLOP / byte)");
    var xmin = Math.pow(10, lx0), xmax = Math.pow(10, lx1);
    R.roofs.forEach(function (r) {
      if (!r.peak_flops) return;
      var label = (r.model ? r.model + ": " : "") + fmtSi(r.peak_flops, "FLOP/s") +
        (r.peak_bandwidth ? " · " + fmtSi(r.peak_bandwidth, "B/s") : " (bandwidth unknown)");
      if (r.peak_bandwidth) {
        var ridge = r.peak_flops / r.peak_bandwidth, x0 = Math.max(xmin, Math.pow(10, ly0) / r.peak_bandwidth);
        S("polyline", { "class": "roof", points: X(x0) + "," + Y(r.peak_bandwidth * x0) + " " + X(ridge) + "," + Y(r.peak_flops) + " " + X(xmax) + "," + Y(r.peak_flops),
          "data-peak-flops": String(r.peak_flops), "data-peak-bandwidth": String(r.peak_bandwidth) });
      } else {
        S("line", { "class": "roof nobw", x1: X(xmin), x2: X(xmax), y1: Y(r.peak_flops), y2: Y(r.peak_flops), "data-peak-flops": String(r.peak_flops) });
      }
      S("text", { x: m.l + pw - 6, y: Y(r.peak_flops) - 5, "text-anchor": "end" }, label);
    });
    var tmax = Math.max.apply(null, R.t) || 1;
    var order = [];
    for (var k = 0; k < n; k++) order.push(k);
    order.sort(function (a, b) { return R.t[b] - R.t[a]; });  // big first so small ones stay visible on top
    order.forEach(function (k) {
      var c = S("circle", { cx: X(R.x[k]).toFixed(1), cy: Y(R.y[k]).toFixed(1), r: (2 + 7 * Math.sqrt(R.t[k] / tmax)).toFixed(1),
        fill: BOUND_COLOR[boundName(R.bound[k])] });
      var title = document.createElementNS(SVGNS, "title");
      title.textContent = R.names[R.name[k]] + "\n" + R.x[k].toPrecision(3) + " FLOP/B · " + fmtSi(R.y[k], "FLOP/s") + " · " +
        fmtSeconds(R.t[k]) + (R.count[k] > 1 ? " over " + R.count[k] + " kernels" : "") + " · " + boundName(R.bound[k]);
      c.appendChild(title);
    });
    var noBw = R.roofs.some(function (r) { return r.peak_flops && !r.peak_bandwidth; });
    var noPeak = !R.roofs.some(function (r) { return r.peak_flops; });
    document.getElementById("roofline-note").textContent =
      (R.mode === "by_name" ? "One point per kernel name and device (" + n + " points for " + R.kernels_total + " kernels): summed FLOPs over summed bytes and time. "
                            : n + " kernels plotted one by one. ") +
      "Achieved FLOP/s = flops / kernel wall; dot area ∝ time. " +
      (R.excluded ? R.excluded + " kernels are not plotted (" + Object.keys(R.excluded_why || {}).filter(function (k) { return R.excluded_why[k]; })
        .map(function (k) { return R.excluded_why[k] + " " + k; }).join(", ") + "). " : "") +
      (R.above_roof ? R.above_roof + " kernels sit above their roof: their modelled FLOPs are more than the peak of " +
        "their precision allows in their time (Winograd and FFT convolutions do fewer multiplies than the direct count), " +
        "so their ideal time is capped at their time (plasmient.kernels.over_peak). " : "") +
      (noBw ? "The device bandwidth is not in the trace, so only the compute roof (dashed) is drawn." : "") +
      (noPeak ? "The " + DEV + "'s peak FLOP/s is unknown, so no roof is drawn." : "");
  }

  function renderAll() { renderIcicle(); drawTimeline(); drawRoofline(); }
  var resizeTimer = null;
  window.addEventListener("resize", function () { clearTimeout(resizeTimer); resizeTimer = setTimeout(renderAll, 120); });
  renderAll();
  document.body.setAttribute("data-ready", "1");
})();
