"""The mutation records stay true, and the engine that writes them keeps its rules.

Two jobs, configurations of one engine (``scripts/mutations/engine.py``, configured in
``scripts/mutations/run.py``): ``backends`` (``record.json``) and ``rule`` (``rule_record.json``).
For each record: every verdict is keyed by the function it judged, no mutant survived unargued,
every argument is for a mutant the record holds as argued, and the README states its score, its
pending count and the commit its sources were read from.

A function whose code changed since its record was written is pending, not a failure: the next
run judges it, and CI judges a seeded sample of it first (``run.py JOB --sample``, in .ci/run).
The engine's rules (keys, triage, arguments, the second stage's reuse) are tested on small cases
of their own.
"""

from __future__ import annotations

import re
import tomllib

import pytest
from conftest import ROOT, load_script

from fovi_ref import available_ops
from fovi_ref.strategies import STRATEGIES

# The engine reads mutmut's status names; the lent GPU's image (scripts/gpu_check.sh) has none.
pytest.importorskip("mutmut", reason="scripts/mutations/engine.py reads mutmut's status names")
RUN = load_script("scripts/mutations/run.py")
ENGINE = RUN.engine
KEYS = ENGINE.keys
PLANTED = load_script("scripts/mutations/planted_bugs.py")
JUDGE = load_script("scripts/mutations/judge.py")
JOBS = RUN.JOBS
RECORDS = {name: ENGINE.load_record(job) for name, job in JOBS.items()}
ARGUMENTS = {name: ENGINE.load_arguments(job.equivalents) for name, job in JOBS.items()}
PENDING = {name: set(ENGINE.pending_now(job, RECORDS[name])) for name, job in JOBS.items()}
VERDICTS = {
    "backends": {*ENGINE.KILLED, "killed_full", "killed_test", *ENGINE.ARGUED},
    "rule": {*ENGINE.KILLED, "equivalent"},
}
"""What a held line of each record may say: every verdict but ``survived``."""


def held(job: str) -> dict[str, dict]:
    """The record's lines whose function is not pending now: the verdicts that still hold."""
    lines = RECORDS[job]["mutants"].items()
    return {n: m for n, m in lines if ENGINE.function_id(n) not in PENDING[job]}


# ------------------------------------------------------------------------------- the records
@pytest.mark.parametrize("job", JOBS)
def test_the_record_keys_every_mutant_by_a_function_it_judged(job):
    """Each mutant's line names its function, which has a key in the record and is not pending
    there; a pending function has mutants to judge and none of them in the record."""
    record = RECORDS[job]
    functions, pending = record["functions"], record["pending"]
    assert record["tool"] == ENGINE.TOOL and record["judge"] == list(JOBS[job].judge)
    assert set(pending) <= set(functions) and all(n > 0 for n in pending.values())
    for name, mutant in record["mutants"].items():
        function = ENGINE.function_id(name)
        assert function in functions and function not in pending, name
        assert function == f"{mutant['file']}::{mutant['function']}", name
    files = {f.partition("::")[0] for f in functions}
    assert files <= set(JOBS[job].files)
    assert all(f"{f}::{KEYS.MODULE}" in functions for f in files)


@pytest.mark.parametrize("job", JOBS)
def test_the_record_was_read_from_a_commit_of_this_repository(job):
    commit = RECORDS[job]["sources"].removesuffix("+uncommitted")
    assert re.fullmatch(r"[0-9a-f]{40}", commit), RECORDS[job]["sources"]


@pytest.mark.parametrize("job", JOBS)
def test_no_mutant_survived_and_every_argued_one_is_argued(job):
    for name, mutant in held(job).items():
        assert mutant["verdict"] in VERDICTS[job], (name, mutant)
        assert mutant["line"] >= 1 and "->" in mutant["change"], name
        if mutant["verdict"] in ENGINE.ARGUED:
            argument = ARGUMENTS[job][name]
            assert len(mutant["argument"]) > 20 and mutant["argument"] == argument["why"]
            assert mutant["change"] == argument["change"], name


