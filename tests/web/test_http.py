"""The web view over plain HTTP: login, headers, cookies, CSRF, scoping and bad input (no 5xx)."""

from __future__ import annotations

import json
import re
from contextlib import closing
from urllib.parse import quote

import httpx
import pytest
from starlette.requests import Request

from tests.console.oidc_issuer import LocalIssuer
from tests.web.conftest import CONTROL_PATH, HOSTILE_HOST, SECRET_VALUE, Seed, login
from umbra.console.services import secrets, traffic
from umbra.console.services.traffic import TrafficFilters
from umbra.console.web.render import visible
from umbra.console.web.session import cookie_names, is_loopback_http


@pytest.fixture(params=["pg", "sqlite"])
def seeded(request: pytest.FixtureRequest) -> Seed:
    return request.getfixturevalue("pg_web" if request.param == "pg" else "sqlite_web")


def admin(seed: Seed, issuer: LocalIssuer) -> httpx.Client:
    return login(seed.server, issuer, seed.team.admin_subject, [f"{seed.team.name}:admin"])


def dev(seed: Seed, issuer: LocalIssuer) -> httpx.Client:
    return login(seed.server, issuer, seed.team.dev_subject, [f"{seed.team.name}:developer"])


def rows(html: str) -> int:
    return len(re.findall(r"<tr data-id=", html))


def test_login_sets_a_hardened_session(seeded: Seed, issuer: LocalIssuer) -> None:
    issuer.browser_grant = (seeded.team.admin_subject, [f"{seeded.team.name}:admin"])
    with httpx.Client(base_url=seeded.server.url, timeout=30) as client:
        start = client.get("/ui/traffic-nowhere")
        assert start.status_code == 404
        start = client.get("/ui/")
        assert start.status_code == 303 and start.headers["location"].startswith("/ui/login")
        begin = client.get(start.headers["location"])
        assert begin.status_code == 303
        authorize = begin.headers["location"]
        assert "code_challenge_method=S256" in authorize and "state=" in authorize
        back = httpx.get(authorize, follow_redirects=False)
        callback = client.get(back.headers["location"])
        assert callback.status_code == 303
        cookie = callback.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=lax" in cookie
        assert "secure" not in cookie  # plain HTTP is only allowed on loopback
        page = client.get(callback.headers["location"], follow_redirects=True)
        assert page.status_code == 200
        csp = page.headers["content-security-policy"]
        assert "unsafe-inline" not in csp and "script-src 'self'" in csp
        assert "frame-ancestors 'none'" in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        # A replayed code is refused by the issuer, and a forged state never reaches it.
        replay = client.get(back.headers["location"])
        assert replay.status_code in (400, 401)


def test_pages_render_seeded_data(seeded: Seed, issuer: LocalIssuer) -> None:
    with closing(admin(seeded, issuer)) as client:
        team = seeded.team.name
        traffic = client.get(f"/ui/teams/{team}/traffic")
        assert traffic.status_code == 200 and rows(traffic.text) == 25
        assert "evil.example" in traffic.text and "pypi.org" in traffic.text
        assert "other-team.example" not in traffic.text
        overview = client.get(f"/ui/teams/{team}/overview")
        assert overview.status_code == 200
        assert "<svg" in overview.text and "host_not_allowed" in overview.text
        assert "evil.example" in overview.text
        cvms = client.get(f"/ui/teams/{team}/cvms")
        assert "alpha" in cvms.text and "beta" in cvms.text and "sec" in cvms.text
        assert cvms.text.count('<span class="ok">attested</span>') == 3
        other = client.get(f"/ui/teams/{seeded.other.name}/cvms")
        assert other.status_code == 403
        profiles = client.get(f"/ui/teams/{team}/profiles")
        assert "test@1" in profiles.text and "clash-a" in profiles.text
        secrets = client.get(f"/ui/teams/{team}/secrets")
        assert "team/bot" in secrets.text and "initial-value" not in secrets.text
        audit = client.get(f"/ui/teams/{team}/audit")
        assert "Chain verified" in audit.text and "policy.upload" in audit.text
        assert "This view verified the entries after #" in audit.text


