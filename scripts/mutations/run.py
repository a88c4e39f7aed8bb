"""The two mutation jobs, configurations of one engine (``engine.py``, which says how a run,
a record and CI's sample work), and their command line::

    python scripts/mutations/run.py backends [--table | --sample N --seed S | MUTANT_GLOB ...]
    python scripts/mutations/run.py rule     [--table | --sample N --seed S | MUTANT_GLOB ...]

**backends** (``make mutations``, record ``record.json``, arguments ``equivalents.toml``): the
files ``[tool.mutmut] only_mutate`` names in pyproject.toml, every function of them, mutmut run in
the repository (its cache ``mutants/``). The first stage is ``judge.py``: the default battery of
the backend that judges the mutated function, paths this CPU never takes forced. The second stage:
the unit tests of the file (:data:`UNIT_TESTS`, ``killed_test``), then the ``--full`` battery's
other graphs (``killed_full``), the slowest. A mutant no test can tell apart is argued
``equivalent``, or ``cuda_only`` where it differs on CUDA alone (``on_cuda.py`` judges those on a
GPU).

**rule** (``make rule-mutations``, record ``rule_record.json``, arguments
``rule_equivalents.toml``): the functions of the tolerance rule that compute the bound and the
verdict (:data:`RULE_FUNCTIONS`); every backend verdict rests on them, so a looser bound that
passes a real bug and a tighter one that fails a correct kernel must both fail a test. mutmut
runs in its own work folder, ``mutants-rule/`` (git-ignored; :func:`prepare_rule_folder`), with
a ``[tool.mutmut]`` of its own (:func:`rule_mutmut_config`). The first stage is the harness's
tests, quickest file first (``rule_order.py``), without the two slowest (:data:`SLOW`); the
second stage is those two (a kill there is ``killed`` too, ``by`` the test).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # engine.py beside it: no package
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine  # noqa: E402
import rule_order  # noqa: E402
from engine import HERE, KILLED, ROOT, Job, Stage  # noqa: E402

JUDGE = "scripts/mutations/judge.py"
UNIT_TESTS = {
    "fovi_ref/knn_general.py": ["tests/test_backends.py", "tests/test_precision.py"],
    "fovi_ref/segment_sum.py": ["tests/test_segment_sum.py"],
    "fovi_ref/knn_gather_gemm.py": ["tests/test_gather_gemm.py"],
    "fovi_ref/knn_einsum_baseline.py": ["tests/test_backends.py"],
    "fovi_ref/strategies/__init__.py": ["tests/test_strategies.py", "tests/test_precision.py"],
    "fovi_ref/strategies/channel_blocks.py": ["tests/test_strategies.py"],
    "fovi_ref/strategies/few_columns.py": ["tests/test_strategies.py"],
    "fovi_ref/strategies/node_rows.py": ["tests/test_strategies.py"],
    "fovi_ref/strategies/occupied_cells.py": ["tests/test_strategies.py"],
    "fovi_ref/layout.py": [
        "tests/test_custom_op.py",  # in_fovi_layout: what compiled code reads
        "tests/test_precision.py",  # padded_rows: what a bfloat16 GEMM reads
        "tests/test_backends.py",
    ],
    "fovi_ref/knn_autograd.py": [
        "tests/test_custom_op.py",
        "tests/test_eager_function.py",
        "tests/test_testing_check_ops.py",  # the doors with a backend of the bare protocol
    ],
    "fovi_ref/precision.py": ["tests/test_precision.py"],
}
"""The unit tests that hold each of the backends' files: their second stage after ``--full``."""
WHERE = ("backend", "graph", "dtype", "check", "quantity")
"""What a kill by the default battery names, and a rerun in CI's sample must find again."""