@pytest.mark.parametrize("job", JOBS)
def test_every_argument_is_for_an_argued_mutant_of_the_record(job):
    """An argument for a mutant of a pending function waits for the job to judge it."""
    lines = held(job)
    for name in ARGUMENTS[job]:
        assert ENGINE.file_of(name) in JOBS[job].files, name
        if ENGINE.function_id(name) in PENDING[job] | set(RECORDS[job]["pending"]):
            continue
        assert lines[name]["verdict"] in ENGINE.ARGUED, name


def test_the_backends_kills_name_their_row_and_the_rules_slow_kills_their_test():
    for mutant in held("backends").values():
        if mutant["verdict"] == "killed":
            assert set(mutant["by"]) >= set(RUN.WHERE)
    for mutant in held("rule").values():
        assert set(mutant.get("by") or {"test": None}) <= {"test", "note"}
        assert (mutant.get("by") or {}).get("test") in (None, *RUN.SLOW)


def test_the_judge_runs_every_backend_and_every_strategy():
    backends = {"general", "gather_gemm", "einsum_baseline", "general_textbook"}
    assert backends <= set(available_ops())
    assert set(JUDGE.JUDGED) == backends | {f"general[{s}]" for s in STRATEGIES}
    home = {
        ENGINE.module_of(f"{f.removesuffix('.py')}.x_f__mutmut_1".replace("/", "."))
        for f in JOBS["backends"].files
    }
    assert {m.removesuffix(".__init__") for m in home} <= set(JUDGE.HOME)
    assert set(RUN.UNIT_TESTS) == set(JOBS["backends"].files)


def test_the_rule_job_has_its_own_mutmut_configuration_and_cache():
    """mutmut reads ``[tool.mutmut]`` from, and writes ``mutants/`` to, the directory it runs
    in: the rule's job runs in ``mutants-rule/``, never in the backends' ``mutants/``."""
    config = tomllib.loads(RUN.rule_mutmut_config())["tool"]["mutmut"]
    assert config["only_mutate"] == list(RUN.RULE_FUNCTIONS)
    assert config["pytest_add_cli_args_test_selection"] == list(JOBS["rule"].judge)
    assert JOBS["rule"].mutants != JOBS["backends"].mutants == ROOT / "mutants"
    backends = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert not set(backends["only_mutate"]) & set(config["only_mutate"])
    assert "mutants-rule/" in (ROOT / ".gitignore").read_text().split()


def test_the_readme_states_both_scores():
    readme = " ".join((ROOT / "README.md").read_text().split())  # lines joined
    record, figures = RECORDS["backends"], ENGINE.score(RECORDS["backends"])
    stated = re.search(
        r"mutation score \*\*(\d+)/(\d+)\*\*.*?(\d+) equivalent.*?(\d+) that differ on CUDA only"
        r".*?(\d+) are killed only by `--full`, (\d+) only by a unit test",
        readme,
    )
    assert stated, "the README's validator section states no mutation score"
    keys = ("killed", "judged", "equivalent", "cuda_only", "full_only", "test_only")
    assert dict(zip(keys, map(int, stated.groups()), strict=True)) == {k: figures[k] for k in keys}
    sources = f"read from commit `{record['sources'][:7]}`"
    assert sources + ("" if "+" not in record["sources"] else " and uncommitted changes") in readme
    pending = f"{figures['pending']} mutants of {figures['pending_functions']} functions pending"
    assert pending in readme
    # a CUDA-only mutant scripts/mutations/on_cuda.py killed on a GPU says so in its argument
    on_gpu = [m for m in record["mutants"].values() if "killed on CUDA" in m.get("argument", "")]
    assert all(m["verdict"] == "cuda_only" for m in on_gpu)
    assert f"({len(on_gpu)} killed on a GPU: `scripts/mutations/on_cuda.py`)" in readme

    record, figures = RECORDS["rule"], ENGINE.score(RECORDS["rule"])
    stated = re.search(
        r"the tolerance rule, is mutated too.*?mutation score \*\*(\d+)/(\d+)\*\* with "
        r"(\d+) argued equivalent, (\d+) of (\d+) functions",
        readme,
    )
    assert stated, "the README's validator section states no score for the rule"
    # the record's own count, not today's: an edit to the rule changes nothing the README states
    # until the record is written again
    functions = [f for f in record["functions"] if not f.endswith("::" + KEYS.MODULE)]
    judged = len([f for f in functions if f not in record["pending"]])
    rule = sum(len(names) for names in RUN.RULE_FUNCTIONS.values())
    want = (figures["killed"], figures["judged"], figures["equivalent"], judged, rule)
    assert tuple(map(int, stated.groups())) == want


