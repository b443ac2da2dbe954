// pagedserve dashboard: draws what /dashboard/events pushes. No libraries: canvas and the DOM.
// The pool arrives as runs (see pagedserve/core/snapshot.py): start, length, owner, first_pos,
// pos_step, ref_cnt, cached. window.pagedserveDashboard holds the decoded state (tests read it).
"use strict";
(function () {
  const RUN_WIDTH = 7;
  const BG = [24, 28, 36], FREE = [38, 43, 54], CACHED_FREE = [46, 92, 100];

  const state = {
    info: null, points: [], snapshot: null, verdict: null, totals: null,
    pool: null, host: null, rows: [], frames: 0, connected: false,
    sort: { key: "state", dir: 1 }, grids: {}, charts: {},
  };
  window.pagedserveDashboard = state;

  // -- colours --------------------------------------------------------------------------
  // Hues by golden-angle steps in order of first sight: requests live at the same time get
  // hues far apart, and a request keeps its hue for as long as the page knows it.
  const hues = new Map();
  let huesGiven = 0;
  function hue(id) {
    let h = hues.get(id);
    if (h === undefined) {
      h = (huesGiven++ * 137.508) % 360;
      hues.set(id, h);
    }
    return h;
  }
  function forgetHues(liveIds) {  // keep the map bounded on a long-running page
    if (hues.size < 4096) return;
    const live = new Set(liveIds);
    for (const id of hues.keys()) if (!live.has(id)) hues.delete(id);
  }
  function hsl(h, s, l) {
    s /= 100; l /= 100;
    const k = n => (n + h / 30) % 12, a = s * Math.min(l, 1 - l);
    const f = n => l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)));
    return [Math.round(255 * f(0)), Math.round(255 * f(8)), Math.round(255 * f(4))];
  }
  const css = c => `rgb(${c[0]},${c[1]},${c[2]})`;
  function ownerColour(row, lightness, saturation) {
    return hsl(hue(row[0]), saturation || 68, lightness || 55);
  }

  // -- pool decoding ----------------------------------------------------------------------
  function decode(runs, n) {
    const owner = new Int32Array(n).fill(-2), pos = new Int32Array(n), ref = new Int32Array(n);
    const cached = new Uint8Array(n);
    for (let i = 0; i < runs.length; i += RUN_WIDTH) {
      const start = runs[i], len = runs[i + 1], own = runs[i + 2], p0 = runs[i + 3], step = runs[i + 4];
      for (let k = 0; k < len; k++) {
        const b = start + k;
        owner[b] = own; pos[b] = own >= 0 ? p0 + k * step : 0; ref[b] = runs[i + 5]; cached[b] = runs[i + 6];
      }
    }
    let used = 0, cachedFree = 0, free = 0, uncovered = 0;
    for (let b = 0; b < n; b++) {
      if (owner[b] === -2) uncovered++;
      else if (ref[b] > 0) used++;
      else if (cached[b]) cachedFree++;
      else free++;
    }
    return { n, owner, pos, ref, cached, used, cachedFree, free, uncovered };
  }

  // -- the block grid -------------------------------------------------------------------------
  // A cell per block while they fit in maxHeight at 1 px; past that (a million-block host
  // pool) a cell stands for `per` consecutive blocks and shows the busiest of them.
  class Grid {
    constructor(canvas, maxHeight) { this.canvas = canvas; this.maxHeight = maxHeight; this.layout = null; }
    size(n) {
      const width = Math.max(this.canvas.parentElement.clientWidth, 100);
      const per = Math.max(1, Math.ceil(n / (width * this.maxHeight)));
      const cells = Math.ceil(n / per);
      let cell = Math.floor(Math.sqrt((width * this.maxHeight) / Math.max(cells, 1)));
      cell = Math.max(1, Math.min(cell, 30));
      const cols = Math.max(1, Math.floor(width / cell));
      const rows = Math.ceil(cells / cols);
      this.layout = { n, per, cells, cell, cols, rows, width: cols * cell, height: Math.max(rows * cell, 1) };
      this.canvas.width = this.layout.width;
      this.canvas.height = this.layout.height;
      this.canvas.style.height = this.layout.height + "px";
      this.canvas.style.width = this.layout.width + "px";
      return this.layout;
    }
    cellAt(x, y) {  // the cell under canvas coordinates, or -1
      const L = this.layout;
      if (!L) return -1;
      const col = Math.floor(x / L.cell), row = Math.floor(y / L.cell);
      if (col < 0 || col >= L.cols || row < 0) return -1;
      const i = row * L.cols + col;
      return i < L.cells ? i : -1;
    }
    cellCentre(i) {
      const L = this.layout;
      return { x: (i % L.cols) * L.cell + L.cell / 2, y: Math.floor(i / L.cols) * L.cell + L.cell / 2 };
    }
    representative(pool, c) {  // the block a cell shows: in use before cached-free before free
      const L = this.layout;
      if (L.per === 1) return c;
      let best = c * L.per, rank = -1;
      for (let b = c * L.per; b < Math.min((c + 1) * L.per, pool.n); b++) {
        const r = pool.ref[b] > 0 ? 2 : pool.cached[b] ? 1 : 0;
        if (r > rank) { rank = r; best = b; if (r === 2) break; }
      }
      return best;
    }
    draw(pool, rows, host) {
      const L = this.layout && this.layout.n === pool.n ? this.layout : this.size(pool.n);
      const ctx = this.canvas.getContext("2d");
      const img = ctx.createImageData(L.width, L.height);
      const px = new Uint32Array(img.data.buffer);
      const pack = c => (255 << 24) | (c[2] << 16) | (c[1] << 8) | c[0];
      const bg = pack(BG), white = pack([255, 255, 255]);
      px.fill(bg);
      const gap = L.cell >= 6 ? 1 : 0, mark = L.cell >= 8 ? Math.max(2, L.cell >> 2) : 0;
      const colours = new Map();
      for (let c = 0; c < L.cells; c++) {
        const b = this.representative(pool, c), own = pool.owner[b];
        let colour;
        if (own < 0) colour = pack(pool.cached[b] ? CACHED_FREE : FREE);
        else {
          const key = own * 2 + (pool.cached[b] ? 1 : 0);
          colour = colours.get(key);
          if (colour === undefined) {
            const row = rows[own] || ["?"];
            colour = pack(host ? ownerColour(row, 42, 35) : ownerColour(row, pool.cached[b] ? 68 : 55));
            colours.set(key, colour);
          }
        }
        const x0 = (c % L.cols) * L.cell, y0 = Math.floor(c / L.cols) * L.cell, size = L.cell - gap;
        for (let y = 0; y < size; y++) {
          const base = (y0 + y) * L.width + x0;
          // host blocks are striped: the KV is on the host side, not in the device pool
          px.fill(host && own >= 0 && size > 3 && y % 3 === 0 ? bg : colour, base, base + size);
        }
        if (mark && pool.ref[b] > 1) {
          for (let y = 0; y < mark; y++) px.fill(white, (y0 + y) * L.width + x0, (y0 + y) * L.width + x0 + mark - y);
        }
      }
      ctx.putImageData(img, 0, 0);
    }
  }

  // -- charts ------------------------------------------------------------------------------------
  const PCT = v => (100 * v).toFixed(0) + "%";
  const MS = v => v >= 1 ? v.toFixed(v >= 10 ? 0 : 1) + " s" : (1000 * v < 10 ? (1000 * v).toFixed(1) : (1000 * v).toFixed(0)) + " ms";
  const NUM = v => (Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2));
  const INT = v => v.toFixed(0);
  const CHARTS = [
    { id: "kv", title: "KV usage", max: 1, fmt: PCT, series: [["kv", "usage", "#5aa9e6"]] },
    { id: "requests", title: "Requests", fmt: INT,
      series: [["running", "running", "#3fb27f"], ["waiting", "waiting", "#e0a43a"], ["swapped", "swapped", "#b48ade"]] },
    { id: "preemptions", title: "Preemptions / s", fmt: NUM, bars: true,
      series: [["preempt_recompute", "recompute", "#ef6f6c"], ["preempt_swap", "swap", "#b48ade"]] },
    { id: "hit_rate", title: "Prefix-cache hit rate", max: 1, fmt: PCT, series: [["hit_rate", "hit rate", "#4fc1c9"]] },
    { id: "tokens", title: "Tokens per step", fmt: NUM,
      series: [["prefill_per_step", "prefill", "#e0a43a"], ["decode_per_step", "decode", "#5aa9e6"]] },
    { id: "busy", title: "Engine busy (forward / wall)", max: 1, fmt: PCT, series: [["busy", "busy", "#3fb27f"]] },
    { id: "ttft", title: "TTFT (sliding window)", fmt: MS,
      series: [["ttft_p50", "P50", "#5aa9e6"], ["ttft_p99", "P99", "#ef6f6c"]] },
    { id: "itl", title: "ITL (sliding window)", fmt: MS,
      series: [["itl_p50", "P50", "#5aa9e6"], ["itl_p99", "P99", "#ef6f6c"]] },
  ];

  class Chart {
    constructor(spec, parent) {
      this.spec = spec;
      const fig = document.createElement("figure");
      fig.dataset.chart = spec.id;
      const cap = document.createElement("figcaption");
      cap.innerHTML = `<span>${spec.title}</span><span class="vals"></span>`;
      this.vals = cap.querySelector(".vals");
      this.canvas = document.createElement("canvas");
      this.canvas.className = "chart";
      fig.append(cap, this.canvas);
      parent.append(fig);
      this.drawn = {};  // series key -> values drawn (tests read these)
    }
    draw(points) {
      const spec = this.spec, canvas = this.canvas, dpr = window.devicePixelRatio || 1;
      const w = canvas.clientWidth || 300, h = canvas.clientHeight || 110;
      canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
      const ctx = canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, w, h);
      const left = 44, right = 6, top = 6, bottom = 16, pw = w - left - right, ph = h - top - bottom;
      let ymax = spec.max || 0;
      if (!spec.max) for (const [key] of spec.series) for (const p of points) if (p[key] != null && p[key] > ymax) ymax = p[key];
      if (!spec.max) ymax = ymax > 0 ? ymax * 1.15 : 1;
      const t1 = points.length ? points[points.length - 1].t : 0, t0 = points.length ? points[0].t : 0;
      const span = Math.max(t1 - t0, 1e-9);
      const X = t => left + ((t - t0) / span) * pw, Y = v => top + ph - (v / ymax) * ph;
      ctx.strokeStyle = "#2a303c"; ctx.lineWidth = 1; ctx.fillStyle = "#8a93a3"; ctx.font = "10px system-ui, sans-serif";
      ctx.beginPath();
      for (const f of [0, 0.5, 1]) { const y = Math.round(top + ph - f * ph) + 0.5; ctx.moveTo(left, y); ctx.lineTo(left + pw, y); }
      ctx.stroke();
      ctx.textAlign = "right";
      ctx.fillText(spec.fmt(ymax), left - 4, top + 8);
      ctx.fillText(spec.fmt(0), left - 4, top + ph);
      ctx.textAlign = "left";
      if (points.length > 1) ctx.fillText(`-${span.toFixed(span < 10 ? 1 : 0)} s`, left, h - 3);
      ctx.textAlign = "right"; ctx.fillText("now", left + pw, h - 3);
      const labels = [];
      spec.series.forEach(([key, label, colour], index) => {
        const values = points.map(p => p[key]);
        this.drawn[key] = values;
        ctx.strokeStyle = colour; ctx.fillStyle = colour; ctx.lineWidth = 1.5;
        if (spec.bars) {
          const bw = Math.max(1, pw / Math.max(points.length, 1) / spec.series.length);
          points.forEach((p, i) => {
            const v = p[key];
            if (v) ctx.fillRect(X(p.t) - bw * (spec.series.length - index), Y(v), bw, top + ph - Y(v));
          });
        } else {
          ctx.beginPath();
          let pen = false;
          points.forEach(p => {
            const v = p[key];
            if (v == null) { pen = false; return; }
            if (pen) ctx.lineTo(X(p.t), Y(v)); else ctx.moveTo(X(p.t), Y(v));
            pen = true;
          });
          ctx.stroke();
        }
        const last = [...values].reverse().find(v => v != null);
        labels.push(`<span style="color:${colour}">${label}</span> ${last == null ? "–" : spec.fmt(last)}`);
      });
      this.vals.innerHTML = labels.join(" · ");
    }
  }

  // -- the requests table ---------------------------------------------------------------------
  const COLUMNS = [
    ["request_id", "request"], ["state", "state"], ["num_prompt_tokens", "prompt"], ["num_output_tokens", "output"],
    ["num_computed_tokens", "computed"], ["num_blocks", "blocks"], ["num_host_blocks", "host"],
    ["num_preemptions", "preempts"], ["age", "age s"],
  ];
  const STATE_ORDER = { running: 0, swapped: 1, waiting: 2 };
  const MAX_TABLE_ROWS = 300;

  function setupTable() {
    const tr = document.querySelector("#requests thead tr");
    for (const [key, label] of COLUMNS) {
      const th = document.createElement("th");
      th.textContent = label; th.dataset.key = key;
      th.addEventListener("click", () => {
        state.sort = { key, dir: state.sort.key === key ? -state.sort.dir : (key === "request_id" || key === "state" ? 1 : -1) };
        renderTable();
      });
      tr.append(th);
    }
  }

  function renderTable() {
    const snap = state.snapshot;
    const body = document.querySelector("#requests tbody");
    if (!snap) { body.innerHTML = ""; return; }
    const cols = snap.request_columns, idx = Object.fromEntries(cols.map((c, i) => [c, i]));
    const rows = snap.requests.map(r => {
      const o = {}; cols.forEach((c, i) => { o[c] = r[i]; });
      o.age = snap.time - o.arrival_time; return o;
    });
    const { key, dir } = state.sort;
    const value = o => key === "state" ? STATE_ORDER[o.state] ?? 9 : o[key];
    rows.sort((a, b) => { const x = value(a), y = value(b); return (x < y ? -1 : x > y ? 1 : 0) * dir; });
    state.rows = rows;
    document.querySelectorAll("#requests th").forEach(th => {
      th.classList.toggle("sorted", th.dataset.key === key);
      th.textContent = COLUMNS.find(c => c[0] === th.dataset.key)[1] + (th.dataset.key === key ? (dir > 0 ? " ▲" : " ▼") : "");
    });
    const html = rows.slice(0, MAX_TABLE_ROWS).map(o => {
      const colour = css(hsl(hue(o.request_id), 68, 55));
      const id = escapeHtml(o.request_id);
      return `<tr><td title="${id}"><i class="dot" style="background:${colour}"></i>${id}</td><td>${o.state}</td>` +
        `<td>${o.num_prompt_tokens}</td><td>${o.num_output_tokens}</td><td>${o.num_computed_tokens}</td>` +
        `<td>${o.num_blocks}</td><td>${o.num_host_blocks}</td><td>${o.num_preemptions}</td><td>${o.age.toFixed(1)}</td></tr>`;
    });
    body.innerHTML = html.join("");
    const more = snap.num_waiting_unlisted ? ` (+${snap.num_waiting_unlisted} more waiting)` : "";
    const shown = rows.length > MAX_TABLE_ROWS ? `, first ${MAX_TABLE_ROWS} shown` : "";
    document.getElementById("req-count").textContent = `${rows.length} live${shown}${more}`;
    void idx;
  }

  function escapeHtml(s) {
    return String(s).replace(/[&<>"']/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  // -- the advisor --------------------------------------------------------------------------------
  function renderVerdict() {
    const v = state.verdict, el = document.getElementById("verdict");
    if (!v) { el.innerHTML = `<span class="muted">no metrics to judge</span>`; return; }
    const findings = (v.findings || []).map(f =>
      `<li><span class="knob">${escapeHtml(f.knob)} (${escapeHtml(f.direction)})</span> — ${escapeHtml(f.title)}<br>` +
      `${escapeHtml(f.action)}<div class="symptom">${escapeHtml(f.symptom)}</div></li>`).join("");
    const window = v.interval_s ? `<span class="muted small">over the last ${v.interval_s.toFixed(0)} s</span>` : "";
    el.innerHTML = `<div class="head"><span class="tag ${escapeHtml(v.verdict)}">${escapeHtml(v.verdict.replace("_", " "))}</span>` +
      `${window}</div><div>${escapeHtml(v.summary)}</div>` + (findings ? `<ol>${findings}</ol>` : "");
  }

  // -- the pool -----------------------------------------------------------------------------------------
  function renderPool() {
    const snap = state.snapshot;
    if (!snap) return;
    forgetHues(snap.requests.map(r => r[0]));
    state.pool = decode(snap.runs, snap.num_blocks);
    state.grids.device.draw(state.pool, snap.requests, false);
    const p = state.pool;
    document.getElementById("used-blocks").textContent = snap.num_used_blocks;
    document.getElementById("cached-free-blocks").textContent = snap.num_cached_free_blocks;
    document.getElementById("free-blocks").textContent = snap.num_blocks - snap.num_used_blocks - snap.num_cached_free_blocks;
    document.getElementById("total-blocks").textContent = snap.num_blocks;
    document.getElementById("usage-pct").textContent = PCT(snap.num_used_blocks / snap.num_blocks);
    document.getElementById("pool-title").textContent =
      `${snap.num_blocks} blocks × ${snap.block_size} tokens` + (p.uncovered ? ` (${p.uncovered} blocks missing from the snapshot!)` : "");
    const hostCanvas = document.getElementById("host-grid");
    if (snap.num_host_blocks > 0) {
      state.host = decode(snap.host_runs, snap.num_host_blocks);
      hostCanvas.hidden = false; document.getElementById("no-host").hidden = true;
      state.grids.host.draw(state.host, snap.requests, true);
      document.getElementById("host-counts").textContent =
        `${snap.num_host_used_blocks} of ${snap.num_host_blocks} blocks hold swapped-out requests` +
        (snap.num_tier_blocks ? `; the host KV tier keeps ${snap.num_tier_used_blocks} of its ${snap.num_tier_blocks} ` +
          `blocks of evicted prefixes (shown cached-free)` : "");
    } else {
      state.host = null;
      hostCanvas.hidden = true; document.getElementById("no-host").hidden = false;
      document.getElementById("host-counts").textContent = "";
    }
  }

  function describeBlock(pool, snap, b, host) {
    const own = pool.owner[b];
    const lines = [`${host ? "host " : ""}block ${b}`];
    if (own < 0) {
      lines.push(pool.cached[b] ? "cached-free: keeps a prefix's KV, reusable until handed out" : "free");
      return lines.join("\n");
    }
    const row = snap.requests[own];
    const cols = snap.request_columns;
    const get = name => row[cols.indexOf(name)];
    lines.push(`${host ? "swapped out by" : "owner"} ${get("request_id")} (${get("state")})`);
    lines.push(`position ${pool.pos[b]} of ${host ? get("num_host_blocks") : get("num_blocks")} in its table`);
    lines.push(`ref count ${pool.ref[b]}` + (pool.ref[b] > 1 ? ` — shared prefix block (${pool.ref[b]} tables)` : ""));
    if (pool.cached[b]) lines.push("in the prefix cache" + (pool.ref[b] > 1 ? "" : " (shareable prefix block)"));
    return lines.join("\n");
  }

  function hover(grid, which) {
    const tip = document.getElementById("tooltip");
    grid.canvas.addEventListener("mousemove", e => {
      const pool = which === "host" ? state.host : state.pool, snap = state.snapshot;
      const r = grid.canvas.getBoundingClientRect();
      const c = pool ? grid.cellAt(e.clientX - r.left, e.clientY - r.top) : -1;
      if (c < 0) { tip.hidden = true; return; }
      const L = grid.layout, b = grid.representative(pool, c);
      const range = L.per > 1 ? `blocks ${c * L.per}–${Math.min((c + 1) * L.per, pool.n) - 1} (one cell), showing:\n` : "";
      tip.textContent = range + describeBlock(pool, snap, b, which === "host");
      tip.hidden = false;
      tip.style.left = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8) + "px";
      tip.style.top = (e.clientY + 14) + "px";
    });
    grid.canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  }

  // -- everything ---------------------------------------------------------------------------------
  function renderHeader() {
    const info = state.info;
    if (!info) return;
    document.getElementById("model").textContent = info.model;
    document.getElementById("source").textContent =
      info.source === "simulation" ? (info.speed ? `simulation ×${info.speed}` : "simulation, unpaced") : "";
    document.getElementById("knobs").textContent =
      `max_num_seqs ${info.max_num_seqs} · max_num_batched_tokens ${info.max_num_batched_tokens} · preemption ${info.preemption_mode}`;
    document.getElementById("window-note").textContent =
      `(a point per ${info.point_interval} s of engine time; latency percentiles over the last ${info.window_s} s)`;
  }

  let scheduled = false, dirtyPool = false;
  function render() {
    scheduled = false;
    renderHeader();
    if (dirtyPool) { renderPool(); renderTable(); dirtyPool = false; }
    for (const chart of Object.values(state.charts)) chart.draw(state.points);
    renderVerdict();
    if (state.snapshot && state.points.length) {
      const lag = state.points[state.points.length - 1].t - state.snapshot.time;
      document.getElementById("snapshot-age").textContent = lag > 2 ? `pool view ${lag.toFixed(0)} s old` : "";
    }
  }
  function schedule() { if (!scheduled) { scheduled = true; requestAnimationFrame(render); } }

  function onMessage(message) {
    const data = JSON.parse(message.data);
    if (data.type === "init") {
      state.info = data.info; state.points = data.points; state.snapshot = data.snapshot;
      state.verdict = data.verdict; state.totals = data.totals; dirtyPool = !!data.snapshot;
      state.grids.device.layout = null; state.grids.host.layout = null;
    } else {
      state.points.push(...data.points);
      const maxPoints = 1200;
      if (state.points.length > maxPoints) state.points.splice(0, state.points.length - maxPoints);
      if (data.snapshot) { state.snapshot = data.snapshot; dirtyPool = true; }
      if (data.verdict) state.verdict = data.verdict;
      state.totals = data.totals;
    }
    state.frames++;
    schedule();
  }

  function connect() {
    const conn = document.getElementById("conn");
    const source = new EventSource("/dashboard/events");
    source.onopen = () => { state.connected = true; conn.textContent = "live"; conn.classList.add("live"); };
    source.onmessage = onMessage;
    source.onerror = () => { state.connected = false; conn.textContent = "reconnecting…"; conn.classList.remove("live"); };
  }

  function start() {
    state.grids.device = new Grid(document.getElementById("grid"), 380);
    state.grids.host = new Grid(document.getElementById("host-grid"), 90);
    hover(state.grids.device, "device");
    hover(state.grids.host, "host");
    const parent = document.getElementById("charts");
    for (const spec of CHARTS) state.charts[spec.id] = new Chart(spec, parent);
    setupTable();
    window.addEventListener("resize", () => {
      state.grids.device.layout = null; state.grids.host.layout = null; dirtyPool = !!state.snapshot; schedule();
    });
    connect();
  }
  start();
})();
