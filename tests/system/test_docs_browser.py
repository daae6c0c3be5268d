"""/v1/docs in a real headless browser (Debian's chromium via chromedriver) against a real gunicorn."""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.programs import program
from tests.support.servers import Gunicorn

OPERATION_IDS = ("listPets", "createPet", "getPet", "listOrders")
RENDER_TIMEOUT = 30.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    """Headless chromium with a fresh profile and no network of its own; quit after the test."""
    # Debian ships them in two packages, so either may be missing alone: each is named.
    chromium, chromedriver = program("chromium"), program("chromedriver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,1800",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    # The driver is given, so selenium never looks for (or downloads) one.
    service = Service(executable_path=chromedriver, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(RENDER_TIMEOUT)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[Gunicorn]:
    """The app under gunicorn (one worker, in-memory limiter) on a free loopback port."""
    environ = {"DATABASE_URL": database_url, "RATELIMIT_STORAGE_URI": "memory://"}
    with Gunicorn(environ, tmp_path / "gunicorn.log", workers=1, threads=4) as running:
        yield running


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    assert data.startswith(PNG_SIGNATURE), "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def try_it_out(browser: webdriver.Chrome, operation_id: str) -> str:
    """Open the operation, press "Try it out" and "Execute"; the Request URL Swagger UI called."""
    block = next(
        element
        for element in browser.find_elements(By.CSS_SELECTOR, ".opblock")
        if element.find_element(By.CSS_SELECTOR, ".opblock-summary-operation-id").text
        == operation_id
    )
    block.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    wait = WebDriverWait(browser, RENDER_TIMEOUT, poll_frequency=0.2)
    wait.until(lambda _: block.find_elements(By.CSS_SELECTOR, ".try-out__btn"))
    block.find_element(By.CSS_SELECTOR, ".try-out__btn").click()
    wait.until(lambda _: block.find_elements(By.CSS_SELECTOR, "button.execute"))
    block.find_element(By.CSS_SELECTOR, "button.execute").click()
    wait.until(lambda _: block.find_elements(By.CSS_SELECTOR, ".request-url pre"))
    return str(block.find_element(By.CSS_SELECTOR, ".request-url pre").text)


def test_docs_page_renders_every_operation(
    browser: webdriver.Chrome, server: Gunicorn, tmp_path: Path
) -> None:
    browser.get(f"{server.url}/v1/docs")

    def rendered(driver: webdriver.Chrome) -> bool:
        shown = {
            e.text for e in driver.find_elements(By.CSS_SELECTOR, ".opblock-summary-operation-id")
        }
        return set(OPERATION_IDS) <= shown

    try:
        WebDriverWait(browser, RENDER_TIMEOUT, poll_frequency=0.2).until(rendered)
    except TimeoutException:
        (tmp_path / "page.html").write_text(browser.page_source, encoding="utf-8")
        pytest.fail(
            f"the operations did not render within {RENDER_TIMEOUT} s; page saved under {tmp_path}; "
            f"gunicorn log:\n{server.log()}"
        )

    # The document names the relative /v1 (never a Host it was sent), which Swagger UI resolves
    # against the page's address: "Try it out" calls the server the page came from, on any port.
    servers = [
        option.get_attribute("value")
        for option in browser.find_elements(By.CSS_SELECTOR, ".servers select option")
    ]
    assert servers == ["/v1"], servers
    request_url = try_it_out(browser, "listPets")
    assert request_url.startswith(f"{server.url}/v1/pets"), request_url

    page = browser.find_element(By.ID, "swagger-ui").text
    assert "Animal Store" in page
    for path in ("/pets", "/pets/{petId}", "/store/orders"):
        assert path in page
    deprecated = browser.find_elements(By.CSS_SELECTOR, ".opblock-deprecated")
    assert [
        e.find_element(By.CSS_SELECTOR, ".opblock-summary-operation-id").text for e in deprecated
    ] == ["getPet"]
    # Swagger UI's scripts and styles came from this server: nothing else was asked for.
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert resources and all(name.startswith(server.url) for name in resources), resources

    screenshot = tmp_path / "docs.png"
    assert browser.save_screenshot(str(screenshot))
    data = screenshot.read_bytes()
    width, height = png_size(data)
    assert width >= 800 and height >= 600, (width, height)
    # A blank page compresses to a few kilobytes; rendered text and colours do not.
    assert len(data) > 30_000, len(data)
    if os.environ.get("PETSTORE_KEEP_SCREENSHOT"):
        shutil.copy(screenshot, os.environ["PETSTORE_KEEP_SCREENSHOT"])
