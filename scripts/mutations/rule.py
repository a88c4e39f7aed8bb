"""The rule's mutation job: mutmut rewrites the tolerance rule one small change at a time, the
harness's own tests judge every mutant, and ``rule_record.json`` says what each one did.

    python scripts/mutations/rule.py                       # make rule-mutations: stale functions
    python scripts/mutations/rule.py 'fovi_ref.check.tolerances.x_gamma__mutmut_*'  # rerun these
    python scripts/mutations/rule.py --table               # the per-function table of the record
    python scripts/mutations/rule.py --no-run              # the record again, today's arguments
    python scripts/mutations/rule.py --sample 4 --seed 0   # CI: rerun a seeded sample of the record

**What is mutated** (:data:`FUNCTIONS`): the functions that compute the bound and the verdict,
``gamma``, ``_largest``, ``expected_quantities``, ``vacuous_stores``, ``accumulated_error``,
``_oracle_error``, ``error_bound``, ``nonfinite_stands``, ``_ratios`` and ``judge_elementwise``
in ``fovi_ref/check/tolerances.py``, every function of
``fovi_ref/check/magnitude.py``, and check_ops' comparing helpers (``_judge``,
``_first_offender``, ``_check_doors``, ``_check_padding``). Every backend verdict of the battery
rests on them: a loosened bound passes real bugs, a tightened one fails correct kernels.

**Where.** The backends' job owns ``mutants/`` and ``[tool.mutmut]`` in pyproject.toml; mutmut
reads its configuration from, and writes its cache to, the directory it runs in. So this job
runs it in its own work folder, ``mutants-rule/`` (git-ignored): a copy of ``fovi_ref/``,
``tests/`` and ``scripts/`` and a pyproject.toml whose ``[tool.mutmut]`` is :func:`mutmut_config`.
mutmut's cache is ``mutants-rule/mutants/``.

**The judge** is :data:`TESTS`, quickest file first (:mod:`rule_order`), without the two
slowest tests (:data:`SLOW`): mutmut runs, on each mutant, those of the tests that call the
mutated function and stops at the first failure. A mutant they all pass is *equivalent* where
``rule_equivalents.toml`` argues its change (no test can tell it from the original; an
argument names the change it is for, as the backends' do: ``run.argued``), else it runs
:data:`SLOW` (*killed*, ``by`` the slow test) and otherwise *survived*.
``tests/test_rule_mutations.py`` fails on a survivor and on an argument for a mutant the record
does not hold as equivalent. ``timeout`` and ``crashed`` count as killed.

**The record is keyed by function** (:mod:`keys`): per function the key of its code, per mutant
its verdict. mutmut runs file by file, the tolerance rule first, and the record is written
after each file, so that a run cut short keeps what it finished. A function whose code changed
since the record judged it, whose file's code outside functions changed, or that the record has
not judged whole yet, is *pending* (with its mutant count): the next run judges its mutants
again, and only those, since mutmut numbers a function's mutants by its own code alone.

**Time.** Most mutants die at the first of the rule's exact tests, in about a second; one the
quick tests pass costs the slow tests too (whole batteries). ``seconds_this_run`` in the record
is the wall time of the run that wrote it, and of nothing before.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path

from mutmut.stats import status_by_exit_code

sys.path.insert(0, str(Path(__file__).resolve().parent))
import keys  # noqa: E402  (the scripts beside this one are not a package)
import rule_order  # noqa: E402
import run  # noqa: E402

ROOT = run.ROOT
HERE = run.HERE
RECORD = HERE / "rule_record.json"
EQUIVALENTS = HERE / "rule_equivalents.toml"
WORK = ROOT / "mutants-rule"
MUTANTS = WORK / "mutants"
COPIED = ("fovi_ref", "tests", "scripts")
"""What the work folder holds besides its pyproject.toml (the tests load scripts/)."""

FUNCTIONS = {
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
        "shared_cell_meta",
        "binned_cells",
    ),
    "fovi_ref/check/check_ops.py": ("_judge", "_first_offender", "_check_doors", "_check_padding"),
}
"""The rule's functions, by file: every mutant of these is judged."""

