// The live view: polls /v1/requests once a second (?refresh=MS to change it; the engine's queued, running and
// recently finished requests, as the API scopes them to this page's key), shows the
// active ones in a table, the finished ones with their timelines as bars (from
// /v1/requests/{id}/timeline), and charts of the engine over the last minutes (uPlot).
"use strict";

// once a second, or as often as ?refresh=MS asks (100 ms at the most often)
const POLL_MS = Math.max(100, Number(new URLSearchParams(location.search).get("refresh")) || 1000);
const HISTORY_S = 300; // the charts' window: the last five minutes
const MAX_FINISHED = 12;
const TIMELINES_OFF = "This server keeps no request timelines (started with --no-request-timelines or --disable-log-stats).";

const history = { t: [], running: [], waiting: [], kv: [], batch: [], gen: [], prompt: [] };
const timelines = new Map(); // request id -> timeline (a finished request's never changes)
let previous = null; // the last engine sample, for the token rates
let charts = null;

const $ = (id) => document.getElementById(id);

// ---------------------------------------------------------------- charts
function chartOptions(width, series, yRange) {
  return {
    width, height: 150, legend: { show: true, live: false }, cursor: { show: false },
    scales: { x: { time: true }, y: { range: yRange } },
    axes: [{ stroke: "#667", grid: { stroke: "#eef" } }, { stroke: "#667", grid: { stroke: "#eef" }, size: 40 }],
    series: [{}, ...series.map(([label, color]) => ({ label, stroke: color, width: 2, fill: color + "22" }))],
  };
}

function makeCharts() {
  const width = (id) => Math.max(200, $(id).clientWidth);
  const zeroTo = (min) => (u, lo, hi) => [0, Math.max(min, hi * 1.1)];
  return {
    requests: new uPlot(chartOptions(width("c-requests"), [["running", "#2563eb"], ["waiting", "#f59e0b"]],
      zeroTo(4)), [[], [], []], $("c-requests")),
    kv: new uPlot(chartOptions(width("c-kv"), [["KV %", "#7c3aed"]], () => [0, 100]), [[], []], $("c-kv")),
    batch: new uPlot(chartOptions(width("c-batch"), [["batch", "#059669"]], zeroTo(4)), [[], []], $("c-batch")),
    tokens: new uPlot(chartOptions(width("c-tokens"), [["generated", "#dc2626"], ["prompt", "#0891b2"]],
      zeroTo(10)), [[], [], []], $("c-tokens")),
  };
}

function rate(now, before, field) {
  if (!before || now.time <= before.time) return null;
  return Math.max(0, (now[field] - before[field]) / (now.time - before.time));
}

function record(engine) {
  const gen = rate(engine, previous, "generation_tokens_total");
  const prompt = rate(engine, previous, "prompt_tokens_total");
  previous = engine;
  const h = history;
  h.t.push(engine.time); h.running.push(engine.num_running); h.waiting.push(engine.num_waiting);
  h.kv.push(100 * (engine.kv_cache_usage || 0)); h.batch.push(engine.batch_size);
  h.gen.push(gen); h.prompt.push(prompt);
  while (h.t.length && h.t[0] < engine.time - HISTORY_S) for (const k in h) h[k].shift();
  if (!charts) charts = makeCharts();
  charts.requests.setData([h.t, h.running, h.waiting]);
  charts.kv.setData([h.t, h.kv]);
  charts.batch.setData([h.t, h.batch]);
  charts.tokens.setData([h.t, h.gen, h.prompt]);
  $("s-running").textContent = engine.num_running;
  $("s-waiting").textContent = engine.num_waiting;
  $("s-kv").textContent = fmt(100 * (engine.kv_cache_usage || 0)) + " %";
  $("s-batch").textContent = engine.batch_size;
  $("s-gen").textContent = gen === null ? "–" : fmt(gen);
  $("s-prompt").textContent = prompt === null ? "–" : fmt(prompt);
}

// ---------------------------------------------------------------- tables
function activeRow(r, now) {
  const cell = (cls, text) => el("td", { class: cls, text: String(text) });
  return el("tr", { class: "req", "data-id": r.id, "data-state": r.state },
    el("td", { class: "c-id mono", text: r.id, title: r.id }), cell("c-tenant", r.tenant ?? "–"),
    el("td", { class: "c-state" }, el("span", { class: `state ${r.state}`, text: r.state })),
    cell("num c-prompt", r.prompt_tokens), cell("num c-gen", r.generated_tokens), cell("num c-cached", r.cached_tokens ?? 0),
    cell("num c-tps", r.tokens_per_second ? fmt(r.tokens_per_second) : "–"),
    cell("num c-age", fmtSeconds(r.arrival_time ? now - r.arrival_time : null)));
}

function renderActive(requests, now) {
  const active = requests.filter((r) => r.state !== "finished")
    .sort((a, b) => (a.state === b.state ? a.arrival_time - b.arrival_time : a.state === "running" ? -1 : 1));
  $("active-count").textContent = active.length;
  const rows = active.map((r) => activeRow(r, now));
  if (!rows.length) rows.push(el("tr", { class: "none" }, el("td", { colspan: 8, text: "No requests in flight." })));
  $("active").replaceChildren(...rows);
}