def mutated_files() -> list[str]:
    """The files ``[tool.mutmut] only_mutate`` names, globs expanded, sorted."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    found = {str(p.relative_to(ROOT)) for g in config["only_mutate"] for p in ROOT.glob(g)}
    return sorted(f for f in found if f.endswith(".py"))


def backend_stages(source: str) -> list[Stage]:
    """The file's unit tests, most pointed first, then the ``--full`` battery's other graphs
    (the judge skips but one backend): the battery is the slowest step and the last resort."""
    full = Stage("killed_full", (JUDGE,), {"MUTATION_BATTERY": "full"})
    return [*(Stage("killed_test", (test,)) for test in UNIT_TESTS[source]), full]


def backend_rerun(name: str, line: dict) -> tuple[list[str], dict[str, str]]:
    """The judge, for a pending mutant (``line`` empty: it picks its backend from mutmut's stats)
    or for a recorded kill: the backend the record says killed it, without the path the judge
    forced (another backend's doors: the home backend, whose battery runs first)."""
    if not line:
        return [JUDGE], {}
    import judge  # torch and fovi_ref: only where a kill is judged again

    backend = line["by"]["backend"]
    for path in judge.PATHS:
        backend = backend.removesuffix(path)
    if backend.endswith(judge.DOORS):
        backend = judge.HOME[engine.module_of(name)]
    return [f"{JUDGE}::test_default_battery[{backend}]"], {"MUTATION_JUDGE": backend}


def backend_same_row(row: dict | None, line: dict) -> bool:
    """Whether the judge failed ``row`` at the graph, dtype, check and quantity ``line`` names."""
    return row is not None and all(row[k] == line["by"][k] for k in WHERE)


BACKENDS = Job(
    name="backends",
    record=HERE / "record.json",
    equivalents=HERE / "equivalents.toml",
    work=ROOT,
    files=dict.fromkeys(mutated_files()),
    judge=(JUDGE,),
    second_stage=backend_stages,
    rerun=backend_rerun,
    same_row=backend_same_row,
    columns=(
        ("default battery", KILLED),
        ("only --full", ("killed_full",)),
        ("only a test", ("killed_test",)),
        ("equivalent", ("equivalent",)),
        ("CUDA only", ("cuda_only",)),
        ("survived", ("survived",)),
    ),
    by_function=False,
    children=2,
    prepare=lambda: None,  # mutmut reads the repository's own pyproject.toml
)

# ------------------------------------------------------------------------------------ rule
RULE_FUNCTIONS = {
    "fovi_ref/check/tolerances.py": (
        "gamma",
        "_largest",
        "expected_quantities",
        "vacuous_stores",
        "accumulated_error",
        "_oracle_error",
        "error_bound",
        "nonfinite_stands",
        "_ratios",
        "judge_elementwise",
    ),
    "fovi_ref/check/magnitude.py": (
        "oracle_quantities",
        "knn_conv_magnitude",
        "knn_conv_term_counts",
        "fan_out",
        "shared_cell_meta",
        "binned_cells",
    ),
    "fovi_ref/check/check_ops.py": ("_judge", "_first_offender", "_check_doors", "_check_padding"),
}
"""The rule's functions, by file: every mutant of these is judged."""
RULE_WORK = ROOT / "mutants-rule"
SLOW = (
    "tests/test_testing_check_ops.py::test_fovi_ref_backends_pass",
    "tests/test_testing_check_ops.py::test_einsum_baseline_differs_only_where_fovis_path_makes_inf_or_nan",
)
"""The two slowest of the rule's tests (whole batteries, 16 s and 8 s of the 30 s of the four
files on one core): its second stage, run only on a mutant the others pass."""


def quick_judge() -> list[str]:
    """pytest's arguments for the rule's first stage: quickest first, no :data:`SLOW`."""
    deselect = [arg for test in SLOW for arg in ("--deselect", test)]
    return ["-p", "scripts.mutations.rule_order", *deselect, *rule_order.TESTS]


def rule_mutmut_config() -> str:
    """The rule's ``[tool.mutmut]``: its files, judged by the first stage's tests."""
    only = ", ".join(f'"{f}"' for f in RULE_FUNCTIONS)
    tests = ", ".join(f'"{t}"' for t in rule_order.TESTS)
    args = ", ".join(f'"{arg}"' for arg in quick_judge()[: -len(rule_order.TESTS)])
    return f"""[tool.mutmut]
source_paths = ["fovi_ref"]
only_mutate = [{only}]
# As in the backends' job: a raise statement's message is wording, which tests/ holds.
do_not_mutate_patterns = ['^\\s*raise ']
also_copy = ["scripts"]
pytest_add_cli_args_test_selection = [{tests}]
pytest_add_cli_args = [{args}]
process_isolation = "forkserver"
# A mutant is stopped after (E + 60) s of wall time, E the clean time of the tests that call
# its function: one that makes a test loop forever is cut off, none that merely runs is.
timeout_constant = 60
timeout_multiplier = 1.0
"""


def prepare_rule_folder() -> None:
    """``mutants-rule/`` as this checkout is now: fovi_ref, the tests and the scripts (the files
    that differ), and the repository's pyproject.toml with its ``[tool.mutmut]`` replaced by
    :func:`rule_mutmut_config` (the tests' pytest settings are kept)."""
    engine.copy_changed(RULE_WORK)
    head, found, tail = (ROOT / "pyproject.toml").read_text().partition("\n[tool.mutmut]\n")
    rest = tail.partition("\n[")[2] if found else ""  # a section after the backends' config
    text = head.rstrip() + "\n\n" + rule_mutmut_config() + (f"\n[{rest}" if rest else "")
    (RULE_WORK / "pyproject.toml").write_text(text)


def rule_rerun(name: str, line: dict) -> tuple[list[str], dict[str, str]]:
    """A recorded kill by a slow test: that test; else the first stage."""
    slow = (line.get("by") or {}).get("test")
    return ([slow] if slow else quick_judge()), {}


RULE = Job(
    name="rule",
    record=HERE / "rule_record.json",
    equivalents=HERE / "rule_equivalents.toml",
    work=RULE_WORK,
    files=RULE_FUNCTIONS,
    judge=tuple(rule_order.TESTS),
    second_stage=lambda source: [Stage("killed", (test,)) for test in SLOW],
    rerun=rule_rerun,
    same_row=lambda row, line: True,  # the rule's tests name no row: failing is the verdict
    columns=(("killed", KILLED), ("equivalent", ("equivalent",)), ("survived", ("survived",))),
    by_function=True,
    children=1,
    prepare=prepare_rule_folder,
)

JOBS = {"backends": BACKENDS, "rule": RULE}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("job", choices=sorted(JOBS), help="which configuration")
    parser.add_argument("names", nargs="*", help="mutant globs, e.g. 'fovi_ref.layout.*'")
    parser.add_argument("--sample", type=int, help="judge this many mutants, pending first (CI)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--cap-seconds", type=float, default=240, help="no sampled mutant after")
    parser.add_argument("--table", action="store_true", help="the record's table, pending now")
    parser.add_argument("--no-run", action="store_true", help="the record from mutmut's cache")
    args = parser.parse_args(argv)
    job = JOBS[args.job]
    if args.table:
        record = engine.load_record(job)
        print(engine.table(job, record))
        print(engine.score(record), "read from", record.get("sources"))
        waiting = engine.pending_now(job, record)
        print(f"pending now ({len(waiting)} functions changed since): {', '.join(waiting)}")
        return 0
    if args.sample:
        return engine.run_sample(job, args.sample, args.seed, args.cap_seconds)
    engine.run_job(job, args.names, run=not args.no_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
