"""The mutation record (scripts/mutations/record.json) stays true: every verdict is keyed by the
function it judged, no mutant survived unargued, and the README states its score, its pending
count and the commit its sources were read from.

A function whose code changed since the record was written is pending, not a failure:
``make mutations`` judges it, and CI judges a seeded sample of it first
(``scripts/mutations/run.py --sample``, in .ci/run). These tests read the record, and the keys'
rules on small sources of their own.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import ROOT, load_script

from fovi_ref import available_ops
from fovi_ref.strategies import STRATEGIES

# run.py reads mutmut's status names; the lent GPU's image (scripts/gpu_check.sh) has no mutmut.
pytest.importorskip("mutmut", reason="scripts/mutations/run.py reads mutmut's status names")
RUN = load_script("scripts/mutations/run.py")
PLANTED = load_script("scripts/mutation_check.py")
JUDGE = RUN.load_sibling("judge")
KEYS = RUN.keys
RECORD = json.loads(RUN.RECORD.read_text())
EQUIVALENTS = RUN.load_arguments(RUN.EQUIVALENTS)
VERDICTS = {*RUN.KILLED, "killed_full", "killed_test", "equivalent", "cuda_only"}


def test_the_record_keys_every_mutant_by_a_function_it_judged():
    """Each mutant's function has a key in the record and is not pending there; a pending
    function has mutants to judge and none of them in the record."""
    functions, pending = RECORD["functions"], RECORD["pending"]
    assert set(pending) <= set(functions) and all(n > 0 for n in pending.values())
    for name, mutant in RECORD["mutants"].items():
        assert RUN.function_id(name) in functions, name
        assert RUN.function_id(name) not in pending, name
        assert RUN.function_id(name).startswith(mutant["file"] + "::"), name
    files = {f.partition("::")[0] for f in functions}
    assert all(f"{f}::{KEYS.MODULE}" in functions for f in files)


def test_the_record_was_read_from_a_commit_of_this_repository():
    commit = RECORD["sources"].removesuffix("+uncommitted")
    assert re.fullmatch(r"[0-9a-f]{40}", commit), RECORD["sources"]


def test_no_mutant_survived_and_every_equivalent_is_argued():
    verdicts = {name: m["verdict"] for name, m in RECORD["mutants"].items()}
    odd = {name: v for name, v in verdicts.items() if v not in VERDICTS}
    assert not odd, f"survivors or unknown verdicts: {odd}"
    for name, mutant in RECORD["mutants"].items():
        if mutant["verdict"] in ("equivalent", "cuda_only"):
            assert len(mutant["argument"]) > 20 and mutant["argument"] == EQUIVALENTS[name]["why"]
            assert mutant["change"] == EQUIVALENTS[name]["change"], name
        if mutant["verdict"] == "killed":
            assert set(mutant["by"]) >= {"backend", "graph", "dtype", "check", "quantity"}
    argued = {n for n, v in verdicts.items() if v in ("equivalent", "cuda_only")}
    judged = {RUN.function_id(n) for n in RECORD["mutants"]}
    stale = {n for n in EQUIVALENTS if RUN.function_id(n) in judged} - argued
    assert not stale, f"arguments for mutants that are not equivalent in the record: {stale}"
    assert all(RUN.file_of(n) in RUN.mutated_files() for n in EQUIVALENTS)  # pending ones wait


def test_every_mutant_has_a_place_and_a_change():
    """The line is the mutant's in the sources the record was read from."""
    for name, mutant in RECORD["mutants"].items():
        assert mutant["line"] >= 1, name
        assert "->" in mutant["change"], name


def test_the_judge_runs_every_backend_and_every_strategy():
    backends = {"general", "gather_gemm", "einsum_baseline", "general_textbook"}
    assert backends <= set(available_ops())
    assert set(JUDGE.JUDGED) == backends | {f"general[{s}]" for s in STRATEGIES}


