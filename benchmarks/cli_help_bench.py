"""`umbra --help` and every `umbra <command> --help` against the interpreter's own start-up,
measured side by side in one run.

The target is a median under 0.2 s on a developer machine for `umbra --help`: the top-level help
lists sub-commands from the static table in `umbra.cli.app` and renders with click's plain
formatter, so it imports no sub-command module and not rich. A sub-command's help imports its own
module and typer's rich help (~0.15 s of rich on its own), but nothing heavy: the Console app,
mitmproxy, Pulumi, httpx, pyOpenSSL, dcap-qvl and jinja2 load inside the commands that run
(`tests/cli/test_help_imports.py` asserts the imports). Each figure is the median of `--runs` runs
(default 5), interleaved so machine load affects all alike. Run:
    python benchmarks/cli_help_bench.py [--runs N] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from umbra.cli.app import COMMANDS, SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]
UMBRA = str(ROOT / ".venv" / "bin" / "umbra")
BASELINE = "python -c pass (baseline)"
CASES = {
    BASELINE: [sys.executable, "-c", "pass"],
    "python -c 'import typer'": [sys.executable, "-c", "import typer"],
    "umbra --help": [UMBRA, "--help"],
    **{f"umbra {name} --help": [UMBRA, name, "--help"] for name in sorted(SUBCOMMANDS)},
    **{f"umbra {name} --help": [UMBRA, name, "--help"] for name in sorted(COMMANDS)},
}


def _once(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=[], help="Command names to measure.")
    args = parser.parse_args()
    cases = {
        name: argv
        for name, argv in CASES.items()
        if name == BASELINE or not args.only or any(f" {o} " in name for o in args.only)
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, argv in cases.items():
            samples[name].append(_once(argv))
    baseline = statistics.median(samples[BASELINE])
    for name, times in samples.items():
        median = statistics.median(times)
        print(f"{name:34s} median {median * 1000:7.1f} ms  ({median / baseline:4.1f}x baseline)")


if __name__ == "__main__":
    main()
