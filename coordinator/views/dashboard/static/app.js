// The dashboard's browser side: three pages (fleet, runs, run) rendered from the server's JSON, kept live by one
// server-sent-events stream. No framework and no CDN: fleets are often offline. State for tests: window.dash.
"use strict";
const params = new URLSearchParams(location.search);
const token = params.get("token") || sessionStorage.getItem("dash-token") || "";
if (token) sessionStorage.setItem("dash-token", token);
const q = (path) => token ? `${path}${path.includes("?") ? "&" : "?"}token=${encodeURIComponent(token)}` : path;
const $ = (sel) => document.querySelector(sel);
const esc = (v) => String(v ?? "-").replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const gib = (n) => n == null ? "-" : (n / 1024 ** 3).toFixed(1) + "G";
const num = (n, d = 0) => n == null ? "-" : Number(n).toLocaleString(undefined, {maximumFractionDigits: d});
const dur = (s) => s == null ? "-" : s < 90 ? `${s.toFixed(0)}s` : s < 5400 ? `${(s / 60).toFixed(0)}m` : `${(s / 3600).toFixed(1)}h`;
// A share with one decimal, a half up, in integers: coordinator/units.py's format_share, the same digits.
const share1 = (v) => { const t = Math.floor(1000 * v + 0.5); return `${Math.floor(t / 10)}.${t % 10}%`; };
const VERDICT = {ok: "ok", finished: "ok", pending: "dim", running: "ok", slow: "warn", straggler: "warn"};
const cls = (v) => VERDICT[v] || "bad";
const dash = window.dash = {updates: 0, lossPoints: 0, page: null, run: null, skew: 0};

function page() {
  const p = location.pathname;
  if (p.startsWith("/run/")) return {name: "run", id: decodeURIComponent(p.slice(5))};
  return {name: p === "/runs" ? "runs" : "fleet"};
}

async function getJSON(path) {
  const r = await fetch(q(path));
  if (!r.ok) throw new Error(`${path}: ${r.status} ${(await r.json()).error || ""}`);
  return r.json();
}

// --- fleet -------------------------------------------------------------------------------------------------
function renderFleet(doc) {
  const rows = doc.nodes.map((n) => {
    const m = n.memory || {};
    const mem = m.total_bytes == null ? "-" : `${gib(m.used_bytes)}/${gib(m.total_bytes)}`;
    const pressure = m.pressure ? ` <span class="${m.pressure === "normal" ? "ok" : "bad"}">${esc(m.pressure)}</span>` : "";
    const load = n.load ? `${n.load[0].toFixed(2)}${n.cpu_count ? "/" + n.cpu_count : ""}` : "-";
    const run = n.run ? `<a href="/run/${encodeURIComponent(n.run.run_id)}" data-nav>${esc(n.run.run_id)}</a> ${n.run.active ? "rank " + esc(n.run.rank) + " step " + esc(n.run.step) : "(" + esc(n.run.state) + ")"}` +
      (n.run.active && n.run.verdict ? ` <span class="${cls(n.run.verdict)}">${esc(n.run.verdict)}</span>` : "") : "-";
    const pf = n.preflight ? `<span class="${n.preflight === "pass" ? "ok" : n.preflight === "warn" ? "warn" : "bad"}">${esc(n.preflight)}</span>` : "-";
    const q_ = n.quarantine && n.quarantine.quarantined ? `<span class="bad">yes</span> ${esc(n.quarantine.reason)}` : "no";
    if (!n.reachable) {
      return `<tr data-node="${esc(n.node)}"><td class="bad">${esc(n.node)}</td><td class="bad">unreachable</td><td colspan="7" class="bad">${esc(n.error)}</td><td>${pf}</td><td>${q_}</td><td>${run}</td></tr>`;
    }
    return `<tr data-node="${esc(n.node)}"><td class="ok">${esc(n.node)}</td><td class="ok">yes</td><td>${esc(n.chip)}</td><td>${esc(n.os)}</td>` +
      `<td>${mem}${pressure}</td><td>${gib(n.disk && n.disk.free_bytes)}</td><td>${load}</td>` +
      `<td>${n.gpu_utilization_pct == null ? "-" : n.gpu_utilization_pct.toFixed(0) + "%"}</td>` +
      `<td>${esc(n.power)}</td><td>${pf}</td><td>${q_}</td><td>${run}</td></tr>`;
  }).join("");
  const probed = doc.probed_at ? `facts ${dur(Date.now() / 1000 - doc.probed_at)} old` : "probing...";
  $("#main").innerHTML = `<h2>fleet <span class="dim">${probed}</span></h2>` +
    `<table id="fleet-table"><tr><th>node</th><th>reachable</th><th>chip</th><th>os</th><th>memory (pressure)</th><th>disk free</th>` +
    `<th>load/cpus</th><th>GPU</th><th>power</th><th>last preflight</th><th>quarantine</th><th>run</th></tr>${rows}</table>` +
    (doc.warnings || []).map((w) => `<p class="warn">warning: ${esc(w)}</p>`).join("");
}

