"""The mutation engine: mutmut rewrites code one small change at a time, a judge runs on every
mutant, and a record says what killed each one. Two jobs are two configurations of it
(``run.py``'s ``JOBS``):

- ``backends`` (``make mutations``): the op's backends, judged by the default battery
  (``judge.py``), paths this CPU never takes forced; record ``record.json``;
- ``rule`` (``make rule-mutations``): the tolerance rule, judged by the harness's own tests,
  quickest first (``rule_order.py``); record ``rule_record.json``.

::

    python scripts/mutations/run.py JOB                      # judge the pending functions
    python scripts/mutations/run.py JOB [MUTANT_GLOB ...]    # judge these mutants again
    python scripts/mutations/run.py JOB --table              # the record's table, pending now
    python scripts/mutations/run.py JOB --sample 8 --seed 0  # CI: pending first, then kills
    python scripts/mutations/run.py JOB --no-run             # the record from mutmut's cache

**Verdicts follow functions** (:mod:`keys`). The record keys every mutant by the function it
mutates and stores each function's key (the hash of its code, docstrings and comments left out),
and each file's ``<module>`` (the rest of the file). A verdict stands while its function and its
file's ``<module>`` are unchanged. A function whose key differs from the record's, or that the
record has not judged whole, is *pending*: the next run judges its mutants, and only those;
until then nothing fails, and ``--table`` and CI's sample say what is pending.

**A run**, file by file, in the job's work folder (where mutmut reads its ``[tool.mutmut]`` and
keeps its cache, ``mutants/``, git-ignored): ``mutmut run`` on the pending functions' mutants,
one thread each, which runs the job's *first stage* (the judge's tests that call the mutated
function, stopping at the first failure); then each mutant the first stage passed runs the
job's *second stage* (:class:`Stage`: other tests, one after another); then the record is
written, so that a run cut short keeps every file it finished. mutmut's *stats* (which judge
tests call which function) are kept in the record, so that a fresh clone skips mutmut's stats
pass unless a pending function is new.

**Verdicts**: ``killed`` (by the first stage; ``by``: the judge's first failed row where the
judge writes one), ``timeout`` (past mutmut's limit: an endless or far slower mutant),
``crashed`` (the worker died), a second stage's verdict (``by``: its row or test), ``equivalent``
or ``cuda_only`` (a survivor whose change the job's equivalents file argues: :func:`argued`), or
``survived``. ``not reached`` (no judge test calls the function) goes to the second stage like a
survivor. The tests (``tests/test_mutations.py``) fail on a survivor and on an argument for a
mutant the record does not hold as argued; never on pending functions.

**Time.** A killed mutant costs seconds, a survivor its judge's tests and the second stage.
``seconds_this_run`` in the record is the wall time of the run that wrote it, and of nothing
before.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fnmatch import fnmatch
from importlib.metadata import version
from pathlib import Path

from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "scripts" / "mutations"


if str(HERE) not in sys.path:  # the scripts beside this one (no package), each imported once
    sys.path.insert(0, str(HERE))
import keys  # noqa: E402

TOOL = f"mutmut {version('mutmut')}"
"""mutmut numbers a function's mutants; a record made by another version is not read."""
RENAMED = {"segfault": "crashed", "no tests": "not reached"}
"""mutmut's words for a status (``mutmut.stats.status_by_exit_code``) that the record says
otherwise: a worker that died, and a function no judge test calls."""
KILLED = ("killed", "timeout", "crashed")
ARGUED = ("equivalent", "cuda_only")
CUDA_ONLY = "CPU only:"
"""How an argument starts when the mutant differs on CUDA alone (verdict ``cuda_only``)."""


