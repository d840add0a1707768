// tokentrail's web chat: plain ES module, no build step, only the public HTTP + SSE API.
// The chat is a tree (parent_id); the page shows one path through it, chosen sibling by sibling.

const $ = (id) => document.getElementById(id);
const S = {
  token: localStorage.getItem("tt_token") || "",
  chats: [],
  chat: null, // ChatRead of the open chat
  choice: {}, // parent id ("root") -> chosen child id
  live: {}, // message id -> {text, tokens: [{index, token_id, text, logprob}]} while streaming
  tokenCache: {}, // message id -> token view data
  reading: null, // AbortController of the stream being read
  streamingId: null,
};

class ApiError extends Error {
  constructor(status, body) {
    super((body && (body.detail?.toString() || body.code)) || `HTTP ${status}`);
    this.status = status;
    this.code = body && body.code;
  }
}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${S.token}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await resp.text();
  const data = text ? JSON.parse(text) : null;
  if (!resp.ok) throw new ApiError(resp.status, data);
  return data;
}

function status(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "status error" : "status";
}

// ---- login ----------------------------------------------------------------------------------
async function login(event) {
  event.preventDefault();
  const user = $("login-user").value.trim();
  const key = $("login-key").value.trim();
  $("login-error").textContent = "";
  try {
    if (key) {
      S.token = key;
    } else {
      const resp = await fetch(`/auth/login/debug?username=${encodeURIComponent(user)}`);
      const data = await resp.json();
      if (!resp.ok) throw new ApiError(resp.status, data);
      S.token = data.access_token.access_token;
    }
    await api("GET", "/auth/check");
    localStorage.setItem("tt_token", S.token);
    await start();
  } catch (err) {
    S.token = "";
    $("login-error").textContent = `Login failed: ${err.message}`;
  }
}

function logout() {
  localStorage.removeItem("tt_token");
  S.token = "";
  S.chat = null;
  $("app").hidden = true;
  $("login").hidden = false;
}

// ---- chats ----------------------------------------------------------------------------------
async function loadChats() {
  S.chats = (await api("GET", "/chats?limit=100")).chats;
  const list = $("chats");
  list.replaceChildren();
  for (const c of S.chats) {
    const li = document.createElement("li");
    li.textContent = c.title || `chat ${c.id.slice(-6)}`;
    li.dataset.id = c.id;
    if (S.chat && S.chat.id === c.id) li.className = "active";
    li.onclick = () => openChat(c.id);
    list.append(li);
  }
}

async function loadModels() {
  const models = await api("GET", "/configs/model_configs");
  const select = $("model");
  const before = select.value;
  select.replaceChildren(...models.map((m) => new Option(`${m.name} (${m.engine})`, m.name)));
  if (models.some((m) => m.name === before)) select.value = before;
  if (!models.length) status("No worker is connected: start one (tokentrail worker …).", true);
}

async function newChat() {
  const system = $("system").value.trim();
  const chat = await api("POST", "/chats", system ? { system_prompt: system } : {});
  S.choice = {};
  await loadChats();
  await openChat(chat.id);
  $("input").focus();
}

async function openChat(id) {
  if (S.reading) S.reading.abort();
  S.chat = await api("GET", `/chats/${id}`);
  if (!S.chat.messages.some((m) => S.choice[m.parent_id ?? "root"] === m.id)) S.choice = {};
  $("system").value = S.chat.system_prompt || "";
  for (const li of $("chats").children) li.className = li.dataset.id === id ? "active" : "";
  render();
  const open = path().find((m) => m.state === "pending" || m.state === "in_progress");
  if (open) follow(open.id);
}

async function reloadChat() {
  if (S.chat) S.chat = await api("GET", `/chats/${S.chat.id}`);
}

// ---- the tree -------------------------------------------------------------------------------
function children() {
  const kids = {};
  for (const m of S.chat.messages) (kids[m.parent_id ?? "root"] ||= []).push(m);
  for (const list of Object.values(kids)) list.sort((a, b) => (a.id < b.id ? -1 : 1));
  return kids;
}

function path() {
  if (!S.chat) return [];
  const kids = children();
  const out = [];
  let key = "root";
  while (kids[key]) {
    const list = kids[key];
    const chosen = list.find((m) => m.id === S.choice[key]) || list[list.length - 1];
    out.push(chosen);
    key = chosen.id;
  }
  return out;
}