def test_filters_narrow_the_rows(seeded: Seed, issuer: LocalIssuer) -> None:
    team = seeded.team.name
    with closing(admin(seeded, issuer)) as client:
        base = f"/ui/teams/{team}/traffic"
        assert rows(client.get(base, params={"decision": "deny"}).text) == 10
        assert rows(client.get(base, params={"host": "pypi.org"}).text) == 6
        assert rows(client.get(base, params={"cvm": seeded.cvm2}).text) == 6
        assert rows(client.get(base, params={"owner": seeded.dev2_subject}).text) == 6
        assert rows(client.get(base, params={"reason": "scan_match"}).text) == 3
        assert rows(client.get(base, params={"rule": "web:egress-0"}).text) == 6
        assert rows(client.get(base, params={"range": "15m"}).text) == 12
        assert rows(client.get(base, params={"host": "nowhere.example"}).text) == 0
        # Keyset paging: 25 records, 50 a page by default; ask the page layer for smaller pages.
        first = client.get(base, params={"decision": "deny"})
        assert "Older" not in first.text


def test_developer_sees_only_their_own(seeded: Seed, issuer: LocalIssuer) -> None:
    team = seeded.team.name
    with closing(dev(seeded, issuer)) as client:
        traffic = client.get(f"/ui/teams/{team}/traffic")
        assert rows(traffic.text) == 19 and "pypi.org" not in traffic.text
        assert client.get(f"/ui/teams/{team}/cvms/{seeded.cvm2}").status_code == 404
        assert client.get(f"/ui/teams/{team}/cvms/{seeded.cvm1}").status_code == 200
        assert client.get(f"/ui/teams/{team}/records/{seeded.dev2_record}").status_code == 404
        peek = client.get(f"/ui/teams/{team}/traffic", params={"owner": seeded.dev2_subject})
        assert peek.status_code == 403
        assert client.get(f"/ui/teams/{team}/audit").status_code == 403
        other = seeded.other.name
        assert client.get(f"/ui/teams/{other}/traffic").status_code == 403
        assert client.get(f"/ui/teams/{team}/records/{seeded.other_record}").status_code == 404
        cvms = client.get(f"/ui/teams/{team}/cvms")
        assert "alpha" in cvms.text and "beta" not in cvms.text
        overview = client.get(f"/ui/teams/{team}/overview")
        assert "evil.example" in overview.text and "pypi.org" not in overview.text
        live = client.get(f"/ui/teams/{team}/traffic/live").json()["records"]
        assert live and all(record["owner"] == seeded.team.dev_subject for record in live)


def test_hostile_values_are_text(seeded: Seed, issuer: LocalIssuer) -> None:
    team = seeded.team.name
    with closing(admin(seeded, issuer)) as client:
        page = client.get(f"/ui/teams/{team}/records/{seeded.hostile_id}")
        assert page.status_code == 200
        assert "<script>window" not in page.text and "<svg onload" not in page.text
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page.text
        assert "\u202e" not in page.text and "\\u202e" in page.text
        control = client.get(f"/ui/teams/{team}/records/{seeded.control_id}")
        assert control.status_code == 200
        assert "\x1b" not in control.text and "\\x1b" in control.text
        assert "\x7f" not in control.text and "\\u200b" in control.text
        listing = client.get(f"/ui/teams/{team}/traffic")
        assert "<script>window" not in listing.text and "\x1b" not in listing.text
        live = client.get(f"/ui/teams/{team}/traffic/live")
        hosts = [record["host"] for record in live.json()["records"]]
        assert HOSTILE_HOST in hosts and visible(CONTROL_PATH)[:8] == "/esc\\x1b"


BAD_QUERIES = [
    {"host": "h" * 20_000},
    {"owner": "a\x00b"},
    {"cvm": "not-a-cvm"},
    {"decision": "maybe"},
    {"since": "yesterday"},
    {"since": "9999-12-31T23:59:59-23:59"},
    {"range": "forever"},
    {"reason": "<script>"},
    {"cursor": "!!!"},
    {"cursor": "eyJub3QiOiJhIGN1cnNvciJ9"},
]


