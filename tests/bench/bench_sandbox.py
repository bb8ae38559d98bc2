"""How long `cacheroute sandbox up` takes with cached binaries.

Runs `cacheroute sandbox up` (a fresh process each time, as a user would; the module form
`python -m cacheroute.sandbox.cli` when the entry point is not installed) RUNS times, each
followed by `down`, and reports the median wall time next to its own parts: the in-process
start-up time the sandbox records, and within it the moment kube-apiserver became ready (the
floor no sandbox start can beat). Writes bench-results/sandbox.json.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cacheroute.sandbox.binaries import GO_COMPONENTS, locate
from cacheroute.sandbox.cluster import STATE_FILE

RUNS = 3
TARGET_SECONDS = 20.0
_ENTRY_POINT = Path(sys.executable).parent / "cacheroute"
CLI = [str(_ENTRY_POINT), "sandbox"] if _ENTRY_POINT.is_file() else [sys.executable, "-m", "cacheroute.sandbox.cli"]


def one_run(state_dir: Path) -> dict[str, float]:
    started = time.monotonic()
    subprocess.run([*CLI, "up", "--state-dir", str(state_dir)], check=True, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - started
    state = json.loads((state_dir / STATE_FILE).read_text())
    stopping = time.monotonic()
    subprocess.run(
        [*CLI, "down", "--state-dir", str(state_dir)], check=True, capture_output=True, text=True, timeout=300
    )
    return {
        "cli_up_wall_s": wall,
        "in_process_up_s": float(state["startup_seconds"]),
        "apiserver_ready_s": float(state["phases"]["kube-apiserver ready"]),
        "down_wall_s": time.monotonic() - stopping,
    }


def main() -> None:
    for name, component in GO_COMPONENTS.items():
        if not component.on_demand:
            locate(name)  # fails early, naming what to build
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        for index in range(RUNS):
            runs.append(one_run(Path(tmp) / f"run{index}"))
            print(f"run {index + 1}: " + ", ".join(f"{k}={v:.2f}" for k, v in runs[-1].items()))
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    ratios = {
        "cli_up_vs_target": medians["cli_up_wall_s"] / TARGET_SECONDS,
        "cli_up_vs_in_process": medians["cli_up_wall_s"] / medians["in_process_up_s"],
        "in_process_up_vs_apiserver_ready": medians["in_process_up_s"] / medians["apiserver_ready_s"],
    }
    print(f"command: {' '.join(CLI)} up")
    print(f"median over {RUNS} runs: " + ", ".join(f"{k}={v:.2f}" for k, v in medians.items()))
    print("ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in ratios.items()))
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    (out / "sandbox.json").write_text(
        json.dumps(
            {"command": [*CLI, "up"], "runs": runs, "median": medians, "ratios": ratios, "target_s": TARGET_SECONDS},
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
