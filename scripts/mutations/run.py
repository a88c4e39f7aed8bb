"""The mutation job: mutmut rewrites the op's backends one small change at a time, the default
battery judges every mutant, and ``record.json`` says what killed each one.

    python scripts/mutations/run.py [MUTANT_GLOB ...]   # make mutations: run, then write the record
    python scripts/mutations/run.py --sample 12 --seed 0  # CI: rerun a seeded sample of the record
    python scripts/mutations/run.py --table             # the per-file table of the record
    python scripts/mutations/run.py --no-run --files F  # enter file F (its second stage) alone
    python scripts/mutations/run.py NAME ... --files F  # rerun mutants, enter F (names first)

**The run.** ``mutmut run`` (its configuration is ``[tool.mutmut]`` in pyproject.toml) copies
``fovi_ref`` to ``mutants/``, where each function of the mutated files can switch to any of its
mutants, runs the judge (``judge.py``) once clean to learn which judged backend calls which
function, then runs each mutant against the backends that call the mutated function, stopping at
the first that fails. Its results are cached in ``mutants/``: a second run judges only mutants
of functions that changed. Two mutants run at a time, one thread each. ``mutants/`` is
git-ignored, so a fresh clone has judged nothing: the record keeps its lines of the mutants
mutmut has not run, in every file it entered as the file is now (:func:`carried_over`), and
``run.py 'fovi_ref.layout.*'`` judges one file's mutants without paying again for the others.

**Past the default battery.** A mutant the default battery passes is run again on what else the
repo has, and the record says which killed it:

1. the ``--full`` battery's other graphs (the random graphs, res18's layers of each kind);
2. the unit tests of the mutated file (:data:`UNIT_TESTS`).

A mutant none of these kills is *equivalent* or differs *on CUDA only*, with its argument in
``equivalents.toml``, or it *survived*. ``tests/test_mutations.py`` fails on a survivor, on an
argument whose mutant is not one of those, and on a judged file whose hash is not the one the
record was made from.

**Verdicts** in the record: ``killed`` (``by`` the default battery: backend and path, graph,
dtype, check, quantity), ``timeout`` (the judge ran past mutmut's limit: an endless or far slower
backend), ``crashed`` (the worker died), ``killed_full``, ``killed_test``, ``equivalent``,
``cuda_only``, ``survived``. ``not reached`` (no judged backend calls the function) goes to the
second stage like a survivor. A file some of whose mutants mutmut has not run yet, and whose
record lines no longer hold, is listed as ``pending`` with its mutant count, and none of its
mutants is in the record (:func:`triage_files`).

**Time.** mutmut runs the mutants it expects to be quick first, two at a time, on one thread
each. A killed mutant costs seconds, one the battery passes a whole battery (for a plain
backend, ``fovi_ref/check/battery_times.json`` has the default battery's time on two threads),
then the second stage. ``seconds_this_run`` in the record is the wall time of the run that
wrote it, and of nothing before: mutmut's cache makes a second run short, and a ``--no-run``
pass whose second stage is in the last record takes seconds.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
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
from importlib.metadata import version
from pathlib import Path

from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "scripts" / "mutations"
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
    "fovi_ref/layout.py": ["tests/test_backends.py"],
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


def file_hashes() -> dict[str, str]:
    """sha256 of every mutated file, as the record stores them."""
    return {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest() for f in mutated_files()}


def env_for(mutant: str, **extra: str) -> dict[str, str]:
    """The environment that runs ``mutant`` from ``mutants/``: its copy of fovi_ref first."""
    return {**os.environ, "MUTANT_UNDER_TEST": mutant, "PYTHONPATH": str(MUTANTS),
            "OMP_NUM_THREADS": "1", **extra}  # fmt: skip


def pytest_fails(mutant: str, args: list[str], **extra: str) -> bool:
    """Whether pytest, run from ``mutants/`` with ``mutant`` switched on, fails."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "--rootdir=.", "-p", "no:cacheprovider"]
    done = subprocess.run(command + args, cwd=MUTANTS, env=env_for(mutant, **extra),
                          capture_output=True, text=True)  # fmt: skip
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
    name = mutant.rpartition("__mutmut_")[0].rpartition(".")[2]
    name = name.rpartition("ǁ")[2] if "ǁ" in name else name.removeprefix("x_")
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
def run_job(names: list[str], run: bool = True, files: list[str] | None = None) -> None:
    """mutmut run (unless ``run`` is False: its cache as it is), then the second stage for its
    survivors, then the record. ``files``: enter only these in the record beside the files it
    has (the second stage of a file's survivors takes minutes each); ``None``: every file whose
    mutants mutmut has all judged. A file the last record has, unchanged, keeps its lines of
    the mutants the cache has not judged (:func:`carried_over`); any other file not entered is
    listed as pending (:func:`triage_files`)."""
    start = time.monotonic()
    sync_unmutated()
    if run:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "mutmut", "run", "--max-children", "2", *names]
        subprocess.run(command, cwd=ROOT, env=env, check=True)
    previous = json.loads(RECORD.read_text()) if RECORD.exists() else {"mutants": {}}
    equivalents = tomllib.loads(EQUIVALENTS.read_text()) if EQUIVALENTS.exists() else {}
    hashes = file_hashes()
    judged, kept, pending = triage_files(mutmut_results(), previous, files, hashes)
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
        "files": {f: h for f, h in hashes.items() if f not in pending},
        "pending": {f: pending[f] for f in sorted(pending)},
        "seconds_this_run": round(time.monotonic() - start),
        "mutants": dict(sorted(mutants.items())),
    }
    RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(table(record))


