"""Request-field rules and LLM usage accounting, each against its baseline in the same run.

1. Policy decisions per second with 1,000 allow rules carrying body field constraints (each
   request decided, then its JSON body read and checked: `decide` + `decide_body`) against the
   same 1,000 rules without them (`decide` alone), on the same requests.
2. Proxy CPU per request with usage accounting on vs off: one `umbra proxy serve`, one origin
   answering an Anthropic-shaped event stream with usage (20 events) or JSON; "on" asks for it on
   `/v1/messages` (an LLM API path: the proxy reads usage beside the stream), "off" on
   `/v1/other` (the same answer, not an LLM path: no reading). CPU is the proxy process's user +
   system time (/proc) over the requests; rounds interleaved, medians reported.

Run: .venv/bin/python benchmarks/fields_usage_bench.py [--decisions 20000] [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._proxy_setup import HOST, connect, read_response, start_origin, start_umbra
from tests.proxy.harness import OriginHandler, Seen
from umbra.policy.body import BodyRequest, decide_body
from umbra.policy.compiled import compile_profile
from umbra.policy.compose import EffectivePolicy
from umbra.policy.model import Profile

RULES = 1000


def build(with_fields: bool) -> EffectivePolicy:
    egress: list[dict[str, Any]] = []
    for index in range(RULES):
        rule: dict[str, Any] = {
            "allow": {
                "hosts": [f"svc{index}.example.com"],
                "methods": ["POST"],
                "paths": ["/api/**"],
            }
        }
        if with_fields:
            rule["body"] = [
                {"pointer": "/channel", "one_of": [f"C{index}", f"C{index + 1}"]},
                {"pointer": "/text", "pattern": "[^<>]{0,4000}"},
                {"pointer": "/as_user", "absent": True},
            ]
        egress.append(rule)
    document = {"apiVersion": "umbra/v1", "kind": "Profile", "name": "bench", "egress": egress}
    compiled, _ = compile_profile(Profile.model_validate(document))
    return EffectivePolicy([compiled])


def workload(count: int) -> list[tuple[str, bytes]]:
    rng = random.Random(7)
    out = []
    for _ in range(count):
        index = rng.randrange(RULES)
        body = {"channel": f"C{index + rng.randrange(3)}", "text": "build green " * 8, "ts": index}
        out.append((f"svc{index}.example.com", json.dumps(body).encode()))
    return out


def decisions_per_second(policy: EffectivePolicy, requests: list[tuple[str, bytes]]) -> float:
    start = time.perf_counter()
    for host, body in requests:
        decision = policy.decide("POST", "https", host, 443, "/api/chat.postMessage")
        if decision.field_rules:
            decide_body(decision, BodyRequest(("application/json",), body))
    return len(requests) / (time.perf_counter() - start)


def bench_fields(decisions: int, rounds: int) -> None:
    plain, fields = build(False), build(True)
    requests = workload(decisions)
    results: dict[str, list[float]] = {"none": [], "fields": []}
    for _ in range(rounds):
        for name, policy in (("none", plain), ("fields", fields)):
            results[name].append(decisions_per_second(policy, requests))
    none, with_fields = statistics.median(results["none"]), statistics.median(results["fields"])
    print(f"\n1,000 allow rules, {decisions} POST requests, {rounds} interleaved rounds (medians)")
    print(f"  without field rules: {none:12,.0f} decisions/s")
    print(f"  with field rules:    {with_fields:12,.0f} decisions/s (decide + read and check body)")
    print(f"  ratio: {with_fields / none:.2f}x")


EVENTS = [
    b'event: message_start\ndata: {"type":"message_start","message":{"model":"claude-sonnet-4-5",'
    b'"usage":{"input_tokens":1200,"output_tokens":1,"cache_read_input_tokens":800}}}\n\n',
    *[
        b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"'
        + b"token " * 20
        + b'"}}\n\n'
    ]
    * 18,
    b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":321}}\n\n',
]
STREAM = b"".join(EVENTS)


def _llm_route(handler: OriginHandler, seen: Seen) -> None:
    handler.send(200, STREAM, {"content-type": "text/event-stream"})


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_usage(requests: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="umbra-usage-bench-") as tmp:
        workdir = Path(tmp)
        origin = start_origin(workdir)
        origin.server.routes[HOST] = _llm_route
        proxy = start_umbra(workdir, origin)
        try:
            sock = connect(proxy.port, origin.port, proxy.ca)

            def run(path: str) -> float:
                body = b'{"stream": true}'
                head = (
                    f"POST {path} HTTP/1.1\r\nHost: {HOST}:{origin.port}\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                ).encode()
                before = _cpu_seconds(proxy.process.pid)
                for _ in range(requests):
                    sock.sendall(head + body)
                    response = read_response(sock)
                    if not response.endswith(EVENTS[-1]):
                        raise RuntimeError(f"short response on {path}: {response[-80:]!r}")
                return (_cpu_seconds(proxy.process.pid) - before) / requests

            run("/v1/messages")  # warm up both paths
            run("/v1/other")
            results: dict[str, list[float]] = {"on": [], "off": []}
            for _ in range(rounds):
                results["on"].append(run("/v1/messages"))
                results["off"].append(run("/v1/other"))
            sock.close()
        finally:
            proxy.stop()
            origin.stop()
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    print(f"\nproxy CPU per request, {len(STREAM)}-byte event stream with usage, {requests} "
          f"keep-alive requests x {rounds} interleaved rounds (medians)")  # fmt: skip
    print(f"  usage accounting off (/v1/other):    {off * 1000:7.3f} ms CPU")
    print(f"  usage accounting on  (/v1/messages): {on * 1000:7.3f} ms CPU")
    print(f"  ratio: {on / off:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["fields", "usage"], default=None)
    args = parser.parse_args()
    if args.only != "usage":
        bench_fields(args.decisions, args.rounds)
    if args.only != "fields":
        bench_usage(args.requests, args.rounds)


if __name__ == "__main__":
    main()