def test_each_retired_planted_class_has_a_quiet_mutant_the_oracle_kills():
    """scripts/mutations/planted_bugs.py retires a planted bug class only for a mutant of the
    record that makes the same kind of bug: a wrong value the oracle finds, not an exception."""
    for kind, (name, _) in PLANTED.RETIRED.items():
        assert kind not in PLANTED.MUTATIONS, kind
        mutant = RECORDS["backends"]["mutants"][name]
        assert mutant["verdict"] == "killed", (kind, mutant)
        assert mutant["by"]["check"] == "oracle", (kind, mutant)
        assert not mutant["by"]["note"].startswith("raised"), (kind, mutant)


# ------------------------------------------------------------------------------- the engine
def test_a_renumbered_mutant_keeps_its_second_stage_verdict_and_a_repeated_change_does_not():
    """An edit above a mutant renumbers it: the record finds its last verdict by its change,
    where that change names one mutant of the file only."""
    line = {"file": "f.py", "line": 3, "verdict": "killed_test", "by": {"test": "t.py"}}
    record = {
        "m__mutmut_1": {**line, "change": "a + b  ->  a - b"},
        "m__mutmut_2": {**line, "change": "x[0]  ->  x[1]"},
        "m__mutmut_3": {**line, "change": "x[0]  ->  x[1]"},  # the same change, twice
    }
    same = ENGINE.by_change(record)
    assert same == {("f.py", "a + b  ->  a - b"): record["m__mutmut_1"]}


def judged(monkeypatch, last: dict, outcome: tuple[str, dict]) -> tuple[dict, list]:
    """``judged_line`` of a mutant the first stage passed (mutmut's exit code 0) whose change is
    ``a  ->  b``, with ``last`` the record's previous line and a second stage that returns
    ``outcome``; with the mutants the second stage was asked about."""
    asked = []

    def second_stage(job, name: str, source: str) -> tuple[str, dict]:
        asked.append(name)
        return outcome

    monkeypatch.setattr(ENGINE, "change_of", lambda job, name, source: (3, "a  ->  b"))
    monkeypatch.setattr(ENGINE, "second_stage", second_stage)
    line = ENGINE.judged_line(
        JOBS["rule"], "p.x_g__mutmut_1", "f.py", 0, {"p.x_g__mutmut_1": last}, {}
    )
    return line, asked