def triage_files(
    results: dict[str, tuple[str, int | None]],
    previous: dict,
    files: list[str] | None,
    hashes: dict[str, str],
) -> tuple[list[tuple[str, str, int | None]], dict[str, dict], Counter[str]]:
    """What the record does with mutmut's ``results`` (:func:`mutmut_results`), file by file:
    ``(judged, kept, pending)``.

    - ``judged``: ``(mutant, file, exit code)`` for every mutant mutmut has run, of the files
      that are entered: those mutmut has judged whole, and those the last record holds as they
      are now (:func:`carried_over`). ``files`` (not None) enters only these beside the
      record's.
    - ``kept``: the last record's lines of the mutants mutmut has not run, in those files.
    - ``pending``: mutants per file of every other file.

    A mutated file (``hashes``) with no mutants in ``results`` is an error unless the last
    record holds it as it is: mutmut has not generated its mutants (a ``--no-run`` with no
    ``mutants/``)."""
    carried = carried_over(previous, results, hashes)
    found = Counter(source for source, _ in results.values())
    missing = sorted(set(hashes) - set(found) - set(carried))
    if missing:
        raise SystemExit(f"mutmut's cache has no mutants of {missing}: run without --no-run")
    whole = {s for s in found if all(c is not None for f, c in results.values() if f == s)}
    entered = whole | set(carried)
    if files is not None:
        entered &= {*previous.get("files", {}), *files}
    kept = {n: line for f in entered & set(carried) for n, line in carried[f].items()}
    judged = sorted((n, s, c) for n, (s, c) in results.items() if s in entered and c is not None)
    pending = Counter({s: n for s, n in found.items() if s not in entered})
    return judged, kept, pending


def carried_over(
    previous: dict, results: dict[str, tuple[str, int | None]], hashes: dict[str, str]
) -> dict[str, dict[str, dict]]:
    """Per file, the last record's lines of the mutants mutmut's ``results`` have not run, for
    every file the record entered from the file as it is now: the same hash, the same mutmut
    (which numbers the mutants), and the same mutants. mutmut's cache lives in the git-ignored
    ``mutants/``: a fresh clone, or ``rm -rf mutants``, has judged nothing, and a run restricted
    to some mutants (``NAME ...``) judges only those. An unchanged file's verdicts still hold,
    and its second stage (minutes a mutant) is not paid again."""
    if previous.get("tool") != f"mutmut {version('mutmut')}":
        return {}
    carried = {}
    for source, digest in previous.get("files", {}).items():
        if hashes.get(source) != digest:
            continue
        lines = {n: line for n, line in previous["mutants"].items() if line["file"] == source}
        now = {n: code for n, (f, code) in results.items() if f == source}
        if now and set(now) != set(lines):
            continue  # mutmut made other mutants of it: nothing of the record holds
        carried[source] = {n: line for n, line in lines.items() if now.get(n) is None}
    return carried