TESTS = rule_order.TESTS
"""The judge: the harness's own tests, run quickest first (:mod:`rule_order`)."""
SLOW = [
    "tests/test_testing_check_ops.py::test_fovi_ref_backends_pass",
    "tests/test_testing_check_ops.py::test_einsum_baseline_differs_only_where_fovis_path_makes_inf_or_nan",
]
"""Left out of the judge: the two slowest of :data:`TESTS` (each runs whole batteries, 16 s and
8 s of the 30 s of the four files on one core); a mutant that survives the rest runs ``SLOW``
alone before it is called a survivor (:func:`second_stage`)."""

VERDICTS = ("killed", "timeout", "crashed", "equivalent", "survived")
"""The record's verdicts, in the table's column order (``timeout``: past mutmut's limit,
``crashed``: the worker died; both count as killed)."""


def quick_judge() -> list[str]:
    """pytest's arguments for :data:`TESTS` as mutmut runs them: quickest first, no :data:`SLOW`."""
    deselect = [arg for test in SLOW for arg in ("--deselect", test)]
    return ["-p", "scripts.mutations.rule_order", *deselect, *TESTS]


def mutmut_config() -> str:
    """The work folder's ``[tool.mutmut]``: the rule's files only, judged by :data:`TESTS`."""
    only = ", ".join(f'"{f}"' for f in FUNCTIONS)
    tests = ", ".join(f'"{t}"' for t in TESTS)
    args = ", ".join(f'"{arg}"' for arg in quick_judge()[: -len(TESTS)])
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


def prepare_work_folder() -> None:
    """``mutants-rule/`` as this checkout is now: :data:`COPIED` (files that differ), and the
    repo's pyproject.toml with its ``[tool.mutmut]`` replaced by :func:`mutmut_config` (the
    tests' pytest settings are kept)."""
    for top in COPIED:
        for path in (ROOT / top).rglob("*"):
            relative = path.relative_to(ROOT)
            copy = WORK / relative
            if not path.is_file() or "__pycache__" in relative.parts:
                continue
            if not copy.exists() or copy.read_bytes() != path.read_bytes():
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, copy)
    text = (ROOT / "pyproject.toml").read_text()
    head, found, tail = text.partition("\n[tool.mutmut]\n")
    rest = tail.partition("\n[")[2] if found else ""  # a section after the backends' config
    pyproject = head.rstrip() + "\n\n" + mutmut_config() + (f"\n[{rest}" if rest else "")
    (WORK / "pyproject.toml").write_text(pyproject)


def current_keys() -> dict[str, dict[str, str]]:
    """Per rule file, the key of each of its :data:`FUNCTIONS` and of its :data:`keys.MODULE`."""
    out = {}
    for source, names in FUNCTIONS.items():
        found = keys.file_keys(ROOT / source)
        out[source] = {n: found[n] for n in (*names, keys.MODULE)}
    return out


def stale_functions(record: dict, now: dict[str, dict[str, str]]) -> list[tuple[str, str]]:
    """``(file, function)`` whose mutants the record does not hold as the code is now: the
    function's key changed, or its file's :data:`keys.MODULE` (a constant may change what any
    function of the file computes), or the record has not judged it."""
    held = record.get("functions", {})
    stale = []
    for source, names in FUNCTIONS.items():
        old = held.get(source, {})
        module_same = old.get(keys.MODULE) == now[source][keys.MODULE]
        for name in names:
            if not (module_same and old.get(name) == now[source][name]):
                stale.append((source, name))
    return stale


def glob_of(source: str, function: str) -> str:
    """mutmut's names of ``function``'s mutants, as a glob: ``fovi_ref.check.tolerances.x_gamma
    __mutmut_*`` (a top-level function's mangled name is ``x_`` and its name)."""
    module = source.removesuffix(".py").replace("/", ".")
    return f"{module}.x_{function}__mutmut_*"


def mutmut_results() -> dict[str, tuple[str, int | None]]:
    """``{mutant: (file, exit code)}`` from the ``.meta`` files of the work folder's cache."""
    results = {}
    for source in FUNCTIONS:
        meta = MUTANTS / f"{source}.meta"
        if meta.exists():
            for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                results[name] = (source, code)
    return results