function siblings(msg) {
  return children()[msg.parent_id ?? "root"] || [msg];
}

function choose(msg) {
  S.choice[msg.parent_id ?? "root"] = msg.id;
  render();
}

// ---- rendering ------------------------------------------------------------------------------
function el(tag, attrs = {}, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k.startsWith("on")) node[k] = v;
    else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  node.append(...kids.filter((k) => k !== null && k !== undefined));
  return node;
}

function render() {
  const thread = $("thread");
  thread.replaceChildren();
  for (const msg of path()) thread.append(renderMessage(msg));
  thread.scrollTop = thread.scrollHeight;
  const busy = S.streamingId !== null;
  $("stop").hidden = !busy;
  $("send").disabled = busy;
}

function renderMessage(msg) {
  const live = S.live[msg.id];
  const sibs = siblings(msg);
  const i = sibs.findIndex((m) => m.id === msg.id);
  const switcher =
    sibs.length > 1
      ? el(
          "span",
          { class: "siblings" },
          el("button", { class: "small", title: "previous version", disabled: i === 0, onclick: () => choose(sibs[i - 1]) }, "<"),
          ` ${i + 1}/${sibs.length} `,
          el("button", { class: "small", title: "next version", disabled: i === sibs.length - 1, onclick: () => choose(sibs[i + 1]) }, ">"),
        )
      : null;
  const failed = msg.state === "aborted_by_worker" || msg.state === "timeout";
  const who = el("div", { class: "who" }, el("b", {}, msg.role === "prompter" ? "you" : "assistant"), switcher,
    msg.role === "assistant" ? el("span", { class: "state" }, msg.state) : null);
  const text = live ? live.text : msg.content ?? "";
  const body = el("div", { class: "text" }, failed ? `${msg.error_code}: ${msg.error}` : text || (msg.state === "pending" ? "…" : ""));
  const reasoning = !live && msg.reasoning_content
    ? el("details", { class: "reasoning" }, el("summary", {}, "reasoning"), el("div", { class: "text" }, msg.reasoning_content))
    : null;
  const calls = !live && msg.tool_calls
    ? el("pre", { class: "calls" }, msg.tool_calls.map((c) => `${c.function.name}(${c.function.arguments})`).join("\n"))
    : null;
  const node = el("div", { class: `msg ${msg.role}${failed ? " error" : ""}`, "data-id": msg.id, "data-state": msg.state },
    who, reasoning, body, calls);
  node.append(actions(msg));
  if (msg.role === "assistant" && msg.state !== "pending") {
    const meta = [];
    if (msg.finish_reason) meta.push(`finish: ${msg.finish_reason}`);
    if (msg.completion_token_count != null) meta.push(`${msg.completion_token_count} tokens`);
    if (msg.attempt > 1) meta.push(`attempt ${msg.attempt}`);
    if (meta.length) node.append(el("div", { class: "meta" }, meta.join(" · ")));
    if ($("show-tokens").checked) node.append(tokenView(msg));
  }
  return node;
}

function actions(msg) {
  const box = el("div", { class: "actions" });
  if (msg.role === "prompter") {
    box.append(el("button", { class: "small", onclick: () => edit(msg) }, "Edit"));
    return box;
  }
  const open = msg.state === "pending" || msg.state === "in_progress";
  if (open) box.append(el("button", { class: "small stop", onclick: () => cancel(msg.id) }, "Stop"));
  if (!open) box.append(el("button", { class: "small regen", onclick: () => regenerate(msg) }, "Regenerate"));
  if (msg.state === "complete") {
    box.append(
      el("button", { class: `small vote-up${msg.score === 1 ? " voted" : ""}`, title: "good reply", onclick: () => vote(msg, 1) }, "+1"),
      el("button", { class: `small vote-down${msg.score === -1 ? " voted" : ""}`, title: "bad reply", onclick: () => vote(msg, -1) }, "−1"),
    );
  }
  return box;
}

// ---- token view: what tokentrail keeps ------------------------------------------------------
function colour(logprob) {
  if (logprob === null || logprob === undefined) return "#eee";
  const p = Math.exp(logprob);
  return `hsl(${Math.round(120 * p)}, 70%, 84%)`;
}

