// The chat page: talks to this server's own OpenAI API (/v1/models, streaming /v1/chat/completions).
import { renderMarkdown } from "/ui/markdown.js";

const KEY_STORAGE = "pocketllm-api-key";
const CHAT_STORAGE = "pocketllm-conversation";  // this tab's conversation, kept across reloads
const $ = (id) => document.getElementById(id);
const conversation = $("conversation");
const SETTINGS = ["temperature", "top_p", "max_tokens", "seed"];

const state = {
  messages: [],  // {role, content} sent back to the server; assistant turns as the server gave them
  controller: null,  // the running request's AbortController
  conversationId: 0,  // bumped by "New chat": a reply still arriving for an older one is dropped
  key: sessionStorage.getItem(KEY_STORAGE) || "",
};

class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function describe(error) {
  if (error instanceof ApiError) {
    const what = {400: "Bad request", 401: "Not authorized", 404: "Not found", 413: "Request too large",
                  503: "Server unavailable"}[error.status] || "Error";
    return error.status ? `${what} (${error.status}): ${error.message}` : `Error: ${error.message}`;
  }
  return `Could not reach the server: ${error.message}`;
}

async function api(path, options = {}) {
  const headers = {"Content-Type": "application/json"};
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  const response = await fetch(path, {...options, headers});
  if (response.ok) return response;
  let message = response.statusText, code = null;
  try {
    const body = await response.json();
    message = body.error?.message || message;
    code = body.error?.code || null;
  } catch { /* not JSON: keep the status text */ }
  if (response.status === 401) askForKey();
  throw new ApiError(response.status, message, code);
}

// Server-sent events of a streaming completion, parsed as JSON; ends at [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function askForKey() {
  const dialog = $("key-dialog");
  $("key").value = "";  // the key that was refused
  if (!dialog.open) dialog.showModal();
}

function addMessage(role) {
  const view = document.createElement("article");
  view.className = `message ${role}`;
  view.dataset.role = role;
  conversation.append(view);
  return view;
}

function showUser(text) {
  const view = addMessage("user");
  view.textContent = text;  // what the user typed is shown as typed
  view.scrollIntoView({block: "end"});
}

function showError(text) {
  const view = addMessage("error");
  view.setAttribute("role", "alert");
  view.textContent = text;
  view.scrollIntoView({block: "end"});
}

// An assistant reply being streamed: reasoning (collapsed), content as Markdown, tool calls, a stats line.
class Reply {
  constructor() {
    this.view = addMessage("assistant");
    this.reasoning = document.createElement("details");
    this.reasoning.className = "reasoning";
    this.reasoning.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    this.reasoningText = document.createElement("div");
    this.reasoning.append(summary, this.reasoningText);
    this.body = document.createElement("div");
    this.body.className = "content";
    this.tools = document.createElement("div");
    this.stats = document.createElement("footer");
    this.stats.className = "stats";
    this.view.append(this.reasoning, this.body, this.tools, this.stats);
    this.content = "";
    this.reasoningContent = "";
    this.toolCalls = [];
    this.pending = false;
  }

  add(delta) {
    this.content += delta.content || "";
    this.reasoningContent += delta.reasoning_content ?? delta.reasoning ?? "";
    for (const call of delta.tool_calls || []) {
      const known = this.toolCalls[call.index] ||= {id: call.id, type: "function", function: {name: "", arguments: ""}};
      known.function.name += call.function?.name || "";
      known.function.arguments += call.function?.arguments || "";
    }
    if (!this.pending) {  // one render per frame, however fast tokens come
      this.pending = true;
      requestAnimationFrame(() => this.render());
    }
  }

  render() {
    this.pending = false;
    this.view.dataset.raw = this.content;
    renderMarkdown(this.content, this.body);
    this.reasoning.hidden = !this.reasoningContent;
    this.reasoningText.textContent = this.reasoningContent;
    this.tools.replaceChildren(...this.toolCalls.filter(Boolean).map((call) => {
      const block = document.createElement("pre");
      block.className = "tool-call";
      block.textContent = `tool call: ${call.function.name}(${call.function.arguments})`;
      return block;
    }));
    this.view.scrollIntoView({block: "end"});
  }

  finish({finishReason, tokens, started, firstAt, endedAt}) {
    this.render();
    this.view.dataset.finish = finishReason;
    if (tokens !== null) this.view.dataset.tokens = String(tokens);
    const parts = [];
    if (tokens !== null) parts.push(`${tokens} tokens`);
    if (tokens && firstAt !== null && endedAt > firstAt) {
      parts.push(`${(tokens / ((endedAt - firstAt) / 1000)).toFixed(1)} tok/s`);
    }
    if (firstAt !== null) parts.push(`first token ${Math.round(firstAt - started)} ms`);
    parts.push(`finish: ${finishReason}`);
    this.stats.textContent = parts.join(" · ");
  }
}

