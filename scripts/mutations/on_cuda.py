"""The record's *CUDA only* mutants, judged on a GPU: the changes that matter on CUDA alone
(a tensor made on the CPU whatever the graph's device, a 16-bit ``index_add_`` that CUDA rounds
at every add), which ``equivalents.toml`` argues and the CPU job cannot run.

    python scripts/mutations/on_cuda.py export DIR   # here (make cuda-mutants): DIR/mutants.json
    python scripts/mutations/on_cuda.py judge DIR    # on the GPU: DIR/cuda_verdicts.json

``export`` needs mutmut's ``mutants/`` (after ``make mutations``): it writes each ``cuda_only``
mutant of ``record.json`` as its whole mutated source file, with its judge (the backend that
judges it in ``judge.py``) and the unit tests of its file (``run.py``'s ``UNIT_TESTS``). The GPU
machine has no mutmut, so ``judge`` needs nothing but fovi_ref's checkout and torch with CUDA:

1. it writes the mutated file into a copy of the checkout, and there, in a fresh process,
2. runs the judge's default battery with ``--device cuda`` on every path CUDA can take: the
   unforced one (16-bit GEMMs narrow; ``gather_gemm``'s dense ``S`` within
   ``DENSE_S_BUDGET["cuda"]``) and, for ``gather_gemm``, its index scatter forced, whose
   ``index_add_`` CUDA runs by atomics in no fixed order (two runs can differ, so that path
   skips ``determinism``); it stops at the first failed row (a function no backend calls,
   mutmut's *not reached*, skips it);
3. where the battery passes, the file's unit tests selected by ``-k cuda``.

Each judge also runs once on the clean checkout. Every run has its own copy of the checkout and
process, and they all run side by side (``--workers``; the battery's kernels are small), so the
job takes about as long as its slowest run. A killed mutant is ``killed`` (the row: path, graph,
dtype, check, quantity) or ``killed_test`` (the first failing test); otherwise ``survived`` or
``timeout``. Where the clean run fails at the same row or test, the mutant is ``unjudged``: that
failure is the original's, not the mutant's. A kill is entered in the mutant's argument in
``equivalents.toml`` (its verdict stays ``cuda_only``, which the CPU job cannot judge), with the
device, the date and the failed row.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from subprocess import PIPE

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "scripts" / "mutations"
COPY_IGNORES = (".git", ".venv", ".whl", "build", "results", "mutants", "__pycache__")
"""What a mutant's copy of the checkout leaves out."""
MUTANT_SECONDS = 150
"""The cap on one mutant's judging, a whole battery where it passes (the CPU's default battery
is about 30 s on 2 cores; on a GPU it is launch-bound)."""


def file_hash(path: str) -> str:
    """sha256 of a checkout file: an exported mutant is judged against the very file it was
    made from."""
    return hashlib.sha256((ROOT / path).read_bytes()).hexdigest()


# ------------------------------------------------------------------------------- here: export
def apply_diff(text: str, diff: str) -> str:
    """``text`` with mutmut's diff of one function applied. The diff's line numbers count from
    the function, not the file, so each hunk's old lines (context and ``-``) are found in
    ``text`` by content, whole lines, where they must occur exactly once, and replaced by its
    new lines. A hunk whose continued lines keep another indent is refused (ValueError)."""
    hunks, old, new = [], [], []
    for line in diff.splitlines()[2:]:  # after the --- and +++ lines
        if line.startswith("@@"):
            if old:
                hunks.append((old, new))
            old, new = [], []
        elif line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
        else:
            old.append(line[1:])
            new.append(line[1:])
    hunks.append((old, new))
    for old, new in hunks:
        # A method's diff is dedented by its class's level: indent the hunk until it is found.
        for indent in ("", "    ", "        "):
            before, after = (
                "".join(indent + line + "\n" if line else "\n" for line in side)
                for side in (old, new)
            )
            if ("\n" + text).count("\n" + before) == 1:  # anchored at a line's start
                break
        else:
            raise ValueError(f"a hunk's old lines are not found once at any indent:\n{before}")
        text = ("\n" + text).replace("\n" + before, "\n" + after)[1:]
    return text