@dataclass(frozen=True)
class Stage:
    """One step of the second stage: pytest ``args`` (run from ``mutants/``, with ``env`` added);
    a mutant that fails them gets ``verdict``."""

    verdict: str
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Job:
    """A configuration of the engine.

    Attributes:
        name: ``"backends"`` or ``"rule"``.
        record, equivalents: its record (JSON) and its arguments (TOML), in this folder.
        work: where mutmut runs: its pyproject.toml's ``[tool.mutmut]``, its ``mutants/``.
        files: the mutated files, each with the functions judged (``None``: all of them).
        judge: the first stage's tests, as the record names them.
        second_stage: the :class:`Stage` list of a mutant of a file, in order.
        rerun: pytest args and env that judge a recorded kill again (CI's sample), from its line.
        same_row: whether a rerun's ``by`` names the row the record's does.
        columns: the table's verdict columns, ``(header, verdicts)``.
        by_function: the table has a row per function, else per file.
        children: mutants mutmut runs at a time.
        prepare: makes the work folder as this checkout is (before mutmut runs).
    """

    name: str
    record: Path
    equivalents: Path
    work: Path
    files: dict[str, tuple[str, ...] | None]
    judge: tuple[str, ...]
    second_stage: Callable[[str], list[Stage]]
    rerun: Callable[[str, dict], tuple[list[str], dict[str, str]]]
    same_row: Callable[[dict | None, dict], bool]
    columns: tuple[tuple[str, tuple[str, ...]], ...]
    by_function: bool
    children: int
    prepare: Callable[[], None]

    @property
    def mutants(self) -> Path:
        return self.work / "mutants"

    @property
    def verdicts(self) -> Path:
        """Where the judge writes the first failed row of a mutant it kills (``judge.py``)."""
        return self.mutants / "judge_verdicts"