// --- runs --------------------------------------------------------------------------------------------------
function renderRuns(doc) {
  const rows = doc.runs.map((r) => `<tr data-run="${esc(r.run_id)}"><td><a href="/run/${encodeURIComponent(r.run_id)}" data-nav>${esc(r.run_id)}</a></td>` +
    `<td class="${r.state === "succeeded" || r.state === "running" ? "ok" : "bad"}">${esc(r.state)}</td><td>${r.step}${r.iters ? "/" + r.iters : ""}</td>` +
    `<td>${num(r.tokens_per_s)} <span class="dim">(predicted ${num(r.predicted_tokens_per_s)})</span></td>` +
    `<td class="${r.incident_count ? "bad" : ""}">${r.incident_count}</td><td class="${r.degraded ? "warn" : ""}">${r.degraded ? "DEGRADED" : "no"}</td>` +
    `<td>${r.active ? dur(r.eta_s) : "-"}</td><td>${esc(r.nodes.join(", "))}</td></tr>`).join("");
  $("#main").innerHTML = `<h2>runs</h2><table id="runs-table"><tr><th>run</th><th>state</th><th>steps</th><th>real tokens/s</th>` +
    `<th>incidents</th><th>degraded</th><th>ETA</th><th>nodes</th></tr>${rows}</table>`;
}

// --- run ---------------------------------------------------------------------------------------------------
function markers(u) {
  // Incidents (red) and recoveries (green) as vertical lines at their step, over the loss curves.
  const r = dash.run;
  if (!r) return;
  const ctx = u.ctx;
  const draw = (step, color) => {
    const x = u.valToPos(step, "x", true);
    ctx.save(); ctx.strokeStyle = color; ctx.lineWidth = 2; ctx.setLineDash([5, 4]);
    ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke(); ctx.restore();
  };
  r.incidents.forEach((i) => i.step != null && draw(i.step, "#c00"));
  r.recoveries.forEach((i) => draw(i.step, "#080"));
}

function chartData(r) {
  const steps = [...new Set([...r.loss.map((p) => p[0]), ...r.val_loss.map((p) => p[0])])].sort((a, b) => a - b);
  const loss = new Map(r.loss), val = new Map(r.val_loss);
  return [steps, steps.map((s) => loss.get(s) ?? null), steps.map((s) => val.get(s) ?? null)];
}

