"""The mutation job: mutmut rewrites the op's backends one small change at a time, the default
battery judges every mutant, and ``record.json`` says what killed each one.

    python scripts/mutations/run.py                      # make mutations: judge the pending
    python scripts/mutations/run.py [MUTANT_GLOB ...]    # judge these mutants again
    python scripts/mutations/run.py --table              # the record's table; pending now
    python scripts/mutations/run.py --sample 8 --seed 0  # CI: pending first, then the record's
    python scripts/mutations/run.py --no-run             # the record from mutmut's cache

**Verdicts follow functions** (:mod:`keys`). The record keys every mutant by the function it
mutates, and stores each function's key: the hash of its code, docstrings and comments left out;
the rest of its file is one more key, ``<module>``. A verdict stands while its own function and
its file's ``<module>`` are unchanged, even if a function it calls has changed: a docstring or a
comment edit leaves every verdict standing, and a code change leaves the other functions'
standing. A function whose key differs from the record's (or that the record does not have) is
*pending*: its mutants are judged by the next ``make mutations``, and until then nothing fails;
``--table`` and CI's sample say what is pending.

**The run.** ``make mutations`` judges the pending functions only, from a fresh clone too.
``mutmut run`` (its configuration is ``[tool.mutmut]`` in pyproject.toml) copies ``fovi_ref`` to
``mutants/``, where each function of the mutated files can switch to any of its mutants, and runs
the judge (``judge.py``) on each mutant of a pending function, against the backends that call
that function, stopping at the first that fails. Which backend calls which function is mutmut's
*stats*: a fresh clone takes them from the record (:func:`seed_stats`) instead of running every
battery once to learn them, unless a pending function is not in them. Two mutants run at a time,
one thread each. ``mutants/`` is mutmut's cache and git-ignored.

**Past the default battery.** A mutant the default battery passes is run again on what else the
repo has, and the record says which killed it:

1. the ``--full`` battery's other graphs (the random graphs, res18's layers of each kind);
2. the unit tests of the mutated file (:data:`UNIT_TESTS`).

A mutant none of these kills is *equivalent* or differs *on CUDA only*, with its argument in
``equivalents.toml`` (which names the change it argues: :func:`argued`), or it *survived*.
``tests/test_mutations.py`` fails on a survivor and on an argument whose mutant is not one of
those; it never fails on pending functions.

**Verdicts** in the record: ``killed`` (``by`` the default battery: backend and path, graph,
dtype, check, quantity), ``timeout`` (the judge ran past mutmut's limit: an endless or far slower
backend), ``crashed`` (the worker died), ``killed_full``, ``killed_test``, ``equivalent``,
``cuda_only``, ``survived``. ``not reached`` (no judged backend calls the function) goes to the
second stage like a survivor. A function some of whose mutants mutmut has not run is listed in
``pending`` with its mutant count, and none of its mutants is in the record.

**Time.** A killed mutant costs seconds, one the battery passes a whole battery (for a plain
backend, ``fovi_ref/check/battery_times.json`` has the default battery's time on two threads),
then the second stage. ``seconds_this_run`` in the record is the wall time of the run that
wrote it, and of nothing before.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatch
from importlib.metadata import version
from pathlib import Path

from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "scripts" / "mutations"


def load_sibling(name: str):
    """``scripts/mutations/<name>.py`` as a module: this script is also loaded by path (the
    tests' ``load_script``), where its folder is not on ``sys.path``."""
    spec = importlib.util.spec_from_file_location(f"mutation_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


keys = load_sibling("keys")
RECORD = HERE / "record.json"
EQUIVALENTS = HERE / "equivalents.toml"
MUTANTS = ROOT / "mutants"
JUDGE = "scripts/mutations/judge.py"

# The unit tests that hold each mutated file, run on a mutant the batteries pass.
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
        "tests/test_backends.py",
        "tests/test_custom_op.py",  # in_fovi_layout: what compiled code reads
        "tests/test_precision.py",  # padded_rows: what a bfloat16 GEMM reads
    ],
    "fovi_ref/knn_autograd.py": [
        "tests/test_custom_op.py",
        "tests/test_eager_function.py",
        "tests/test_testing_check_ops.py",  # the doors with a backend of the bare protocol
    ],
}
RENAMED = {"segfault": "crashed", "no tests": "not reached"}
"""mutmut's words for a mutant's status (``mutmut.stats.status_by_exit_code``) that the record
says otherwise: a worker that died, and a function no judged backend calls."""
CUDA_ONLY = "CPU only:"
"""How an argument in equivalents.toml starts when the mutant differs on CUDA alone."""
WHERE = ("backend", "graph", "dtype", "check", "quantity")
"""What a killing verdict names, and a rerun must find again."""
KILLED = ("killed", "timeout", "crashed")
SECOND_STAGE = ("killed_full", "killed_test")
ARGUED = ("equivalent", "cuda_only")
COLUMNS = ("killed_full", "killed_test", "equivalent", "cuda_only", "survived")
"""The verdicts the table counts beside the default battery's kills, in its column order."""


