"""The chat page at `/`, driven by a real headless Chromium (Selenium + Debian's chromium / chromium-driver)
against a real `asyncengine serve --api-key ...` subprocess.

The server runs the embedded default model with its end-of-text and end-of-turn rows of the output layer zeroed
(`never_ending_model`): its answers read the same but never end by themselves, so every answer runs to the page's
"Max tokens" (a known length) or to Stop (a long answer that is still going when the button is pressed).

On failure a test saves a screenshot and the browser's console log next to it, under pytest's tmp_path. Set
ASYNCENGINE_UPDATE_SCREENSHOT=1 to also write the README's docs/chat-page.png from the streaming test. Without
chromium and chromedriver the tests fail (they do not skip): CI installs them (.ci/run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file
from test_server_cli import CLIServer
from test_server_harness import ServerThread, wait_until
from test_server_sse import slow_execute

from asyncengine.config import default_model_path

pytestmark = pytest.mark.timeout(240)

API_KEY = "webui-test-key.0123"
MODEL_NAME = "asyncengine-default-no-eot"
SCREENSHOT = Path(__file__).parent.parent / "docs" / "chat-page.png"
END_TOKENS = (1, 5)  # <|end_of_text|>, <|eot_id|> (asyncengine/default_model/SOURCE.md)
ANSWER_TIMEOUT = 90.0  # seconds; the shared 2-core test machine decodes a few dozen tokens per second here

# Runs in the page before the test's actions: records every WebSocket frame the page sends and every text the
# newest answer shows (a MutationObserver sees each change of the DOM, which polling from the test could miss).
RECORDER = """
window.__texts = [];
if (!window.__sent) {
  window.__sent = [];
  const send = WebSocket.prototype.send;
  WebSocket.prototype.send = function (data) { window.__sent.push(JSON.parse(data)); return send.call(this, data); };
  new MutationObserver(() => {
    const bodies = document.querySelectorAll(".message.assistant .body");
    if (bodies.length) window.__texts.push(bodies[bodies.length - 1].textContent);
  }).observe(document.getElementById("log"), { subtree: true, childList: true, characterData: true });
}
"""


@pytest.fixture(scope="module")
def never_ending_model(tmp_path_factory) -> Path:
    """The default model, untied, with the output rows of its end tokens zeroed: their logit is always 0, far
    below a trained model's top logits, so it never ends an answer (every other token keeps its logit)."""
    folder = tmp_path_factory.mktemp("never_ending") / "model"
    shutil.copytree(default_model_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(folder / "model.safetensors")
    lm_head = weights["model.embed_tokens.weight"].clone()
    lm_head[list(END_TOKENS)] = 0
    weights["lm_head.weight"] = lm_head
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def chat_server(never_ending_model, tmp_path_factory):
    server = start_server(never_ending_model, tmp_path_factory.mktemp("server_log"))
    try:
        yield server
    finally:
        stop_server(server)


def start_server(model: Path, log_dir: Path) -> CLIServer:
    return CLIServer(model, "--api-key", API_KEY, "--served-model-name", MODEL_NAME, "--max-model-len", "2048",
                     log_dir=log_dir)


def stop_server(server: CLIServer) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(20)
        except Exception:  # noqa: BLE001 - a stuck server is killed; the test's own assertions report problems
            server.kill()


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        pytest.fail("the chat page tests need a headless Chromium: `apt-get install chromium chromium-driver` "
                    f"(found chromium={browser}, chromedriver={driver}); .ci/run installs them")
    return browser, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,720", "--no-first-run", "--disable-extensions",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium_profile')}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def screenshot_on_failure(driver, tmp_path: Path):
    """Save a screenshot and the console log under tmp_path if the body fails, and name them in the error."""
    try:
        yield
    except BaseException as exc:
        shot = tmp_path / "failure.png"
        driver.save_screenshot(str(shot))
        console = "\n".join(f"{e['level']} {e['message']}" for e in driver.get_log("browser"))
        (tmp_path / "console.log").write_text(console)
        exc.add_note(f"screenshot: {shot}\nbrowser console:\n{console[-2000:]}")
        raise


# -- page helpers ---------------------------------------------------------------------------------------------------
def by_css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def wait_for(driver, condition, timeout: float = 20.0, message: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message)


def open_page(driver, url: str, key: str | None = None) -> None:
    """Load the chat page at `url` with `key` already in its sessionStorage (None: no key kept). The key is set
    from /health, a page of the same origin that runs no script: set from the chat page itself, the page's own
    first GET v1/models (401, no key yet) could land after the key was set and forget it again."""
    driver.get(url + "/health")
    driver.execute_script("sessionStorage.clear(); if (arguments[0] !== null) "
                          "sessionStorage.setItem('asyncengine.apiKey', arguments[0]);", key)
    driver.get(url + "/")


def key_dialog_open(driver) -> bool:
    return driver.execute_script("return document.getElementById('key-dialog').open")


def enter_key(driver, key: str) -> None:
    wait_for(driver, key_dialog_open, message="the page did not ask for the API key")
    field = by_css(driver, "#key")
    field.clear()
    field.send_keys(key)
    by_css(driver, "#key-submit").click()


def wait_connected(driver, timeout: float = 20.0) -> None:
    wait_for(driver, lambda d: by_css(d, "#status").get_attribute("data-state") == "connected", timeout,
             "the page did not connect")


def set_field(driver, selector: str, value) -> None:
    field = by_css(driver, selector)
    field.clear()
    field.send_keys(str(value))


def ask(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    driver.execute_script(RECORDER)
    prompt = by_css(driver, "#prompt")
    if len(text) > 200:  # typing key by key would take most of a minute
        driver.execute_script("arguments[0].value = arguments[1]", prompt, text)
    else:
        prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)


def last_answer(driver):
    return driver.find_elements("css selector", ".message.assistant")[-1]


def wait_answer_finished(driver, timeout: float = ANSWER_TIMEOUT):
    wait_for(driver, lambda d: last_answer(d).get_attribute("data-state") is not None, timeout,
             "the answer did not finish")
    return last_answer(driver)


def metrics(server) -> dict[str, float]:
    """The /metrics samples, summed over labels: {"vllm:num_requests_running": 0.0, ...}."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = re.match(r"([^{ ]+)(?:\{[^}]*\})? (\S+)", line).groups()
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


# -- the tests ------------------------------------------------------------------------------------------------------
def test_page_asks_for_the_key_once_and_streams_answers_in_a_conversation(chat_server, browser, tmp_path):
    with screenshot_on_failure(browser, tmp_path):
        open_page(browser, chat_server.url)
        enter_key(browser, API_KEY)
        wait_connected(browser)
        assert browser.execute_script("return sessionStorage.getItem('asyncengine.apiKey')") == API_KEY
        assert [o.text for o in browser.find_elements("css selector", "#model option")] == [MODEL_NAME]

        set_field(browser, "#temperature", "0.7")
        set_field(browser, "#max-tokens", "24")
        ask(browser, "Who comes here?")
        answer = wait_answer_finished(browser)
        assert answer.get_attribute("data-state") == "done", answer.text
        final = answer.find_element("css selector", ".body").text
        texts = [t for t in browser.execute_script("return window.__texts") if t]
        growth = [t for i, t in enumerate(texts) if i == 0 or t != texts[i - 1]]
        assert len(growth) >= 3, growth  # the text grew in at least three separate updates ...
        assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(growth, growth[1:])), growth
        assert growth[-1].strip() == final.strip()  # ... up to the completed answer
        stats = answer.find_element("css selector", ".stats").text
        assert re.fullmatch(r"TTFT \d+ ms · \d+\.\d tok/s · 24 tokens · max tokens reached", stats), stats
        first_request = browser.execute_script("return window.__sent")[-1]
        assert first_request["messages"] == [{"role": "user", "content": "Who comes here?"}]
        assert (first_request["model"], first_request["temperature"], first_request["max_tokens"]) == (
            MODEL_NAME, 0.7, 24)

        ask(browser, "And what news?")  # the conversation so far goes with the next question
        assert wait_answer_finished(browser).get_attribute("data-state") == "done"
        second_request = browser.execute_script("return window.__sent")[-1]
        assert [m["role"] for m in second_request["messages"]] == ["user", "assistant", "user"]
        assert second_request["messages"][1]["content"].strip() == final.strip()
        assert len(browser.find_elements("css selector", ".message")) == 4

        # Offline-able: everything the page loaded came from the server itself.
        loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert loaded and all(url.startswith(chat_server.url + "/") for url in loaded), loaded
        browser.save_screenshot(str(tmp_path / "chat-page.png"))
        if os.environ.get("ASYNCENGINE_UPDATE_SCREENSHOT"):
            SCREENSHOT.parent.mkdir(exist_ok=True)
            shutil.copyfile(tmp_path / "chat-page.png", SCREENSHOT)

        browser.refresh()  # the key is asked once per tab: a reload connects with the stored key
        wait_connected(browser)
        assert not key_dialog_open(browser)


def test_stop_ends_a_long_answer_and_frees_the_engine(chat_server, browser, tmp_path):
    with screenshot_on_failure(browser, tmp_path):
        open_page(browser, chat_server.url, API_KEY)
        wait_connected(browser)
        set_field(browser, "#max-tokens", "1500")
        ask(browser, "Tell me a long story.")
        wait_for(browser, lambda d: len(last_answer(d).find_element("css selector", ".body").text) > 30,
                 ANSWER_TIMEOUT, "the long answer did not start")
        assert metrics(chat_server)["vllm:num_requests_running"] == 1
        by_css(browser, "#stop").click()
        answer = wait_answer_finished(browser, timeout=15)
        assert answer.get_attribute("data-state") == "stopped"
        assert browser.execute_script("return window.__sent")[-1]["type"] == "cancel"
        stats = answer.find_element("css selector", ".stats").text
        tokens = int(re.search(r"(\d+) tokens", stats).group(1))
        assert stats.endswith("stopped") and tokens < 1500, stats
        wait_until(lambda: metrics(chat_server)["vllm:num_requests_running"] == 0, 2.0)
        assert metrics(chat_server)["vllm:num_requests_waiting"] == 0
        assert by_css(browser, "#send").is_displayed() and not by_css(browser, "#stop").is_displayed()


# Opens a WebSocket from the page with the given subprotocols; resolves with its selected protocol or "refused".
PROBE_SOCKET = """
const [protocols, done] = arguments;
const ws = new WebSocket(new URL("v1/ws", location.href).href.replace(/^http/, "ws"), protocols);
ws.onopen = () => { done(ws.protocol); ws.close(); };
ws.onclose = () => done("refused");
"""


def test_a_wrong_key_shows_an_authentication_error_and_reaches_no_engine(chat_server, browser, tmp_path):
    with screenshot_on_failure(browser, tmp_path):
        before = metrics(chat_server)
        open_page(browser, chat_server.url)
        enter_key(browser, "not-the-key")
        wait_for(browser, lambda d: by_css(d, "#key-error").is_displayed(), message="no authentication error shown")
        assert by_css(browser, "#key-error").text == "Authentication failed: the server refused this API key."
        assert browser.execute_script("return sessionStorage.getItem('asyncengine.apiKey')") is None
        assert by_css(browser, "#send").get_attribute("disabled") is not None
        # The browser's own handshake: a wrong bearer subprotocol is refused, the right one answered asyncengine.v1.
        assert browser.execute_async_script(PROBE_SOCKET, ["asyncengine.v1", "bearer.not-the-key"]) == "refused"
        assert browser.execute_async_script(PROBE_SOCKET, ["asyncengine.v1", f"bearer.{API_KEY}"]) == "asyncengine.v1"
        after = metrics(chat_server)
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"):
            assert after.get(name, 0.0) == before.get(name, 0.0), name

        enter_key(browser, API_KEY)  # asked again, and the right key then works
        wait_connected(browser)


class TCPProxy:
    """127.0.0.1:<ephemeral port> forwarded to `target`, so a test can cut the network under a live page.

    `drop()` resets every open connection (as a failed network would) and refuses new ones until `restore()`.
    """

    def __init__(self, target_url: str):
        host, port = target_url.split("://", 1)[1].rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.refusing = False
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="test-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            if self.refusing:
                _reset(client)
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                _reset(sock)
                with self.lock:
                    self.open.discard(sock)

    def drop(self) -> None:
        self.refusing = True
        with self.lock:
            for sock in list(self.open):
                _reset(sock)
            self.open.clear()

    def restore(self) -> None:
        self.refusing = False

    def close(self) -> None:
        self.drop()
        self.listener.close()


def _reset(sock: socket.socket) -> None:
    """Cut the connection: shutdown wakes the thread blocked in recv() on it (close alone would not), and with
    SO_LINGER 0 the close sends a TCP reset rather than a polite FIN."""
    for cut in (lambda: sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)),
                lambda: sock.shutdown(socket.SHUT_RDWR), sock.close):
        try:
            cut()
        except OSError:
            pass


def test_errors_show_as_messages_and_a_dropped_connection_reconnects(chat_server, browser, tmp_path):
    with screenshot_on_failure(browser, tmp_path):
        open_page(browser, chat_server.url, API_KEY)
        wait_connected(browser)
        set_field(browser, "#max-tokens", "4")
        ask(browser, "word " * 2100)  # more tokens than --max-model-len
        answer = wait_answer_finished(browser)
        assert answer.get_attribute("data-state") == "failed"
        assert "The request was refused" in answer.text and "max_model_len" in answer.text, answer.text

        proxy = TCPProxy(chat_server.url)
        try:
            open_page(browser, proxy.url, API_KEY)
            wait_connected(browser)
            set_field(browser, "#max-tokens", "1500")
            ask(browser, "Speak on.")
            wait_for(browser, lambda d: last_answer(d).find_element("css selector", ".body").text, ANSWER_TIMEOUT)
            proxy.drop()  # the network fails mid-answer
            answer = wait_answer_finished(browser, timeout=10)
            assert answer.get_attribute("data-state") == "failed" and "Connection lost" in answer.text, answer.text
            wait_for(browser, lambda d: "reconnecting" in by_css(d, "#banner").text, 10)
            assert by_css(browser, "#send").get_attribute("disabled") is not None
            # the server saw the socket go and aborted its request
            wait_until(lambda: metrics(chat_server)["vllm:num_requests_running"] == 0, 5.0)

            proxy.restore()
            wait_connected(browser, timeout=15)  # the page reconnects by itself, with the key it kept
            assert not by_css(browser, "#banner").is_displayed()
            set_field(browser, "#max-tokens", "3")
            ask(browser, "Again?")
            assert wait_answer_finished(browser).get_attribute("data-state") == "done"
        finally:
            proxy.close()


def test_without_a_key_the_page_does_not_ask_and_a_full_queue_shows_as_busy(llama_dir, browser, tmp_path):
    # allowed_origins names another site only: the page's socket is same-origin, which always passes
    with ServerThread(llama_dir, app_kwargs={"allowed_origins": ["https://elsewhere.example"]}, max_num_seqs=1,
                      max_queue_len=1) as server:
        with screenshot_on_failure(browser, tmp_path):
            open_page(browser, server.url)
            wait_connected(browser)
            assert not key_dialog_open(browser) and not by_css(browser, "#change-key").is_displayed()
            set_field(browser, "#max-tokens", "5")
            ask(browser, "Hello")
            answer = wait_answer_finished(browser)
            assert answer.get_attribute("data-state") == "done", answer.text
            tokens = int(re.search(r"(\d+) tokens", answer.find_element("css selector", ".stats").text).group(1))
            assert 1 <= tokens <= 5

            # other clients hold the only running slot and the only waiting one for about 10 s each (long enough for
            # the waiting one to be seen there on a loaded machine, where 2 s was once missed) ...
            slow_execute(server.engine, 0.1)
            body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True}
            occupants = [threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                          kwargs={"json": body, "timeout": 120}, daemon=True) for _ in range(2)]
            # One at a time: sent together, the second can arrive while the first still waits to be scheduled (a
            # loaded machine), find the queue full and get the 429 itself, and (1 running, 1 waiting) never comes.
            occupants[0].start()
            wait_until(lambda: server.engine.stats().num_running == 1, 30)
            occupants[1].start()
            wait_until(lambda: (server.engine.stats().num_running, server.engine.stats().num_waiting) == (1, 1), 30)
            ask(browser, "Are you there?")  # ... so the page's request is refused with 429
            answer = wait_answer_finished(browser)
            assert answer.get_attribute("data-state") == "failed"
            assert answer.find_element("css selector", ".error").text.startswith("The server is busy: "), answer.text
            for occupant in occupants:
                occupant.join(60)
