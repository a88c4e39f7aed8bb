"""scripts/profile_layer.py runs as help(fovi_ref.check.bench) shows it and prints one table
per contender."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_layer.py"


def test_profile_layer_prints_every_contender_with_its_gemm_share():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "layer4.0.conv2", "--batch", "1", "5", "--calls", "2"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert out.startswith("platform ")  # the machine, before any figure
    assert out.count("layer4.0.conv2, batch ") == 2  # one table per batch
    for contender in ("routed (general)", "fovi einsum", "GEMM floor"):
        shares = re.findall(rf"  {re.escape(contender)}: \d+ us, GEMMs (\d+)%", out)
        assert len(shares) == 2 and all(0 < int(s) <= 100 for s in shares), (contender, out)
    # The floor is its three GEMMs and little else; the rows list operators with call counts.
    assert re.search(r"^    mm +3 calls", out, re.M)


def test_profile_layer_profiles_a_16_bit_dtype():
    command = [sys.executable, str(SCRIPT), "layer4.0.conv2", "--batch", "2", "--calls", "1"]
    out = subprocess.run(
        [*command, "--dtype", "bfloat16"], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert "layer4.0.conv2, batch 2, bfloat16, 1 calls each" in out


def test_profile_layer_names_an_unknown_layer():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "layer9.conv"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 2 and "unknown layer 'layer9.conv'" in run.stderr
    assert "Traceback" not in run.stderr
