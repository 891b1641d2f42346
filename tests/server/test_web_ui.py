"""The chat page at / in a real headless Chromium (Debian's chromium and chromedriver) against real
pocketllm-server processes: the default model for answers, Stop and settings; the echo backend, which replays the
prompt, for markup in a reply and for the API key. Screenshots go to $POCKETLLM_TEST_ARTIFACTS (default
test-artifacts/)."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pocketllm.args import DEFAULT_MODEL
from tests.conftest import requires_default_model
from tests.server.conftest import server_process

webdriver = pytest.importorskip("selenium.webdriver")
if not (shutil.which("chromium") and shutil.which("chromedriver")):
    pytest.skip("Chromium and ChromeDriver are not installed (Debian: apt-get install chromium chromium-driver)",
                allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ARTIFACTS = Path(os.environ.get("POCKETLLM_TEST_ARTIFACTS", "test-artifacts"))
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def smol_server() -> Iterator[str]:
    with server_process(["--model", DEFAULT_MODEL, "--log-level", "warning"]) as (_, url):
        yield url


@pytest.fixture(scope="module")
def echo_server(pocketllm_tiny_llama: Path) -> Iterator[str]:
    with server_process(["--model", str(pocketllm_tiny_llama), "--backend", "echo", "--api-key", KEY,
                         "--log-level", "warning"], env={"POCKETLLM_PLUGINS": "echo"}) as (_, url):
        yield url


def wait(browser, condition, timeout: float = 60):
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(lambda _: condition())


def open_page(browser, url: str) -> None:
    browser.get(f"{url}/")
    wait(browser, lambda: browser.find_element(By.ID, "model").get_attribute("value"))


def open_with_key(browser, url: str) -> None:
    """The page on a server with --api-key, as after the user gave the key once in this tab (and no conversation
    kept from an earlier test)."""
    browser.get(f"{url}/")
    browser.execute_script("sessionStorage.clear(); sessionStorage.setItem('pocketllm-api-key', arguments[0])", KEY)
    open_page(browser, url)


def new_chat(browser, url: str, **settings: str) -> None:
    """The page, a new conversation, and these settings fields filled in."""
    open_page(browser, url)
    browser.find_element(By.ID, "new-chat").click()
    for name, value in settings.items():
        set_field(browser, name, value)


def set_field(browser, name: str, value: str) -> None:
    field = browser.find_element(By.ID, name)
    if not field.is_displayed():
        browser.find_element(By.ID, "toggle-settings").click()
    field.clear()
    field.send_keys(value)


def ask(browser, text: str) -> None:
    before = len(replies(browser))
    browser.find_element(By.ID, "prompt").send_keys(text)
    browser.find_element(By.ID, "send").click()
    wait(browser, lambda: len(replies(browser)) > before)


def replies(browser) -> list:
    return browser.find_elements(By.CSS_SELECTOR, "article.assistant")


def finished_reply(browser):
    """The last reply once its stream ended (it then has a finish reason)."""
    return wait(browser, lambda: (r := replies(browser)) and r[-1].get_attribute("data-finish") and r[-1])


def start_long_reply(browser, url: str, question: str) -> None:
    """A new conversation whose reply is streaming, with some of it shown, and far from its end."""
    new_chat(browser, url, max_tokens="1500", temperature="0.8")
    ask(browser, question)
    streaming = replies(browser)[-1]
    wait(browser, lambda: len(streaming.get_attribute("data-raw") or "") > 20)


def running(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^pocketllm:num_requests_running\{[^}]*\} (\S+)$", metrics, re.M).group(1))


def screenshot(browser, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / name))


@requires_default_model
def test_a_streamed_answer_equals_the_sdk_s_greedy_one(browser, smol_server: str) -> None:
    openai = pytest.importorskip("openai")
    new_chat(browser, smol_server, temperature="0", max_tokens="48")
    question = "What is the capital of France?"
    ask(browser, question)
    streaming = replies(browser)[-1]
    wait(browser, lambda: streaming.get_attribute("data-raw"))  # tokens arrive while it streams
    reply = finished_reply(browser)
    with openai.OpenAI(base_url=f"{smol_server}/v1", api_key="unused", max_retries=0) as sdk:
        expected = sdk.chat.completions.create(model=browser.find_element(By.ID, "model").get_attribute("value"),
                                               messages=[{"role": "user", "content": question}], temperature=0,
                                               max_tokens=48)
    assert reply.get_attribute("data-raw") == expected.choices[0].message.content
    assert reply.find_element(By.CSS_SELECTOR, ".content").text.strip()
    stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
    assert "tok/s" in stats and "first token" in stats and f"finish: {expected.choices[0].finish_reason}" in stats
    ask(browser, "And of Italy?")  # the conversation goes on: the page sends both turns
    finished_reply(browser)
    screenshot(browser, "web-ui-conversation.png")
    assert len(browser.find_elements(By.CSS_SELECTOR, "article.user")) == 2
    answers = [r.get_attribute("data-raw") for r in replies(browser)]
    browser.refresh()  # the tab keeps its conversation
    wait(browser, lambda: [r.get_attribute("data-raw") for r in replies(browser)] == answers)
    assert len(browser.find_elements(By.CSS_SELECTOR, "article.user")) == 2


@requires_default_model
def test_eight_tokens_at_temperature_zero_end_with_length(browser, smol_server: str) -> None:
    new_chat(browser, smol_server, temperature="0", max_tokens="8")
    ask(browser, "Tell me a long story about a dragon.")
    reply = finished_reply(browser)
    assert reply.get_attribute("data-tokens") == "8" and reply.get_attribute("data-finish") == "length"
    assert "8 tokens" in reply.text and "finish: length" in reply.text
    first = reply.get_attribute("data-raw")
    browser.find_element(By.ID, "regenerate").click()  # the same greedy reply again, in place of the first
    wait(browser, lambda: len(replies(browser)) == 1 and replies(browser)[0].get_attribute("data-finish"))
    assert replies(browser)[0].get_attribute("data-raw") == first


@requires_default_model
def test_stop_aborts_and_the_server_frees_the_request(browser, smol_server: str) -> None:
    start_long_reply(browser, smol_server, "Write a very long essay about the history of every country.")
    assert running(smol_server) == 1
    browser.find_element(By.ID, "stop").click()
    assert finished_reply(browser).get_attribute("data-finish") == "stopped"
    wait(browser, lambda: running(smol_server) == 0, timeout=10)
    assert browser.find_element(By.ID, "send").is_enabled()


@requires_default_model
def test_new_chat_during_a_stream_drops_it_everywhere(browser, smol_server: str) -> None:
    start_long_reply(browser, smol_server, "Write a very long essay about oceans.")
    browser.find_element(By.ID, "new-chat").click()
    wait(browser, lambda: running(smol_server) == 0, timeout=10)
    time.sleep(0.3)  # the aborted stream's last callbacks have run
    assert not browser.find_elements(By.CSS_SELECTOR, "#conversation article")
    assert browser.find_element(By.ID, "send").is_enabled()
    assert not browser.find_element(By.ID, "regenerate").is_enabled()
    ask(browser, "Hi")  # the new conversation has this one turn only
    assert finished_reply(browser) and len(browser.find_elements(By.CSS_SELECTOR, "article.user")) == 1


def test_a_wrong_key_shows_the_401_and_the_right_one_works(browser, echo_server: str) -> None:
    browser.get(f"{echo_server}/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{echo_server}/")
    dialog = wait(browser, lambda: (d := browser.find_element(By.ID, "key-dialog")).is_displayed() and d)
    assert "401" in wait(browser, lambda: " ".join(e.text for e in
                                                  browser.find_elements(By.CSS_SELECTOR, "article.error")))
    dialog.find_element(By.ID, "key").send_keys("wrong")
    dialog.find_element(By.CSS_SELECTOR, "button").click()
    errors = wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "article.error"))
    assert "Not authorized (401)" in errors[-1].text and "API key" in errors[-1].text
    browser.find_element(By.ID, "key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait(browser, lambda: browser.find_element(By.ID, "model").get_attribute("value"))
    assert browser.execute_script("return sessionStorage.getItem('pocketllm-api-key')") == KEY
    assert KEY not in httpx.get(f"{echo_server}/").text and KEY not in httpx.get(f"{echo_server}/ui/app.js").text


def test_markup_in_a_reply_renders_as_text(browser, echo_server: str) -> None:
    """The echo backend replays the prompt, so the reply holds the user's markup: it must stay text."""
    open_with_key(browser, echo_server)
    browser.find_element(By.ID, "new-chat").click()
    set_field(browser, "temperature", "0")
    markup = ('<script>window.pwned = 1</script> <img src=x onerror="window.pwned = 2"> '
              '[link](javascript:window.pwned=3) **bold** `<b>code</b>` ' + "`" * 40)
    ask(browser, markup)
    reply = finished_reply(browser)
    content = reply.find_element(By.CSS_SELECTOR, ".content")
    assert "<script>window.pwned = 1</script>" in content.text and "<img src=x onerror=" in content.text
    assert not content.find_elements(By.CSS_SELECTOR, "script, img, a[href^='javascript']")
    assert content.find_elements(By.CSS_SELECTOR, "strong"), reply.get_attribute("data-raw")  # Markdown renders
    codes = {c.text for c in content.find_elements(By.CSS_SELECTOR, "code")}  # the echo may replay it twice
    assert codes == {"<b>code</b>"}
    assert browser.execute_script("return window.pwned") is None


