"""`umbra` → Claude Code's first streamed token in the local Dev CVM's sandbox, against the
stand-in model API, through the real path: `umbra up` (the stack, the sandbox under runc, the
forwarder, the Security CVM with the stand-in profiles), then per sample

- through the CLI: `umbra ssh -- env … claude -p 'say hi' --output-format stream-json
  --include-partial-messages --verbose` on the developer's side (the Console's session info,
  the attested SSH ingress, sshd, the sandbox's login environment; `umbra claude` takes the same
  path and adds dtach, whose attach is `benchmarks/session_bench.py`), with OpenSSH connection
  reuse (ControlMaster), `umbra claude`'s default;
- baseline: the same argv started inside the sandbox directly (nsenter, the same login
  environment), no CLI, no SSH;

both through the forwarder and the Security CVM's proxy (the key injected, the placeholder in
the sandbox), interleaved, the clock stopped at the first `text_delta` line. The first round
warms caches and is dropped. `umbra claude -p` itself does not exist: `umbra claude` is the
interactive attach, whose first token needs a human's prompt.

Run (root, the sandbox image cached): .venv/bin/python benchmarks/claude_attach_bench.py [-n N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
UMBRA = str(ROOT / ".venv" / "bin" / "umbra")

from umbra.cli import up_stack  # noqa: E402
from umbra.cli.up_agents import agent_commands  # noqa: E402
from umbra.cli.up_check import llm_endpoints  # noqa: E402
from umbra.sandbox import local_cvm  # noqa: E402


def first_token(argv: list[str], env: dict[str, str] | None) -> float:
    started = time.perf_counter()
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    elapsed = None
    for line in process.stdout:
        if '"text_delta"' in line:
            elapsed = time.perf_counter() - started
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    errors = process.stderr.read()[-800:]
    process.wait()
    if elapsed is None:
        raise SystemExit(f"{' '.join(argv[:4])}: claude streamed no text\n{errors}")
    return elapsed


def _base() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return min(int(sock.getsockname()[1]), 60000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=7)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("claude_attach_bench needs root (umbra up creates namespaces)")
    with tempfile.TemporaryDirectory(prefix="umbra-claude-bench-") as tmp:
        env = {
            **os.environ,
            "XDG_CONFIG_HOME": f"{tmp}/config",
            "HOME": tmp,
            "TMPDIR": tmp,
            "UMBRA_UP_NAME_PREFIX": f"ucb{os.getpid() % 10000}",
        }
        for opt_in in ("UMBRA_STATE_DIR", "UMBRA_SIMULATED_PKI", "UMBRA_SSH_IDENTITY"):
            env.pop(opt_in, None)
        base = _base()
        where = ["--state-dir", f"{tmp}/state", "--port-base", str(base)]
        samples: dict[str, list[float]] = {"in the sandbox": [], "umbra ssh (CLI)": []}
        try:
            done = subprocess.run([UMBRA, "up", *where], env=env, capture_output=True,
                                  text=True, timeout=900)  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"umbra up failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            stack = up_stack.Stack(Path(tmp) / "state", base)
            stack.load()
            cvm = stack.state["dev_cvm_id"]
            plan = local_cvm.load_plan(stack.p("cvms"), cvm)
            assert plan is not None
            claude = agent_commands(llm_endpoints(stack))[0]
            argv = [
                "env", *(f"{k}={v}" for k, v in claude.env.items()),
                "claude", "-p", "say hi", "--output-format", "stream-json",
                "--include-partial-messages", "--verbose",
            ]  # fmt: skip
            ways = (
                ("in the sandbox", local_cvm.run_argv(plan, argv), None),
                ("umbra ssh (CLI)", [UMBRA, "ssh", cvm, "--", *argv], env),
            )
            for index in range(args.n + 1):
                for name, command, command_env in ways:
                    value = first_token(command, command_env)
                    if index:
                        samples[name].append(value)
        finally:
            for pid_file in Path(tmp).glob("umbra-ssh-*/agent-*.pid"):
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            subprocess.run([UMBRA, "down", *where], env=env, capture_output=True, timeout=300)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, values in samples.items():
        print(f"{name:>16}: median {medians[name] * 1000:6.0f} ms  "
              f"min {min(values) * 1000:6.0f}  max {max(values) * 1000:6.0f}  (n={len(values)})")  # fmt: skip
    cli, inside = medians["umbra ssh (CLI)"], medians["in the sandbox"]
    print(
        f"ratio CLI/in-sandbox: {cli / inside:.2f}  (the CLI's path adds {(cli - inside) * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    main()