function drawChart() {
  const r = dash.run, el = $("#chart");
  if (!el) return;
  dash.lossPoints = r.loss.length;
  const data = chartData(r);
  if (dash.plot && dash.plot.root.isConnected) { dash.plot.setData(data); return; }
  el.innerHTML = "";
  dash.plot = new uPlot({
    width: Math.min(1100, window.innerWidth - 60), height: 300, scales: {x: {time: false}},
    axes: [{label: "step"}, {label: "loss"}],
    series: [{label: "step"}, {label: "loss", stroke: "#1f77b4", width: 2, points: {show: true, size: 4}},
      {label: "val loss", stroke: "#ff7f0e", width: 2, spanGaps: true, points: {show: true, size: 6}}],
    hooks: {draw: [markers]},
  }, data, el);
}

function rankRows(r, nowLocal) {
  const now = nowLocal + dash.skew;
  return r.ranks.map((k) => {
    const beat = k.last_t == null ? null : Math.max(0, now - k.last_t);
    const stepAge = k.last_step_t == null ? null : Math.max(0, now - k.last_step_t);
    const st = k.step_time_s;
    // the server's verdict (the monitor's rules) is as of its last push; silence past the run's heartbeat timeout
    // is the monitor's `hung` even when nothing is pushed
    const verdict = r.active && beat != null && beat > r.heartbeat_timeout && ["ok", "slow"].includes(k.verdict) ? "hung" : k.verdict;
    const slow = k.tokens_per_s != null && k.calibrated_tokens_per_s ? k.tokens_per_s / k.calibrated_tokens_per_s : null;
    return `<tr data-rank="${k.rank}"><td>${k.rank}</td><td>${esc(k.node)}</td><td class="${cls(verdict)}">${esc(verdict)}</td>` +
      `<td>${esc(k.phase)}</td><td>${k.step}</td><td>${r.active ? dur(beat) + " ago" : "-"}</td><td>${r.active && stepAge != null ? dur(stepAge) + " ago" : "-"}</td>` +
      `<td>${num(k.tokens_per_s)} <span class="dim">/ ${num(k.calibrated_tokens_per_s)}${slow ? ` (${(slow * 100).toFixed(0)}%)` : ""}</span></td>` +
      `<td>${st ? `${st.min.toFixed(3)} / ${st.median.toFixed(3)} / ${st.max.toFixed(3)}` : "-"}</td>` +
      `<td>${r.split[k.node] != null ? share1(r.split[k.node]) : "-"}</td><td>${k.loss == null ? "-" : k.loss.toFixed(4)}</td></tr>`;
  }).join("");
}

function renderRunHead(r) {
  const head = $("#run-head");
  if (!head) return;
  head.innerHTML =
    `<div class="card">state<b id="run-state" class="${r.state === "running" || r.state === "succeeded" ? "ok" : "bad"}">${esc(r.state)}</b></div>` +
    `<div class="card">step<b id="run-step">${r.step}${r.iters ? "/" + r.iters : ""}</b></div>` +
    `<div class="card">real tokens/s<b>${num(r.tokens_per_s)} <span class="dim">predicted ${num(r.predicted_tokens_per_s)}</span></b></div>` +
    `<div class="card">ETA<b>${r.active ? dur(r.eta_s) : "-"}</b></div>` +
    `<div class="card">incidents<b class="${r.incident_count ? "bad" : ""}">${r.incident_count}</b></div>` +
    (r.degraded ? `<div class="card warn">DEGRADED<b>${esc(r.left_out.map((x) => x.node).join(", "))} left out</b></div>` : "") +
    (r.active ? `<div class="card"><button class="stop" id="stop" ${token ? "" : "disabled title='open the URL with the token'"}>stop run</button><span id="stop-note" class="dim"></span></div>` : "");
  const btn = $("#stop");
  if (btn) btn.onclick = stopRun;
}

