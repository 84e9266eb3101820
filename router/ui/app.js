// ovrouter's dashboard: one live event stream (GET /api/events, read with fetch so the admin key
// travels as a header, never in a URL), the /api actions, and a playground on /v1. No build step.
"use strict";

const KEY = "ovrouter-admin-key";
const state = { models: new Map(), requests: new Map(), loading: new Map(), stateLagMs: [], resyncs: 0 };
const $ = (sel) => document.querySelector(sel);
window.ovrouter = state; // for the browser tests and curious operators

// ---- auth ---------------------------------------------------------------------------------
function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function askKey(message) {
  $("#key-error").textContent = message || "";
  const dialog = $("#key-dialog");
  if (!dialog.open) dialog.showModal();
}

$("#key-form").addEventListener("submit", () => {
  sessionStorage.setItem(KEY, $("#key-input").value.trim());
  $("#key-input").value = "";
  $("#forget-key").classList.remove("hidden");
  restart();
});
$("#forget-key").addEventListener("click", () => { sessionStorage.removeItem(KEY); location.reload(); });
if (sessionStorage.getItem(KEY)) $("#forget-key").classList.remove("hidden");

async function api(method, path, body) {
  const init = { method, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body) init.body = JSON.stringify(body);
  const resp = await fetch(path, init);
  if (resp.status === 401) askKey("The key was not accepted.");
  let data = null;
  try { data = await resp.json(); } catch (e) { data = null; }
  return { ok: resp.ok, status: resp.status, data };
}

function toast(text, bad = false) {
  const el = document.createElement("div");
  el.className = "toast" + (bad ? " bad" : "");
  el.textContent = text;
  $("#toasts").appendChild(el);
  setTimeout(() => el.remove(), bad ? 8000 : 4000);
}

// ---- the event stream ------------------------------------------------------------------------
let eventsAbort = null;

async function* sseBlocks(resp, signal) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  signal.addEventListener("abort", () => reader.cancel().catch(() => {}));
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let kind = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) kind = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { kind, data: data.join("\n") };
    }
  }
}

async function connect() {
  if (eventsAbort) eventsAbort.abort();
  const abort = (eventsAbort = new AbortController());
  try {
    const resp = await fetch("/api/events", { headers: headers(), signal: abort.signal });
    if (resp.status === 401) { setConn(false, "key needed"); askKey(); return; }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    setConn(true, "live");
    for await (const { kind, data } of sseBlocks(resp, abort.signal)) onEvent(kind, JSON.parse(data));
  } catch (e) {
    if (abort.signal.aborted) return;
  }
  if (abort.signal.aborted) return;
  setConn(false, "reconnecting…");
  setTimeout(() => { if (eventsAbort === abort) connect(); }, 1000);
}

function restart() { connect(); startLogs(); }

function setConn(on, text) {
  const el = $("#conn");
  el.className = "conn " + (on ? "on" : "off");
  el.textContent = text;
}

function onEvent(kind, d) {
  switch (kind) {
    case "snapshot":
      state.models = new Map(d.models.map((m) => [m.name, m]));
      state.requests = new Map(d.requests.map((r) => [r.id, r]));
      $("#config").textContent = d.config || "";
      renderModels(); renderRequests(); renderPickers(); showReloadOf(d.last_reload, false);
      break;
    case "stats":
      for (const m of d.models) state.models.set(m.name, { ...state.models.get(m.name), ...m });
      if (d.models.length !== state.models.size || [...state.models.keys()].some((n) => !d.models.find((m) => m.name === n))) {
        state.models = new Map(d.models.map((m) => [m.name, m]));
        renderPickers();
      }
      renderModels(); showReloadOf(d.last_reload, false);
      break;
    case "state": {
      const m = state.models.get(d.model);
      if (!m) break;
      Object.assign(m, { state: d.state, pid: d.pid, last_reason: d.reason, last_error: d.last_error, started_at: d.started_at });
      if (d.state !== "starting") state.loading.delete(d.model);
      renderModels();
      if (d.at) state.stateLagMs.push(Date.now() - d.at * 1000);
      break;
    }
    case "loaded":
      if (!d.ok) toast(`${d.model} failed to start: ${String(d.last_error || "see its log").split("\n")[0]}`, true);
      break;
    case "loading":
      state.loading.set(d.model, d);
      renderModels();
      break;
    case "request":
      state.requests.set(d.id, d);
      if (state.requests.size > 300) {
        const done = [...state.requests.values()].filter((r) => r.state !== "running").sort((a, b) => a.id - b.id);
        for (const r of done.slice(0, state.requests.size - 250)) state.requests.delete(r.id);
      }
      later(renderRequests); // many requests a second: one table redraw per frame
      break;
    case "reload":
      showReloadOf(d, true);
      break;
    case "resync": // this tab fell behind and lost events: fetch the state afresh, keep the stream
      state.resyncs++;
      resync();
      break;
  }
}

