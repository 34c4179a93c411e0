// The ellm web console: plain JS, no framework. Pages by URL hash: #/sessions, #/session/ID,
// #/live, #/chat/ID (a new session when ID is empty). Data from the daemon's documented JSON
// endpoints (/api/..., docs/http-api.md) and its OpenAI route for the chat. The API key is kept
// in sessionStorage only; every text is put in the page as text, never as markup.
"use strict";

const KEY = "ellm-api-key";
const HISTORY = 300; // live samples kept for the charts (one a second: five minutes)
const $ = (selector) => document.querySelector(selector);
const state = { sort: "updated", up: false, filter: "", timer: null, live: [], chatBusy: false, route: 0 };

// ---- plumbing ---------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(path, options = {}) {
  const reply = await fetch(path, { ...options, headers: headers(options.headers) });
  if (!reply.ok) {
    let message = `${reply.status} ${reply.statusText}`;
    try { message = (await reply.json()).error.message; } catch (_) { /* not JSON */ }
    if (reply.status === 401) showLogin(`The key was refused: ${message}`);
    throw new ApiError(reply.status, message);
  }
  return reply;
}

const getJson = async (path) => (await api(path)).json();
const STALE = new Error("the page changed meanwhile");

// The data of the page being shown; STALE if another page was asked for while it loaded, so that
// a slow answer never paints over the newer page.
async function pageJson(path) {
  const route = state.route;
  const data = await getJson(path);
  if (route !== state.route) throw STALE;
  return data;
}
const postJson = async (path, body, method = "POST") => (await api(path, {
  method, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) })).json();

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) if (child !== null && child !== undefined) node.append(child);
  return node;
}

const num = (n) => (n === null || n === undefined ? "" : Number(n).toLocaleString("en"));
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  for (; n >= 1024 && i < units.length - 1; i++) n /= 1024;
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
function ago(seconds) {
  const s = Math.max(0, Date.now() / 1000 - seconds);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}
const sessionLink = (id) => `#/session/${encodeURIComponent(id)}`;
const sessionPath = (id) => `/api/sessions/${encodeURIComponent(id)}`;

function toast(message) {
  const box = $("#toast");
  box.textContent = message;
  box.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { box.hidden = true; }, 4000);
}

function confirmAction(message) {
  return new Promise((resolve) => {
    $("#confirm-text").textContent = message;
    $("#confirm").hidden = false;
    const done = (answer) => { $("#confirm").hidden = true; resolve(answer); };
    $("#confirm-yes").onclick = () => done(true);
    $("#confirm-no").onclick = () => done(false);
  });
}

function view(...children) {
  $("#view").replaceChildren(...children);
}

function failed(error) {
  if (error !== STALE && error.status !== 401) view(el("p", { class: "error", id: "error", text: error.message }));
}

// ---- the key ----------------------------------------------------------------------------

function showLogin(message = "") {
  stopTimer();
  sessionStorage.removeItem(KEY);
  $("#login").hidden = false;
  $("#view").replaceChildren();
  $("#logout").hidden = true;
  $("#login-error").textContent = message;
  $("#key").focus();
}

async function connect(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("#key").value);
  try {
    const models = await getJson("/v1/models");
    $("#model").textContent = models.data.map((m) => m.id).join(", ");
  } catch (error) {
    if (error.status !== 401) $("#login-error").textContent = error.message;
    return;
  }
  $("#key").value = "";
  $("#login").hidden = true;
  $("#logout").hidden = false;
  route();
}

// ---- sessions ---------------------------------------------------------------------------

const COLUMNS = [ // [field, heading, numeric]
  ["session_id", "Id"], ["owner", "Owner"], ["title", "Title"], ["tags", "Tags"], ["tokens", "Tokens", true],
  ["turn_count", "Turns", true], ["resident", "Where"], ["updated", "Last used"], ["kv_bytes", "KV bytes", true],
];

function sortedSessions(sessions) {
  const filter = state.filter.toLowerCase();
  const shown = sessions.filter((s) => !filter || [s.session_id, s.title, s.owner || "", ...(s.tags || [])]
    .some((text) => String(text).toLowerCase().includes(filter)));
  const key = (s) => (Array.isArray(s[state.sort]) ? s[state.sort].join(",") : s[state.sort] ?? "");
  shown.sort((a, b) => (key(a) < key(b) ? -1 : key(a) > key(b) ? 1 : 0) * (state.up ? 1 : -1));
  return shown;
}