def argued(name: str, line: dict, equivalents: dict[str, str]) -> dict:
    """A survivor's line with its argument from equivalents.toml, if it has one (``cuda_only``
    where the argument starts with :data:`CUDA_ONLY`); an argued line whose argument is gone is
    a survivor again."""
    if line["verdict"] not in ("survived", *ARGUED):
        return line
    line = {k: v for k, v in line.items() if k != "argument"} | {"verdict": "survived"}
    if name not in equivalents:
        return line
    argument = equivalents[name]
    verdict = "cuda_only" if argument.startswith(CUDA_ONLY) else "equivalent"
    return line | {"verdict": verdict, "argument": argument}


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
    test, equivalent (argued), differing on CUDA only (argued), survived."""
    head = ("file", "mutants", "default battery", "only --full", "only a test", "equivalent",
            "CUDA only", "survived")  # fmt: skip
    rows = []
    for source in sorted(record["files"]):
        verdicts = [m["verdict"] for m in record["mutants"].values() if m["file"] == source]
        killed = sum(v in KILLED for v in verdicts)
        rows.append([source, len(verdicts), killed, *(verdicts.count(c) for c in COLUMNS)])
    rows.append(["all", *(sum(r[i] for r in rows) for i in range(1, len(head)))])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    pending = ", ".join(f"{f} ({n})" for f, n in record["pending"].items())
    return "\n".join(lines) + (f"\nnot judged yet: {pending}" if pending else "")


def score(record: dict) -> dict[str, int]:
    """The README's figures: ``killed`` by the default battery out of ``judged`` (the mutants
    neither equivalent nor CUDA only), and the counts of ``equivalent``, ``cuda_only``,
    ``full_only`` and ``test_only`` mutants."""
    verdicts = [m["verdict"] for m in record["mutants"].values()]
    equivalent, cuda_only = verdicts.count("equivalent"), verdicts.count("cuda_only")
    return {
        "killed": sum(v in KILLED for v in verdicts),
        "judged": len(verdicts) - equivalent - cuda_only,
        "equivalent": equivalent,
        "cuda_only": cuda_only,
        "full_only": verdicts.count("killed_full"),
        "test_only": verdicts.count("killed_test"),
    }


# ------------------------------------------------------------------------------ the CI sample
def generate_mutants() -> None:
    """mutmut's ``mutants/`` tree without running anything (no stats pass: the record knows
    which backend kills each sampled mutant)."""
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


def load_judge():
    """``judge.py`` as a module (it is a pytest file, not a package module)."""
    spec = importlib.util.spec_from_file_location("mutation_judge", HERE / "judge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_sample(size: int, seed: int) -> int:
    """Rerun ``size`` killed mutants of the record, drawn with ``seed``, on the backend the
    record says killed each: each must fail there, at the same graph, dtype and check."""
    record = json.loads(RECORD.read_text())
    hashes = file_hashes()
    if any(hashes[f] != h for f, h in record["files"].items()):
        print("the record was made from other versions of the mutated files: make mutations")
        return 1
    generate_mutants()
    judge_module = load_judge()
    killed = sorted(n for n, m in record["mutants"].items() if m["verdict"] == "killed")
    disagree = 0
    for name in random.Random(seed).sample(killed, size):
        want = record["mutants"][name]["by"]
        (MUTANTS / "judge_verdicts" / f"{name}.json").unlink(missing_ok=True)
        judge = want["backend"]
        for path in judge_module.PATHS:  # the judged backend, without the path the judge forced
            judge = judge.removesuffix(path)
        if judge.endswith(judge_module.DOORS):  # another backend's doors, after the home battery
            judge = judge_module.HOME[module_of(name)]
        failed = pytest_fails(name, [f"{JUDGE}::test_default_battery[{judge}]"],
                              MUTATION_JUDGE=judge)  # fmt: skip
        got = verdict_of(name)
        same = failed and got is not None and all(got[k] == want[k] for k in WHERE)
        disagree += not same
        record_says = {k: want[k] for k in WHERE}
        found = got and {k: got[k] for k in WHERE}
        print(f"{'agrees' if same else 'DISAGREES':<10} {name}: record {record_says}, now {found}")
    print(f"{size - disagree} of {size} sampled mutants agree with the record")
    return int(disagree > 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutant globs, e.g. 'fovi_ref.layout.*'")
    parser.add_argument("--sample", type=int, help="rerun this many killed mutants (CI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table", action="store_true", help="print the record's table")
    parser.add_argument("--no-run", action="store_true", help="the record from mutmut's cache")
    parser.add_argument("--files", nargs="*", help="enter only these files (and the record's)")
    args = parser.parse_args(argv)
    stray = [f for f in args.files or [] if not f.endswith(".py")]
    if stray:  # --files takes every argument after it
        parser.error(f"--files takes .py files; put mutant names before it: {stray}")
    os.chdir(ROOT)  # mutmut reads its mutants/ relative to the working directory
    if args.table:
        record = json.loads(RECORD.read_text())
        print(table(record))
        print(score(record))
        return 0
    if args.sample:
        return run_sample(args.sample, args.seed)
    run_job(args.names, run=not args.no_run, files=args.files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