const pending = new Set();
function later(render) {
  if (pending.has(render)) return;
  pending.add(render);
  requestAnimationFrame(() => { pending.delete(render); render(); });
}

async function resync() {
  const [models, requests] = await Promise.all([api("GET", "/api/models"), api("GET", "/api/requests")]);
  if (models.ok) state.models = new Map(models.data.models.map((m) => [m.name, m]));
  if (requests.ok) state.requests = new Map(requests.data.requests.map((r) => [r.id, r]));
  renderModels(); renderRequests(); renderPickers();
}

// ---- models ---------------------------------------------------------------------------------
function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
const fmtS = (s) => (s == null ? "–" : s < 1 ? `${Math.round(s * 1000)} ms` : s < 120 ? `${s.toFixed(1)} s` : s < 7200 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`);
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));

function sparkline(values) {
  if (!values || !values.length) return "";
  const w = 90, h = 18, max = Math.max(1, ...values), step = w / Math.max(1, values.length - 1);
  const pts = values.map((v, i) => `${(i * step).toFixed(1)},${(h - 1 - (v / max) * (h - 2)).toFixed(1)}`).join(" ");
  return `<svg class="spark" width="${w}" height="${h}" viewBox="0 0 ${w} ${h}"><polyline fill="none" stroke="#2563eb" stroke-width="1.5" points="${pts}"/></svg>`;
}

function stateCell(m) {
  let html = `<span class="badge ${esc(m.state)}" data-testid="state">${esc(m.state)}</span>`;
  const loading = state.loading.get(m.name);
  if (m.state === "starting" && loading) {
    html += ` <span class="reason">${loading.elapsed_s.toFixed(0)} s${loading.estimate_s ? ` of ~${loading.estimate_s.toFixed(0)} s` : ""}</span>`;
  }
  if (m.waiting) html += `<div class="reason" data-testid="waiting">${esc(m.waiting)}</div>`;
  if (m.last_reason) html += `<div class="reason">last: ${esc(m.last_reason)}</div>`;
  if (m.last_error) html += `<div class="lasterr" title="${esc(m.last_error)}">${esc(String(m.last_error).split("\n")[0].slice(0, 160))}</div>`;
  return html;
}

function renderModels() {
  const rows = [];
  for (const m of state.models.values()) {
    const restarts = Object.entries(m.restarts_by_reason || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    const mem = fmtBytes(m.rss_bytes) + (m.reported && m.reported.device_memory_bytes ? ` · dev ${fmtBytes(m.reported.device_memory_bytes)}` : "");
    const kv = m.reported && m.reported.cache_usage != null ? ` · KV ${(m.reported.cache_usage * 100).toFixed(0)}%` : "";
    rows.push(`<tr data-model="${esc(m.name)}" data-state="${esc(m.state)}">
      <td><b>${esc(m.name)}</b><div class="reason">${esc(m.task)} · ${esc(m.device)}${m.kind !== "modelserver" ? " · " + esc(m.kind) : ""}</div></td>
      <td class="wrap">${stateCell(m)}</td>
      <td class="num">${m.pid ?? "–"}</td>
      <td class="num">${fmtS(m.state === "ready" && m.started_at ? Date.now() / 1000 - m.started_at : null)}</td>
      <td class="num">${mem}${kv}</td>
      <td class="num">${m.in_flight ?? 0} / ${m.queued ?? 0}</td>
      <td>${m.restarts ?? 0}${restarts ? ` <span class="reason">(${esc(restarts)})</span>` : ""}</td>
      <td class="num">${m.requests_per_min ?? 0}</td>
      <td class="num">${fmtS(m.ttft_p50_s)}</td>
      <td class="num">${m.tokens_per_s ?? "–"}</td>
      <td>${sparkline(m.sparkline)}</td>
      <td>
        <button data-act="load" data-testid="load">Load</button>
        <button data-act="unload" data-testid="unload">Unload</button>
        <button data-act="restart" data-testid="restart">Restart</button>
        <button data-act="logs">Logs</button>
      </td></tr>`);
  }
  $("#models tbody").innerHTML = rows.join("");
}

$("#models").addEventListener("click", async (ev) => {
  const button = ev.target.closest("button[data-act]");
  if (!button) return;
  const name = button.closest("tr").dataset.model;
  const act = button.dataset.act;
  if (act === "logs") { $("#log-model").value = name; startLogs(); return; }
  button.disabled = true;
  const res = await api("POST", `/api/models/${encodeURIComponent(name)}/${act}`);
  button.disabled = false;
  if (!res.ok) toast(`${act} ${name}: ${res.data?.error?.message || "HTTP " + res.status}`, true);
  else toast(`${act} ${name}: ${res.data?.state ?? "done"}`);
});

// ---- reload ---------------------------------------------------------------------------------
let shownReloadAt = null;
function showReloadOf(r, force) {
  if (!r || (!force && r.at === shownReloadAt)) return;
  shownReloadAt = r.at;
  const box = $("#reload-result");
  if (r.ok && r.source === "start") { box.classList.add("hidden"); return; }
  box.classList.remove("hidden", "ok", "bad");
  box.classList.add(r.ok ? "ok" : "bad");
  if (r.ok) {
    const d = r.diff || {};
    box.textContent = `Config reloaded (${r.source}): added ${d.added?.length ?? 0}, changed ${d.changed?.length ?? 0}, removed ${d.removed?.length ?? 0}.`;
  } else {
    box.textContent = `Config invalid (${r.source}); still serving the previous config:\n` + (r.errors || []).join("\n");
  }
}

$("#reload").addEventListener("click", async () => {
  const res = await api("POST", "/api/reload");
  if (res.data && "ok" in res.data) showReloadOf(res.data, true);
  else toast(`reload: HTTP ${res.status}`, true);
});

// ---- logs ------------------------------------------------------------------------------------
let logsAbort = null;
async function startLogs() {
  if (logsAbort) logsAbort.abort();
  const name = $("#log-model").value;
  const pre = $("#logs");
  pre.textContent = "";
  if (!name) return;
  const abort = (logsAbort = new AbortController());
  try {
    const resp = await fetch(`/api/models/${encodeURIComponent(name)}/logs?follow=1&lines=300`, { headers: headers(), signal: abort.signal });
    if (!resp.ok) { pre.textContent = `HTTP ${resp.status}`; return; }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      pre.append(decoder.decode(value, { stream: true }));
      if (pre.textContent.length > 400000) pre.textContent = pre.textContent.slice(-200000);
      if ($("#log-follow").checked) pre.scrollTop = pre.scrollHeight;
    }
  } catch (e) { /* aborted or the router went away */ }
}
$("#log-model").addEventListener("change", startLogs);

// ---- requests ---------------------------------------------------------------------------------
function renderRequests() {
  const all = [...state.requests.values()];
  const running = all.filter((r) => r.state === "running").sort((a, b) => a.id - b.id);
  const done = all.filter((r) => r.state !== "running").sort((a, b) => b.id - a.id).slice(0, 200);
  $("#requests tbody").innerHTML = [...running, ...done].map((r) => {
    const tokens = r.completion_tokens != null ? `${r.prompt_tokens ?? "?"} → ${r.completion_tokens}` : "–";
    const status = r.state === "running" ? "…" : r.state === "done" ? r.status : `${r.status ?? ""} ${r.state}`;
    return `<tr class="${r.state === "running" ? "running" : ""}" data-id="${r.id}">
      <td>${new Date(r.started_at * 1000).toLocaleTimeString()}</td><td>${esc(r.model)}</td><td>${esc(r.path)}</td>
      <td>${esc(status)}</td><td class="num">${fmtS(r.duration_s)}</td><td class="num">${r.queue_s ? fmtS(r.queue_s) : "–"}</td>
      <td class="num">${fmtS(r.ttft_s)}</td><td class="num">${tokens}</td><td class="num">${r.tokens_per_s ? r.tokens_per_s.toFixed(1) : "–"}</td>
      <td>${esc(r.client ?? "")}</td>
      <td>${r.state === "running" ? `<button data-cancel="${r.id}" data-testid="cancel">Cancel</button>` : ""}</td></tr>`;
  }).join("");
}

$("#requests").addEventListener("click", async (ev) => {
  const id = ev.target.dataset?.cancel;
  if (!id) return;
  const res = await api("POST", `/api/requests/${id}/cancel`);
  if (!res.ok) toast(`cancel ${id}: ${res.data?.error?.message || "HTTP " + res.status}`, true);
});

// ---- playground ---------------------------------------------------------------------------------
function renderPickers() {
  const names = [...state.models.keys()];
  for (const sel of [$("#log-model"), $("#pg-model")]) {
    const keep = sel.value;
    sel.innerHTML = names.map((n) => `<option>${esc(n)}</option>`).join("");
    if (names.includes(keep)) sel.value = keep;
  }
  if (!logsAbort && names.length) startLogs();
  showPlayground();
}

function showPlayground() {
  const m = state.models.get($("#pg-model").value);
  const task = m ? m.task : "";
  $("#pg-task").textContent = task;
  const panel = { llm: "chat", vlm: "chat", embeddings: "embeddings", rerank: "rerank", transcription: "transcription" }[task] || "other";
  for (const p of ["chat", "embeddings", "rerank", "transcription", "other"]) $(`#pg-${p}`).classList.toggle("hidden", p !== panel);
}
$("#pg-model").addEventListener("change", showPlayground);