async function sessionsPage() {
  const { sessions } = await pageJson("/api/sessions");
  const filter = el("input", { id: "filter", type: "search", placeholder: "Filter by id, title, owner, tag",
    value: state.filter, oninput: (e) => { state.filter = e.target.value; fillSessions(sessions); } });
  const head = el("tr", {}, COLUMNS.map(([name, heading, numeric]) => el("th", {
    "data-sort": name, class: [numeric ? "num" : "", state.sort === name ? "sorted" : "", state.sort === name && state.up ? "up" : ""].join(" "),
    text: heading, onclick: () => { state.up = state.sort === name ? !state.up : false; state.sort = name; sessionsPage().catch(failed); },
  })), el("th", { text: "" }));
  view(el("h1", { text: `Sessions (${sessions.length})` }),
    el("div", { class: "toolbar" }, filter, el("button", { id: "refresh", text: "Refresh", onclick: () => sessionsPage().catch(failed) })),
    el("table", { id: "sessions" }, el("thead", {}, head), el("tbody")));
  fillSessions(sessions);
  $("#filter").focus();
}

function fillSessions(sessions) {
  const rows = sortedSessions(sessions).map((s) => el("tr", { "data-id": s.session_id },
    el("td", { class: "mono" }, el("a", { class: "open", href: sessionLink(s.session_id), text: s.session_id })),
    el("td", { text: s.owner || "operator" }), el("td", { text: s.title }), el("td", { text: (s.tags || []).join(", ") }),
    el("td", { class: "num tokens", text: num(s.tokens) }), el("td", { class: "num", text: num(s.turn_count) }),
    el("td", {}, placeBadge(s)), el("td", { title: new Date(s.updated * 1000).toISOString(), text: ago(s.updated) }),
    el("td", { class: "num", text: bytes(s.kv_bytes) }),
    el("td", {}, sessionActions(s, () => sessionsPage().catch(failed)))));
  $("#sessions tbody").replaceChildren(...rows);
}

function placeBadge(s) {
  if (s.busy) return el("span", { class: "badge busy", text: "busy" });
  return el("span", { class: `badge ${s.resident ? "resident" : "stored"}`, text: s.resident ? "resident" : "stored" });
}

function sessionActions(s, then) {
  return [
    el("button", { class: "fork", text: "Fork", onclick: () => forkSession(s.session_id, then) }), " ",
    el("button", { class: "export", text: "Export", onclick: () => exportSession(s.session_id) }), " ",
    el("button", { class: "delete danger", text: "Delete", onclick: () => deleteSession(s.session_id, then) }),
  ];
}

async function forkSession(id, then) {
  if (!(await confirmAction(`Fork session ${id} into a new session?`))) return;
  try {
    const fork = await postJson(`${sessionPath(id)}/fork`, {});
    toast(`forked ${id} into ${fork.session_id}`);
    then();
  } catch (error) { toast(error.message); }
}

async function deleteSession(id, then) {
  if (!(await confirmAction(`Delete session ${id}? Its tokens and KV are removed from the store.`))) return;
  try {
    await api(sessionPath(id), { method: "DELETE" });
    toast(`deleted ${id}`);
    then();
  } catch (error) { toast(error.message); }
}

async function exportSession(id) {
  if (!(await confirmAction(`Export session ${id} (its tokens and KV) as a file?`))) return;
  try {
    const blob = await (await api(`${sessionPath(id)}/export`)).blob();
    const link = el("a", { href: URL.createObjectURL(blob), download: `${id}.ellm` });
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 10000);
    toast(`exported ${id}: ${bytes(blob.size)}`);
  } catch (error) { toast(error.message); }
}

// ---- one session ------------------------------------------------------------------------

async function sessionPage(id) {
  const s = await pageJson(sessionPath(id));
  const byKind = {};
  for (const turn of s.turns) byKind[turn.kind] = (byKind[turn.kind] || 0) + turn.tokens;
  const facts = [["Title", s.title], ["Owner", s.owner || "operator"], ["Tags", s.tags.join(", ")],
    ["Tokens", num(s.tokens)], ["Where", s.busy ? "busy" : s.resident ? "resident" : "stored"], ["KV bytes", bytes(s.kv_bytes)],
    ["Created", new Date(s.created * 1000).toLocaleString()], ["Last used", ago(s.updated)],
    ["Skills", s.skills.join(", ") || "none"], ["RAG documents", s.rag.join(", ") || "none"],
    ["Tokens by kind", Object.entries(byKind).map(([kind, n]) => `${kind} ${num(n)}`).join(", ") || "none"],
    ["Usage", Object.entries(s.usage || {}).map(([counter, n]) => `${counter} ${num(n)}`).join(", ") || "none"]];
  const back = () => { location.hash = "#/sessions"; };
  view(el("h1", {}, "Session ", el("span", { class: "mono", id: "session-id", text: s.session_id })),
    el("div", { class: "toolbar" }, el("a", { href: `#/chat/${encodeURIComponent(s.session_id)}`, id: "chat-link" }, el("button", { text: "Chat" })),
      sessionActions(s, back)),
    el("div", { class: "facts" }, facts.map(([name, value]) => [el("span", { class: "muted", text: name }), el("span", { text: value })])),
    el("h2", { text: `Turns (${s.turns.length})` }), turnTable(s));
}