// Spans of a timeline: queued (arrival to the first scheduling), prefill (to the first
// token), decode (to the finish), preempted (a preemption to the next scheduling).
function spans(events) {
  const at = (name) => (events.find((e) => e.event === name) || {}).time;
  const start = at("arrived") ?? events[0].time;
  const end = at("finished") ?? events[events.length - 1].time;
  const scheduled = events.filter((e) => e.event === "scheduled");
  const first = scheduled.length ? scheduled[0].time : end;
  const firstToken = at("first_token") ?? end;
  const out = [["queued", start, first], ["prefill", first, firstToken], ["decode", firstToken, end]];
  events.forEach((e, i) => {
    if (e.event !== "preempted") return;
    const resumed = events.slice(i + 1).find((x) => x.event === "scheduled");
    out.push(["preempted", e.time, resumed ? resumed.time : end]);
  });
  return { start, end, out, ticks: scheduled.map((e) => e.time) };
}

function describe(events, start) {
  return events.map((e) => {
    const extra = ["num_tokens", "cached_tokens", "reason"].filter((k) => e[k] !== undefined && e[k] !== null)
      .map((k) => `${k}=${e[k]}`).join(" ");
    return `+${Math.round((e.time - start) * 1000)} ms ${e.event} ${extra}`;
  }).join("\n");
}

function timelineRow(r, tl, scale) {
  const { start, end, out, ticks } = spans(tl.events);
  const bar = el("div", { class: "bar", title: describe(tl.events, start) });
  const pct = (t) => `${(100 * (t - start)) / scale}%`;
  for (const [kind, a, b] of out) {
    if (b <= a) continue;
    const seg = el("div", { class: `seg ${kind}` });
    seg.style.left = pct(a);
    seg.style.width = `${(100 * (b - a)) / scale}%`;
    bar.append(seg);
  }
  for (const t of ticks) {
    const tick = el("div", { class: "tick" });
    tick.style.left = pct(t);
    bar.append(tick);
  }
  const ttft = (tl.events.find((e) => e.event === "first_token") || {}).time;
  return el("div", { class: "tl-row", "data-id": r.id },
    el("div", { class: "tl-meta" }, el("span", { class: "mono", text: r.id, title: r.id }),
      el("span", { class: "muted", text: `${r.tenant ?? ""} ${r.prompt_tokens}→${r.generated_tokens} tok` +
        ` · ${r.finish_reason || ""}` })),
    bar,
    el("div", { class: "tl-nums muted", text: `${fmtSeconds(end - start)}` +
      (ttft ? ` · ttft ${fmtSeconds(ttft - start)}` : "") + (r.tokens_per_second ? ` · ${fmt(r.tokens_per_second)} tok/s` : "") }));
}

async function fetchTimelines(finished) {
  await Promise.all(finished.filter((r) => !timelines.has(r.id)).map(async (r) => {
    const resp = await api(`v1/requests/${encodeURIComponent(r.id)}/timeline`);
    if (resp.ok) timelines.set(r.id, await resp.json());
  }));
  const keep = new Set(finished.map((r) => r.id));
  for (const id of timelines.keys()) if (!keep.has(id)) timelines.delete(id);
}

async function renderFinished(requests) {
  const finished = requests.filter((r) => r.state === "finished")
    .sort((a, b) => (b.finish_time || 0) - (a.finish_time || 0)).slice(0, MAX_FINISHED);
  await fetchTimelines(finished);
  const shown = finished.filter((r) => timelines.has(r.id) && timelines.get(r.id).events.length);
  const box = $("finished");
  if (!shown.length) return box.replaceChildren(el("div", { class: "none", text: "No finished requests yet." }));
  // one scale for all rows, so that their lengths compare
  const scale = Math.max(...shown.map((r) => spans(timelines.get(r.id).events)).map((s) => s.end - s.start), 1e-3);
  box.replaceChildren(...shown.map((r) => timelineRow(r, timelines.get(r.id), scale)));
}

// ---------------------------------------------------------------- polling
async function poll() {
  const started = performance.now();
  try {
    const resp = await api(`v1/requests?limit=${MAX_FINISHED}`);
    if (!resp.ok) throw new Error(await errorText(resp));
    const body = await resp.json();
    if (!body.engine || body.engine.time === undefined) throw new Error(TIMELINES_OFF);
    const now = body.engine.time;
    record(body.engine);
    renderActive(body.data, now);
    await renderFinished(body.data);
    $("updated").textContent = "updated " + new Date(now * 1000).toLocaleTimeString();
    $("updated").classList.remove("error");
  } catch (e) {
    $("updated").textContent = String(e.message || e);
    $("updated").classList.add("error");
  }
  setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));
}

window.addEventListener("resize", () => {
  if (!charts) return;
  for (const [id, chart] of Object.entries({ "c-requests": charts.requests, "c-kv": charts.kv,
    "c-batch": charts.batch, "c-tokens": charts.tokens })) chart.setSize({ width: $(id).clientWidth, height: 150 });
});

document.addEventListener("DOMContentLoaded", poll);
