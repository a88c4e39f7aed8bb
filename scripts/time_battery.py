"""How long ``python -m fovi_ref check`` takes on this machine, for the times it announces.

    .venv/bin/python scripts/time_battery.py          # make battery-times

Runs ``python -m fovi_ref check einsum_baseline`` (a plain-PyTorch backend) with the default
battery and with ``--full``, one after another, as a user would (torch's default threads), and
writes their wall times, the core count and the load average to
``fovi_ref/check/battery_times.json``. ``check --help`` and the README state those times
(``fovi_ref.check.check_command.DEFAULT_SECONDS`` and ``FULL_SECONDS``), and
``tests/test_check_command.py`` holds them to this record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "fovi_ref" / "check" / "battery_times.json"


def timed(*options: str) -> float:
    """Wall seconds of one ``check einsum_baseline`` run (which must pass but for its
    documented departures, so its exit status is not asked for)."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "fovi_ref", "check", "einsum_baseline", *options]
    subprocess.run(command, cwd=ROOT, capture_output=True, check=False)
    return round(time.perf_counter() - start, 1)


def main() -> int:
    record = {
        "command": "python -m fovi_ref check einsum_baseline [--full]",
        "cores": os.cpu_count(),
        "load_before": os.getloadavg()[0],
        "default_seconds": timed(),
        "full_seconds": timed("--full"),
    }
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
