// The chat playground: model picker (/v1/models), system prompt, sampling controls,
// streamed answers from /v1/chat/completions (SSE) with a Stop button that aborts the
// fetch (the server then aborts the request), reasoning in a collapsible block, tool
// calls, markdown rendered by marked and sanitized by DOMPurify (model output is never
// inserted as raw HTML), conversations and settings kept in localStorage.
"use strict";

const STORE = { chats: "llmserve.conversations", current: "llmserve.current", settings: "llmserve.settings" };
const DEFAULTS = { model: "", system: "", temperature: 0.7, top_p: 1, max_tokens: 512, tools: "" };
const MAX_CONVERSATIONS = 50;

const state = {
  chats: JSON.parse(localStorage.getItem(STORE.chats) || "[]"),
  current: localStorage.getItem(STORE.current),
  settings: Object.assign({}, DEFAULTS, JSON.parse(localStorage.getItem(STORE.settings) || "{}")),
  controller: null, // the AbortController of the stream in flight
};

const $ = (id) => document.getElementById(id);

function save() {
  state.chats = state.chats.slice(0, MAX_CONVERSATIONS);
  localStorage.setItem(STORE.chats, JSON.stringify(state.chats));
  localStorage.setItem(STORE.current, state.current || "");
  localStorage.setItem(STORE.settings, JSON.stringify(state.settings));
}

function currentChat() {
  return state.chats.find((c) => c.id === state.current) || null;
}

function newChat() {
  const chat = { id: "c" + Date.now().toString(36), title: "New chat", messages: [], updated: Date.now() };
  state.chats.unshift(chat);
  state.current = chat.id;
  save();
  return chat;
}

// ---------------------------------------------------------------- rendering
function markdown(text) {
  const html = window.marked ? marked.parse(text || "", { gfm: true, breaks: true }) : null;
  if (html === null || !window.DOMPurify) return el("div", { class: "md", text: text || "" });
  const div = el("div", { class: "md" });
  div.innerHTML = DOMPurify.sanitize(html); // sanitized: no script, no handlers
  for (const pre of div.querySelectorAll("pre")) {
    pre.prepend(el("button", { class: "copy", type: "button", text: "copy",
      onclick: () => navigator.clipboard && navigator.clipboard.writeText(pre.innerText.replace(/^copy\n?/, "")) }));
  }
  return div;
}

function statsLine(stats) {
  if (!stats) return el("div", { class: "stats", text: "…" });
  const parts = [];
  if (stats.prompt_tokens !== undefined) parts.push(`${stats.prompt_tokens} prompt`);
  if (stats.completion_tokens !== undefined) parts.push(`${stats.completion_tokens} generated tokens`);
  if (stats.tokens_per_second) parts.push(`${fmt(stats.tokens_per_second)} tok/s`);
  if (stats.ttft !== undefined) parts.push(`first token ${fmtSeconds(stats.ttft)}`);
  if (stats.finish_reason) parts.push(stats.finish_reason);
  return el("div", { class: "stats", text: parts.join(" · ") });
}

function toolCallsBlock(calls) {
  const box = el("div", { class: "tool-calls" });
  for (const call of calls) {
    const fn = call.function || {};
    let args = fn.arguments || "";
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (e) { /* still streaming */ }
    box.append(el("div", { class: "tool-call" }, el("span", { class: "tool-name", text: `tool call · ${fn.name || "?"}` }),
      el("pre", { text: args })));
  }
  return box;
}

function messageNode(msg) {
  const node = el("div", { class: `msg ${msg.role}` + (msg.pending ? " pending" : "") });
  node.append(el("div", { class: "role", text: msg.role === "user" ? "you" : (msg.model || "assistant") }));
  if (msg.reasoning) {
    const details = el("details", { class: "reasoning" }, el("summary", { text: msg.pending && !msg.content
      ? "Reasoning…" : "Reasoning" }), el("div", { class: "reasoning-text", text: msg.reasoning }));
    if (msg.pending && !msg.content) details.open = true;
    node.append(details);
  }
  node.append(msg.role === "user" ? el("div", { class: "md", text: msg.content }) : markdown(msg.content));
  if (msg.tool_calls && msg.tool_calls.length) node.append(toolCallsBlock(msg.tool_calls));
  if (msg.error) node.append(el("div", { class: "error", text: msg.error }));
  if (msg.role === "assistant") node.append(statsLine(msg.stats));
  return node;
}

function renderMessages() {
  const box = $("messages");
  const chat = currentChat();
  box.replaceChildren();
  if (!chat || !chat.messages.length) {
    box.append(el("div", { class: "empty", text: "Send a message to start." }));
    return;
  }
  for (const msg of chat.messages) box.append(messageNode(msg));
  box.scrollTop = box.scrollHeight;
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const chat of state.chats) {
    const item = el("li", { class: chat.id === state.current ? "active" : "" },
      el("span", { class: "title", text: chat.title, onclick: () => { state.current = chat.id; save(); renderAll(); } }),
      el("button", { class: "ghost del", type: "button", title: "delete", text: "×", onclick: () => {
        state.chats = state.chats.filter((c) => c !== chat);
        if (state.current === chat.id) state.current = state.chats.length ? state.chats[0].id : null;
        save(); renderAll();
      } }));
    list.append(item);
  }
}

function renderAll() {
  renderSidebar();
  renderMessages();
}