def second_stage(name: str) -> str | None:
    """The first of :data:`SLOW` that fails with mutant ``name`` switched on, or ``None``."""
    for test in SLOW:
        if run.pytest_fails(name, [test]):
            return test
    return None


def verdict_of(name: str, code: int | None, line: dict, arguments: dict) -> dict:
    """A mutant's ``line`` with its verdict from mutmut's exit code: for one the quick tests
    passed, equivalent where ``arguments`` argues its change (:func:`run.argued`), else
    :func:`second_stage` (``by``: the slow test that killed it)."""
    status = run.RENAMED.get(status_by_exit_code[code], status_by_exit_code[code])
    if status in run.KILLED:
        return line | {"verdict": status}
    if status not in ("survived", "not reached"):
        raise SystemExit(f"{name}: mutmut says {status!r}; rerun it")
    survivor = run.argued(name, line | {"verdict": "survived"}, arguments)
    if survivor["verdict"] != "survived":  # argued: no test can tell it from the original
        return survivor
    slow = second_stage(name)
    if slow is not None:
        return line | {"verdict": "killed", "by": slow}
    return survivor | ({"note": "no test calls it"} if code == 33 else {})


def load_record() -> dict:
    """The last record, or nothing where another mutmut made it (it numbers mutants otherwise)."""
    previous = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    return previous if previous.get("tool") == f"mutmut {version('mutmut')}" else {}


def run_job(names: list[str]) -> None:
    """File by file, the tolerance rule first: mutmut on the stale functions' mutants (or on
    the ``names`` in that file), then the record (:func:`write_record`), so that a run cut
    short keeps every file it finished."""
    start = time.monotonic()
    run.load_arguments(EQUIVALENTS)  # a malformed entry stops the job before mutmut runs
    prepare_work_folder()
    entered = set()
    for source in FUNCTIONS:
        previous = load_record()
        stale = [f for s, f in stale_functions(previous, current_keys()) if s == source]
        globs = [n for n in names if run.file_of(n) == source]
        globs = globs if names else [glob_of(source, function) for function in stale]
        if globs:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            command = [sys.executable, "-m", "mutmut", "run", "--max-children", "1", *globs]
            subprocess.run(command, cwd=WORK, env=env, check=True)
            entered.add(source)
        write_record(previous, entered, start)


def write_record(previous: dict, entered: set[str], start: float) -> None:
    """The record: for the files mutmut ran on (``entered``), every function all of whose
    mutants it has judged, from its cache; for every other function, the last record's lines
    where its code is unchanged; anything else is pending (its mutant count)."""
    now = current_keys()
    stale = set(stale_functions(previous, now))
    equivalents = run.load_arguments(EQUIVALENTS)
    codes: dict[tuple[str, str], dict[str, int | None]] = {}
    for name, (source, code) in mutmut_results().items():
        codes.setdefault((source, keys.function_of(name)), {})[name] = code
    old = previous.get("mutants", {})
    cwd = Path.cwd()
    os.chdir(WORK)  # mutmut's diff reads mutants/ from the working directory
    run.MUTANTS = MUTANTS  # run.py's helpers work on the mutants/ its MUTANTS names
    mutants, functions, pending = {}, {s: {keys.MODULE: now[s][keys.MODULE]} for s in now}, {}
    for source, names in FUNCTIONS.items():
        for function in names:
            found = codes.get((source, function), {})
            if source in entered and found and None not in found.values():
                for name, code in sorted(found.items()):
                    mutants[name] = judged_line(name, source, function, code, old, equivalents)
            elif (source, function) not in stale:
                lines = {
                    n: m for n, m in old.items() if (m["file"], m["function"]) == (source, function)
                }
                mutants |= {n: run.argued(n, m, equivalents) for n, m in lines.items()}
            else:
                pending[f"{source}::{function}"] = len(found)
                continue
            functions[source][function] = now[source][function]
    os.chdir(cwd)
    record = {
        "tool": f"mutmut {version('mutmut')}",
        "tests": TESTS,
        "functions": functions,
        "pending": pending,
        "seconds_this_run": round(time.monotonic() - start),
        "mutants": dict(sorted(mutants.items())),
    }
    RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(table(record), flush=True)