def test_a_survivor_of_the_first_stage_runs_the_second_unless_the_record_holds_its_outcome(
    monkeypatch,
):
    """The second stage is skipped only where the last record holds its outcome for this same
    change: a kill by it (a test named where its verdict is also the first stage's), or a
    survivor (argued again by the caller). An equivalent line that never ran it runs it, and so
    does a first-stage kill that the first stage now passes."""
    slow = {"test": "tests/t.py::test_slow"}
    kill = {"change": "a  ->  b", "verdict": "killed", "by": slow}
    line, asked = judged(monkeypatch, kill, ("survived", {}))
    assert (line["verdict"], line["by"], asked) == ("killed", slow, [])
    full = {"change": "a  ->  b", "verdict": "killed_full", "by": {"graph": "random"}}
    assert judged(monkeypatch, full, ("survived", {}))[0]["verdict"] == "killed_full"
    survivor = {"change": "a  ->  b", "verdict": "equivalent", "by": {}, "argument": "..."}
    line, asked = judged(monkeypatch, survivor, ("killed", slow))
    assert (line["verdict"], asked) == ("survived", [])
    never_ran = {"change": "a  ->  b", "verdict": "equivalent", "argument": "gone now"}
    line, asked = judged(monkeypatch, never_ran, ("killed", slow))
    assert (line["verdict"], line["by"], asked) == ("killed", slow, ["p.x_g__mutmut_1"])
    first_stage = {"change": "a  ->  b", "verdict": "killed", "by": {"graph": "random"}}
    line, asked = judged(monkeypatch, first_stage, ("survived", {}))
    assert (line["verdict"], asked) == ("survived", ["p.x_g__mutmut_1"])
    other_change = {"change": "c  ->  d", "verdict": "killed", "by": slow}
    assert judged(monkeypatch, other_change, ("survived", {}))[1] == ["p.x_g__mutmut_1"]


def test_mutmut_names_map_to_the_functions_keys():
    assert KEYS.function_of("fovi_ref.segment_sum.x_segment_sum__mutmut_3") == "segment_sum"
    method = "fovi_ref.knn_general.xǁGeneralTextbookOpsǁforward__mutmut_12"
    assert KEYS.function_of(method) == "GeneralTextbookOps.forward"
    assert ENGINE.function_id(method) == "fovi_ref/knn_general.py::GeneralTextbookOps.forward"
    strategy = "fovi_ref.strategies.x_strategy_for__mutmut_1"  # a package's module
    assert ENGINE.function_id(strategy) == "fovi_ref/strategies/__init__.py::strategy_for"


def test_a_changed_function_is_pending_and_a_changed_module_pends_its_file():
    job = JOBS["rule"]
    now = ENGINE.keys_now(job)
    record = {"tool": ENGINE.TOOL, "functions": dict(now), "pending": {}}
    assert ENGINE.pending_now(job, record) == []
    record["functions"]["fovi_ref/check/tolerances.py::gamma"] = "another"
    assert ENGINE.pending_now(job, record) == ["fovi_ref/check/tolerances.py::gamma"]
    record["functions"][f"fovi_ref/check/magnitude.py::{KEYS.MODULE}"] = "another"
    magnitude = {f for f in ENGINE.pending_now(job, record) if "magnitude" in f}
    assert magnitude == {
        f"fovi_ref/check/magnitude.py::{n}"
        for n in RUN.RULE_FUNCTIONS["fovi_ref/check/magnitude.py"]
    }


# ------------------------------------------------------------------- verdicts keyed by function
SOURCE = '''"""A module."""

LIMIT = 3  # a constant


def grow(x):
    """Doubles."""
    return x * 2  # twice


class Ops:
    """Some ops."""

    name = "ops"

    def run(self, x, scale=1):
        return grow(x) * scale
'''


def test_a_docstring_or_comment_edit_keeps_every_key():
    edited = SOURCE.replace("Doubles.", "Doubles its argument.").replace("# twice", "# x + x")
    edited = edited.replace('"""Some ops."""', '"""Ops, reworded."""\n    # a comment')
    assert KEYS.function_keys(edited) == KEYS.function_keys(SOURCE)
    assert set(KEYS.function_keys(SOURCE)) == {"grow", "Ops.run", KEYS.MODULE}