const chat = [];
function addMsg(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.innerHTML = role === "user" ? "" : `<span class="think"></span><span class="text"></span>`;
  if (role === "user") el.textContent = "> " + text;
  $("#chat-log").appendChild(el);
  return el;
}

$("#chat-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("#chat-input").value.trim();
  const model = $("#pg-model").value;
  if (!text || !model) return;
  $("#chat-input").value = "";
  chat.push({ role: "user", content: text });
  addMsg("user", text);
  const out = addMsg("assistant", "");
  const log = $("#chat-log");
  let answer = "";
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model, messages: chat, stream: true }),
    });
    if (!resp.ok) throw new Error((await resp.json().catch(() => ({}))).error?.message || `HTTP ${resp.status}`);
    for await (const { data } of sseBlocks(resp, new AbortController().signal)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta || {};
      if (delta.reasoning_content) out.querySelector(".think").textContent += delta.reasoning_content;
      if (delta.content) { answer += delta.content; out.querySelector(".text").textContent = answer; }
      log.scrollTop = log.scrollHeight;
    }
    chat.push({ role: "assistant", content: answer });
  } catch (e) {
    out.querySelector(".text").innerHTML = `<span class="error">${esc(e.message)}</span>`;
    chat.pop();
  }
});
$("#chat-clear").addEventListener("click", () => { chat.length = 0; $("#chat-log").innerHTML = ""; });

