"""The web view in a real headless Chromium (Debian's, driven by Playwright): login through the
OIDC issuer, every page with the seeded data, filters, hostile records, an audited admin action,
the live view and role isolation. Each page is screenshotted under tests/web/artifacts/."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.console.helpers import traffic_record
from tests.console.oidc_issuer import LocalIssuer
from tests.web.conftest import ARTIFACTS, HOSTILE_HOST, HOSTILE_PATH, Seed, ingest

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.path.exists(CHROMIUM) or shutil.which("chromium") is None:
        pytest.fail("Chromium not found: run scripts/system-deps (apt `chromium`)")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield launched
        launched.close()


class Watched:
    """A logged-in page that records CSP violations and any dialog a hostile value might open."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.violations: list[str] = []
        self.dialogs: list[str] = []
        page.on("console", self._console)
        page.on("dialog", self._dialog)

    def _console(self, message: object) -> None:
        text = getattr(message, "text", "")
        if "Content Security Policy" in text or "Refused to" in text:
            self.violations.append(text)

    def _dialog(self, dialog: object) -> None:
        self.dialogs.append(getattr(dialog, "message", ""))
        dialog.dismiss()  # type: ignore[attr-defined]

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def clean(self) -> None:
        assert self.page.evaluate("typeof window.__pwned") == "undefined"
        assert not self.dialogs and not self.violations, (self.dialogs, self.violations)


def login(
    browser: Browser, seed: Seed, issuer: LocalIssuer, subject: str, roles: list[str]
) -> Watched:
    issuer.browser_grant = (subject, roles)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(seed.server.url + "/ui/")
    page.wait_for_url("**/traffic")
    return Watched(page)


def test_admin_sees_every_page(browser: Browser, pg_web: Seed, issuer: LocalIssuer) -> None:
    seed, team = pg_web, pg_web.team.name
    view = login(browser, seed, issuer, seed.team.admin_subject, [f"{team}:admin"])
    page, base = view.page, f"{seed.server.url}/ui/teams/{team}"
    expect(page.locator("#records tbody tr")).to_have_count(25)
    expect(page.locator("header")).to_contain_text(seed.team.admin_subject)
    view.shot("traffic")
    page.goto(f"{base}/overview")
    expect(page.locator("svg.chart").first).to_be_visible()
    expect(page.locator("main")).to_contain_text("evil.example")
    view.shot("overview")
    page.goto(f"{base}/cvms")
    expect(page.locator("#cvms tbody tr")).to_have_count(3)
    expect(page.locator("#cvms")).to_contain_text("beta")
    view.shot("cvms")
    page.goto(f"{base}/cvms/{seed.cvm1}")
    expect(page.locator("#state")).to_have_text("running")
    view.shot("cvm")
    page.goto(f"{base}/profiles")
    expect(page.locator("#bundle")).to_contain_text("test@1")
    view.shot("profiles")
    page.goto(f"{base}/secrets")
    expect(page.locator("main")).to_contain_text("team/bot")
    view.shot("secrets")
    page.goto(f"{base}/audit")
    expect(page.locator("#chain")).to_contain_text("Chain verified")
    view.shot("audit")
    view.clean()


def test_filters_change_the_rows(browser: Browser, pg_web: Seed, issuer: LocalIssuer) -> None:
    seed, team = pg_web, pg_web.team.name
    view = login(browser, seed, issuer, seed.team.admin_subject, [f"{team}:admin"])
    page = view.page
    page.select_option("select[name=decision]", "deny")
    page.click("#filters button[type=submit]")
    expect(page.locator("#records tbody tr")).to_have_count(10)
    page.fill("input[name=host]", "evil.example")
    page.click("#filters button[type=submit]")
    expect(page.locator("#records tbody tr")).to_have_count(5)
    page.select_option("select[name=cvm]", label="beta")
    page.fill("input[name=host]", "")
    page.click("#filters button[type=submit]")
    expect(page.locator("#records tbody tr")).to_have_count(3)
    view.shot("traffic-filtered")
    view.clean()