function tokenView(msg) {
  const box = el("div", { class: "tokens" });
  const data = S.tokenCache[msg.id];
  const live = S.live[msg.id];
  if (live) {
    box.append(...live.tokens.map(tokenSpan));
    return box;
  }
  if (!data) {
    box.append(el("span", { class: "legend" }, "loading tokens…"));
    loadTokens(msg).then(render).catch((err) => status(`tokens: ${err.message}`, true));
    return box;
  }
  const reused = data.reused_prefix_len || 0;
  const synthetic = data.synthetic_token_count || 0;
  const ids = data.prompt_token_ids || [];
  box.append(
    el("div", { class: "legend" }, `prompt: ${ids.length} tokens — ${reused} reused from the stored chain (blue), ${synthetic} synthetic closer (orange), the rest newly rendered`),
    el("div", { class: "prompt-ids" }, ...ids.map((id, k) => {
      const kind = k < reused ? "reused" : k < reused + synthetic ? "synthetic" : "";
      return el("span", { class: `pid ${kind}`, title: `prompt[${k}] id ${id}${kind ? ` (${kind})` : ""}` }, String(id));
    })),
    el("div", { class: "legend" }, `completion: ${data.tokens.length} tokens, coloured by probability (green likely, red unlikely); hover for id and logprob`),
    el("div", { class: "completion" }, ...data.tokens.map(tokenSpan)),
  );
  return box;
}

function tokenSpan(t) {
  const title = `#${t.index} id ${t.token_id} logprob ${t.logprob === null ? "n/a" : t.logprob.toFixed(4)}`;
  return el("span", { class: "tok", style: `background:${colour(t.logprob)}`, title, "data-token-id": t.token_id }, t.text || "∅");
}

async function loadTokens(msg) {
  const full = await api("GET", `/chats/${S.chat.id}/messages/${msg.id}?include=tokens`);
  const tokens = [];
  await readEvents(msg.id, -1, (ev) => {
    if (ev.event_type === "token") tokens.push(ev);
  });
  S.tokenCache[msg.id] = { ...full, tokens };
}

// ---- streaming ------------------------------------------------------------------------------
// Reads the message's SSE events with fetch (EventSource cannot send the Authorization header),
// resuming with Last-Event-ID after a network drop. Resolves with the final event.
async function readEvents(messageId, after, onEvent, signal) {
  let last = after;
  for (let tries = 0; tries < 30; tries++) {
    const headers = { Authorization: `Bearer ${S.token}`, Accept: "text/event-stream" };
    if (last >= 0) headers["Last-Event-ID"] = String(last);
    try {
      const resp = await fetch(`/chats/${S.chat.id}/messages/${messageId}/events`, { headers, signal });
      if (!resp.ok) throw new ApiError(resp.status, await resp.json().catch(() => null));
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        // sse-starlette ends lines with CRLF; a CR at the very end waits for its LF in the next chunk
        buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
          if (!data) continue;
          const ev = JSON.parse(data);
          if (ev.event_type === "token") last = Math.max(last, ev.index);
          if (ev.event_type === "reset") last = ev.from_index - 1;
          onEvent(ev);
          if (ev.event_type === "message" || ev.event_type === "error") return ev;
        }
      }
    } catch (err) {
      if (signal && signal.aborted) throw err;
      if (err instanceof ApiError && err.status < 500) throw err;
    }
    await new Promise((r) => setTimeout(r, Math.min(500 * (tries + 1), 3000)));
  }
  throw new Error("the event stream kept failing");
}

async function follow(messageId) {
  if (S.reading) S.reading.abort();
  const controller = new AbortController();
  S.reading = controller;
  S.streamingId = messageId;
  const live = (S.live[messageId] = { text: "", tokens: [] });
  render();
  try {
    const final = await readEvents(messageId, -1, (ev) => {
      if (ev.event_type === "token") {
        live.tokens[ev.index] = ev;
        live.text = live.tokens.map((t) => (t ? t.text : "")).join("");
        updateLive(messageId);
      } else if (ev.event_type === "reset") {
        live.tokens.length = ev.from_index;
        live.text = live.tokens.map((t) => t.text).join("");
      } else if (ev.event_type === "pending") {
        status(`queued: position ${ev.queue_position + 1} of ${Math.max(ev.queue_size, 1)}`);
      }
    }, controller.signal);
    status(final.event_type === "error" ? `${final.code}: ${final.error}` : "", final.event_type === "error" && final.code !== "cancelled");
  } catch (err) {
    if (!controller.signal.aborted) status(`stream: ${err.message}`, true);
  } finally {
    if (S.reading === controller) {
      S.reading = null;
      S.streamingId = null;
    }
    delete S.live[messageId];
    await reloadChat();
    render();
  }
}