function turnTable(s) {
  const rows = s.turns.map((turn) => {
    const text = el("pre", { class: "text", text: turn.text ?? "" });
    const ids = el("td", { class: "mono ids" });
    return el("tr", { "data-index": turn.index },
      el("td", { class: "num", text: turn.index }), el("td", { class: "kind", text: turn.kind }),
      el("td", { text: [turn.role, turn.name].filter(Boolean).join(" · ") }),
      el("td", { class: "num mono", text: `${turn.start}–${turn.end}` }), el("td", { class: "num tokens", text: turn.tokens }),
      el("td", {}, text), ids,
      el("td", {}, el("button", { class: "more", text: "Text", title: "Show the whole text", onclick: () => text.classList.toggle("open") }), " ",
        el("button", { class: "show-tokens", text: "Tokens", onclick: () => showTokens(s.session_id, turn.index, ids) }), " ",
        el("button", { class: "rewind danger", text: "Rewind here", onclick: () => rewindTo(s.session_id, turn.index) })));
  });
  return el("table", { id: "turns" }, el("thead", {}, el("tr", {}, ["#", "Kind", "Role / name", "Span", "Tokens", "Text", "Token ids", ""]
    .map((h, i) => el("th", { class: [0, 3, 4].includes(i) ? "num" : "", text: h })))), el("tbody", {}, rows));
}

async function showTokens(id, index, cell) {
  try {
    const s = await getJson(`${sessionPath(id)}?tokens=1`);
    cell.textContent = s.turns[index].token_ids.join(" ");
  } catch (error) { toast(error.message); }
}

async function rewindTo(id, index) {
  if (!(await confirmAction(`Rewind session ${id} to before turn ${index}? Turn ${index} and the later ones are dropped.`))) return;
  try {
    await postJson(`${sessionPath(id)}/rewind`, { turn: index });
    toast(`rewound ${id} to ${index} turns`);
    await sessionPage(id);
  } catch (error) { toast(error.message); }
}

// ---- live -------------------------------------------------------------------------------

const CHARTS = [ // [id, title, value of a sample given the one before]
  ["chart-generated", "Generated tok/s", (s, p) => rate(s, p, "generated")],
  ["chart-prefilled", "Prefilled tok/s", (s, p) => rate(s, p, "prefilled")],
  ["chart-reused", "Reused (cached) tok/s", (s, p) => rate(s, p, "reused")],
  ["chart-requests", "Requests in flight", (s) => s.in_flight],
  ["chart-kv", "KV memory used (MiB)", (s) => s.kv_bytes_used / 2 ** 20],
  ["chart-accepted", "Draft tokens accepted /s", (s, p) => rate(s, p, "accepted")],
];

function rate(sample, previous, counter) {
  if (!previous) return 0;
  const seconds = (sample.at - previous.at) / 1000;
  return seconds > 0 ? Math.max(0, (sample.counters[counter] - previous.counters[counter]) / seconds) : 0;
}

async function livePage() {
  view(el("h1", { text: "Live" }), el("div", { id: "live-summary", class: "facts" }),
    el("h2", { text: "Slots" }), el("table", { id: "slots" }), el("h2", { text: "Over the last minutes" }),
    el("div", { class: "charts" }, CHARTS.map(([id, title]) => el("div", { class: "chart" },
      el("div", { class: "muted" }, title, " ", el("strong", { class: "now", "data-chart": id })), el("canvas", { id, width: 600, height: 180 })))));
  const route = state.route;
  await refreshLive();
  if (route !== state.route) return;
  state.timer = setInterval(() => refreshLive().catch((error) => { stopTimer(); failed(error); }), 1000);
}