async function fileText(input) {
  const f = input.files && input.files[0];
  return f ? await f.text() : null;
}

async function post(path, body) {
  $("#pg-out").textContent = "…";
  const init = { method: "POST", headers: headers() };
  if (body instanceof FormData) init.body = body;
  else { init.headers["Content-Type"] = "application/json"; init.body = JSON.stringify(body); }
  const resp = await fetch(path, init);
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) { $("#pg-out").textContent = data.error?.message || `HTTP ${resp.status}`; return null; }
  return data;
}

$("#emb-go").addEventListener("click", async () => {
  const text = (await fileText($("#emb-file"))) ?? $("#emb-input").value;
  const input = text.split("\n").map((s) => s.trim()).filter(Boolean);
  const data = await post("/v1/embeddings", { model: $("#pg-model").value, input });
  if (data) $("#pg-out").textContent = data.data.map((e, i) => `#${i} ${e.embedding.length} dims: [${e.embedding.slice(0, 6).map((x) => x.toFixed(4)).join(", ")}, …]`).join("\n") + `\nusage: ${JSON.stringify(data.usage)}`;
});

$("#rr-go").addEventListener("click", async () => {
  const text = (await fileText($("#rr-file"))) ?? $("#rr-docs").value;
  const documents = text.split("\n").map((s) => s.trim()).filter(Boolean);
  const data = await post("/v1/rerank", { model: $("#pg-model").value, query: $("#rr-query").value, documents });
  if (data) $("#pg-out").textContent = (data.results || []).map((r) => `${r.relevance_score.toFixed(4)}  ${documents[r.index]}`).join("\n");
});

$("#tr-go").addEventListener("click", async () => {
  const f = $("#tr-file").files[0];
  if (!f) { $("#pg-out").textContent = "pick an audio file first"; return; }
  const form = new FormData();
  form.append("model", $("#pg-model").value);
  form.append("file", f);
  const data = await post("/v1/audio/transcriptions", form);
  if (data) $("#pg-out").textContent = data.text;
});

restart();