// A pipeline's stages and every rank's memory against the plan: the server's stage view, as status and the report.
// A share as a whole percentage: coordinator.views.stagetable.pct's rule (a half rounded up) on the same value.
const pct = (v) => v == null ? "-" : `${Math.floor(100 * v + 0.5)}%`;
const bytes = (n) => n == null ? "-" : n >= 1024 ** 3 ? `${(n / 1024 ** 3).toFixed(1)} GiB` : n >= 1024 ** 2 ? `${(n / 1024 ** 2).toFixed(1)} MiB` : `${(n / 1024).toFixed(1)} KiB`;
function renderStages(r) {
  const t = $("#stages"), head = $("#stage-summary"), v = r.stages;
  if (!t || !head) return;
  const pipeline = v && v.kind === "pipeline", memory = v && v.ranks.some((k) => k.budget_bytes != null);
  $("#stages-section").style.display = pipeline || memory ? "" : "none";
  if (!pipeline && !memory) return;
  const neck = pipeline && v.bottleneck != null ? v.ranks.find((k) => k.rank === v.bottleneck) : null;
  head.innerHTML = pipeline ? `pipeline of ${v.ranks.length} stages, ${v.micro_batches ?? "-"} micro-batches (${esc(v.schedule)}): ` +
    `bubble <b id="bubble">${pct(v.bubble)}</b>${v.predicted_bubble != null ? ` <span class="dim">(plan ${pct(v.predicted_bubble)})</span>` : ""}` +
    (neck ? `, bottleneck stage ${neck.stage} on ${esc(neck.node)}` : "") : "memory against the plan";
  const over = (k) => k.peak_memory_bytes != null && k.budget_bytes != null && k.peak_memory_bytes > k.budget_bytes;
  t.innerHTML = `<tr><th>rank</th><th>node</th>${pipeline ? "<th>stage</th><th>layers</th><th>busy / wait of step</th><th>busy per step (plan)</th>" : ""}<th>peak memory / plan / budget</th></tr>` +
    v.ranks.map((k) => `<tr data-stage-rank="${k.rank}"><td>${k.rank}</td><td>${esc(k.node)}</td>` +
      (pipeline ? `<td>${esc(k.stage)}</td><td>${k.first_layer != null && k.last_layer != null ? `${k.first_layer}-${k.last_layer - 1}` : "-"}</td>` +
        `<td>${pct(k.busy_share)} / ${pct(k.wait_share)}</td><td>${k.busy_s == null ? "-" : k.busy_s.toFixed(3) + " s"}${k.predicted_busy_s != null ? ` <span class="dim">(${k.predicted_busy_s.toFixed(3)} s)</span>` : ""}</td>` : "") +
      `<td class="${over(k) ? "bad" : ""}">${bytes(k.peak_memory_bytes)} <span class="dim">/ ${bytes(k.predicted_memory_bytes)} / ${bytes(k.budget_bytes)}</span></td></tr>`).join("");
}

function renderRunTables(r) {
  const t = $("#ranks");
  if (t) t.innerHTML = `<tr><th>rank</th><th>node</th><th>verdict</th><th>phase</th><th>step</th><th>last heartbeat</th><th>last step</th>` +
    `<th>real tokens/s / calibrated</th><th>step time min/median/max (s)</th><th>split</th><th>loss</th></tr>${rankRows(r, Date.now() / 1000)}`;
  const inc = $("#incidents");
  if (inc) inc.innerHTML = r.incidents.length ? r.incidents.map((i) => `<li><span class="bad">${esc(i.kind)}</span> on ${esc(i.node)} rank ${esc(i.rank)} step ${esc(i.step)} (${esc(i.action)}): ${esc(i.summary)}</li>`).join("") +
    r.recoveries.map((x) => `<li class="ok">relaunched: ranks started again at step ${x.step}</li>`).join("") : "<li class='dim'>none</li>";
  const ck = $("#checkpoints");
  if (ck) ck.innerHTML = r.checkpoints.slice(-5).reverse().map((c) => `<li>step ${c.step}: <span class="dim">${esc(c.path)}</span></li>`).join("") || "<li class='dim'>none yet</li>";
}