async function refreshLive() {
  const sample = { ...(await getJson("/api/live")), at: Date.now() };
  if (!$("#slots")) return; // left the page meanwhile
  state.live.push(sample);
  state.live.splice(0, Math.max(0, state.live.length - HISTORY));
  const storeUsed = sample.store.bytes_used, storeSize = sample.store.map_size;
  $("#live-summary").replaceChildren(
    el("span", { class: "muted", text: "KV memory" }), meter(sample.kv_bytes_used, sample.kv_bytes, "kv-meter"),
    el("span", { class: "muted", text: "Store" }), storeSize ? meter(storeUsed, storeSize, "store-meter") : el("span", { text: bytes(storeUsed || 0) }),
    el("span", { class: "muted", text: "Sessions" }), el("span", { text: `${sample.sessions_resident} resident of ${sample.slots.length} slots, ${num(sample.sessions_stored)} stored` }),
    el("span", { class: "muted", text: "Requests" }), el("span", { id: "requests",
      text: `${sample.in_flight} in flight (max ${sample.max_queue}): ${sample.generating} generating, ${sample.prefilling} prefilling, ${sample.waiting} waiting, ${sample.queued} queued` }),
    el("span", { class: "muted", text: "Uptime" }), el("span", { text: `${num(Math.round(sample.uptime_s))} s` }));
  $("#slots").replaceChildren(el("tr", {}, ["Slot", "State", "Session", "Tokens", "Progress"].map((h) => el("th", { text: h }))),
    ...sample.slots.map(slotRow));
  drawCharts();
}

function meter(used, total, id) {
  const share = total ? used / total : 0;
  const fill = el("span");
  fill.style.width = `${(100 * share).toFixed(1)}%`; // through the CSSOM: the CSP refuses style attributes
  return el("span", { id, title: `${bytes(used)} of ${bytes(total)}` }, el("div", { class: "bar" }, fill),
    el("span", { class: "muted", text: `${bytes(used)} of ${bytes(total)} (${(100 * share).toFixed(1)}%)` }));
}

function slotRow(slot) {
  let progress = "";
  if (slot.state === "prefilling") progress = `${num(slot.done)} of ${num(slot.total)} tokens (${Math.round(100 * slot.done / slot.total)}%)`;
  if (slot.state === "generating") progress = `${num(slot.generated)} tokens, ${slot.tok_s === null ? "…" : `${slot.tok_s} tok/s`}`;
  return el("tr", { "data-slot": slot.slot }, el("td", { class: "num", text: slot.slot }),
    el("td", {}, el("span", { class: `badge ${slot.state}`, text: slot.state })),
    el("td", { class: "mono" }, slot.session_id ? el("a", { href: sessionLink(slot.session_id), text: slot.title ? `${slot.session_id} (${slot.title})` : slot.session_id }) : ""),
    el("td", { class: "num", text: num(slot.tokens) }), el("td", { text: progress }));
}

function drawCharts() {
  for (const [id, , value] of CHARTS) {
    const canvas = document.getElementById(id);
    const points = state.live.map((sample, i) => value(sample, state.live[i - 1]));
    document.querySelector(`[data-chart="${id}"]`).textContent = points.length ? points[points.length - 1].toFixed(1) : "";
    drawLine(canvas, points);
  }
}

function drawLine(canvas, points) {
  const context = canvas.getContext("2d");
  const { width, height } = canvas;
  context.clearRect(0, 0, width, height);
  context.strokeStyle = "#dde1e8";
  context.strokeRect(0.5, 0.5, width - 1, height - 1);
  if (points.length < 2) return;
  const top = Math.max(...points, 1e-9);
  context.strokeStyle = "#2f6fdb";
  context.lineWidth = 2;
  context.beginPath();
  const step = width / (points.length - 1); // the samples since the page opened, up to HISTORY
  points.forEach((point, i) => {
    const x = i * step;
    const y = height - 4 - (point / top) * (height - 8);
    if (i) context.lineTo(x, y); else context.moveTo(x, y);
  });
  context.stroke();
}

// ---- chat -------------------------------------------------------------------------------

