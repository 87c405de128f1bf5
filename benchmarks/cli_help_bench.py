"""`umbra --help` start-up against the interpreter's own start-up, measured side by side in one run.

The target is a median under 0.2 s on a developer machine: the top-level help lists sub-commands
from the static table in `umbra.cli.app` and renders with click's plain formatter, so it imports no
sub-command module and not rich. Each figure is the median of `--runs` runs (default 10),
interleaved so machine load affects all alike. Run:
    python benchmarks/cli_help_bench.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UMBRA = str(ROOT / ".venv" / "bin" / "umbra")
CASES = {
    "python -c pass (baseline)": [sys.executable, "-c", "pass"],
    "python -c 'import typer'": [sys.executable, "-c", "import typer"],
    "umbra --help": [UMBRA, "--help"],
    "umbra profile --help": [UMBRA, "profile", "--help"],
}


def _once(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.runs):
        for name, argv in CASES.items():
            samples[name].append(_once(argv))
    baseline = statistics.median(samples["python -c pass (baseline)"])
    for name, times in samples.items():
        median = statistics.median(times)
        print(f"{name:30s} median {median * 1000:7.1f} ms  ({median / baseline:4.1f}x baseline)")


if __name__ == "__main__":
    main()