def test_a_code_change_moves_its_own_functions_key_only():
    before = KEYS.function_keys(SOURCE)
    for edited, moved in [
        (SOURCE.replace("x * 2", "x * 3"), {"grow"}),
        (SOURCE.replace("scale=1", "scale=2"), {"Ops.run"}),  # a default is the function's
        (SOURCE.replace("LIMIT = 3", "LIMIT = 4"), {KEYS.MODULE}),
        (SOURCE.replace('name = "ops"', 'name = "other"'), {KEYS.MODULE}),
        (SOURCE.replace("def grow", "@cache\ndef grow"), {"grow"}),  # a decorator
    ]:
        after = KEYS.function_keys(edited)
        assert {f for f in before if after[f] != before[f]} == moved, edited


def test_an_import_is_keyed_by_the_functions_that_read_its_names():
    """One more import for one function leaves the others standing; re-pointing a name pends
    every function that reads it, and the module code where it reads it."""
    base = (
        "from m import a\nfrom m import b\n\ndef f():\n    return a()\n\ndef g():\n    return b()\n"
    )
    before = KEYS.function_keys(base)
    added = KEYS.function_keys(base.replace("from m import b", "from m import b, c"))
    assert added == before  # no function reads c yet
    moved = KEYS.function_keys(base.replace("from m import a", "from n import a"))
    assert {f for f in before if moved[f] != before[f]} == {"f"}
    aliased = KEYS.function_keys(base.replace("from m import b", "from m import c as b"))
    assert {f for f in before if aliased[f] != before[f]} == {"g"}
    used_by_module = base + "X = a\n"
    moved = KEYS.function_keys(used_by_module.replace("from m import a", "from n import a"))
    changed = {f for f, k in KEYS.function_keys(used_by_module).items() if moved[f] != k}
    assert changed == {"f", KEYS.MODULE}
    future = KEYS.function_keys("from __future__ import annotations\n" + base)
    assert future[KEYS.MODULE] != before[KEYS.MODULE]  # it changes every function's meaning


def _triage_case():
    """A record of two files, ``a`` and ``b``, and mutmut's results in a fresh clone. In ``a``:
    ``same`` unchanged and not run, ``edited`` changed and not run, ``rerun`` changed and run
    whole; ``b``'s module code (a constant) changed, so its unchanged ``kept`` is pending too."""
    a, b = "pkg/a/__init__.py", "pkg/b/__init__.py"
    line = {"line": 3, "change": "x  ->  y", "verdict": "killed", "by": {}}
    names = {"pkg.a.x_same": (a, 2), "pkg.a.x_edited": (a, 1), "pkg.a.x_rerun": (a, 1)}
    names["pkg.b.x_kept"] = (b, 1)
    previous = {
        "tool": ENGINE.TOOL,
        "functions": {f"{a}::{KEYS.MODULE}": "ma", f"{b}::{KEYS.MODULE}": "mb"},
        "pending": {},
        "mutants": {
            f"{f}__mutmut_{i}": {"file": source, **line}
            for f, (source, count) in names.items()
            for i in range(1, count + 1)
        },
    }
    for function in ("same", "edited", "rerun"):
        previous["functions"][f"{a}::{function}"] = "k"
    previous["functions"][f"{b}::kept"] = "k"
    now = {**previous["functions"], f"{a}::edited": "k2", f"{a}::rerun": "k2"}
    now[f"{b}::{KEYS.MODULE}"] = "mb2"
    results = {name: (line["file"], None) for name, line in previous["mutants"].items()}
    results["pkg.a.x_rerun__mutmut_1"] = (a, 1)  # mutmut ran it: an exit code
    return previous, results, now


