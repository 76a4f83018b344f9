"""The chat page at / in headless Chromium: a typed message streams an answer into the page.

Chromium is Debian's /usr/bin/chromium (.ci/run installs it), driven by the playwright package;
playwright's own browser downloads are never used. With WEB_CHAT_SCREENSHOT=PATH the test also
writes a screenshot of the page there (docs/web_chat.png is made so).
"""

import os
import re
from pathlib import Path

import pytest

from tests.serving_server import API_KEY, shared_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return shared_server(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            user_data_dir=str(tmp_path_factory.mktemp("profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1100, "height": 700})
        page = browser.new_page()
        page.goto(server.url + "/")
        yield page
        browser.close()


def test_a_sent_message_streams_an_answer_into_the_page(page):
    page.wait_for_function("document.getElementById('status').textContent !== ''", timeout=30000)
    assert "API key" in page.inner_text("#status")  # the server wants one, and the page says so
    page.fill("#api_key", API_KEY)
    page.dispatch_event("#api_key", "change")
    page.wait_for_function("document.getElementById('model').value !== ''", timeout=30000)
    assert page.input_value("#model") == "tiny"
    page.fill("#max_tokens", "12")
    page.fill("#document", "The heron waits by the weir for the fish that the current brings down.")
    page.click("#add_document")
    page.fill("#input", "Who waits by the weir?")
    page.click("#send")
    page.wait_for_selector(".note", timeout=60000)  # written once the stream's usage chunk arrived
    assert page.inner_text(".message.user") == "Who waits by the weir?"
    assert page.inner_text(".message.assistant").strip()
    note = page.inner_text(".note")
    answer_tokens = re.search(r"(\d+) answer tokens", note)
    # the random tiny model may greedily reach its end-of-text token first; CPUs differ in near-ties
    assert answer_tokens and 1 <= int(answer_tokens.group(1)) <= 12, note
    assert page.is_enabled("#send") and not page.is_enabled("#stop")

    page.fill("#input", "And then?")
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelectorAll('.note').length === 2", timeout=60000)
    second = page.locator(".note").nth(1).inner_text()
    assert "(0 cached)" not in second, second  # the follow-up reused the first turn's cache
    screenshot = os.environ.get("WEB_CHAT_SCREENSHOT")
    if screenshot:
        page.screenshot(path=screenshot)