def test_a_bad_request_shows_the_400_and_the_turn_can_be_asked_again(browser, echo_server: str) -> None:
    open_with_key(browser, echo_server)
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "100000000")
    browser.find_element(By.ID, "prompt").send_keys("hello")
    browser.find_element(By.ID, "send").click()
    error = wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "article.error"))[-1]
    assert "Bad request (400)" in error.text and "context length" in error.text
    set_field(browser, "max_tokens", "4")
    browser.find_element(By.ID, "regenerate").click()
    assert finished_reply(browser).get_attribute("data-finish") == "length"


def test_reasoning_shows_collapsed_and_tool_calls_as_such(browser, tiny_hermes: Path) -> None:
    """With --reasoning-parser deepseek_r1 the echo backend's reply reasons until the </think> the user typed, then
    holds the tool call the user typed, which --tool-call-parser hermes finds since the request has tools (the
    template renders them in that format)."""
    with server_process(["--model", str(tiny_hermes), "--backend", "echo", "--reasoning-parser",
                         "deepseek_r1", "--tool-call-parser", "hermes", "--log-level", "warning"],
                        env={"POCKETLLM_PLUGINS": "echo"}) as (_, url):
        open_page(browser, url)
        assert "(default)" in browser.find_element(By.ID, "top_p").get_attribute("placeholder")
        set_field(browser, "temperature", "0")
        set_field(browser, "tools", '[{"type": "function", "function": {"name": "get_weather", "parameters": '
                                    '{"type": "object", "properties": {"city": {"type": "string"}}}}}]')
        ask(browser, 'weighing it</think>Let me look. <tool_call>{"name": "get_weather", "arguments": '
                     '{"city": "Paris"}}</tool_call>')
        reply = finished_reply(browser)
        reasoning = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
        assert reasoning.is_displayed() and reasoning.get_attribute("open") is None
        assert "weighing it" in reasoning.get_attribute("textContent")
        assert reply.find_element(By.CSS_SELECTOR, ".content").text.startswith("Let me look.")
        call = reply.find_element(By.CSS_SELECTOR, ".tool-call").text
        assert call.startswith("tool call: get_weather(") and '"city": "Paris"' in call
        set_field(browser, "tools", "[not json")
        ask_failed = len(browser.find_elements(By.CSS_SELECTOR, "article.error"))
        browser.find_element(By.ID, "prompt").send_keys("again")
        browser.find_element(By.ID, "send").click()
        error = wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "article.error")[ask_failed:])[0]
        assert "Tools must be a JSON list" in error.text