def test_an_unchanged_function_keeps_its_verdicts_and_a_changed_one_is_pending():
    """A fresh ``mutants/`` has judged nothing: the record keeps the lines of a function whose
    code and module are unchanged; a changed function mutmut has run whole is judged anew; any
    other changed function, and every function of a file whose module code changed, is pending."""
    previous, results, now = _triage_case()
    judged, kept, pending = ENGINE.triage(results, previous, now, set())
    assert set(kept) == {"pkg.a.x_same__mutmut_1", "pkg.a.x_same__mutmut_2"}
    assert kept["pkg.a.x_same__mutmut_1"] == previous["mutants"]["pkg.a.x_same__mutmut_1"]
    assert [n for n, _, _ in judged] == ["pkg.a.x_rerun__mutmut_1"]
    assert pending == {"pkg/a/__init__.py::edited": 1, "pkg/b/__init__.py::kept": 1}


def test_a_rerun_mutant_of_an_unchanged_function_is_judged_anew():
    previous, results, now = _triage_case()
    results["pkg.a.x_same__mutmut_2"] = ("pkg/a/__init__.py", 0)
    rerun = {"pkg.a.x_same__mutmut_2"}
    judged, kept, _ = ENGINE.triage(results, previous, now, rerun)
    assert "pkg.a.x_same__mutmut_1" in kept and "pkg.a.x_same__mutmut_2" not in kept
    assert "pkg.a.x_same__mutmut_2" in [n for n, _, _ in judged]


def test_nothing_is_kept_from_another_mutmut_or_from_other_mutants():
    """mutmut numbers a function's mutants: another version, or other mutants of the same
    function, make the last record's names mean other changes."""
    previous, results, now = _triage_case()
    older = {**previous, "tool": "mutmut 0.0.1"}
    assert ENGINE.triage(results, older, now, set())[1] == {}
    results["pkg.a.x_same__mutmut_3"] = ("pkg/a/__init__.py", None)  # not in the record
    _, kept, pending = ENGINE.triage(results, previous, now, set())
    assert not kept and pending["pkg/a/__init__.py::same"] == 3


def test_a_function_pending_in_the_record_stays_pending_until_judged():
    previous, results, now = _triage_case()
    previous["pending"] = {"pkg/a/__init__.py::same": 2}
    _, kept, pending = ENGINE.triage(results, previous, now, set())
    assert not kept and pending["pkg/a/__init__.py::same"] == 2


def test_the_ci_sample_takes_pending_mutants_first_and_replays_by_seed():
    pending, killed = [f"p{i}" for i in range(3)], [f"k{i}" for i in range(20)]
    chosen = ENGINE.choose_sample(pending, killed, 8, seed=5)
    assert sorted(chosen[:3]) == pending and set(chosen[3:]) <= set(killed) and len(chosen) == 8
    assert ENGINE.choose_sample(pending, killed, 8, seed=5) == chosen
    assert set(ENGINE.choose_sample([f"p{i}" for i in range(10)], killed, 8, seed=5)) < {
        f"p{i}" for i in range(10)
    }


def test_a_kept_line_is_argued_by_the_arguments_as_they_are_now():
    """The equivalents file decides a survivor's verdict each time the record is written: an
    argument added argues it, one removed makes it a survivor again, a CUDA-only one says so."""
    survivor = {"file": "f.py", "change": "a + b  ->  a - b", "verdict": "survived", "by": {}}
    argued = {**survivor, "verdict": "equivalent", "argument": "path: the same values"}
    assert ENGINE.argued("m", argued, {}) == survivor
    path = {"m": {"change": "a + b  ->  a - b", "why": "path: x"}}
    assert ENGINE.argued("m", survivor, path)["verdict"] == "equivalent"
    reason = f"{ENGINE.CUDA_ONLY} on CUDA it mixes devices"
    cuda = ENGINE.argued("m", argued, {"m": {"change": "a + b  ->  a - b", "why": reason}})
    assert (cuda["verdict"], cuda["argument"]) == ("cuda_only", reason)
    killed = {"file": "f.py", "verdict": "killed_test", "by": {"test": "t.py"}}
    assert ENGINE.argued("m", killed, path) == killed  # a kill is not argued away


