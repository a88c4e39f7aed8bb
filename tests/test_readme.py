"""The README's facts that code can check: its commands, its example, its tables."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from fovi_ref.check.bench import targets

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.DOTALL)


def test_quick_start_gives_two_commands_main_job_then_tests():
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", quick, flags=re.DOTALL).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    assert commands[0].endswith("python -m fovi_ref")
    assert commands[1].endswith("pytest --nbval")
    assert all("torch==2.13.0" in c for c in commands)


def test_targets_table_matches_the_code():
    rows = re.findall(r"^\| `([^`|]+)` \| <= ([0-9.]+) \|$", README, flags=re.MULTILINE)
    assert [(name, float(v)) for name, v in rows] == [(t.name, t.at_most) for t in targets.ALL]


def test_every_module_in_the_table_exists():
    table = README.split("## Where each idea lives", 1)[1].split("```", 1)[0]
    paths = re.findall(r"`(fovi_ref/[\w/.]+)`", table)
    assert len(paths) > 10
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing


def test_the_python_example_prints_what_its_comment_says():
    example = next(b for b in code_blocks("python") if "get_layer" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(example, {})  # the README's own example, as a reader would paste it
    comment = re.search(r"print\([^\n]*\) +# ([^\n]*)", example).group(1)
    assert out.getvalue().strip() == comment
