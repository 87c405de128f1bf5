"""Budgets through the real proxy: a CVM over its requests-per-minute or bytes-per-day budget
gets 429 `budget_exceeded` with a record, another CVM is not affected, and the counters survive a
restart of the proxy (saved in its spool directory)."""

from __future__ import annotations

import json
import math
import ssl
import time
from pathlib import Path

import pytest

from tests.proxy.harness import (
    ALICE_TOKEN,
    BOB_TOKEN,
    OriginServer,
    ProxyProcess,
    Recorder,
    TestCA,
    curl,
    curl_status,
    start_proxy,
    write_identities,
)

HOSTS = ["rate.test", "bytes.test"]


def policy(port: int) -> str:
    return f"""
apiVersion: umbra/v1
kind: Profile
name: testing
egress:
  - {{id: rate, allow: {{hosts: [rate.test], ports: [{port}]}}}}
  - {{id: bulk, allow: {{hosts: [bytes.test], ports: [{port}]}}}}
budgets:
  - {{id: per-minute, per: cvm, hosts: [rate.test], requests_per_minute: 3}}
  - {{id: daily-bytes, per: owner, rules: [bulk], bytes_per_day: 150000}}
"""


def start(
    workdir: Path, ca: TestCA, policy_dir: Path, port: int | None = None, clock: bool = False
) -> ProxyProcess:
    return start_proxy(
        [
            *("--policy-dir", str(policy_dir), "--identities", str(workdir / "identities.json")),
            *("--secrets", str(workdir / "secrets.json"), "--upstream-ca", str(ca.cert_path)),
            *("--test-allow-upstream", "127.0.0.1/32"),
            *("--test-resolver", str(workdir / "resolver.json")),
            *(("--test-clock", str(workdir / "clock")) if clock else ()),
        ],
        workdir,
        port=port,
    )


def setup(workdir: Path) -> tuple[TestCA, OriginServer, Path]:
    ca = TestCA(workdir)
    cert, key = ca.issue(HOSTS)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    origin = OriginServer(Recorder(), tls).start()
    policy_dir = workdir / "policies"
    policy_dir.mkdir()
    (policy_dir / "testing.yaml").write_text(policy(origin.port))
    (workdir / "resolver.json").write_text(json.dumps({h: ["127.0.0.1"] for h in HOSTS}))
    write_identities(workdir / "identities.json")
    (workdir / "secrets.json").write_text(json.dumps({"team": {}}))
    (workdir / "secrets.json").chmod(0o600)
    return ca, origin, policy_dir


def test_budgets_are_enforced_recorded_and_survive_a_restart(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    workdir = tmp_path_factory.mktemp("budgets")
    ca, origin, policy_dir = setup(workdir)
    # the per-minute part (restart included) must fall in one UTC minute: start early in one
    if (second := time.time() % 60) > 30:
        time.sleep(61 - second)
    proxy = start(workdir, ca, policy_dir)
    rate = f"https://rate.test:{origin.port}/x"
    bulk = f"https://bytes.test:{origin.port}/big?n=100000"
    try:
        statuses = [curl_status(curl(proxy, rate)) for _ in range(3)]
        mark = proxy.log.mark()
        over = curl(proxy, rate)
        assert statuses == [200, 200, 200] and curl_status(over) == 429
        assert (
            "budget_exceeded" in over.stdout
            and "testing:per-minute: 3 requests a minute" in over.stdout
        )
        record = proxy.log.wait_for(mark, lambda r: r["reason"] == "budget_exceeded")
        assert record["status"] == 429 and record["rule_id"] == "testing:per-minute"
        # the budget is per CVM: bob's CVM still has its own
        assert curl_status(curl(proxy, rate, token=BOB_TOKEN, cvm="cvm-bob")) == 200
        # bytes per day, per owner: the request that crosses the limit completes, the next is refused
        assert [curl_status(curl(proxy, bulk)) for _ in range(2)] == [200, 200]
        assert curl_status(curl(proxy, bulk)) == 429
    finally:
        output = proxy.stop()
    assert "failing closed" not in output
    saved = json.loads((workdir / "spool" / "budgets.json").read_text())
    assert any(row[0] == "testing:daily-bytes" and row[4] >= 200_000 for row in saved["counters"])
    # a restart loads the counters: the budgets reached stay reached
    proxy = start(workdir, ca, policy_dir)
    try:
        assert curl_status(curl(proxy, bulk)) == 429
        assert curl_status(curl(proxy, rate, token=ALICE_TOKEN)) == 429
    finally:
        proxy.stop()
        origin.shutdown()


def test_a_budget_reached_admits_again_when_its_window_rolls(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Reached and reset, on the proxy's test clock (no waiting for a minute or a day): the
    per-minute budget refuses the 4th request, and the next minute admits 3 again; the per-day
    bytes budget refuses after crossing, and the next day admits again. Each refusal is recorded."""
    workdir = tmp_path_factory.mktemp("budgets-reset")
    ca, origin, policy_dir = setup(workdir)
    clock = workdir / "clock"
    # the proxy's clock starts one second into a UTC minute that is also well inside a day
    now = time.time()
    offset = (math.floor(now / 86400) * 86400 + 3600 + 1) - now
    clock.write_text(str(offset))
    proxy = start(workdir, ca, policy_dir, clock=True)
    rate = f"https://rate.test:{origin.port}/x"
    bulk = f"https://bytes.test:{origin.port}/big?n=100000"

    def refused(url: str) -> dict[str, object]:
        mark = proxy.log.mark()
        result = curl(proxy, url)
        assert curl_status(result) == 429 and "budget_exceeded" in result.stdout
        return proxy.log.wait_for(mark, lambda r: r["reason"] == "budget_exceeded")

    try:
        assert [curl_status(curl(proxy, rate)) for _ in range(3)] == [200] * 3
        assert refused(rate)["rule_id"] == "testing:per-minute"
        clock.write_text(str(offset + 60))  # the next minute: reset
        assert [curl_status(curl(proxy, rate)) for _ in range(3)] == [200] * 3
        assert refused(rate)["rule_id"] == "testing:per-minute"
        assert [curl_status(curl(proxy, bulk)) for _ in range(2)] == [200, 200]
        assert refused(bulk)["rule_id"] == "testing:daily-bytes"
        clock.write_text(str(offset + 90))  # later the same day: the bytes budget stays reached
        assert curl_status(curl(proxy, bulk)) == 429
        clock.write_text(str(offset + 86400))  # the next day: both budgets start from zero
        assert [curl_status(curl(proxy, bulk)) for _ in range(2)] == [200, 200]
        assert curl_status(curl(proxy, rate)) == 200
    finally:
        output = proxy.stop()
        origin.shutdown()
    assert "--test-clock" in output  # the test-only warning names it