def export(folder: Path) -> None:
    """Write ``folder/mutants.json``: every ``cuda_only`` mutant as a whole mutated file."""
    if str(HERE) not in sys.path:  # the scripts beside this one: no package
        sys.path.insert(0, str(HERE))
    import engine  # mutmut's reader: here only, never on the GPU machine
    from judge import HOME
    from mutmut.stats import status_by_exit_code
    from run import BACKENDS, UNIT_TESTS

    record = engine.load_record(BACKENDS)
    waiting = set(engine.pending_now(BACKENDS, record))
    argued = {
        engine.function_id(n) for n, m in record["mutants"].items() if m["verdict"] == "cuda_only"
    }
    stale = sorted(argued & waiting)
    if stale:
        sys.exit(f"the record does not hold these functions as they are (make mutations): {stale}")
    codes = {name: code for name, (_, code) in engine.mutmut_results(BACKENDS).items()}
    mutants = []
    for name, entry in sorted(record["mutants"].items()):
        if entry["verdict"] != "cuda_only":
            continue
        source = entry["file"]
        diff = engine.mutant_diff(BACKENDS, name, source)
        mutants.append(
            {
                "name": name,
                "file": source,
                "hash": file_hash(source),
                "change": entry["change"],
                "judge": HOME[engine.module_of(name)],
                "tests": UNIT_TESTS[source],
                # mutmut's "not reached": no backend calls the function, only its tests judge it
                "battery": engine.RENAMED.get(status_by_exit_code[codes[name]]) != "not reached",
                "source": apply_diff((ROOT / source).read_text(), diff),
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mutants.json").write_text(json.dumps(mutants, indent=1) + "\n")
    print(f"{len(mutants)} CUDA-only mutants written to {folder / 'mutants.json'}")


# ------------------------------------------------------------------------ on the GPU: judge
def battery_on(judged: str, device: str) -> dict | None:
    """The first failed row of the judge's default battery on ``device``, on each path CUDA
    takes (``None``: every path passes). An error raised outside the ops' calls is a failed row."""
    import torch
    from judge import DTYPES, GRAPHS, ops_of

    from fovi_ref.check.check_ops import CHECKS, check_ops
    from fovi_ref.check.switches import forced_grad_input_path

    paths = [(judged, contextlib.nullcontext(), CHECKS)]
    if judged == "gather_gemm":  # CUDA's dense S is the unforced path; the scatter, forced
        # CUDA's index_add_ adds colliding rows by atomics in no fixed order, so the index
        # path differs between runs there (the clean checkout fails determinism on it)
        index = forced_grad_input_path("index", torch.device(device).type)
        paths.append((judged + "[index]", index, [c for c in CHECKS if c != "determinism"]))
    for path, knob, checks in paths:
        try:
            ops = ops_of(judged)  # in the try: a mutant of forced_ops may raise here
            with knob:
                report = check_ops(
                    ops,
                    graphs=GRAPHS["default"],
                    dtypes=DTYPES,
                    device=device,
                    checks=checks,
                    stop_at_first_fail=True,
                )
        except Exception as err:
            return {"backend": path, "check": "battery", "note": f"raised {err!r}"[:300]}
        if report.failures:
            row = report.failures[0]
            return {
                "backend": path,
                "graph": row.graph,
                "dtype": row.dtype,
                "check": row.check,
                "quantity": row.quantity,
                "note": row.note[:300],
            }
    return None


def first_failing_test(tests: list[str]) -> str | None:
    """The first of ``tests``' CUDA tests that fails on the mutated checkout (``None``: all
    pass). Raises where pytest cannot run, or selects nothing."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-k",
        "cuda",
        *tests,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode == 1:
        failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
        return failed[0] if failed else done.stdout[-300:]
    if done.returncode != 0:
        raise RuntimeError(f"pytest could not run {tests}:\n{done.stdout[-2000:]}")
    return None


def judge_one(mutant: dict) -> dict:
    """The verdict on one mutant whose file is already written over the checkout's."""
    row = battery_on(mutant["judge"], mutant["device"]) if mutant["battery"] else None
    if row is not None:
        return {"verdict": "killed", "by": row}
    failed = first_failing_test(mutant["tests"])
    if failed is not None:
        return {"verdict": "killed_test", "by": {"test": failed}}
    return {"verdict": "survived", "by": {}}


def judge_in_copy(task: dict, folder: Path, timeout: float, device: str) -> dict:
    """Judge ``task`` (a mutant, or a clean run where it has no ``source``) in its own copy of
    the checkout, ``folder``, in a fresh process, so that tasks run side by side, each importing
    its own fovi_ref. A task past ``timeout`` is stopped with every process it started."""
    shutil.copytree(ROOT, folder, ignore=shutil.ignore_patterns(*COPY_IGNORES))
    if "source" in task:
        (folder / task["file"]).write_text(task["source"])
    path = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "2"}
    one = {key: task[key] for key in ("judge", "tests", "battery")} | {"device": device}
    command = [sys.executable, str(folder / "scripts/mutations/on_cuda.py"), "one", json.dumps(one)]
    started = time.monotonic()
    # its own session, so that a timeout stops the pytest it may have started too
    process = subprocess.Popen(
        command, cwd=folder, env=env, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=timeout)
        lines = out.strip().splitlines()
        if process.returncode == 0 and lines:
            verdict = json.loads(lines[-1])
        else:  # the judge itself broke (pytest could not run, say): no verdict, the error kept
            verdict = {"verdict": "error", "by": {"note": err[-1000:]}}
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        verdict = {"verdict": "timeout", "by": {}}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return verdict | {"seconds": round(time.monotonic() - started, 1)}


def clean_name(mutant: dict) -> str:
    """The clean run a mutant's verdict is read against: the same judge, tests and battery."""
    return f"clean {mutant['judge']} {' '.join(mutant['tests'])} battery={mutant['battery']}"


def passes(clean: dict) -> dict:
    """A clean run's verdict in the record's words: ``passes`` where no row or test failed."""
    return clean | {"verdict": "passes"} if clean["verdict"] == "survived" else clean


def failed_at(verdict: dict) -> tuple:
    """Where a run failed: the row's backend, graph, dtype, check and quantity, or the test's
    node id (not the notes and messages, whose numbers differ from run to run)."""
    by = verdict["by"]
    if "test" in by:
        return (by["test"].split(" - ")[0],)
    return tuple(by.get(key) for key in ("backend", "graph", "dtype", "check", "quantity"))


def read_against_clean(verdict: dict, clean: dict) -> dict:
    """A mutant's verdict, ``unjudged`` where its clean run failed at the same row or test."""
    if clean["verdict"] != "passes" and failed_at(clean) == failed_at(verdict):
        return {**verdict, "verdict": "unjudged"}
    return verdict


def verdicts(found: dict, cleans: list[str], mutants: list[dict], device: str) -> dict:
    """The verdicts file from the runs ``found`` so far: a mutant whose clean run has not
    finished keeps its raw verdict and says so (``clean`` not run)."""
    import torch

    out = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "complete": len(found) == len(cleans) + len(mutants),
        # a clean run that no row or test fails "passes" (judge_one's word is "survived")
        "clean": {name: passes(found[name]) for name in cleans if name in found},
        "mutants": {},
    }
    for mutant in mutants:
        if mutant["name"] not in found:
            continue
        verdict, clean = found[mutant["name"]], out["clean"].get(clean_name(mutant))
        verdict = read_against_clean(verdict, clean) if clean else verdict | {"clean": "not run"}
        out["mutants"][mutant["name"]] = verdict | {
            key: mutant[key] for key in ("file", "hash", "change")
        }
    return out