async function chatPage(id) {
  const session = id ? await pageJson(sessionPath(id)) : null;
  const raw = session && session.turns.some((turn) => ["text", "tokens"].includes(turn.kind));
  const chat = { id: id || `chat-${Math.random().toString(16).slice(2, 10)}`, messages: session ? session.messages : [] };
  view(el("h1", {}, "Chat with ", el("span", { class: "mono", id: "chat-session", text: chat.id }), id ? "" : el("span", { class: "muted", text: " (new)" })),
    el("div", { class: "chat" },
      el("div", {}, el("div", { id: "chat-log" }, chat.messages.map(messageBox)),
        el("form", { id: "chat-form", onsubmit: (event) => { event.preventDefault(); send(chat); } },
          el("textarea", { id: "chat-input", placeholder: raw ? "" : "Write a message (Enter sends, Shift+Enter a new line)", disabled: raw,
            onkeydown: (event) => { if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(chat); } } }),
          el("label", { class: "muted" }, "max tokens ", el("input", { id: "chat-max-tokens", type: "number", min: 1, value: 512, size: 5 })),
          el("button", { id: "chat-send", type: "submit", text: "Send", disabled: raw })),
        raw ? el("p", { class: "error", text: "This session holds raw text or token turns, not only chat messages: chat with it from its client." }) : ""),
      el("div", {}, el("h2", { text: "Turns" }), el("table", { id: "chat-turns" }))));
  $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
  if (session) fillChatTurns(session.turns);
  if (!raw) $("#chat-input").focus();
}

function messageBox(message) {
  const content = typeof message.content === "string" ? message.content : JSON.stringify(message.content);
  return el("div", { class: `msg ${message.role}` }, el("span", { class: "role", text: message.role }), el("span", { class: "content", text: content ?? "" }));
}

function fillChatTurns(turns) {
  const table = $("#chat-turns");
  if (!table) return;
  table.replaceChildren(el("tr", {}, ["#", "Kind", "Role", "Tokens"].map((h) => el("th", { text: h }))),
    ...turns.map((turn) => el("tr", { "data-index": turn.index }, el("td", { class: "num", text: turn.index }),
      el("td", { class: "kind", text: turn.kind }), el("td", { text: turn.role || "" }), el("td", { class: "num tokens", text: turn.tokens }))));
}

async function refreshChatTurns(id) {
  try { fillChatTurns((await getJson(sessionPath(id))).turns); } catch (_) { /* not created yet */ }
}

async function send(chat) {
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text || state.chatBusy) return;
  state.chatBusy = true;
  $("#chat-send").disabled = true;
  input.value = "";
  const user = { role: "user", content: text };
  $("#chat-log").append(messageBox(user));
  const reply = messageBox({ role: "assistant", content: "" });
  reply.classList.add("streaming");
  $("#chat-log").append(reply);
  const poll = setInterval(() => refreshChatTurns(chat.id), 2000);
  try {
    const answer = await streamReply(chat, [...chat.messages, user], reply.querySelector(".content"));
    chat.messages.push(user, { role: "assistant", content: answer });
    if (location.hash !== `#/chat/${encodeURIComponent(chat.id)}`) history.replaceState(null, "", `#/chat/${encodeURIComponent(chat.id)}`);
  } catch (error) {
    reply.append(el("div", { class: "error", text: error.message }));
  } finally {
    clearInterval(poll);
    reply.classList.remove("streaming");
    reply.classList.add("done");
    state.chatBusy = false;
    $("#chat-send").disabled = false;
    await refreshChatTurns(chat.id);
  }
}

async function streamReply(chat, messages, target) {
  const reply = await api("/v1/chat/completions", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: "ellm", messages, stream: true, session_id: chat.id,
      max_tokens: Number($("#chat-max-tokens").value) || undefined }) });
  const reader = reply.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", answer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices && chunk.choices[0] ? chunk.choices[0].delta.content : null;
        if (delta) { answer += delta; target.textContent = answer; $("#chat-log").scrollTop = $("#chat-log").scrollHeight; }
      }
    }
  }
  return answer;
}

// ---- routing ----------------------------------------------------------------------------

function stopTimer() {
  clearInterval(state.timer);
  state.timer = null;
}

function route() {
  stopTimer();
  state.route += 1;
  if (!$("#login").hidden) return;
  const [, page = "sessions", arg = ""] = location.hash.split("/");
  const id = decodeURIComponent(arg);
  for (const link of document.querySelectorAll("header nav a")) link.classList.toggle("active", link.id === `nav-${page}`);
  const pages = { sessions: sessionsPage, session: () => sessionPage(id), live: livePage, chat: () => chatPage(id) };
  (pages[page] || sessionsPage)().catch(failed);
}

document.addEventListener("DOMContentLoaded", () => {
  $("#login-form").addEventListener("submit", connect);
  $("#logout").addEventListener("click", () => showLogin());
  window.addEventListener("hashchange", route);
  if (sessionStorage.getItem(KEY) === null) return showLogin();
  $("#logout").hidden = false;
  getJson("/v1/models").then((models) => { $("#model").textContent = models.data.map((m) => m.id).join(", "); }).catch(() => {});
  route();
});