def mutated_files() -> list[str]:
    """The files ``[tool.mutmut] only_mutate`` names, globs expanded, sorted."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    found = {str(p.relative_to(ROOT)) for g in config["only_mutate"] for p in ROOT.glob(g)}
    return sorted(f for f in found if f.endswith(".py"))


def module_of(mutant: str) -> str:
    """The module of a mutmut name: ``fovi_ref.segment_sum.x_f__mutmut_3`` is
    ``fovi_ref.segment_sum``."""
    return mutant.rpartition("__mutmut_")[0].rpartition(".")[0]


def file_of(mutant: str) -> str:
    """The mutated file of a mutmut name (a package's module is its ``__init__.py``)."""
    module = module_of(mutant).replace(".", "/")
    return f"{module}.py" if (ROOT / f"{module}.py").exists() else f"{module}/__init__.py"


def function_keys_now() -> dict[str, str]:
    """``{"file::function": key}`` of every function of the mutated files, and each file's
    ``file::<module>`` (:func:`keys.function_keys`)."""
    return {
        f"{source}::{function}": key
        for source in mutated_files()
        for function, key in keys.file_keys(ROOT / source).items()
    }


def function_id(mutant: str) -> str:
    """``"file::function"`` of a mutmut name, as :func:`function_keys_now` keys it."""
    return f"{file_of(mutant)}::{keys.function_of(mutant)}"


def current_in(record: dict, function: str, now: dict[str, str]) -> bool:
    """Whether ``record`` judged ``function`` (``"file::function"``) as its code is ``now``: the
    same key for it and for its file's ``<module>``, made by the same mutmut (which numbers the
    mutants), and not pending there."""
    module = f"{function.partition('::')[0]}::{keys.MODULE}"
    judged = record.get("functions", {})
    same = all(now.get(f) is not None and judged.get(f) == now[f] for f in (function, module))
    made_alike = record.get("tool") == f"mutmut {version('mutmut')}"
    return same and made_alike and function not in record.get("pending", {})


def env_for(mutant: str, **extra: str) -> dict[str, str]:
    """The environment that runs ``mutant`` from ``mutants/``: its copy of fovi_ref first."""
    here = {"MUTANT_UNDER_TEST": mutant, "PYTHONPATH": str(MUTANTS), "OMP_NUM_THREADS": "1"}
    return {**os.environ, **here, **extra}


def pytest_fails(mutant: str, args: list[str], **extra: str) -> bool:
    """Whether pytest, run from ``mutants/`` with ``mutant`` switched on, fails."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "--rootdir=.", "-p", "no:cacheprovider"]
    env = env_for(mutant, **extra)
    done = subprocess.run(command + args, cwd=MUTANTS, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"pytest could not run for {mutant}:\n{done.stdout[-2000:]}")
    return done.returncode == 1


def sync_unmutated() -> None:
    """Copy fovi_ref's files that are not mutated (the harness, the judge's battery) and the
    tests (the second stage's) into ``mutants/`` where they differ: mutmut copies a source file
    there only once, and the tests only when it runs. A harness change can change verdicts that
    mutmut's cache keeps; ``rm -rf mutants`` and a whole ``make mutations`` judge everything
    again."""
    mutated = set(mutated_files())
    for path in [*(ROOT / "fovi_ref").rglob("*"), *(ROOT / "tests").rglob("*")]:
        relative = str(path.relative_to(ROOT))
        copy = MUTANTS / relative
        if not path.is_file() or "__pycache__" in relative or relative in mutated:
            continue
        if not copy.exists() or copy.read_bytes() != path.read_bytes():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, copy)


# ------------------------------------------------------------------------ reading mutmut's cache
def mutmut_results() -> dict[str, tuple[str, int | None]]:
    """``{mutant: (file, exit code)}`` from mutmut's ``.meta`` files."""
    results = {}
    for meta in MUTANTS.glob("fovi_ref/**/*.py.meta"):
        source = str(meta.relative_to(MUTANTS)).removesuffix(".meta")
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            results[name] = (source, code)
    return results


def change_of(mutant: str, source: str) -> tuple[int, str]:
    """``(line in the original file, one-line description)`` of a mutant, from mutmut's diff."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    diff = get_diff_for_mutant(mutant, path=source)  # reads mutants/ from ROOT (see main)
    removed = [line[1:] for line in diff.splitlines()[2:] if line.startswith("-")]
    added = [line[1:] for line in diff.splitlines()[2:] if line.startswith("+")]
    line = function_line_of(source, mutant, removed[0].strip() if removed else "")
    before, after = (" / ".join(s.strip() for s in side) for side in (removed, added))
    return line, f"{before}  ->  {after}"


def function_line_of(source: str, mutant: str, text: str) -> int:
    """The line of ``text`` inside the mutated function of ``source`` (its first line if none)."""
    name = keys.function_of(mutant).rpartition(".")[2]
    lines = (ROOT / source).read_text().splitlines()
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            for number in range(node.lineno, node.end_lineno + 1):
                if text and text in lines[number - 1]:
                    return number
            return node.lineno
    return 0


def verdict_of(mutant: str) -> dict | None:
    """The judge's note of the first failed row, where the default battery killed ``mutant``."""
    path = MUTANTS / "judge_verdicts" / f"{mutant}.json"
    return json.loads(path.read_text()) if path.exists() else None


# ----------------------------------------------------------------------------- second stage
def second_stage(mutant: str, source: str) -> tuple[str, dict]:
    """``(verdict, by)`` for a mutant the default battery passed."""
    if pytest_fails(mutant, [JUDGE], MUTATION_BATTERY="full"):  # the judge skips but one
        return "killed_full", verdict_of(mutant)
    for test_file in UNIT_TESTS[source]:
        if pytest_fails(mutant, [test_file]):
            return "killed_test", {"test": test_file}
    return "survived", {}


# ---------------------------------------------------------------------------------- the job
def run_job(names: list[str], run: bool = True) -> None:
    """mutmut run on ``names`` (none: the mutants of every pending function; ``run`` False:
    mutmut's cache as it is), then the second stage for the survivors, then the record."""
    start = time.monotonic()
    equivalents = load_arguments(EQUIVALENTS)  # first: a malformed entry stops the job here
    previous = json.loads(RECORD.read_text()) if RECORD.exists() else {"mutants": {}}
    now = function_keys_now()
    generate_mutants()  # mutmut's names of every mutant, to know the pending ones by name
    sync_unmutated()
    results = mutmut_results()
    if run and not names:
        names = sorted(n for n in results if not current_in(previous, function_id(n), now))
    if run and names:
        seed_stats(previous, names)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "mutmut", "run", "--max-children", "2", *names]
        subprocess.run(command, cwd=ROOT, env=env, check=True)
        results = mutmut_results()
    elif run:
        print("nothing is pending: every function's verdicts stand, the record as it is")
        return
    rerun = {n for n in results if any(fnmatch(n, name) for name in names)} if run else set()
    judged, kept, pending = triage_functions(results, previous, now, rerun)
    same_change = by_change(previous["mutants"])

    def entry(item: tuple[str, str, int | None]) -> dict:
        name, source, code = item
        found = judged_entry(name, source, code, previous["mutants"].get(name, {}), same_change)
        found = argued(name, found, equivalents)
        print(f"{found['verdict']:<12} {name}", flush=True)
        return found

    with ThreadPoolExecutor(max_workers=2) as pool:  # the second stage: two mutants at a time
        mutants = dict(zip((n for n, _, _ in judged), pool.map(entry, judged), strict=True))
    mutants |= {name: argued(name, line, equivalents) for name, line in kept.items()}
    record = {
        "tool": f"mutmut {version('mutmut')}",
        "judge": JUDGE,
        "sources": sources_read(),
        "functions": now,
        "pending": dict(sorted(pending.items())),
        "stats": stats_to_keep(previous),
        "seconds_this_run": round(time.monotonic() - start),
        "mutants": dict(sorted(mutants.items())),
    }
    RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(table(record))