def test_the_page_waits_for_a_loading_model(browser, serve_app, tiny_args, monkeypatch) -> None:
    import pocketllm_server.app_state
    from pocketllm_server import create_app

    real_load = pocketllm_server.app_state.load_engine

    def slow_load(args):
        time.sleep(2)
        return real_load(args)

    monkeypatch.setattr(pocketllm_server.app_state, "load_engine", slow_load)
    with serve_app(create_app(tiny_args, served_model_name="tiny")) as server:
        browser.get(f"{server.url}/")
        notice = wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "article.error"))[0]
        assert "503" in notice.text and "loading" in notice.text
        wait(browser, lambda: browser.find_element(By.ID, "model").get_attribute("value") == "tiny", timeout=30)
        wait(browser, lambda: not browser.find_elements(By.CSS_SELECTOR, "article.error"))


def test_the_page_can_be_turned_off(pocketllm_tiny_llama: Path) -> None:
    with server_process(["--model", str(pocketllm_tiny_llama), "--backend", "echo", "--no-web-ui",
                         "--log-level", "warning"], env={"POCKETLLM_PLUGINS": "echo"}) as (_, url):
        assert httpx.get(f"{url}/").status_code == 404
        assert httpx.get(f"{url}/ui/app.js").status_code == 404
        assert httpx.get(f"{url}/v1/models").status_code == 200