def judge(folder: Path, timeout_s: float, workers: int, device: str) -> None:
    """Judge every mutant of ``folder/mutants.json``, and each judge once on the clean
    checkout, ``workers`` at a time, each within ``timeout_s``; write
    ``folder/cuda_verdicts.json`` after every run, so that a job cut off keeps what it found. A
    mutant whose judge fails the clean checkout at the same row (or test) is ``unjudged``: that
    row cannot tell the mutant from the original. (The battery stops at its first failed row, so
    a clean run that fails early leaves the mutants after it unjudged, tests unrun.)"""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("on_cuda.py judge needs a CUDA device (--device cpu: a dry run of the job)")
    mutants = json.loads((folder / "mutants.json").read_text())
    for mutant in mutants:
        if file_hash(mutant["file"]) != mutant["hash"]:
            sys.exit(f"{mutant['file']} is not the file {mutant['name']} was exported from")
    cleans = {clean_name(m): {**m, "name": clean_name(m)} for m in mutants}
    for clean in cleans.values():
        del clean["source"]
    tasks = [*cleans.values(), *mutants]  # the clean runs first: every verdict needs one
    found = {}
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(workers) as pool:
        running = {
            pool.submit(judge_in_copy, task, Path(work) / str(i), timeout_s, device): task
            for i, task in enumerate(tasks)
        }
        for future in as_completed(running):
            name = running[future]["name"]
            found[name] = future.result()
            print(name, found[name]["verdict"], found[name]["by"], f"{found[name]['seconds']} s")
            out = verdicts(found, list(cleans), mutants, device)
            (folder / "cuda_verdicts.json").write_text(json.dumps(out, indent=1) + "\n")
    print(dict(Counter(v["verdict"] for v in out["mutants"].values())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["export", "judge", "one"])
    parser.add_argument("where", help="DIR (export, judge); one: the task, as JSON")
    parser.add_argument("--timeout", type=float, default=MUTANT_SECONDS, help="judge: s a mutant")
    parser.add_argument("--device", default="cuda", help="judge: cpu for a dry run (all survive)")
    parser.add_argument("--workers", type=int, default=32, help="judge: runs at a time")
    args = parser.parse_args()
    if args.action == "export":
        export(Path(args.where))
    elif args.action == "judge":
        judge(Path(args.where), args.timeout, args.workers, args.device)
    else:  # one: the fresh process of judge(), run with the mutated file in place
        print(json.dumps(judge_one(json.loads(args.where))))


if __name__ == "__main__":
    main()
