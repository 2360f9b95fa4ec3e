"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright) against a
real ``promptlb-gateway`` with emulated nodes and sidecars, all real processes.

``PROMPTLB_SCREENSHOT=docs/dashboard.png`` keeps the screenshot where the README shows it
(``make screenshot``); otherwise it goes to the test's temporary folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from promptlb.emulator import start_command

from tests.conftest import Launcher, need_binary, sidecar_args

TOKEN = "dashboard-test-token-0123456789"
NODES = {
    "heavy": ("--slots", "2", "--tokens-per-s", "60", "--ttft-ms", "150"),
    "light": ("--slots", "16", "--tokens-per-s", "400", "--ttft-ms", "30"),
    "leaky": ("--slots", "8", "--tokens-per-s", "200", "--ttft-ms", "60", "--leak-mb-per-req", "8"),
}


@pytest.fixture
def chromium() -> str:
    binary = need_binary("chromium", "chromium")
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        message = "playwright is not installed (the dev extra has it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


async def traffic(url: str, stop: asyncio.Event) -> None:
    """About 12 requests a second, of mixed lengths, until told to stop."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        i = 0
        pending: set[asyncio.Task[None]] = set()

        async def one(n: int) -> None:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"question {n}"}],
                "max_tokens": 8 + n % 5 * 12,
            }
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.post(url + "/v1/chat/completions", json=body) as answer:
                    await answer.read()

        while not stop.is_set():
            task = asyncio.create_task(one(i))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
            await asyncio.sleep(1 / 12)
        await asyncio.gather(*pending, return_exceptions=True)


async def status(url: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url + "/_promptlb/status", headers={"Authorization": f"Bearer {TOKEN}"}) as r,
    ):
        assert r.status == 200
        doc: dict[str, Any] = await r.json()
        return doc


async def test_dashboard_in_a_real_browser(chromium: str, launch: Launcher, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright

    tables = []
    models = {}
    for name, flags in NODES.items():
        model = launch("emulator", "--model", "m", "--seed", "7", *flags)
        sidecar = launch("sidecar", *sidecar_args(model.url, name))
        models[name] = model
        tables.append(
            f"[[nodes]]\nname = '{name}'\nurl = '{model.url}'\nsidecar = '{sidecar.url}'\n"
        )
    config = tmp_path / "promptlb.toml"
    config.write_text(
        f"admin_token = '{TOKEN}'\n"
        "health = { interval = '300ms', timeout = '300ms', unhealthy_threshold = 1 }\n"
        + "".join(tables)
    )
    gateway = start_command(
        "gateway", ["-m", "promptlb.middleware", "--config", str(config), "--port", "0"]
    )
    stop = asyncio.Event()
    load = asyncio.create_task(traffic(gateway.url, stop))
    shot = Path(os.environ.get("PROMPTLB_SCREENSHOT") or tmp_path / "dashboard.png")
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=chromium, headless=True, args=["--no-sandbox"]
            )
            page = await browser.new_page(viewport={"width": 1500, "height": 560})
            await page.goto(gateway.url + "/_promptlb/")

            # No token yet: the page asks for one; a wrong one is refused.
            await page.locator("#login").wait_for(state="visible", timeout=10_000)
            # A token no header can carry (a pasted curly quote) is refused at once: it made
            # every fetch throw, read as "gateway unreachable" for good.
            await page.fill("#token", "not\u2019the-token")
            await page.click("#login button")
            await page.locator("#login-error", has_text="cannot carry").wait_for(timeout=10_000)
            await page.fill("#token", "not-the-token")
            await page.click("#login button")
            await page.locator("#login-error", has_text="refused").wait_for(timeout=10_000)

            await page.fill("#token", TOKEN)
            await page.click("#login button")
            rows = page.locator("#nodes tbody tr")
            await page.wait_for_function(
                "() => document.querySelectorAll('#nodes tbody tr[data-state=ready]').length === 3",
                timeout=15_000,
            )
            assert sorted(await rows.evaluate_all("rs => rs.map(r => r.dataset.node)")) == sorted(
                NODES
            )
            # The token stays in the tab, never in the address.
            assert TOKEN not in page.url
            token = await page.evaluate("() => sessionStorage.getItem('promptlb-admin-token')")
            assert token == TOKEN

            # Live: the totals fill in from the traffic, and the page keeps updating.
            await page.wait_for_function(
                "() => Number(document.getElementById('t-qps').textContent) > 0",
                timeout=15_000,
            )
            # Keeps updating: two more polls' answers drawn (the page asks every 750 ms; the
            # bound is for a loaded machine, the mechanism is that it goes on at all).
            before = int(await page.evaluate("() => document.body.dataset.updated"))
            await page.wait_for_function(
                f"() => Number(document.body.dataset.updated) >= {before} + 700", timeout=5_000
            )

            # A status answer it cannot read (a proxy's error page sent as 200) is retried: it
            # used to end the polling for good.
            async def junk(route: Any) -> None:
                await route.fulfill(status=200, body="<html>bad gateway</html>")

            await page.route("**/_promptlb/status", junk)
            await page.locator("#freshness", has_text="status unreadable").wait_for(timeout=5_000)
            # The reason stays in sight once the data's age is shown too (it used to be written
            # over by "last update N s ago" every second, and back at each retry).
            await page.locator("#freshness", has_text="last update").wait_for(timeout=6_000)
            shown = await page.locator("#freshness").text_content() or ""
            assert "status unreadable" in shown, shown
            assert await page.locator("#forget").is_visible()  # a way out if the token fails
            await page.unroute("**/_promptlb/status", junk)
            before = int(await page.evaluate("() => document.body.dataset.updated"))
            await page.wait_for_function(
                f"() => Number(document.body.dataset.updated) > {before}", timeout=5_000
            )
            await page.locator("#freshness", has_text="live").wait_for(timeout=5_000)
            leaky = page.locator("tr[data-node=leaky] .state")
            # Fast growth while it still serves: a warning of its own, not the drained state.
            growing = leaky.locator(".state-growing")
            await growing.wait_for(timeout=20_000)
            assert await growing.text_content() == "memory growing"
            for name in NODES:
                # p50 / p90 / p99 with their unit: ms, or s from a second up (the heavy node
                # decodes 60 tokens/s, so on a slow machine its answers pass a second).
                latency = page.locator(f"tr[data-node={name}] td").nth(7)
                shown = await latency.text_content() or ""
                assert re.match(r"[\d.]+ m?s / [\d.]+ m?s / [\d.]+ m?s", shown), shown

            # A node dies: its row changes state within about a second of the gateway seeing it.
            models["light"].proc.kill()
            models["light"].proc.wait(timeout=5)
            deadline = time.monotonic() + 15
            while True:
                states = {n["name"]: n["state"] for n in (await status(gateway.url))["nodes"]}
                if states["light"] != "ready":
                    seen_by_gateway = time.monotonic()
                    break
                assert time.monotonic() < deadline, "the gateway never saw the node die"
                await asyncio.sleep(0.05)
            await page.wait_for_function(
                "() => document.querySelector('tr[data-node=light]').dataset.state !== 'ready'",
                timeout=5_000,
            )
            lag = time.monotonic() - seen_by_gateway
            assert lag < 5, f"the page showed the dead node {lag:.2f}s after the gateway"
            # First its sidecar says the model server is not ready (warming); then the health
            # checks mark it unhealthy, or its failed tries eject it, whichever comes first.
            gone = "tr[data-node=light]:is([data-state=unhealthy], [data-state=ejected])"
            await page.locator(gone).wait_for(timeout=5_000)
            badge = page.locator("tr[data-node=light] .state .badge").first
            assert await badge.text_content() in {"unhealthy", "ejected"}
            png = await page.screenshot(path=str(shot), full_page=True)
            assert png.startswith(b"\x89PNG") and len(png) > 10_000
            # Forgotten: the login, with no age of the board's data counting over it.
            await page.click("#forget")
            await page.locator("#login").wait_for(state="visible", timeout=5_000)
            assert await page.evaluate("() => lastAt") == 0
            await browser.close()
        assert TOKEN not in gateway.log()  # nothing the browser sent was logged
    finally:
        stop.set()
        await load
        gateway.stop()