def triage_functions(
    results: dict[str, tuple[str, int | None]],
    previous: dict,
    now: dict[str, str],
    rerun: set[str],
) -> tuple[list[tuple[str, str, int | None]], dict[str, dict], dict[str, int]]:
    """What the record does with mutmut's ``results`` (:func:`mutmut_results`), function by
    function: ``(judged, kept, pending)``.

    - ``kept``: the last record's lines of a function it judged as its code is ``now``
      (:func:`current_in`) with the same mutants, except those this run ran again (``rerun``).
    - ``judged``: ``(mutant, file, exit code)`` of those rerun, and of every mutant of a function
      that is not current in the record and whose mutants mutmut has all run.
    - ``pending``: ``{"file::function": mutant count}`` of every other function."""
    by_function: dict[str, list[str]] = {}
    for name in results:
        by_function.setdefault(function_id(name), []).append(name)
    judged, kept, pending = [], {}, {}
    for function, names in sorted(by_function.items()):
        recorded = {n for n, m in previous["mutants"].items() if function_id(n) == function}
        if current_in(previous, function, now) and recorded == set(names):
            kept |= {n: previous["mutants"][n] for n in names if n not in rerun}
            judged += [(n, *results[n]) for n in sorted(names) if n in rerun]
        elif all(results[n][1] is not None for n in names):
            judged += [(n, *results[n]) for n in sorted(names)]
        else:
            pending[function] = len(names)
    return judged, kept, pending


