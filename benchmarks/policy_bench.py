"""Policy decisions per second at 10 and at 10,000 rules, measured side by side in one run.

The matcher indexes rules by host key and path trie, so the ratio should stay near 1. Run:
    python benchmarks/policy_bench.py [--decisions N]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from umbra.policy.compiled import compile_profile
from umbra.policy.compose import EffectivePolicy
from umbra.policy.model import Profile

METHODS = ["GET", "POST", "PUT"]


def build_policy(rule_count: int) -> EffectivePolicy:
    egress: list[dict[str, Any]] = []
    for index in range(rule_count):
        host = f"svc{index}.example.com" if index % 4 else f"*.zone{index}.example.net"
        kind = "deny" if index % 10 == 9 else "allow"
        egress.append(
            {
                kind: {
                    "hosts": [host],
                    "methods": [METHODS[index % 3]],
                    "paths": [f"/api/v{index % 3}/**", f"/items/*/{index % 7}"],
                }
            }
        )
    document = {"apiVersion": "umbra/v1", "kind": "Profile", "name": "bench", "egress": egress}
    compiled, _ = compile_profile(Profile.model_validate(document))
    return EffectivePolicy([compiled])


def requests(rule_count: int, count: int, seed: int = 7) -> list[tuple[str, str, str, int, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        index = rng.randrange(rule_count)
        host = f"svc{index}.example.com" if index % 4 else f"a.b.zone{index}.example.net"
        if rng.random() < 0.2:
            host = f"unknown{index}.example.org"
        path = rng.choice(
            [f"/api/v{index % 3}/users/{index}", f"/items/x/{index % 7}", "/other/path", "/"]
        )
        out.append((METHODS[rng.randrange(3)], "https", host, 443, path))
    return out


def decisions_per_second(
    policy: EffectivePolicy, workload: list[tuple[str, str, str, int, str]]
) -> float:
    best = 0.0
    for _ in range(5):  # best of five: the least disturbed run measures the code, not the machine
        start = time.perf_counter()
        for method, scheme, host, port, path in workload:
            policy.decide(method, scheme, host, port, path)
        best = max(best, len(workload) / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decisions", type=int, default=20_000)
    args = parser.parse_args()
    small = build_policy(10)
    started = time.perf_counter()
    large = build_policy(10_000)
    print(f"compiled 10,000 rules in {time.perf_counter() - started:.2f} s")
    # The same requests against both policies: the large one holds the small one's rules plus 9,990
    # others, so any difference is the cost of the rules a request does not touch.
    same = requests(10, args.decisions)
    rates = {
        count: decisions_per_second(policy, same)
        for count, policy in ((10, small), (10_000, large))
    }
    for count, rate in rates.items():
        print(f"{count:>6} rules, same requests:  {rate:>10,.0f} decisions/s")
    print(f"ratio 10,000 / 10 rules: {rates[10_000] / rates[10]:.2f}")
    # Requests spread over all 10,000 hosts: more distinct names than the normalization cache holds.
    spread = decisions_per_second(large, requests(10_000, args.decisions))
    print(f"10,000 rules, requests over every host: {spread:>10,.0f} decisions/s (cold name cache)")


if __name__ == "__main__":
    main()