def judged_line(
    name: str, source: str, function: str, code: int, old: dict, arguments: dict
) -> dict:
    """The record's line of a mutant mutmut judged: where, what, and its verdict. One the quick
    tests passed goes through :func:`verdict_of`, unless the last record says a slow test
    killed the same change (a second stage costs whole batteries). A survivor or an equivalent
    line is judged again: an equivalent one never ran the second stage, and a survivor is a
    finding worth the batteries."""
    line_no, change = run.change_of(name, source)
    line = {"file": source, "function": function, "line": line_no, "change": change}
    last = old.get(name, {})
    if code == 0 and last.get("change") == change and "by" in last:
        return line | {"verdict": last["verdict"], "by": last["by"]}
    return verdict_of(name, code, line, arguments)


def table(record: dict) -> str:
    """Per function: mutants, killed (``timeout`` and ``crashed`` among them), equivalent,
    survived; and functions pending (changed since the record judged them)."""
    head = ("function", "mutants", "killed", "equivalent", "survived")
    now = current_keys()
    pending = set(stale_functions(record, now))
    rows = []
    for source, names in FUNCTIONS.items():
        for name in names:
            verdicts = [
                m["verdict"]
                for m in record["mutants"].values()
                if (m["file"], m["function"]) == (source, name)
            ]
            killed = sum(v in run.KILLED for v in verdicts)
            label = f"{Path(source).stem}.{name}" + (
                " (pending)" if (source, name) in pending else ""
            )
            rows.append(
                [
                    label,
                    len(verdicts),
                    killed,
                    verdicts.count("equivalent"),
                    verdicts.count("survived"),
                ]
            )
    rows.append(["all", *(sum(r[i] for r in rows) for i in range(1, len(head)))])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def score(record: dict) -> dict[str, int]:
    """The README's figures: ``killed`` out of ``judged`` (the mutants not argued equivalent),
    and ``equivalent``."""
    verdicts = Counter(m["verdict"] for m in record["mutants"].values())
    equivalent = verdicts["equivalent"]
    killed = sum(verdicts[v] for v in run.KILLED)
    return {
        "killed": killed,
        "judged": sum(verdicts.values()) - equivalent,
        "equivalent": equivalent,
    }


def run_sample(size: int, seed: int) -> int:
    """Rerun ``size`` killed mutants of the record, drawn with ``seed`` among the functions it
    holds as they are now: each must still fail the judge (:func:`quick_judge`, or the slow
    test the record says killed it)."""
    record = json.loads(RECORD.read_text())
    pending = set(stale_functions(record, current_keys()))
    killed = sorted(
        n
        for n, m in record["mutants"].items()
        if m["verdict"] == "killed" and (m["file"], m["function"]) not in pending
    )
    prepare_work_folder()
    os.chdir(WORK)  # mutmut generates its mutants/ in the working directory
    run.MUTANTS = MUTANTS  # run.py's helpers work on the mutants/ its MUTANTS names
    run.generate_mutants()
    disagree = 0
    size = min(size, len(killed))  # every function may be pending: then nothing is sampled
    for name in random.Random(seed).sample(killed, size):
        slow = record["mutants"][name].get("by")  # killed by one of SLOW alone
        failed = run.pytest_fails(name, [slow] if slow else quick_judge())
        disagree += not failed
        print(f"{'killed' if failed else 'NOT KILLED':<10} {name}", flush=True)
    print(f"{size - disagree} of {size} sampled mutants of the rule are killed, as recorded")
    return int(disagree > 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutant globs, e.g. 'fovi_ref.check.*gamma*'")
    parser.add_argument("--sample", type=int, help="rerun this many killed mutants (CI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table", action="store_true", help="print the record's table")
    parser.add_argument("--no-run", action="store_true", help="rewrite the record, run nothing")
    args = parser.parse_args(argv)
    if args.table:
        record = json.loads(RECORD.read_text())
        print(table(record))
        print(score(record))
        return 0
    if args.sample:
        return run_sample(args.sample, args.seed)
    if args.no_run:  # today's arguments applied to the record's lines
        write_record(load_record(), set(), time.monotonic())
        return 0
    run_job(args.names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