def test_the_readme_states_the_records_score():
    figures = RUN.score(RECORD)
    readme = " ".join((ROOT / "README.md").read_text().split())  # lines joined
    stated = re.search(
        r"mutation score \*\*(\d+)/(\d+)\*\*.*?(\d+) equivalent.*?(\d+) that differ on CUDA only"
        r".*?(\d+) are killed only by `--full`, (\d+) only by a unit test",
        readme,
        re.S,
    )
    assert stated, "the README's validator section states no mutation score"
    keys = ("killed", "judged", "equivalent", "cuda_only", "full_only", "test_only")
    assert dict(zip(keys, map(int, stated.groups()), strict=True)) == {k: figures[k] for k in keys}
    sources = f"read from commit `{RECORD['sources'][:7]}`"
    assert sources + ("" if "+" not in RECORD["sources"] else " and uncommitted changes") in readme
    pending = f"{figures['pending']} mutants of {figures['pending_functions']} functions pending"
    assert pending in readme
    # a CUDA-only mutant scripts/mutations/on_cuda.py killed on a GPU says so in its argument
    on_gpu = [m for m in RECORD["mutants"].values() if "killed on CUDA" in m.get("argument", "")]
    assert all(m["verdict"] == "cuda_only" for m in on_gpu)
    assert f"({len(on_gpu)} killed on a GPU: `scripts/mutations/on_cuda.py`)" in readme


def test_each_retired_planted_class_has_a_quiet_mutant_the_oracle_kills():
    """scripts/mutation_check.py retires a planted bug class only for a mutant of the record
    that makes the same kind of bug: a wrong value the oracle finds, not an exception."""
    for kind, (name, _) in PLANTED.RETIRED.items():
        assert kind not in PLANTED.MUTATIONS, kind
        mutant = RECORD["mutants"][name]
        assert mutant["verdict"] == "killed", (kind, mutant)
        assert mutant["by"]["check"] == "oracle", (kind, mutant)
        assert not mutant["by"]["note"].startswith("raised"), (kind, mutant)


def test_a_renumbered_mutant_keeps_its_second_stage_verdict_and_a_repeated_change_does_not():
    """An edit above a mutant renumbers it: the record finds its last verdict by its change,
    where that change names one mutant of the file only."""
    line = {"file": "f.py", "line": 3, "verdict": "killed_test", "by": {"test": "t.py"}}
    record = {
        "m__mutmut_1": {**line, "change": "a + b  ->  a - b"},
        "m__mutmut_2": {**line, "change": "x[0]  ->  x[1]"},
        "m__mutmut_3": {**line, "change": "x[0]  ->  x[1]"},  # the same change, twice
    }
    same = RUN.by_change(record)
    assert same == {("f.py", "a + b  ->  a - b"): record["m__mutmut_1"]}


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


def test_mutmut_names_map_to_the_functions_keys():
    assert KEYS.function_of("fovi_ref.segment_sum.x_segment_sum__mutmut_3") == "segment_sum"
    method = "fovi_ref.knn_general.xǁGeneralTextbookOpsǁforward__mutmut_12"
    assert KEYS.function_of(method) == "GeneralTextbookOps.forward"
    assert RUN.function_id(method) == "fovi_ref/knn_general.py::GeneralTextbookOps.forward"
    strategy = "fovi_ref.strategies.x_strategy_for__mutmut_1"  # a package's module
    assert RUN.function_id(strategy) == "fovi_ref/strategies/__init__.py::strategy_for"


