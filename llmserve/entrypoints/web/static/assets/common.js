// Shared by the playground and the live view: the API key (kept in localStorage, sent as
// Authorization: Bearer), fetch with a retry after the key dialog on a 401, small DOM helpers.
"use strict";

const KEY_STORAGE = "llmserve.apiKey";
let keyPrompt = null; // one dialog at a time, shared by every request that got a 401

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

function askForKey(message) {
  if (keyPrompt) return keyPrompt;
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  const note = dialog.querySelector("p");
  if (message) note.textContent = message;
  input.value = apiKey();
  keyPrompt = new Promise((resolve) => {
    const done = (ok) => {
      dialog.close();
      keyPrompt = null;
      if (ok) localStorage.setItem(KEY_STORAGE, input.value.trim());
      resolve(ok);
    };
    document.getElementById("key-form").onsubmit = (ev) => { ev.preventDefault(); done(true); };
    document.getElementById("key-cancel").onclick = () => done(false);
  });
  dialog.showModal();
  input.focus();
  return keyPrompt;
}

// fetch(path) with the key; on 401 ask for a key once and retry, else return the 401.
async function api(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = Object.assign({}, options.headers || {});
    const key = apiKey();
    if (key) headers["Authorization"] = "Bearer " + key;
    const resp = await fetch(path, Object.assign({}, options, { headers }));
    if (resp.status !== 401 || attempt > 2) return resp;
    const msg = key ? "That key was refused. Enter another one." : null;
    if (!(await askForKey(msg))) return resp;
  }
}

// The message of an OpenAI error body, or the status line.
async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return `HTTP ${resp.status} ${resp.statusText}`;
  }
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function fmt(n, digits = 1) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toFixed(digits);
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(s < 10 ? 2 : 1)} s`;
}

document.addEventListener("DOMContentLoaded", () => {
  const button = document.getElementById("key-button");
  if (button) button.addEventListener("click", () => askForKey("The API key sent with every request from this page."));
});