def test_bad_input_is_refused_clearly(seeded: Seed, issuer: LocalIssuer) -> None:
    team = seeded.team.name
    with closing(admin(seeded, issuer)) as client:
        for params in BAD_QUERIES:
            response = client.get(f"/ui/teams/{team}/traffic", params=params)
            assert response.status_code == 422, (params, response.status_code)
            assert "error-message" in response.text
            assert "h" * 1000 not in response.text
        raw = client.get(f"/ui/teams/{team}/traffic?host=%ff%fe&owner=%00")
        assert raw.status_code == 422
        for path in (
            f"/ui/teams/{team}/records/not-a-uuid",
            f"/ui/teams/{team}/records/{'9' * 5000}",
            f"/ui/teams/{team}/records/00000000-0000-0000-0000-000000000000",
            f"/ui/teams/{team}/cvms/cvm_0000000000000000",
            f"/ui/teams/{team}/cvms/{quote('<script>')}",
            "/ui/teams/NOT_A_TEAM/traffic",
            f"/ui/teams/{'x' * 300}/traffic",
        ):
            response = client.get(path)
            assert response.status_code == 404, (path, response.status_code)
        assert client.get(f"/ui/teams/{team}/audit", params={"before": "-1"}).status_code == 422
        assert client.get(f"/ui/teams/{team}/overview", params={"range": "x"}).status_code == 422
        live = client.get(f"/ui/teams/{team}/traffic/live", params={"after": "<>"})
        assert live.status_code == 422