def test_hostile_record_is_text(browser: Browser, pg_web: Seed, issuer: LocalIssuer) -> None:
    seed, team = pg_web, pg_web.team.name
    view = login(browser, seed, issuer, seed.team.admin_subject, [f"{team}:admin"])
    page = view.page
    expect(page.locator("#records")).to_contain_text("<script>window.__pwned=1</script>")
    page.goto(f"{seed.server.url}/ui/teams/{team}/records/{seed.hostile_id}")
    expect(page.locator("#host")).to_have_text(HOSTILE_HOST)
    expect(page.locator("#path")).to_have_text(HOSTILE_PATH)
    assert page.locator("#host img, #path svg, main script").count() == 0
    view.shot("record-hostile")
    page.goto(f"{seed.server.url}/ui/teams/{team}/records/{seed.control_id}")
    expect(page.locator("#path")).to_contain_text("\\x1b[31mred\\u202edrowssap")
    view.shot("record-control")
    view.clean()


def test_admin_action_is_audited(browser: Browser, pg_web: Seed, issuer: LocalIssuer) -> None:
    seed, team = pg_web, pg_web.team.name
    view = login(browser, seed, issuer, seed.team.admin_subject, [f"{team}:admin"])
    page, base = view.page, f"{seed.server.url}/ui/teams/{team}"
    page.goto(f"{base}/cvms/{seed.cvm1}")
    page.select_option("#attach-form select", "web")
    page.click("#attach-form button")
    expect(page.locator(".flash")).to_contain_text("profiles of alpha: web")
    expect(page.locator("#profiles")).to_have_text("web")
    page.click("button:has-text('Detach web')")
    expect(page.locator("#profiles")).to_have_text("none")
    page.goto(f"{base}/cvms/{seed.cvm2}")
    page.click("button:has-text('Stop')")
    expect(page.locator("#state")).to_have_text("stopped")
    page.goto(f"{base}/audit")
    rows = page.locator("#audit tbody tr")
    expect(rows.nth(0)).to_contain_text("cvm.update")
    expect(rows.nth(1)).to_contain_text("profiles.attach")
    expect(rows.nth(1)).to_contain_text('"profiles": []')
    expect(rows.nth(2)).to_contain_text('"profiles": ["web"]')
    expect(page.locator("#chain")).to_contain_text("Chain verified")
    view.shot("audit-after-actions")
    view.clean()


def test_developer_is_confined(browser: Browser, pg_web: Seed, issuer: LocalIssuer) -> None:
    seed, team = pg_web, pg_web.team.name
    view = login(browser, seed, issuer, seed.team.dev_subject, [f"{team}:developer"])
    page, root = view.page, f"{seed.server.url}/ui/teams"
    expect(page.locator("#records tbody tr")).to_have_count(19)
    expect(page.locator("#records")).not_to_contain_text("pypi.org")
    expect(page.locator("header nav")).not_to_contain_text("Audit")
    response = page.goto(f"{root}/{team}/cvms/{seed.cvm2}")
    assert response is not None and response.status == 404
    expect(page.locator("#error-message")).to_contain_text("not found")
    view.shot("developer-other-cvm")
    response = page.goto(f"{root}/{seed.other.name}/traffic")
    assert response is not None and response.status == 403
    response = page.goto(f"{root}/{team}/records/{seed.dev2_record}")
    assert response is not None and response.status == 404
    response = page.goto(f"{root}/{team}/audit")
    assert response is not None and response.status == 403
    view.clean()


def test_live_view_follows_new_records(browser: Browser, pg_web: Seed, issuer: LocalIssuer) -> None:
    # On the other team, so the seeded team's row counts stay as the other tests expect.
    seed, other = pg_web, pg_web.other
    view = login(browser, seed, issuer, other.admin_subject, [f"{other.name}:admin"])
    page = view.page
    expect(page.locator("#records tbody tr")).to_have_count(1)
    page.check("#live")
    expect(page.locator("#live-status")).to_have_text("following")
    fresh = traffic_record(
        other.name,
        host="live-<b>new</b>.example",
        time=datetime.now(UTC).isoformat(),
        id=str(uuid.uuid4()),
    )
    ingest(other, [fresh])
    row = page.locator(f"#records tbody tr[data-id='{fresh['id']}']")
    expect(row).to_be_visible(timeout=10_000)
    expect(row).to_contain_text("live-<b>new</b>.example")
    expect(page.locator("#records tbody tr")).to_have_count(2)
    view.shot("traffic-live")
    view.clean()