def sources_read() -> str:
    """The commit the mutated files were read from: ``HEAD``'s hash, with ``+uncommitted``
    where a mutated file differs from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    status = ["git", "status", "--porcelain", "--", *mutated_files()]
    dirty = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+uncommitted" if dirty else "")


# ------------------------------------------------------------------- mutmut's stats, kept
STATS = MUTANTS / "mutmut-stats.json"


def stats_to_keep(previous: dict) -> dict:
    """Which judge tests call each mutated function, and each test's clean time: mutmut's stats
    as this run left them (else the last record's), for a fresh clone's :func:`seed_stats`."""
    if not STATS.exists():
        return previous.get("stats", {})
    stats = json.loads(STATS.read_text())
    calls = stats["tests_by_mangled_function_name"]
    return {
        "tests_by_function": {name: sorted(tests) for name, tests in sorted(calls.items())},
        "duration_by_test": dict(sorted(stats["duration_by_test"].items())),
    }


def seed_stats(previous: dict, names: list[str]) -> None:
    """Write the record's stats as mutmut's, where ``mutants/`` has none: mutmut then skips its
    stats pass (every judged battery run once, clean, minutes). A function the record has but
    no judge test called stays uncalled (mutmut's "not reached"); a function the record does
    not have makes mutmut run its stats pass."""
    stats = previous.get("stats")
    if STATS.exists() or not stats:
        return
    if any("*" in n or function_id(n) not in previous.get("functions", {}) for n in names):
        return  # a glob, or a function new since the record: mutmut learns its callers itself
    from mutmut.configuration import config

    os.chdir(ROOT)  # mutmut's configuration is pyproject.toml's, read from here
    seeded = {
        "tests_by_mangled_function_name": stats["tests_by_function"],
        "duration_by_test": stats["duration_by_test"],
        "stats_time": 0,
        "function_hashes": {},  # no old hashes: mutmut invalidates no caller edges
        "function_dependencies": {},
        "config_fingerprint": config().config_fingerprint(),
        "watched_file_hashes": {},
        "git_commit": None,
    }
    STATS.write_text(json.dumps(seeded, indent=1))
    print(f"mutmut's stats taken from the record ({len(seeded['duration_by_test'])} judge tests)")


def load_arguments(path: Path) -> dict[str, dict[str, str]]:
    """An equivalents file: per mutant name, the ``change`` it argues (as the record writes
    it, :func:`change_of`) and ``why`` no test can tell that mutant from the original. An entry
    with other keys stops the job before mutmut runs, naming the entry."""
    arguments = tomllib.loads(path.read_text()) if path.exists() else {}
    for name, entry in arguments.items():
        if not isinstance(entry, dict) or set(entry) != {"change", "why"}:
            raise SystemExit(f"{path.name}: {name} must hold exactly 'change' and 'why'")
    return arguments


def argued(name: str, line: dict, arguments: dict[str, dict[str, str]]) -> dict:
    """A survivor's line with its argument (:func:`load_arguments`), if it has one
    (``cuda_only`` where the argument starts with :data:`CUDA_ONLY`); an argued line whose
    argument is gone is a survivor again.

    An argument holds only for the change it names. mutmut numbers a function's mutants in
    order, so an edit to the function renumbers them, and an argument found by name alone
    would then speak for another mutant: such a line stays a survivor, with the change its
    argument names (``argued_change``)."""
    if line["verdict"] not in ("survived", *ARGUED):
        return line
    line = {k: v for k, v in line.items() if k not in ("argument", "argued_change")}
    line |= {"verdict": "survived"}
    if name not in arguments:
        return line
    change, why = arguments[name]["change"], arguments[name]["why"]
    if change != line["change"]:
        return line | {"argued_change": change}
    verdict = "cuda_only" if why.startswith(CUDA_ONLY) else "equivalent"
    return line | {"verdict": verdict, "argument": why}


def by_change(mutants: dict[str, dict]) -> dict[tuple[str, str], dict]:
    """A record's lines by ``(file, change)``, where that pair names one mutant only: an edit
    above a mutant renumbers it (mutmut numbers a function's mutants in order), and its change
    is still the same one."""
    keys = [(m["file"], m["change"]) for m in mutants.values()]
    count = Counter(keys)
    return {key: m for key, m in zip(keys, mutants.values(), strict=True) if count[key] == 1}


def judged_entry(
    name: str, source: str, code: int | None, old: dict, same_change: dict[tuple[str, str], dict]
) -> dict:
    """The record's line for a mutant mutmut judged: where, what, and what killed it (the
    second stage for one the default battery passed, unless the last record has its verdict,
    under its name or, renumbered, under the same change (``same_change``, :func:`by_change`):
    killed by the second stage, or survived it, argued or not)."""
    entry: dict = {"file": source}
    entry["line"], entry["change"] = change_of(name, source)
    if old.get("change") != entry["change"]:
        old = same_change.get((source, entry["change"]), {})
    status = RENAMED.get(status_by_exit_code[code], status_by_exit_code[code])
    if status == "killed":
        return entry | {"verdict": "killed", "by": verdict_of(name)}
    if status not in ("survived", "not reached"):
        return entry | {"verdict": status}
    if old.get("change") == entry["change"]:  # the last record's second stage still holds
        if old.get("verdict") in SECOND_STAGE:
            return entry | {k: old[k] for k in ("verdict", "by")}
        if old.get("verdict") in (*ARGUED, "survived"):
            return entry | {"verdict": "survived", "by": old.get("by")}  # argued anew by the caller
    entry["verdict"], entry["by"] = second_stage(name, source)
    if status == "not reached" and entry["verdict"] == "survived":
        entry["by"] = {"note": "no judged backend calls the function"}
    return entry


def table(record: dict) -> str:
    """Per file: mutants, killed by the default battery, killed only by --full, only by a unit
    test, equivalent (argued), differing on CUDA only (argued), survived, and pending (mutants of
    functions the record has not judged as they were read)."""
    head = ["file", "mutants", "default battery", "only --full", "only a test", "equivalent"]
    head += ["CUDA only", "survived", "pending"]
    rows = []
    for source in sorted({f.partition("::")[0] for f in record["functions"]}):
        verdicts = [m["verdict"] for m in record["mutants"].values() if m["file"] == source]
        killed = sum(v in KILLED for v in verdicts)
        waiting = sum(n for f, n in record["pending"].items() if f.startswith(source + "::"))
        counts = [verdicts.count(c) for c in COLUMNS]
        rows.append([source, len(verdicts) + waiting, killed, *counts, waiting])
    rows.append(["all", *(sum(r[i] for r in rows) for i in range(1, len(head)))])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def score(record: dict) -> dict[str, int]:
    """The README's figures: ``killed`` by the default battery out of ``judged`` (the mutants
    neither equivalent nor CUDA only), the counts of ``equivalent``, ``cuda_only``,
    ``full_only`` and ``test_only`` mutants, and the ``pending`` mutants and functions."""
    verdicts = [m["verdict"] for m in record["mutants"].values()]
    equivalent, cuda_only = verdicts.count("equivalent"), verdicts.count("cuda_only")
    return {
        "killed": sum(v in KILLED for v in verdicts),
        "judged": len(verdicts) - equivalent - cuda_only,
        "equivalent": equivalent,
        "cuda_only": cuda_only,
        "full_only": verdicts.count("killed_full"),
        "test_only": verdicts.count("killed_test"),
        "pending": sum(record["pending"].values()),
        "pending_functions": len(record["pending"]),
    }


def pending_now(record: dict) -> list[str]:
    """The functions (``"file::function"``) whose verdicts the record does not hold as their
    code is now: changed since it was written, new, or pending in it."""
    now = function_keys_now()
    functions = {f for f in now if not f.endswith("::" + keys.MODULE)}
    return sorted(f for f in functions if not current_in(record, f, now))


def generate_mutants() -> None:
    """mutmut's ``mutants/`` tree without running anything: every mutant's name, no stats pass."""
    from mutmut.__main__ import (
        copy_also_copy_files,
        copy_src_dir,
        create_mutants,
        setup_source_paths,
        store_lines_covered_by_tests,
    )

    MUTANTS.mkdir(exist_ok=True)
    copy_src_dir()
    copy_also_copy_files()
    setup_source_paths()
    store_lines_covered_by_tests()
    create_mutants(2)


# ------------------------------------------------------------------------------ the CI sample
def run_sample(size: int, seed: int, cap_seconds: float) -> int:
    """Judge ``size`` mutants drawn with ``seed``: first those of functions pending now
    (:func:`pending_now`), then killed mutants of the record, each on the backend the record
    says killed it. A recorded kill must fail there again, at the same graph, dtype and check,
    or the sample fails. A pending mutant is judged by the default battery and printed, killed
    or not: one that survives is a finding for the next ``make mutations``, not a failure (the
    record has no verdict on it yet). No mutant starts after ``cap_seconds``."""
    start = time.monotonic()
    record = json.loads(RECORD.read_text())
    generate_mutants()
    sync_unmutated()
    seed_stats(record, [])  # which backend judges a pending mutant: the record's stats say
    waiting = set(pending_now(record))
    pending = sorted(n for n in mutmut_results() if function_id(n) in waiting)
    killed = sorted(n for n, m in record["mutants"].items() if m["verdict"] == "killed")
    killed = [n for n in killed if function_id(n) not in waiting]
    chosen = choose_sample(pending, killed, size, seed)
    print(f"{len(waiting)} functions pending now ({len(pending)} mutants); judging {size}:")
    disagree, findings, judged = 0, 0, 0
    for name in chosen:
        if time.monotonic() - start > cap_seconds:
            print(f"cap of {cap_seconds:.0f} s reached: {size - judged} sampled mutants not judged")
            break
        judged += 1
        if name in record["mutants"] and function_id(name) not in waiting:
            disagree += not sample_agrees(name, record["mutants"][name]["by"])
        else:
            findings += not sample_pending(name)
    print(f"{judged} judged: {disagree} disagree with the record, {findings} pending survived")
    return int(disagree > 0)


def choose_sample(pending: list[str], killed: list[str], size: int, seed: int) -> list[str]:
    """``size`` mutants drawn with ``seed``: pending ones first, the record's killed ones after."""
    draw = random.Random(seed)
    chosen = draw.sample(pending, min(size, len(pending)))
    return chosen + draw.sample(killed, min(size - len(chosen), len(killed)))


def sample_agrees(name: str, want: dict) -> bool:
    """Whether a killed mutant of the record fails its judge again at the row it names."""
    judge_module = load_sibling("judge")
    (MUTANTS / "judge_verdicts" / f"{name}.json").unlink(missing_ok=True)
    judge = want["backend"]
    for path in judge_module.PATHS:  # the judged backend, without the path the judge forced
        judge = judge.removesuffix(path)
    if judge.endswith(judge_module.DOORS):  # another backend's doors, after the home battery
        judge = judge_module.HOME[module_of(name)]
    test = f"{JUDGE}::test_default_battery[{judge}]"
    failed = pytest_fails(name, [test], MUTATION_JUDGE=judge)
    got = verdict_of(name)
    same = failed and got is not None and all(got[k] == want[k] for k in WHERE)
    found = got and {k: got[k] for k in WHERE}
    record_says = {k: want[k] for k in WHERE}
    print(f"{'agrees' if same else 'DISAGREES':<10} {name}: record {record_says}, now {found}")
    return same


def sample_pending(name: str) -> bool:
    """Whether the default battery kills a mutant of a pending function (printed either way)."""
    (MUTANTS / "judge_verdicts" / f"{name}.json").unlink(missing_ok=True)
    killed = pytest_fails(name, [JUDGE])  # the judge picks its backend from mutmut's stats
    got = verdict_of(name)
    where = got and {k: got[k] for k in WHERE}
    print(
        f"{'pending, killed' if killed else 'FINDING: pending, survived':<26} {name} {where or ''}"
    )
    return killed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutant globs, e.g. 'fovi_ref.layout.*'")
    parser.add_argument("--sample", type=int, help="judge this many mutants, pending first (CI)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--cap-seconds", type=float, default=240, help="no sampled mutant after")
    parser.add_argument("--table", action="store_true", help="the record's table, pending now")
    parser.add_argument("--no-run", action="store_true", help="the record from mutmut's cache")
    args = parser.parse_args(argv)
    os.chdir(ROOT)  # mutmut reads its mutants/ relative to the working directory
    if args.table:
        record = json.loads(RECORD.read_text())
        print(table(record))
        print(score(record), "read from", record["sources"])
        waiting = pending_now(record)
        print(f"pending now ({len(waiting)} functions changed since): {', '.join(waiting)}")
        return 0
    if args.sample:
        return run_sample(args.sample, args.seed, args.cap_seconds)
    run_job(args.names, run=not args.no_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