function settings() {
  const values = {};
  for (const name of SETTINGS) {
    const raw = $(name).value.trim();
    if (raw !== "") values[name] = Number(raw);
  }
  const tools = $("tools").value.trim();
  if (tools) {
    try {
      values.tools = JSON.parse(tools);
    } catch (error) {
      throw new ApiError(0, `Tools must be a JSON list of tool definitions: ${error.message}`);
    }
  }
  return values;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || state.messages.length === 0;
}

async function complete() {
  const system = $("system").value.trim();
  const messages = [...(system ? [{role: "system", content: system}] : []), ...state.messages];
  let body;
  try {
    body = {model: $("model").value || undefined, messages, stream: true, stream_options: {include_usage: true},
            ...settings()};
  } catch (error) {
    showError(describe(error));
    return;
  }
  const reply = new Reply();
  const conversationId = state.conversationId;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const started = performance.now();
  let firstAt = null, finishReason = null, tokens = null;
  try {
    const response = await api("/v1/chat/completions", {method: "POST", body: JSON.stringify(body),
                                                        signal: controller.signal});
    for await (const chunk of events(response)) {
      if (chunk.error) throw new ApiError(0, chunk.error.message, chunk.error.code);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        if (firstAt === null && choice.delta && Object.keys(choice.delta).some((k) => k !== "role")) {
          firstAt = performance.now();
        }
        reply.add(choice.delta || {});
        finishReason = choice.finish_reason || finishReason;
      }
    }
  } catch (error) {
    if (state.conversationId !== conversationId) return;
    if (error.name === "AbortError") {
      finishReason = "stopped";
    } else {  // the user's turn stays: Regenerate asks again
      reply.view.remove();
      showError(describe(error));
      return;
    }
  } finally {
    if (state.controller === controller) {
      state.controller = null;
      setBusy(false);
    }
  }
  if (state.conversationId !== conversationId) return;  // "New chat" dropped this conversation meanwhile
  reply.finish({finishReason: finishReason || "unknown", tokens, started, firstAt, endedAt: performance.now()});
  const turn = {role: "assistant", content: reply.content};
  if (reply.toolCalls.length) turn.tool_calls = reply.toolCalls.filter(Boolean);
  state.messages.push(turn);
  saveConversation();
  setBusy(false);
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  state.messages.push({role: "user", content: text});
  saveConversation();
  showUser(text);
  await complete();
}

// Asks again for the last reply (or for a reply to the last turn, when asking failed).
async function regenerate() {
  if (state.controller || state.messages.length === 0) return;
  if (state.messages.at(-1).role === "assistant") {
    state.messages.pop();
    [...conversation.querySelectorAll("article.assistant")].at(-1)?.remove();
  }
  await complete();
}

function saveConversation() {
  sessionStorage.setItem(CHAT_STORAGE, JSON.stringify(state.messages));
}

function restoreConversation() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(CHAT_STORAGE) || "[]");
    if (!Array.isArray(saved)) return;
    state.messages = saved.filter((m) => m && (m.role === "user" || m.role === "assistant") &&
                                         typeof m.content === "string");
  } catch {
    return;  // not ours, or from an older page: start afresh
  }
  for (const message of state.messages) {
    if (message.role === "user") {
      showUser(message.content);
    } else {
      const reply = new Reply();
      reply.content = message.content;
      reply.toolCalls = Array.isArray(message.tool_calls) ? message.tool_calls.filter((c) => c?.function) : [];
      reply.render();
    }
  }
  setBusy(false);
}

function newChat() {
  const running = state.controller;
  state.conversationId += 1;  // the running reply, when its abort lands, belongs to no conversation
  state.controller = null;
  running?.abort();
  state.messages = [];
  saveConversation();
  conversation.replaceChildren();
  setBusy(false);
}

let loadingNotice = null;  // the "still loading" message, while the page waits for the model

async function loadServer() {
  try {
    const models = await (await api("/v1/models")).json();
    const select = $("model");
    select.replaceChildren(...models.data.map((m) => new Option(m.id, m.id)));
    const defaults = await (await api("/ui/defaults")).json();
    for (const name of SETTINGS) {
      const value = defaults.sampling[name];
      $(name).placeholder = value === null || value === undefined ? "server default" : `${value} (default)`;
    }
    if (defaults.sampling.max_tokens === null) $("max_tokens").placeholder = `rest of ${defaults.max_model_len}`;
    loadingNotice?.remove();
    loadingNotice = null;
  } catch (error) {
    if (error.status === 503 && error.code === "model_loading") {  // ask again until the model is up
      if (!loadingNotice) {
        showError(describe(error));
        loadingNotice = conversation.lastElementChild;
      }
      setTimeout(loadServer, 1000);
      return;
    }
    showError(describe(error));
  }
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("regenerate").addEventListener("click", regenerate);
$("new-chat").addEventListener("click", newChat);
$("toggle-settings").addEventListener("click", () => {
  const panel = $("settings");
  panel.hidden = !panel.hidden;
  $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
});
$("key-form").addEventListener("submit", () => {
  state.key = $("key").value.trim();
  sessionStorage.setItem(KEY_STORAGE, state.key);
  conversation.querySelectorAll("article.error").forEach((e) => e.remove());
  restoreConversation();
loadServer();
});
restoreConversation();
loadServer();
