"""Claude Code's first streamed token against the stand-in model API: through the real proxy (the
key injected, placeholders in the agent's environment) vs straight to the stand-in (the real key in
the agent's environment), in one run, interleaved, so the ratio compares like with like.

Each sample starts `claude -p 'say hi' --output-format stream-json --include-partial-messages
--verbose` and stops the clock at the first `text_delta` line on its stdout: process start, Claude
Code's own start-up, the request, the proxy's checks and injection, and the first SSE event. The
stand-in streams its reply in pieces 50 ms apart. This is the part of `umbra claude` attach →
first token that Umbra adds to; the dtach/SSH attach is `benchmarks/session_bench.py`.

Run: .venv/bin/python benchmarks/agent_first_token_bench.py [-n N]   (installs the pinned agents
into the test cache on first use, like tests/agents/test_agents_e2e.py)
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.agents.stack import start_stack  # noqa: E402
from tests.agents.test_agents_e2e import ANTHROPIC_KEY, LLM, OPENAI_KEY, agent_bin  # noqa: E402
from umbra.cli.llm_origin import Api, OriginConfig, OriginServer, serve  # noqa: E402
from umbra.cli.up_agents import ANTHROPIC_KEY_REF, CLAUDE_QUIET, standin_profiles  # noqa: E402


def first_token(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    process = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    elapsed = None
    for line in process.stdout:
        if '"text_delta"' in line:
            elapsed = time.perf_counter() - started
            break
    process.kill()
    process.wait()
    if elapsed is None:
        raise RuntimeError("claude streamed no text")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=7)
    args = parser.parse_args()
    bin_dir = agent_bin()
    config = OriginConfig(
        {
            Api.ANTHROPIC: hashlib.sha256(ANTHROPIC_KEY.encode()).hexdigest(),
            Api.OPENAI: hashlib.sha256(OPENAI_KEY.encode()).hexdigest(),
        },
        gap=0.05,
    )
    servers: list[OriginServer] = []
    origin_ca: list[Path] = []

    def start_llm(cert: Path, key: Path) -> dict[str, str]:
        server = serve(config, str(cert), str(key))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        origin_ca.append(cert.parent / "origin-ca.pem")
        return standin_profiles(LLM, server.port)

    with tempfile.TemporaryDirectory(prefix="umbra-agent-bench-") as tmp:
        work = Path(tmp)
        (work / "stack").mkdir()
        stack = start_stack(
            work / "stack", [LLM], {}, ["anthropic-standin", "openai-standin"],
            {"team": {"anthropic-api-key": ANTHROPIC_KEY}}, start_llm,
        )  # fmt: skip
        port = servers[0].port
        argv = [
            "claude", "-p", "say hi", "--output-format", "stream-json",
            "--include-partial-messages", "--verbose",
        ]  # fmt: skip
        base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8",
                **CLAUDE_QUIET}  # fmt: skip
        proxied = {
            **base,
            "HTTPS_PROXY": stack.proxy_url,
            "NODE_EXTRA_CA_CERTS": str(stack.proxy.ca),
            "ANTHROPIC_BASE_URL": f"https://{LLM}:{port}",
            "ANTHROPIC_API_KEY": f"umbra-placeholder:{ANTHROPIC_KEY_REF}",
        }
        direct = {
            **base,
            "NODE_EXTRA_CA_CERTS": str(origin_ca[0]),
            "ANTHROPIC_BASE_URL": f"https://127.0.0.1:{port}",
            "ANTHROPIC_API_KEY": ANTHROPIC_KEY,
        }
        samples: dict[str, list[float]] = {"direct": [], "through the proxy": []}
        try:
            for index in range(args.n + 1):  # the first round warms caches and is dropped
                for name, env in (("direct", direct), ("through the proxy", proxied)):
                    value = first_token(argv, env, work)
                    if index:
                        samples[name].append(value)
        finally:
            stack.stop()
            servers[0].shutdown()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, values in samples.items():
        print(f"{name:>18}: median {medians[name] * 1000:7.0f} ms  "
              f"min {min(values) * 1000:7.0f}  max {max(values) * 1000:7.0f}  (n={len(values)})")  # fmt: skip
    ratio = medians["through the proxy"] / medians["direct"]
    added = (medians["through the proxy"] - medians["direct"]) * 1000
    print(f"ratio proxy/direct: {ratio:.2f}  (Umbra adds {added:.0f} ms to the first token)")


if __name__ == "__main__":
    main()