def _triage_case():
    """A record of two files, ``a`` and ``b``, and mutmut's results in a fresh clone. In ``a``:
    ``same`` unchanged and not run, ``edited`` changed and not run, ``rerun`` changed and run
    whole; ``b``'s module code (a constant) changed, so its unchanged ``kept`` is pending too."""
    a, b = "pkg/a/__init__.py", "pkg/b/__init__.py"
    line = {"line": 3, "change": "x  ->  y", "verdict": "killed", "by": {}}
    names = {"pkg.a.x_same": (a, 2), "pkg.a.x_edited": (a, 1), "pkg.a.x_rerun": (a, 1)}
    names["pkg.b.x_kept"] = (b, 1)
    previous = {
        "tool": RECORD["tool"],
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
    judged, kept, pending = RUN.triage_functions(results, previous, now, set())
    assert set(kept) == {"pkg.a.x_same__mutmut_1", "pkg.a.x_same__mutmut_2"}
    assert kept["pkg.a.x_same__mutmut_1"] == previous["mutants"]["pkg.a.x_same__mutmut_1"]
    assert [n for n, _, _ in judged] == ["pkg.a.x_rerun__mutmut_1"]
    assert pending == {"pkg/a/__init__.py::edited": 1, "pkg/b/__init__.py::kept": 1}


def test_a_rerun_mutant_of_an_unchanged_function_is_judged_anew():
    previous, results, now = _triage_case()
    results["pkg.a.x_same__mutmut_2"] = ("pkg/a/__init__.py", 0)
    rerun = {"pkg.a.x_same__mutmut_2"}
    judged, kept, _ = RUN.triage_functions(results, previous, now, rerun)
    assert "pkg.a.x_same__mutmut_1" in kept and "pkg.a.x_same__mutmut_2" not in kept
    assert "pkg.a.x_same__mutmut_2" in [n for n, _, _ in judged]


def test_nothing_is_kept_from_another_mutmut_or_from_other_mutants():
    """mutmut numbers a function's mutants: another version, or other mutants of the same
    function, make the last record's names mean other changes."""
    previous, results, now = _triage_case()
    older = {**previous, "tool": "mutmut 0.0.1"}
    assert RUN.triage_functions(results, older, now, set())[1] == {}
    results["pkg.a.x_same__mutmut_3"] = ("pkg/a/__init__.py", None)  # not in the record
    _, kept, pending = RUN.triage_functions(results, previous, now, set())
    assert not kept and pending["pkg/a/__init__.py::same"] == 3


def test_a_function_pending_in_the_record_stays_pending_until_judged():
    previous, results, now = _triage_case()
    previous["pending"] = {"pkg/a/__init__.py::same": 2}
    _, kept, pending = RUN.triage_functions(results, previous, now, set())
    assert not kept and pending["pkg/a/__init__.py::same"] == 2


def test_the_ci_sample_takes_pending_mutants_first_and_replays_by_seed():
    pending, killed = [f"p{i}" for i in range(3)], [f"k{i}" for i in range(20)]
    chosen = RUN.choose_sample(pending, killed, 8, seed=5)
    assert sorted(chosen[:3]) == pending and set(chosen[3:]) <= set(killed) and len(chosen) == 8
    assert RUN.choose_sample(pending, killed, 8, seed=5) == chosen
    assert set(RUN.choose_sample([f"p{i}" for i in range(10)], killed, 8, seed=5)) < {
        f"p{i}" for i in range(10)
    }


def test_a_kept_line_is_argued_by_the_arguments_as_they_are_now():
    """equivalents.toml decides a survivor's verdict each time the record is written: an argument
    added argues it, one removed makes it a survivor again, a CUDA-only one says so."""
    survivor = {"file": "f.py", "change": "a + b  ->  a - b", "verdict": "survived", "by": {}}
    argued = {**survivor, "verdict": "equivalent", "argument": "path: the same values"}
    assert RUN.argued("m", argued, {}) == survivor
    path = {"m": {"change": "a + b  ->  a - b", "why": "path: x"}}
    assert RUN.argued("m", survivor, path)["verdict"] == "equivalent"
    reason = f"{RUN.CUDA_ONLY} on CUDA it mixes devices"
    cuda = RUN.argued("m", argued, {"m": {"change": "a + b  ->  a - b", "why": reason}})
    assert (cuda["verdict"], cuda["argument"]) == ("cuda_only", reason)
    killed = {"file": "f.py", "verdict": "killed_test", "by": {"test": "t.py"}}
    assert RUN.argued("m", killed, path) == killed  # a kill is not argued away


def test_an_argument_for_another_change_argues_nothing():
    """An edit renumbers a function's mutants: an argument written for mutant 7's old change
    leaves today's mutant 7 a survivor, with the change the argument was for; written again for
    the new change, it argues it."""
    survivor = {"file": "f.py", "change": "a * b  ->  a / b", "verdict": "survived", "by": {}}
    old = {"m": {"change": "a + b  ->  a - b", "why": "path: the same values"}}
    line = RUN.argued("m", survivor, old)
    assert line == survivor | {"argued_change": "a + b  ->  a - b"}
    new = {"m": {"change": "a * b  ->  a / b", "why": "path: the same values"}}
    assert RUN.argued("m", line, new) == survivor | {
        "verdict": "equivalent",
        "argument": "path: the same values",
    }


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