function renderRun(r) {
  dash.run = r;
  dash.plot = null;
  $("#main").innerHTML = `<h2>run ${esc(r.run_id)}</h2><div class="cards" id="run-head"></div><div id="chart"></div>` +
    `<h3>ranks</h3><table id="ranks"></table>` +
    `<div id="stages-section" style="display:none"><h3>stages and memory</h3><p id="stage-summary"></p><table id="stages"></table></div>` +
    `<h3>incidents and recoveries</h3><ul id="incidents"></ul><h3>checkpoints</h3><ul id="checkpoints"></ul>` +
    (r.message ? `<p class="dim">${esc(r.message)}</p>` : "");
  renderRunHead(r); drawChart(); renderRunTables(r); renderStages(r);
}

function applyRunDelta(msg) {
  const r = dash.run;
  if (!r || msg.run_id !== r.run_id || msg.delta_from < r.offset) return;  // already in the snapshot
  const d = msg.delta;
  r.loss.push(...d.loss); r.val_loss.push(...d.val_loss); r.incidents.push(...d.incidents);
  r.recoveries.push(...d.recoveries); r.checkpoints.push(...d.checkpoints);
  Object.assign(r, msg.view);
  renderRunHead(r); drawChart(); renderRunTables(r); renderStages(r);
}

async function stopRun() {
  if (!confirm(`Stop run ${dash.run.run_id}? Every rank on every node is stopped.`)) return;
  $("#stop").disabled = true;
  const r = await fetch(q(`/api/run/${encodeURIComponent(dash.run.run_id)}/stop`), {method: "POST", headers: {"X-Dashboard-Token": token}});
  $("#stop-note").textContent = r.ok ? " stopping..." : ` ${(await r.json()).error}`;
}

// --- routing and the live stream ---------------------------------------------------------------------------
async function load() {
  const p = dash.page = page();
  connect(p.name === "run" ? p.id : "");
  try {
    if (p.name === "fleet") renderFleet(await getJSON("/api/fleet"));
    else if (p.name === "runs") renderRuns(await getJSON("/api/runs"));
    else { const r = await getJSON(`/api/run/${encodeURIComponent(p.id)}`); dash.skew = r.now - Date.now() / 1000; renderRun(r); }
  } catch (e) { $("#main").innerHTML = `<p class="bad">${esc(e.message)}</p>`; }
}

document.addEventListener("click", (e) => {
  const a = e.target.closest("a[data-nav]");
  if (!a) return;
  e.preventDefault(); history.pushState(null, "", a.getAttribute("href")); load();
});
window.addEventListener("popstate", load);

// One stream, naming the run page's run: the server tails the runs that someone views (and the newest ones), so
// a page of an old run is followed while it is open and forgotten after.
let stream = null;
function connect(run) {
  if (stream && stream.run === run) return;
  if (stream) stream.close();
  const es = stream = new EventSource(q(run ? `/api/stream?run=${encodeURIComponent(run)}` : "/api/stream"));
  es.run = dash.watching = run;
  const seen = () => { dash.updates += 1; $("#updates").textContent = dash.updates; };
  es.addEventListener("hello", () => { $("#live").textContent = "live"; });
  es.addEventListener("run", (e) => { seen(); if (dash.page.name === "run") applyRunDelta(JSON.parse(e.data)); });
  es.addEventListener("runs", (e) => { seen(); if (dash.page.name === "runs") renderRuns(JSON.parse(e.data)); });
  es.addEventListener("fleet", (e) => { seen(); if (dash.page.name === "fleet") renderFleet(JSON.parse(e.data)); });
  es.addEventListener("notice", (e) => { const n = JSON.parse(e.data); const el = $("#stop-note"); if (el) el.textContent = " " + n.error; });
  es.onerror = () => { $("#live").textContent = "reconnecting..."; };
}

// Ages tick in the browser between pushes (a dead rank's heartbeat age keeps growing with no event at all).
setInterval(() => { if (dash.page && dash.page.name === "run" && dash.run && dash.run.active) renderRunTables(dash.run); }, 1000);
load();