@contextlib.contextmanager
def working_in(folder: Path) -> Iterator[None]:
    """mutmut's functions read its configuration and ``mutants/`` from the working directory:
    within the block, ``folder``; restored after it."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


# --------------------------------------------------------------------------- names and keys
def module_of(mutant: str) -> str:
    """``fovi_ref.segment_sum.x_f__mutmut_3`` is in module ``fovi_ref.segment_sum``."""
    return mutant.rpartition("__mutmut_")[0].rpartition(".")[0]


def file_of(mutant: str) -> str:
    """The mutated file of a mutmut name (a package's module is its ``__init__.py``)."""
    module = module_of(mutant).replace(".", "/")
    return f"{module}.py" if (ROOT / f"{module}.py").exists() else f"{module}/__init__.py"


def function_id(mutant: str) -> str:
    """``"file::function"`` of a mutmut name, as :func:`keys_now` keys it."""
    return f"{file_of(mutant)}::{keys.function_of(mutant)}"


def keys_now(job: Job) -> dict[str, str]:
    """``{"file::function": key}`` of the job's functions as this checkout has them, and each
    file's ``"file::<module>"`` (:mod:`keys`)."""
    now = {}
    for source, functions in job.files.items():
        found = keys.file_keys(ROOT / source)
        for function in functions or [f for f in found if f != keys.MODULE]:
            now[f"{source}::{function}"] = found[function]
        now[f"{source}::{keys.MODULE}"] = found[keys.MODULE]
    return now


def current_in(record: dict, function: str, now: dict[str, str]) -> bool:
    """Whether ``record`` judged ``function`` as its code is ``now``: the same key for it and for
    its file's ``<module>``, made by the same mutmut, and not pending there."""
    module = f"{function.partition('::')[0]}::{keys.MODULE}"
    judged = record.get("functions", {})
    same = all(now.get(f) is not None and judged.get(f) == now[f] for f in (function, module))
    return same and record.get("tool") == TOOL and function not in record.get("pending", {})


def pending_now(job: Job, record: dict) -> list[str]:
    """The job's functions whose verdicts ``record`` does not hold as their code is now."""
    now = keys_now(job)
    functions = [f for f in now if not f.endswith("::" + keys.MODULE)]
    return sorted(f for f in functions if not current_in(record, f, now))


def load_record(job: Job) -> dict:
    """The job's record (an empty one where there is none)."""
    return json.loads(job.record.read_text()) if job.record.exists() else {"mutants": {}}


# ----------------------------------------------------------------------------- mutmut's cache
def in_work_folder(job: Job, code: str) -> str:
    """Run ``code`` (Python) in a fresh interpreter in the job's work folder and return what it
    prints. mutmut reads its configuration from the working directory once per process and keeps
    it (``mutmut.configuration.config``), so a process that has read one job's cannot generate
    the other's mutants: each job's mutmut calls run in a process of their own."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=job.work, capture_output=True, text=True, check=True
    )
    return done.stdout


GENERATE = """
from mutmut.__main__ import (
    copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths,
    store_lines_covered_by_tests,
)
from pathlib import Path
Path("mutants").mkdir(exist_ok=True)
copy_src_dir()
copy_also_copy_files()
setup_source_paths()
store_lines_covered_by_tests()
create_mutants(2)
"""
"""mutmut's ``mutants/`` without running anything: every mutant's name, no stats pass."""


def generate_mutants(job: Job) -> None:
    """The work folder as this checkout is (``job.prepare``), mutmut's ``mutants/`` generated in
    it (:data:`GENERATE`), then the files mutmut does not mutate, as they are now (:func:`sync`)."""
    job.prepare()
    in_work_folder(job, GENERATE)
    sync(job)


def copy_changed(target: Path, skip: frozenset[str] = frozenset()) -> None:
    """Copy fovi_ref, the tests and the scripts into ``target`` where a file differs, but the
    ``skip`` files (paths from the repository's root)."""
    for top in ("fovi_ref", "tests", "scripts"):
        for path in (ROOT / top).rglob("*"):
            relative = str(path.relative_to(ROOT))
            copy = target / relative
            if not path.is_file() or "__pycache__" in path.parts or relative in skip:
                continue
            if not copy.exists() or copy.read_bytes() != path.read_bytes():
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, copy)


def sync(job: Job) -> None:
    """The files mutmut does not mutate, into ``mutants/`` where they differ: mutmut copies a
    source file there once, and the tests only when it runs, so a harness change would not
    otherwise reach a sample. (A harness change can change verdicts mutmut's cache keeps:
    ``rm -rf`` the work folder's ``mutants/`` to judge everything again.)"""
    copy_changed(job.mutants, skip=frozenset(job.files))


def mutmut_results(job: Job) -> dict[str, tuple[str, int | None]]:
    """``{mutant: (file, exit code)}`` of the job's functions, from mutmut's ``.meta`` files
    (``None``: not run yet)."""
    judged = {f for f in keys_now(job) if not f.endswith("::" + keys.MODULE)}
    results = {}
    for source in job.files:
        meta = job.mutants / f"{source}.meta"
        if meta.exists():
            for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                if function_id(name) in judged:
                    results[name] = (source, code)
    return results


def mutant_diff(job: Job, mutant: str, source: str) -> str:
    """mutmut's diff of ``mutant`` against ``source``, its function's lines (from ``mutants/``)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    with working_in(job.work):
        return get_diff_for_mutant(mutant, path=source)


def change_of(job: Job, mutant: str, source: str) -> tuple[int, str]:
    """``(line in the original file, one-line description)`` of a mutant, from mutmut's diff."""
    diff = mutant_diff(job, mutant, source)
    removed = [line[1:] for line in diff.splitlines()[2:] if line.startswith("-")]
    added = [line[1:] for line in diff.splitlines()[2:] if line.startswith("+")]
    before, after = (" / ".join(s.strip() for s in side) for side in (removed, added))
    return line_of(source, mutant, removed[0].strip() if removed else ""), f"{before}  ->  {after}"


def line_of(source: str, mutant: str, text: str) -> int:
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


def pytest_fails(job: Job, mutant: str, args: list[str], env: dict[str, str]) -> bool:
    """Whether pytest, run from ``mutants/`` with ``mutant`` switched on, fails."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "--rootdir=.", "-p", "no:cacheprovider"]
    here = {"MUTANT_UNDER_TEST": mutant, "PYTHONPATH": str(job.mutants), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command + args,
        cwd=job.mutants,
        env={**os.environ, **here, **env},
        capture_output=True,
        text=True,
    )
    if done.returncode not in (0, 1):
        raise RuntimeError(f"pytest could not run for {mutant}:\n{done.stdout[-2000:]}")
    return done.returncode == 1


def judge_row(job: Job, mutant: str) -> dict | None:
    """The judge's note of the first failed row, where it wrote one for ``mutant``."""
    path = job.verdicts / f"{mutant}.json"
    return json.loads(path.read_text()) if path.exists() else None


# ------------------------------------------------------------------------- mutmut's stats, kept
def stats_to_keep(job: Job, previous: dict) -> dict:
    """Which judge tests call each function and each test's clean time: mutmut's stats as this
    run left them (else the last record's), for a fresh clone's :func:`seed_stats`."""
    path = job.mutants / "mutmut-stats.json"
    if not path.exists():
        return previous.get("stats", {})
    stats = json.loads(path.read_text())
    calls = stats["tests_by_mangled_function_name"]
    return {
        "tests_by_function": {name: sorted(tests) for name, tests in sorted(calls.items())},
        "duration_by_test": dict(sorted(stats["duration_by_test"].items())),
    }


def seed_stats(job: Job, previous: dict, names: list[str]) -> None:
    """Write the record's stats as mutmut's where ``mutants/`` has none, so that mutmut skips its
    stats pass (every judge test run once, clean: minutes). Not for a glob, nor for a function
    the record does not have: mutmut then learns its callers itself."""
    path, stats = job.mutants / "mutmut-stats.json", previous.get("stats")
    if path.exists() or not stats:
        return
    if any("*" in n or function_id(n) not in previous.get("functions", {}) for n in names):
        return
    code = "from mutmut.configuration import config; print(config().config_fingerprint())"
    fingerprint = in_work_folder(job, code).strip().splitlines()[-1]
    seeded = {
        "tests_by_mangled_function_name": stats["tests_by_function"],
        "duration_by_test": stats["duration_by_test"],
        "stats_time": 0,
        "function_hashes": {},  # no old hashes: mutmut invalidates no caller edges
        "function_dependencies": {},
        "config_fingerprint": fingerprint,
        "watched_file_hashes": {},
        "git_commit": None,
    }
    path.write_text(json.dumps(seeded, indent=1))
    print(f"mutmut's stats taken from the record ({len(seeded['duration_by_test'])} judge tests)")


# ---------------------------------------------------------------------------------- arguments
def load_arguments(path: Path) -> dict[str, dict[str, str]]:
    """An equivalents file: per mutant, the ``change`` it argues (as the record writes it) and
    ``why`` no test can tell that mutant from the original. An entry with other keys stops the
    job before mutmut runs, naming the entry."""
    arguments = tomllib.loads(path.read_text()) if path.exists() else {}
    for name, entry in arguments.items():
        if not isinstance(entry, dict) or set(entry) != {"change", "why"}:
            raise SystemExit(f"{path.name}: {name} must hold exactly 'change' and 'why'")
    return arguments


def argued(name: str, line: dict, arguments: dict[str, dict[str, str]]) -> dict:
    """A survivor's line with its argument, if it has one (``cuda_only`` where it starts with
    :data:`CUDA_ONLY`); an argued line whose argument is gone is a survivor again.

    An argument holds only for the change it names: mutmut numbers a function's mutants in
    order, so an edit renumbers them, and an argument found by name alone would speak for
    another mutant. Such a line stays a survivor, with the change its argument names
    (``argued_change``)."""
    if line["verdict"] not in ("survived", *ARGUED):
        return line
    line = {k: v for k, v in line.items() if k not in ("argument", "argued_change")}
    line |= {"verdict": "survived"}
    if name not in arguments:
        return line
    change, why = arguments[name]["change"], arguments[name]["why"]
    if change != line["change"]:
        return line | {"argued_change": change}
    return (
        line
        | {"verdict": "cuda_only" if why.startswith(CUDA_ONLY) else "equivalent"}
        | {"argument": why}
    )


# -------------------------------------------------------------------------------- the verdicts
def triage(
    results: dict[str, tuple[str, int | None]], previous: dict, now: dict[str, str], rerun: set
) -> tuple[list[tuple[str, str, int | None]], dict[str, dict], dict[str, int]]:
    """What the record does with mutmut's ``results``, function by function: ``(judged, kept,
    pending)``.

    - ``kept``: the last record's lines of a function it judged as its code is ``now``
      (:func:`current_in`) with the same mutants, but those this run ran again (``rerun``);
    - ``judged``: ``(mutant, file, exit code)`` of those rerun, and of every mutant of a function
      not current in the record whose mutants mutmut has all run;
    - ``pending``: ``{"file::function": mutant count}`` of every other function."""
    by_function: dict[str, list[str]] = {}
    for name in results:
        by_function.setdefault(function_id(name), []).append(name)
    recorded_by_function: dict[str, set[str]] = {}
    for name in previous["mutants"]:
        recorded_by_function.setdefault(function_id(name), set()).add(name)
    judged, kept, pending = [], {}, {}
    for function, names in sorted(by_function.items()):
        recorded = recorded_by_function.get(function, set())
        if current_in(previous, function, now) and recorded == set(names):
            kept |= {n: previous["mutants"][n] for n in names if n not in rerun}
            judged += [(n, *results[n]) for n in sorted(names) if n in rerun]
        elif all(results[n][1] is not None for n in names):
            judged += [(n, *results[n]) for n in sorted(names)]
        else:
            pending[function] = len(names)
    return judged, kept, pending


def by_change(mutants: dict[str, dict]) -> dict[tuple[str, str], dict]:
    """A record's lines by ``(file, change)``, where that pair names one mutant only: an edit
    above a mutant renumbers it, and its change is still the same one."""
    found = [(m["file"], m["change"]) for m in mutants.values()]
    count = Counter(found)
    return {key: m for key, m in zip(found, mutants.values(), strict=True) if count[key] == 1}


def second_stage(job: Job, mutant: str, source: str) -> tuple[str, dict]:
    """``(verdict, by)`` of a mutant the first stage passed: the first :class:`Stage` that fails
    it (``by``: the judge's row, else the test), else ``survived``."""
    for stage in job.second_stage(source):
        (job.verdicts / f"{mutant}.json").unlink(missing_ok=True)
        if pytest_fails(job, mutant, list(stage.args), stage.env):
            return stage.verdict, judge_row(job, mutant) or {"test": " ".join(stage.args)}
    return "survived", {}


def from_second_stage(old: dict) -> bool:
    """Whether a record's line holds a second stage's outcome: a survivor's (argued or not) or a
    second stage's kill (whose ``by`` names a test where its verdict is also a first stage's)."""
    if "by" not in old:
        return False
    return old["verdict"] not in KILLED or "test" in (old["by"] or {})


def judged_line(
    job: Job, name: str, source: str, code: int | None, previous: dict, same_change: dict
) -> dict:
    """The record's line for a mutant mutmut judged: where, what, and what killed it. One the
    first stage passed goes through :func:`second_stage`, unless the last record's line for its
    change (under its name, or renumbered: :func:`by_change`) holds that stage's outcome."""
    line = {"file": source, "function": keys.function_of(name)}
    line["line"], line["change"] = change_of(job, name, source)
    status = RENAMED.get(status_by_exit_code[code], status_by_exit_code[code])
    if status == "killed":
        return line | {"verdict": "killed", "by": judge_row(job, name)}
    if status not in ("survived", "not reached"):
        return line | {"verdict": status}
    old = previous.get(name, {})
    if old.get("change") != line["change"]:
        old = same_change.get((source, line["change"]), {})
    if from_second_stage(old):
        survived = old["verdict"] in (*ARGUED, "survived")  # argued anew by the caller
        return line | {"verdict": "survived" if survived else old["verdict"], "by": old["by"]}
    line["verdict"], line["by"] = second_stage(job, name, source)
    if status == "not reached" and line["verdict"] == "survived":
        line["by"] = {"note": "no judge test calls the function"}
    return line


def sources_read(job: Job) -> str:
    """``HEAD``'s hash, with ``+uncommitted`` where a mutated file differs from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    status = ["git", "status", "--porcelain", "--", *job.files]
    dirty = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+uncommitted" if dirty else "")


def write_record(
    job: Job, previous: dict, rerun: set[str], start: float, history: dict[str, dict]
) -> dict:
    """The record from mutmut's cache (:func:`triage` against ``previous``, the record as the
    run's last file left it), second stages run ``job.children`` at a time. ``history`` is the
    record the run started from: a pending function's lines are gone from ``previous`` once a
    file is written, and their second stages are still worth reusing."""
    arguments = load_arguments(job.equivalents)
    now = keys_now(job)
    judged, kept, pending = triage(mutmut_results(job), previous, now, rerun)
    same_change = by_change(history)

    def line(item: tuple[str, str, int | None]) -> dict:
        name, source, code = item
        found = judged_line(job, name, source, code, history, same_change)
        found = argued(name, found, arguments)
        print(f"{found['verdict']:<12} {name}", flush=True)
        return found

    with ThreadPoolExecutor(max_workers=job.children) as pool:
        mutants = dict(zip((n for n, _, _ in judged), pool.map(line, judged), strict=True))
    mutants |= {name: argued(name, old, arguments) for name, old in kept.items()}
    record = {
        "tool": TOOL,
        "judge": list(job.judge),
        "sources": sources_read(job),
        "functions": now,
        "pending": dict(sorted(pending.items())),
        "stats": stats_to_keep(job, previous),
        "seconds_this_run": round(time.monotonic() - start),
        "mutants": dict(sorted(mutants.items())),
    }
    job.record.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return record


def run_job(job: Job, names: list[str], run: bool = True) -> None:
    """File by file: ``mutmut run`` on ``names`` in it (none: the mutants of its pending
    functions), then the record. ``run`` False: the record from mutmut's cache as it is."""
    start = time.monotonic()
    load_arguments(job.equivalents)  # a malformed entry stops the job before mutmut runs
    generate_mutants(job)
    previous, now = load_record(job), keys_now(job)
    if not run:
        print(table(job, write_record(job, previous, set(), start, previous["mutants"])))
        return

    def wanted(name: str) -> bool:
        if names:
            return any(fnmatch(name, glob) for glob in names)
        return not current_in(previous, function_id(name), now)

    chosen = {source: [] for source in job.files}
    for name, (source, _) in sorted(mutmut_results(job).items()):
        if wanted(name):
            chosen[source].append(name)
    everything = [name for mine in chosen.values() for name in mine]
    if not everything:
        print("nothing is pending: every function's verdicts stand, the record as it is")
        return
    seed_stats(job, previous, everything)  # once: a function new to the record needs its pass
    for mine in chosen.values():
        if mine:
            command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(job.children)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(command + mine, cwd=job.work, env=env, check=True)
            rerun = set(mine) if names else set()
            record = write_record(job, load_record(job), rerun, start, previous["mutants"])
    print(table(job, record))


# ------------------------------------------------------------------------- table and score
def table(job: Job, record: dict) -> str:
    """Per file (or per function): mutants, the job's verdict columns, and pending mutants."""
    waiting = set(pending_now(job, record)) | set(record["pending"])
    head = ["function" if job.by_function else "file", "mutants"]
    head += [header for header, _ in job.columns] + ["pending"]
    groups = [f for f in keys_now(job) if not f.endswith("::" + keys.MODULE)]
    if not job.by_function:
        groups = sorted({f.partition("::")[0] for f in groups})
    lines = record["mutants"].values()
    rows = []
    for group in groups:
        mine = [m for m in lines if group in (m["file"], f"{m['file']}::{m['function']}")]
        verdicts = [m["verdict"] for m in mine]
        count = sum(n for f, n in record["pending"].items() if group in (f, f.partition("::")[0]))
        label = group
        if job.by_function:
            source, _, function = group.partition("::")
            label = f"{Path(source).stem}.{function}" + (" (pending)" if group in waiting else "")
        columns = [sum(v in kinds for v in verdicts) for _, kinds in job.columns]
        rows.append([label, len(verdicts) + count, *columns, count])
    rows.append(["all", *(sum(r[i] for r in rows) for i in range(1, len(head)))])
    text = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(text + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def score(record: dict) -> dict[str, int]:
    """The README's figures: ``killed`` by the first stage out of ``judged`` (the mutants not
    argued), the argued and second-stage counts, and what is pending."""
    verdicts = Counter(m["verdict"] for m in record["mutants"].values())
    return {
        "killed": sum(verdicts[v] for v in KILLED),
        "judged": sum(verdicts.values()) - sum(verdicts[v] for v in ARGUED),
        "equivalent": verdicts["equivalent"],
        "cuda_only": verdicts["cuda_only"],
        "full_only": verdicts["killed_full"],
        "test_only": verdicts["killed_test"],
        "survived": verdicts["survived"],
        "pending": sum(record["pending"].values()),
        "pending_functions": len(record["pending"]),
    }


# --------------------------------------------------------------------------- the CI sample
def choose_sample(pending: list[str], killed: list[str], size: int, seed: int) -> list[str]:
    """``size`` mutants drawn with ``seed``: pending ones first, the record's killed ones after."""
    draw = random.Random(seed)
    chosen = draw.sample(pending, min(size, len(pending)))
    return chosen + draw.sample(killed, min(size - len(chosen), len(killed)))


def run_sample(job: Job, size: int, seed: int, cap_seconds: float) -> int:
    """Judge ``size`` mutants drawn with ``seed``: first those of functions pending now, then
    killed mutants of the record. A recorded kill must fail again (at the row it names, where
    the judge names rows), or the sample fails. A pending mutant is judged by the first stage
    and printed, killed or not: one that survives is a finding for the next run, not a failure
    (the record has no verdict on it yet). No mutant starts after ``cap_seconds``."""
    start = time.monotonic()
    record = load_record(job)
    generate_mutants(job)
    seed_stats(job, record, [])  # which judge test judges a pending mutant: the record's stats
    waiting = set(pending_now(job, record))
    pending = sorted(n for n in mutmut_results(job) if function_id(n) in waiting)
    killed = [
        n
        for n, m in sorted(record["mutants"].items())
        if m["verdict"] == "killed" and function_id(n) not in waiting
    ]
    chosen = choose_sample(pending, killed, size, seed)
    print(f"{job.name}: {len(waiting)} functions pending now ({len(pending)} mutants); {size}:")
    disagree = findings = judged = 0
    for name in chosen:
        if time.monotonic() - start > cap_seconds:
            print(f"cap of {cap_seconds:.0f} s reached: {len(chosen) - judged} not judged")
            break
        judged += 1
        (job.verdicts / f"{name}.json").unlink(missing_ok=True)
        line = record["mutants"][name] if name in killed else {}
        args, env = job.rerun(name, line)
        failed = pytest_fails(job, name, args, env)
        row = judge_row(job, name)
        if line:
            same = failed and job.same_row(row, line)
            disagree += not same
            print(f"{'agrees' if same else 'DISAGREES':<10} {name}: now {row}", flush=True)
        else:
            findings += not failed
            label = "pending, killed" if failed else "FINDING: pending, survived"
            print(f"{label:<26} {name} {row or ''}", flush=True)
    print(f"{judged} judged: {disagree} disagree with the record, {findings} pending survived")
    return int(disagree > 0)
