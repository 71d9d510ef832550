"""The chat page at `/` (specmlx/server/page.html), driven in a real headless Chromium
(Debian's chromium through Playwright, started here): a reply streams over the OpenAI API,
the tokens of accepted drafts are shaded as such, and the stats and the chart update.

Skips, saying why, where chromium or playwright is missing (.ci/run installs both).
SPECMLX_PAGE_SCREENSHOT=FILE also saves what the page shows at the end."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_server import MODEL, running, template_ids

import specmlx
from specmlx.server import make_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install)")
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).is_file(), reason="needs Debian's chromium (apt-get install chromium)"
)
# No first-run UI, no update checks, no network but the test server's.
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PROMPT = "hello there"
WAIT_MS = 60_000  # a hang, not a slow machine


@pytest.fixture(scope="module")
def url(models):
    with running(make_app(models["target"], models["perturbed"], model_id=MODEL)) as base:
        yield base


@pytest.fixture
def page(tmp_path):
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # empty: a fresh profile every run
            executable_path=CHROMIUM,
            headless=True,
            args=ARGS,
            viewport={"width": 900, "height": 520},
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def ask(page, url: str, gamma: str) -> None:
    """Open the page, set greedy decoding and γ, send PROMPT and wait for the reply's end."""
    page.goto(f"{url}/")
    page.fill("#temperature", "0")
    page.fill("#num_draft", gamma)
    page.fill("#max_tokens", "24")
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")
    page.wait_for_selector(".assistant[data-done=true]", timeout=WAIT_MS)


def test_a_reply_streams_with_accepted_drafts_marked_and_the_stats_updated(page, url, models):
    ask(page, url, "3")
    target, draft = models["target"], models["perturbed"]
    expected = specmlx.generate(
        target, template_ids(target, PROMPT), draft=draft, max_tokens=24, num_draft=3
    ).run()
    assert page.inner_text(".assistant").strip() == expected.text.strip()
    assert page.locator(".assistant .tok-draft").count() == expected.stats.accepted > 0
    assert page.locator(".assistant .tok-target").count() > 0
    assert page.inner_text("#stat-gamma") == "3"
    alpha = float(page.inner_text("#stat-alpha"))
    assert alpha == pytest.approx(expected.stats.accepted / expected.stats.drafted, abs=0.005)
    assert float(page.inner_text("#stat-tps")) > 0 and float(page.inner_text("#stat-tau")) > 1
    assert page.locator("#chart rect.bar-accepted").count() > 0
    assert page.locator("#chart path.gamma-line").count() == 1
    if os.environ.get("SPECMLX_PAGE_SCREENSHOT"):
        page.screenshot(path=os.environ["SPECMLX_PAGE_SCREENSHOT"])


def test_without_drafts_every_token_is_the_targets(page, url):
    ask(page, url, "0")
    assert page.locator(".assistant .tok-target").count() > 0
    assert page.locator(".assistant .tok-draft, .assistant .tok-lookup").count() == 0
    assert page.inner_text("#stat-alpha") == "–"