// ---------------------------------------------------------------- settings
function bindSettings() {
  const s = state.settings;
  for (const name of ["system", "temperature", "top_p", "max_tokens", "tools"]) {
    const input = $(name);
    input.value = s[name];
    const out = $(name + "-out");
    if (out) out.textContent = input.value;
    input.addEventListener("input", () => {
      s[name] = input.type === "range" || input.type === "number" ? Number(input.value) : input.value;
      if (out) out.textContent = input.value;
      save();
    });
  }
  $("model").addEventListener("change", () => { s.model = $("model").value; save(); });
}

async function loadModels() {
  const select = $("model");
  const resp = await api("v1/models");
  if (!resp.ok) {
    select.replaceChildren(el("option", { text: "(models: " + (await errorText(resp)) + ")" }));
    return;
  }
  const ids = (await resp.json()).data.map((m) => m.id);
  select.replaceChildren(...ids.map((id) => el("option", { value: id, text: id })));
  if (ids.includes(state.settings.model)) select.value = state.settings.model;
  state.settings.model = select.value;
}

// ---------------------------------------------------------------- chat
function requestBody(chat) {
  const s = state.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of chat.messages) {
    if (m.pending || m.error && !m.content) continue;
    messages.push({ role: m.role, content: m.content || "" });
  }
  const body = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: s.temperature, top_p: s.top_p, max_tokens: s.max_tokens };
  if (s.tools.trim()) body.tools = JSON.parse(s.tools); // a SyntaxError is shown under the answer
  return body;
}

function applyDelta(msg, delta, now) {
  const reasoning = delta.reasoning ?? delta.reasoning_content;
  if (reasoning) msg.reasoning = (msg.reasoning || "") + reasoning;
  if (delta.content) msg.content += delta.content;
  for (const frag of delta.tool_calls || []) {
    msg.tool_calls = msg.tool_calls || [];
    const call = msg.tool_calls[frag.index] ||= { id: frag.id, type: "function", function: { name: "", arguments: "" } };
    if (frag.function && frag.function.name) call.function.name += frag.function.name;
    if (frag.function && frag.function.arguments) call.function.arguments += frag.function.arguments;
  }
  if (reasoning || delta.content || delta.tool_calls) {
    msg.n_chunks = (msg.n_chunks || 0) + 1; // about one token each: the count when no usage came
    msg.t_first = msg.t_first || now;
    msg.t_last = now;
  }
}

function finishStats(msg, usage, t0, finishReason) {
  const stats = { finish_reason: finishReason || undefined };
  if (usage) Object.assign(stats, { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens });
  if (msg.t_first) stats.ttft = (msg.t_first - t0) / 1000;
  if (stats.completion_tokens === undefined && msg.n_chunks) stats.completion_tokens = msg.n_chunks;
  const n = stats.completion_tokens;
  // decode rate: the tokens after the first over the time since the first (llama.cpp's predicted_per_second)
  if (n > 1 && msg.t_last > msg.t_first) stats.tokens_per_second = (n - 1) / ((msg.t_last - msg.t_first) / 1000);
  return stats;
}

async function readStream(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split(/\r?\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

function liveUpdater(chat, msg) {
  const box = $("messages");
  let scheduled = false;
  return () => {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => {
      scheduled = false;
      const index = chat.messages.indexOf(msg);
      const old = box.children[index];
      if (old && currentChat() === chat) old.replaceWith(messageNode(msg));
      box.scrollTop = box.scrollHeight;
    });
  };
}

async function send(text) {
  const chat = currentChat() || newChat();
  if (!chat.messages.length) chat.title = text.slice(0, 48);
  chat.messages.push({ role: "user", content: text });
  const msg = { role: "assistant", content: "", model: $("model").value, pending: true, stats: null };
  chat.messages.push(msg);
  chat.updated = Date.now();
  save();
  renderAll();
  const update = liveUpdater(chat, msg);
  const controller = (state.controller = new AbortController());
  setBusy(true);
  const t0 = performance.now();
  let usage = null, finishReason = null;
  try {
    const resp = await api("v1/chat/completions", { method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(requestBody(chat)) });
    if (!resp.ok) throw new Error(await errorText(resp));
    await readStream(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const choice = (chunk.choices || [])[0];
      if (choice) {
        applyDelta(msg, choice.delta || {}, performance.now());
        finishReason = choice.finish_reason || finishReason;
      }
      update();
    });
  } catch (e) {
    if (e.name === "AbortError") finishReason = "stopped";
    else msg.error = String(e.message || e);
  } finally {
    msg.pending = false;
    msg.stats = finishStats(msg, usage, t0, finishReason);
    delete msg.t_first; delete msg.t_last; delete msg.n_chunks;
    state.controller = null;
    setBusy(false);
    save();
    renderAll();
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// An answer still streaming when the page was closed ends there.
function endInterrupted() {
  for (const chat of state.chats) {
    for (const m of chat.messages) {
      if (!m.pending) continue;
      m.pending = false;
      m.stats = Object.assign({}, m.stats, { finish_reason: "interrupted" });
    }
  }
}

document.addEventListener("DOMContentLoaded", () => {
  endInterrupted();
  bindSettings();
  renderAll();
  loadModels();
  $("new-chat").addEventListener("click", () => { newChat(); renderAll(); $("prompt").focus(); });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
});
