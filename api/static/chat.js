// The asyncengine chat page: plain JavaScript, no framework, no build step, nothing fetched from elsewhere.
//
// Protocol (api/websocket.py): one WebSocket to v1/ws, opened with the subprotocols
// ["asyncengine.v1", "bearer.<key>"] when the server needs a key (browsers cannot set an Authorization header on
// a WebSocket). Each question is one {"id", "type": "chat.completion", "messages": <the whole conversation>, ...}
// message; its answer streams back as chat.completion.chunk objects carrying that id, then {"id", "type": "done"}.
// Stop sends {"type": "cancel", "id"}: the answer ends with finish_reason "abort". An error for one request is
// {"id", "type": "error", "error": {...}} (then its "done"); a message refused before it became a request gets an
// error with "id": null. GET v1/models comes first: it fills the model picker and tells whether a key is needed or
// wrong (a refused WebSocket handshake is invisible to JavaScript). The key lives in sessionStorage (this tab).
"use strict";

(() => {
  const SUBPROTOCOL = "asyncengine.v1";
  const KEY_STORAGE = "asyncengine.apiKey";
  const HTTP_TOKEN = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/; // the characters a WebSocket subprotocol may hold
  const RETRY_MIN_MS = 500;
  const RETRY_MAX_MS = 8000;
  const ERROR_TITLES = {
    rate_limit_error: "The server is busy",
    invalid_request_error: "The request was refused",
    service_unavailable: "The server is unavailable",
    server_error: "Server error",
    connection: "Connection lost",
  };
  const FINISH_LABELS = { stop: "finished", length: "max tokens reached", abort: "stopped" };

  const $ = (id) => document.getElementById(id);
  const ui = {
    log: $("log"), prompt: $("prompt"), composer: $("composer"), send: $("send"), stop: $("stop"),
    model: $("model"), temperature: $("temperature"), maxTokens: $("max-tokens"), status: $("status"),
    banner: $("banner"), newChat: $("new-chat"), changeKey: $("change-key"),
    keyDialog: $("key-dialog"), keyForm: $("key-form"), key: $("key"), keyError: $("key-error"),
  };

  const state = {
    key: sessionStorage.getItem(KEY_STORAGE), // null until the server asks for one
    ws: null,
    conversation: [], // [{role, content}], sent whole with every question
    answer: null, // the answer streaming now (one at a time), see newAnswer()
    nextId: 1,
    retryMs: RETRY_MIN_MS,
    retryTimer: null,
  };

  // -- connection ------------------------------------------------------------------------------------------------
  async function connect() {
    clearTimeout(state.retryTimer);
    setStatus("connecting", "connecting");
    let response;
    try {
      response = await fetch("v1/models", { headers: authHeaders(), cache: "no-store" });
    } catch (err) {
      return retryLater("The server cannot be reached");
    }
    if (response.status === 401) {
      const refused = state.key !== null;
      forgetKey();
      return askForKey(refused ? "Authentication failed: the server refused this API key." : "");
    }
    if (!response.ok) return retryLater(`The server answered ${response.status} to GET v1/models`);
    if (state.key !== null) sessionStorage.setItem(KEY_STORAGE, state.key);
    fillModels((await response.json()).data);
    openSocket();
  }

  function openSocket() {
    const url = new URL("v1/ws", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    const ws = new WebSocket(url, state.key !== null ? [SUBPROTOCOL, "bearer." + state.key] : [SUBPROTOCOL]);
    let opened = false;
    state.ws = ws;
    ws.onopen = () => {
      opened = true;
      state.retryMs = RETRY_MIN_MS;
      hideBanner();
      setStatus("connected", "connected");
      updateControls();
    };
    ws.onmessage = (event) => onServerMessage(JSON.parse(event.data));
    ws.onclose = () => {
      if (state.ws !== ws) return; // closed on purpose (a new key)
      state.ws = null;
      failAnswer("the connection to the server was lost before the answer completed.");
      retryLater(opened ? "The connection to the server was lost" : "The server refused the WebSocket");
    };
  }

  function closeSocket() {
    const ws = state.ws;
    state.ws = null;
    if (ws) ws.close();
    failAnswer("the connection was closed.");
    updateControls();
  }

  function retryLater(reason) {
    setStatus("offline", "offline");
    updateControls();
    showBanner(`${reason}; reconnecting in ${(state.retryMs / 1000).toFixed(1)} s…`);
    state.retryTimer = setTimeout(connect, state.retryMs);
    state.retryMs = Math.min(state.retryMs * 2, RETRY_MAX_MS);
  }

  function isOpen() {
    return state.ws !== null && state.ws.readyState === WebSocket.OPEN;
  }

  // -- the API key -------------------------------------------------------------------------------------------------
  function authHeaders() {
    return state.key !== null ? { Authorization: "Bearer " + state.key } : {};
  }

  function forgetKey() {
    state.key = null;
    sessionStorage.removeItem(KEY_STORAGE);
  }

  function askForKey(error) {
    setStatus("locked", "API key needed");
    ui.changeKey.hidden = false;
    ui.keyError.textContent = error;
    ui.keyError.hidden = !error;
    ui.key.value = "";
    if (!ui.keyDialog.open) ui.keyDialog.showModal();
    ui.key.focus();
  }

  ui.keyForm.addEventListener("submit", (event) => {
    const key = ui.key.value.trim();
    if (!HTTP_TOKEN.test(key)) {
      event.preventDefault(); // keep the dialog open
      ui.keyError.textContent = "A browser can only send a key made of letters, digits and !#$%&'*+-.^_`|~ "
        + "(it travels as a WebSocket subprotocol).";
      ui.keyError.hidden = false;
      return;
    }
    state.key = key;
    closeSocket();
    connect();
  });

  ui.changeKey.addEventListener("click", () => {
    closeSocket();
    clearTimeout(state.retryTimer);
    askForKey("");
  });

  // -- asking and answering --------------------------------------------------------------------------------------
  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = ui.prompt.value.trim();
    if (!text || !isOpen() || state.answer) return;
    const question = addMessage("user", text);
    state.conversation.push({ role: "user", content: text });
    const answer = newAnswer(question);
    const request = {
      id: answer.id,
      type: "chat.completion",
      messages: state.conversation,
      stream_options: { include_usage: true },
    };
    if (ui.model.value) request.model = ui.model.value;
    setNumber(request, "temperature", ui.temperature.value);
    setNumber(request, "max_tokens", ui.maxTokens.value);
    state.ws.send(JSON.stringify(request));
    ui.prompt.value = "";
    updateControls();
  });

  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      ui.composer.requestSubmit();
    }
  });

  ui.stop.addEventListener("click", () => {
    if (!state.answer || !isOpen()) return;
    state.ws.send(JSON.stringify({ type: "cancel", id: state.answer.id }));
    ui.stop.disabled = true; // the answer ends with finish_reason "abort", then "done"
  });

  ui.newChat.addEventListener("click", () => {
    if (state.answer) return;
    state.conversation = [];
    ui.log.replaceChildren();
  });

  function setNumber(request, field, value) {
    if (value !== "") request[field] = Number(value); // empty: the server's default; the server validates the rest
  }

  function newAnswer(question) {
    const el = addMessage("assistant", "");
    el.classList.add("streaming");
    const body = el.querySelector(".body");
    const text = document.createTextNode("");
    body.append(text);
    const stats = document.createElement("div");
    stats.className = "stats";
    el.append(stats);
    state.answer = {
      id: `chat-${state.nextId++}`, question, el, textNode: text, stats,
      text: "", sentAt: performance.now(), firstAt: null, finishReason: null, usage: null, error: null,
    };
    el.dataset.id = state.answer.id;
    return state.answer;
  }

  function onServerMessage(msg) {
    const answer = state.answer;
    if (answer && msg.type === "error" && msg.id === null) { // refused before it became a request: no "done"
      answer.error = msg.error;
      return finishAnswer();
    }
    if (!answer || msg.id !== answer.id) {
      if (msg.type === "error") showBanner(errorText(msg.error));
      return;
    }
    if (msg.type === "error") {
      answer.error = msg.error; // its "done" follows
    } else if (msg.type === "done") {
      finishAnswer();
    } else {
      for (const choice of msg.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) appendText(answer, piece);
        if (choice.finish_reason) answer.finishReason = choice.finish_reason;
      }
      if (msg.usage) answer.usage = msg.usage;
    }
  }

  function appendText(answer, piece) {
    if (answer.firstAt === null) answer.firstAt = performance.now();
    answer.text += piece;
    answer.textNode.appendData(piece);
    scrollToEnd();
  }

  function finishAnswer() {
    const answer = state.answer;
    state.answer = null;
    const doneAt = performance.now();
    answer.el.classList.remove("streaming");
    if (answer.error) {
      // the question got no (whole) answer: it leaves the conversation, so the next question is sent without it
      state.conversation.pop();
      answer.question.classList.add("unanswered");
      answer.el.classList.add("failed");
      answer.el.dataset.state = "failed";
      const error = document.createElement("div");
      error.className = "error";
      error.textContent = errorText(answer.error);
      answer.el.append(error);
    } else {
      state.conversation.push({ role: "assistant", content: answer.text });
      answer.el.dataset.state = answer.finishReason === "abort" ? "stopped" : "done";
    }
    answer.stats.textContent = statsText(answer, doneAt);
    updateControls();
    scrollToEnd();
  }

  function failAnswer(message) {
    if (!state.answer) return;
    state.answer.error = { type: "connection", message };
    finishAnswer();
  }

  function statsText(answer, doneAt) {
    const parts = [];
    if (answer.firstAt !== null) parts.push(`TTFT ${Math.round(answer.firstAt - answer.sentAt)} ms`);
    const tokens = answer.usage ? answer.usage.completion_tokens : null;
    if (tokens !== null) {
      const decodeSeconds = (doneAt - answer.firstAt) / 1000; // tokens after the first, over the time after it
      if (answer.firstAt !== null && tokens > 1 && decodeSeconds > 0) {
        parts.push(`${((tokens - 1) / decodeSeconds).toFixed(1)} tok/s`);
      }
      parts.push(`${tokens} tokens`);
    }
    if (!answer.error && answer.finishReason) parts.push(FINISH_LABELS[answer.finishReason] || answer.finishReason);
    return parts.join(" · ");
  }

  function errorText(error) {
    return `${ERROR_TITLES[error.type] || "Error"}: ${error.message}`;
  }

  // -- the page ----------------------------------------------------------------------------------------------------
  function addMessage(role, text) {
    const el = document.createElement("article");
    el.className = `message ${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role === "user" ? "You" : "Assistant";
    const body = document.createElement("div");
    body.className = "body";
    body.textContent = text;
    el.append(label, body);
    ui.log.append(el);
    scrollToEnd();
    return el;
  }

  function fillModels(cards) {
    const current = ui.model.value;
    ui.model.replaceChildren(...cards.map((card) => new Option(card.id, card.id)));
    if (cards.some((card) => card.id === current)) ui.model.value = current;
  }

  function updateControls() {
    const busy = state.answer !== null;
    ui.send.disabled = !isOpen() || busy;
    ui.send.hidden = busy;
    ui.stop.hidden = !busy;
    ui.stop.disabled = !isOpen();
    ui.newChat.disabled = busy;
  }

  function setStatus(name, text) {
    ui.status.dataset.state = name;
    ui.status.textContent = text;
  }

  function showBanner(text) {
    ui.banner.textContent = text;
    ui.banner.hidden = false;
  }

  function hideBanner() {
    ui.banner.hidden = true;
  }

  function scrollToEnd() {
    ui.log.scrollTop = ui.log.scrollHeight;
  }

  connect();
})();