function updateLive(messageId) {
  const node = document.querySelector(`.msg[data-id="${messageId}"] .text`);
  if (node) node.textContent = S.live[messageId].text;
  else render();
}

// ---- actions --------------------------------------------------------------------------------
function sampling() {
  const num = (id) => {
    const v = $(id).value;
    return v === "" ? null : Number(v);
  };
  return {
    temperature: num("temperature"),
    top_p: num("top_p"),
    max_new_tokens: num("max_new_tokens"),
    ignore_eos: $("ignore_eos").checked,
  };
}

async function ask(parentId) {
  const model = $("model").value;
  if (!model) throw new Error("no model: connect a worker first");
  const msg = await api("POST", `/chats/${S.chat.id}/assistant_message`, {
    parent_id: parentId,
    model_config_name: model,
    sampling_parameters: sampling(),
  });
  S.choice[parentId] = msg.id;
  await reloadChat();
  await follow(msg.id);
}

async function send(event) {
  event.preventDefault();
  const content = $("input").value.trim();
  if (!content || S.streamingId) return;
  try {
    if (!S.chat) await newChat();
    const tail = path().at(-1);
    if (tail && (tail.role !== "assistant" || tail.state !== "complete")) {
      throw new Error("the last reply did not complete: regenerate it first");
    }
    const prompt = await api("POST", `/chats/${S.chat.id}/prompter_message`, { parent_id: tail ? tail.id : null, content });
    $("input").value = "";
    S.choice[tail ? tail.id : "root"] = prompt.id;
    await ask(prompt.id);
    loadChats();
  } catch (err) {
    status(err.message, true);
  }
}

async function regenerate(msg) {
  try {
    await ask(msg.parent_id);
  } catch (err) {
    status(err.message, true);
  }
}

async function edit(msg) {
  const content = window.prompt("Edit your message (a new branch):", msg.content);
  if (content === null || !content.trim()) return;
  try {
    const prompt = await api("POST", `/chats/${S.chat.id}/prompter_message`, { parent_id: msg.parent_id, content });
    S.choice[msg.parent_id ?? "root"] = prompt.id;
    await ask(prompt.id);
  } catch (err) {
    status(err.message, true);
  }
}

async function vote(msg, score) {
  try {
    await api("POST", `/chats/${S.chat.id}/messages/${msg.id}/votes`, { score: msg.score === score ? 0 : score });
    await reloadChat();
    render();
  } catch (err) {
    status(err.message, true);
  }
}

async function cancel(messageId) {
  try {
    await api("POST", `/chats/${S.chat.id}/messages/${messageId}/cancel`);
  } catch (err) {
    if (err.code !== "message_finished") status(err.message, true);
  }
}

async function saveSystem() {
  if (!S.chat) return;
  try {
    await api("PUT", `/chats/${S.chat.id}`, { system_prompt: $("system").value.trim() || null });
    await reloadChat();
    status("system prompt saved: later turns use it");
  } catch (err) {
    status(err.message, true);
  }
}

// ---- start ----------------------------------------------------------------------------------
async function start() {
  $("login").hidden = true;
  $("app").hidden = false;
  await Promise.all([loadChats(), loadModels()]);
  if (S.chats.length) await openChat(S.chats[0].id);
  else render();
}

$("login-form").onsubmit = login;
$("logout").onclick = logout;
$("new-chat").onclick = () => newChat().catch((err) => status(err.message, true));
$("compose").onsubmit = send;
$("stop").onclick = () => S.streamingId && cancel(S.streamingId);
$("save-system").onclick = saveSystem;
$("show-tokens").onchange = render;
$("model").onfocus = () => loadModels().catch(() => {});
$("input").onkeydown = (e) => {
  if (e.key === "Enter" && !e.shiftKey) send(e);
};

if (S.token) {
  api("GET", "/auth/check").then(start, () => logout());
} else {
  logout();
}