def test_forms_need_the_csrf_token(seeded: Seed, issuer: LocalIssuer) -> None:
    team = seeded.team.name
    with closing(admin(seeded, issuer)) as client:
        before = client.get(f"/ui/teams/{team}/audit").text.count("<tr><td>")
        url = f"/ui/teams/{team}/cvms/{seeded.cvm1}/actions"
        assert client.post(url, data={"action": "stop"}).status_code == 403
        assert client.post(url, data={"action": "stop", "csrf": "guess"}).status_code == 403
        page = client.get(f"/ui/teams/{team}/cvms/{seeded.cvm1}").text
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token is not None
        foreign = client.post(
            url,
            data={"action": "stop", "csrf": token.group(1)},
            headers={"Origin": "https://attacker.example"},
        )
        assert foreign.status_code == 403
        garbage = client.post(
            url,
            content=b"csrf=\xff\xfe",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert garbage.status_code == 400
        assert client.get(f"/ui/teams/{team}/audit").text.count("<tr><td>") == before


def test_secret_rotation_is_write_only_and_audited(seeded: Seed, issuer: LocalIssuer) -> None:
    team = seeded.team.name
    with closing(admin(seeded, issuer)) as client:
        page = client.get(f"/ui/teams/{team}/secrets").text
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token is not None
        done = client.post(
            f"/ui/teams/{team}/secrets/rotate",
            data={"csrf": token.group(1), "name": "bot", "value": SECRET_VALUE},
        )
        assert done.status_code == 200 and "now version" in done.text
        assert SECRET_VALUE not in done.text and SECRET_VALUE not in str(done.url)
        audit = client.get(f"/ui/teams/{team}/audit").text
        assert "secret.set" in audit and SECRET_VALUE not in audit
        missing = client.post(
            f"/ui/teams/{team}/secrets/rotate",
            data={"csrf": token.group(1), "name": "nope", "value": SECRET_VALUE},
        )
        assert missing.status_code == 404 and SECRET_VALUE not in missing.text
    with closing(dev(seeded, issuer)) as client:
        page = client.get(f"/ui/teams/{team}/secrets").text
        assert "rotate-form" not in page
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token is not None
        refused = client.post(
            f"/ui/teams/{team}/secrets/rotate",
            data={"csrf": token.group(1), "name": "bot", "value": SECRET_VALUE},
        )
        assert refused.status_code == 403


def test_web_rotation_is_conditional_on_the_version_it_read(
    seeded: Seed, issuer: LocalIssuer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The form rotates with the version whose hosts it read: a change in between (here the read
    is made stale) gets 412 and stores nothing, never a silent overwrite of newer hosts."""
    team = seeded.team.name
    fresh = secrets.team_secret_state(seeded.server.console, team, "bot")
    assert fresh is not None
    hosts, version, kind = fresh
    monkeypatch.setattr(secrets, "team_secret_state", lambda *_: (hosts, version - 1, kind))
    with closing(admin(seeded, issuer)) as client:
        page = client.get(f"/ui/teams/{team}/secrets").text
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token is not None
        stale = client.post(
            f"/ui/teams/{team}/secrets/rotate",
            data={"csrf": token.group(1), "name": "bot", "value": SECRET_VALUE},
        )
        assert stale.status_code == 412 and SECRET_VALUE not in stale.text
    monkeypatch.undo()
    assert secrets.team_secret_state(seeded.server.console, team, "bot") == (hosts, version, kind)


def test_session_and_login_tampering(seeded: Seed, issuer: LocalIssuer) -> None:
    server = seeded.server
    with httpx.Client(base_url=server.url, timeout=30) as client:
        client.cookies.set("umbra_web", "eyJzIjoiYWRtaW4ifQ.forged")
        assert client.get("/ui/").status_code == 303
        assert client.get("/ui/callback", params={"code": "x", "state": "y"}).status_code == 400
        bounce = client.get("/ui/login", params={"next": "//attacker.example/"})
        assert bounce.status_code == 303
        login_cookie = client.cookies.get("umbra_web_login")
        assert login_cookie is not None
        # A callback whose state differs from the one in the login cookie is refused.
        assert client.get("/ui/callback", params={"code": "x", "state": "y"}).status_code == 400


def test_visible_escapes_hidden_characters() -> None:
    assert visible("plain.example") == "plain.example"
    assert visible("a\x1bb") == "a\\x1bb"
    assert visible("\u202egnp.exe") == "\\u202egnp.exe"
    assert visible("zero\u200bwidth") == "zero\\u200bwidth"
    assert visible("lone\udcff") == "lone\\udcff"
    assert visible("ünïcödé") == "ünïcödé"
    assert visible("typed\\x1b") == "typed\\\\x1b"


def test_cookies_are_secure_off_loopback() -> None:
    def request(scheme: str, host: str) -> Request:
        return Request({"type": "http", "scheme": scheme, "server": (host, 443), "path": "/",
                        "headers": [(b"host", host.encode())], "query_string": b""})  # fmt: skip

    assert is_loopback_http(request("http", "127.0.0.1"))
    assert is_loopback_http(request("http", "localhost"))
    assert not is_loopback_http(request("https", "127.0.0.1"))
    assert not is_loopback_http(request("http", "console.example.com"))
    assert not is_loopback_http(request("http", "10.0.0.5"))
    assert cookie_names(request("https", "console.example.com"))[0].startswith("__Host-")


def test_destroy_from_the_page_is_audited(seeded: Seed, issuer: LocalIssuer) -> None:
    team = seeded.team.name
    doomed = seeded.team.dev_cvm("doomed")
    with closing(admin(seeded, issuer)) as client:
        page = client.get(f"/ui/teams/{team}/cvms/{doomed}").text
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token is not None
        url = f"/ui/teams/{team}/cvms/{doomed}/actions"
        unconfirmed = client.post(url, data={"csrf": token.group(1), "action": "destroy"})
        assert unconfirmed.status_code == 422
        done = client.post(
            url, data={"csrf": token.group(1), "action": "destroy", "confirm": "yes"}
        )
        assert done.status_code == 200 and "doomed is destroyed" in done.text
        entries = client.get(f"/ui/teams/{team}/audit").text
        first = entries.split("<tbody>", 1)[1].split("</tr>", 1)[0]
        assert "cvm.destroy" in first and doomed in first
        api = seeded.team.admin.get(f"/api/v1/teams/{team}/audit", params={"limit": 1000})
        assert api.json()["entries"][-1]["action"] == "cvm.destroy"
        bogus = client.post(url, data={"csrf": token.group(1), "action": "explode"})
        assert bogus.status_code == 422


def test_no_team_and_logout(seeded: Seed, issuer: LocalIssuer) -> None:
    with closing(login(seeded.server, issuer, "outsider", [])) as client:
        page = client.get("/ui/")
        assert page.status_code == 200 and "holds no role in any team" in page.text
        assert client.get(f"/ui/teams/{seeded.team.name}/traffic").status_code == 403
        token = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert token is not None
        assert client.post("/ui/logout", data={}).status_code == 403
        out = client.post("/ui/logout", data={"csrf": token.group(1)})
        assert out.status_code == 200 and "Logged out" in out.text
        again = client.get("/ui/", follow_redirects=False)
        assert again.status_code == 303 and again.headers["location"].startswith("/ui/login")


def test_keyset_paging_walks_every_record_once(seeded: Seed) -> None:
    console, team = seeded.server.console, seeded.team.name
    everything = traffic.page(console=console, team=team, filters=TrafficFilters(), limit=1000).rows
    seen: list[str] = []
    cursor = None
    while True:
        page = traffic.page(
            console=console, team=team, filters=TrafficFilters(cursor=cursor), limit=4
        )
        seen.extend(row.id for row in page.rows)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == [row.id for row in everything] and len(set(seen)) == len(seen) >= 25


def test_a_secret_needing_a_new_login_says_so(seeded: Seed, issuer: LocalIssuer) -> None:
    """A refresh the token endpoint refused marks the secret; the secrets page shows it with its
    kind, and never the document."""
    from sqlalchemy import update

    from umbra.console.enums import SecretStatus
    from umbra.console.models import Secret

    team = seeded.team.name
    document = {"token_url": "https://auth.example/t", "client_id": "c", "refresh_token": "rt-w3b"}
    put = seeded.team.admin.put(
        f"/api/v1/teams/{team}/secrets/chain",
        json={"value": json.dumps(document), "hosts": [], "kind": "oauth2-refresh"},
    )
    assert put.status_code == 200, put.text
    with seeded.server.console.write() as session:
        session.execute(
            update(Secret)
            .where(Secret.team == team, Secret.name == "chain")  # type: ignore[arg-type]
            .values(status=SecretStatus.needs_login)
        )
    with closing(admin(seeded, issuer)) as client:
        page = client.get(f"/ui/teams/{team}/secrets").text
    assert "oauth2-refresh" in page and "needs a new login" in page and "rt-w3b" not in page
    seeded.team.admin.delete(f"/api/v1/teams/{team}/secrets/chain")


def test_admin_deactivates_a_developer_from_the_page(seeded: Seed, issuer: LocalIssuer) -> None:
    """The web form calls the same service as the API: the leaver's own web session loses the
    team on its next request; developers have no form and are refused."""
    from tests.console.helpers import unique

    team = seeded.team.name
    leaver = unique("leaver")
    with closing(login(seeded.server, issuer, leaver, [f"{team}:developer"])) as gone:
        assert gone.get(f"/ui/teams/{team}/cvms").status_code == 200
        with closing(dev(seeded, issuer)) as client:
            page = client.get(f"/ui/teams/{team}/cvms").text
            assert "deactivate-form" not in page
            token = re.search(r'name="csrf" value="([^"]+)"', page)
            assert token is not None
            refused = client.post(
                f"/ui/teams/{team}/members/deactivate",
                data={"csrf": token.group(1), "subject": leaver, "confirm": "yes"},
            )
            assert refused.status_code == 403
        with closing(admin(seeded, issuer)) as client:
            page = client.get(f"/ui/teams/{team}/cvms").text
            assert "deactivate-form" in page
            token = re.search(r'name="csrf" value="([^"]+)"', page)
            assert token is not None
            unconfirmed = client.post(
                f"/ui/teams/{team}/members/deactivate",
                data={"csrf": token.group(1), "subject": leaver},
            )
            assert unconfirmed.status_code == 422
            done = client.post(
                f"/ui/teams/{team}/members/deactivate",
                data={"csrf": token.group(1), "subject": leaver, "confirm": "yes"},
            )
            assert done.status_code == 200 and "deactivated" in done.text, done.text
            assert "user.deactivate" in client.get(f"/ui/teams/{team}/audit").text
        assert gone.get(f"/ui/teams/{team}/cvms").status_code == 403