def test_an_argument_for_another_change_argues_nothing():
    """An edit renumbers a function's mutants: an argument written for mutant 7's old change
    leaves today's mutant 7 a survivor, with the change the argument was for; written again for
    the new change, it argues it."""
    survivor = {"file": "f.py", "change": "a * b  ->  a / b", "verdict": "survived", "by": {}}
    old = {"m": {"change": "a + b  ->  a - b", "why": "path: the same values"}}
    line = ENGINE.argued("m", survivor, old)
    assert line == survivor | {"argued_change": "a + b  ->  a - b"}
    new = {"m": {"change": "a * b  ->  a / b", "why": "path: the same values"}}
    assert ENGINE.argued("m", line, new) == survivor | {
        "verdict": "equivalent",
        "argument": "path: the same values",
    }


def test_an_equivalents_entry_must_hold_its_change_and_why(tmp_path):
    path = tmp_path / "equivalents.toml"
    path.write_text('["m"]\nchange = "a  ->  b"\nwhy = "the same values"\n')
    assert ENGINE.load_arguments(path) == {"m": {"change": "a  ->  b", "why": "the same values"}}
    path.write_text('["m"]\nchnage = "a  ->  b"\nwhy = "the same values"\n')
    with pytest.raises(SystemExit, match="m must hold exactly 'change' and 'why'"):
        ENGINE.load_arguments(path)
    path.write_text('"m" = "an argument without its change"\n')
    with pytest.raises(SystemExit, match="m must hold"):
        ENGINE.load_arguments(path)


# --------------------------------------------------- scripts/mutations/on_cuda.py (the GPU's job)
ON_CUDA = load_script("scripts/mutations/on_cuda.py")
CLASS_FILE = """class Ops:
    def grad(self, acc):
        total = acc + 1
        return total
"""


def test_a_methods_diff_is_applied_at_its_class_indent():
    """mutmut's diff of a method is dedented to the function's own level, and its line numbers
    count from the function: the hunk is found by content, at the class's indent."""
    diff = "\n".join(
        [
            "--- f.py",
            "+++ f.py",
            "@@ -1,3 +1,3 @@",
            " def grad(self, acc):",
            "-    total = acc + 1",
            "+    total = acc - 1",
            "     return total",
        ]
    )
    mutated = ON_CUDA.apply_diff(CLASS_FILE, diff)
    assert mutated == CLASS_FILE.replace("acc + 1", "acc - 1")
    with pytest.raises(ValueError, match="not found once"):
        ON_CUDA.apply_diff(CLASS_FILE, diff.replace("acc + 1", "acc + 2"))


def test_a_kill_at_the_row_the_clean_checkout_fails_is_unjudged():
    """Where the clean run fails at the same row (its note, with the numbers, may differ) or the
    same test, the row cannot tell the mutant from the original."""
    row = {"backend": "gather_gemm[index]", "graph": "downsample_wide", "check": "determinism"}
    killed = {"verdict": "killed", "by": {**row, "note": "differs between runs: grad_x"}}
    failing_clean = {"verdict": "killed", "by": {**row, "note": "differs between runs: y"}}
    assert ON_CUDA.read_against_clean(killed, failing_clean)["verdict"] == "unjudged"
    test = "FAILED tests/test_segment_sum.py::test_sums[cuda]"
    by_test = {"verdict": "killed_test", "by": {"test": test + " - assert 0.1 == 0.2"}}
    clean_test = {"verdict": "killed_test", "by": {"test": test + " - assert 0.3 == 0.2"}}
    assert ON_CUDA.read_against_clean(by_test, clean_test)["verdict"] == "unjudged"
    elsewhere = {"verdict": "killed", "by": {**row, "graph": "downsample"}}
    assert ON_CUDA.read_against_clean(elsewhere, failing_clean)["verdict"] == "killed"
    passing_clean = {"verdict": "passes", "by": {}}
    assert ON_CUDA.read_against_clean(killed, passing_clean)["verdict"] == "killed"
