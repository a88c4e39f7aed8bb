"""The mutation record (scripts/mutations/record.json) stays true: it was made from the backend
files as they are, no mutant survived unargued, and the README states its score.

The record is made by ``make mutations`` (hours on 2 cores); CI reruns a seeded sample of it
(``scripts/mutations/run.py --sample``, in .ci/run). These tests read it and nothing more.
"""

from __future__ import annotations

import json
import re
import tomllib

import pytest
from conftest import ROOT, load_script

from fovi_ref import available_ops
from fovi_ref.strategies import STRATEGIES

# run.py reads mutmut's status names; the lent GPU's image (scripts/gpu_check.sh) has no mutmut.
pytest.importorskip("mutmut", reason="scripts/mutations/run.py reads mutmut's status names")
RUN = load_script("scripts/mutations/run.py")
PLANTED = load_script("scripts/mutation_check.py")
JUDGE = RUN.load_judge()
RECORD = json.loads(RUN.RECORD.read_text())
EQUIVALENTS = tomllib.loads(RUN.EQUIVALENTS.read_text())
VERDICTS = {*RUN.KILLED, "killed_full", "killed_test", "equivalent", "cuda_only"}


def test_the_record_was_made_from_the_backend_files_as_they_are():
    """Change a judged file and this fails until ``make mutations`` judges it again. A file
    whose mutants are not all judged yet is listed as pending, with its mutant count."""
    hashes = RUN.file_hashes()
    changed = [f for f, h in RECORD["files"].items() if hashes[f] != h]
    assert not changed, f"mutated since the record was made: {changed}; run make mutations"
    assert sorted([*RECORD["files"], *RECORD["pending"]]) == RUN.mutated_files()
    assert {m["file"] for m in RECORD["mutants"].values()} == set(RECORD["files"])
    assert all(count > 0 for count in RECORD["pending"].values())


def test_no_mutant_survived_and_every_equivalent_is_argued():
    verdicts = {name: m["verdict"] for name, m in RECORD["mutants"].items()}
    odd = {name: v for name, v in verdicts.items() if v not in VERDICTS}
    assert not odd, f"survivors or unknown verdicts: {odd}"
    for name, mutant in RECORD["mutants"].items():
        if mutant["verdict"] in ("equivalent", "cuda_only"):
            assert len(mutant["argument"]) > 20 and mutant["argument"] == EQUIVALENTS[name]
        if mutant["verdict"] == "killed":
            assert set(mutant["by"]) >= {"backend", "graph", "dtype", "check", "quantity"}
    argued = {n for n, v in verdicts.items() if v in ("equivalent", "cuda_only")}
    stale = {n for n in EQUIVALENTS if RUN.file_of(n) in RECORD["files"]} - argued
    assert not stale, f"arguments for mutants that are not equivalent in the record: {stale}"
    assert all(RUN.file_of(n) in RUN.mutated_files() for n in EQUIVALENTS)  # pending files' wait


def test_every_mutant_has_a_place_and_a_change():
    for name, mutant in RECORD["mutants"].items():
        lines = (ROOT / mutant["file"]).read_text().count("\n")
        assert 1 <= mutant["line"] <= lines, name
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
    assert dict(zip(keys, map(int, stated.groups()), strict=True)) == figures
    judged, pending = len(RECORD["files"]), len(RECORD["pending"])
    if pending:
        assert f"{judged} of the {judged + pending} files are judged so far" in readme
    else:
        assert f"All {judged} files are judged" in readme
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


def test_mutant_names_after_files_are_refused_not_run_as_a_whole_job(capsys):
    """``--files`` takes every argument after it: a mutant name there would leave none to
    rerun, and mutmut would run every unjudged mutant (hours)."""
    with pytest.raises(SystemExit) as stopped:
        RUN.main(["--files", "fovi_ref/layout.py", "fovi_ref.layout.x_linear_rows__mutmut_3"])
    assert stopped.value.code == 2
    assert "put mutant names before it" in capsys.readouterr().err


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


def _triage_case():
    """A last record of three files and mutmut's results in a fresh clone: ``same.py``
    unchanged and not run, ``part.py`` unchanged with one mutant rerun, ``changed.py`` edited
    and not run, ``new.py`` never entered and not run, ``run.py`` entered and run whole."""
    line = {"line": 3, "change": "a  ->  b", "verdict": "killed", "by": {}}
    names = {"same": 1, "part": 2, "changed": 1, "run": 2}
    previous = {
        "tool": RECORD["tool"],
        "files": {"same.py": "h1", "part.py": "h2", "changed.py": "h3", "run.py": "h4"},
        "mutants": {
            f"{f}.x__mutmut_{i}": {"file": f"{f}.py", **line}
            for f, count in names.items()
            for i in range(1, count + 1)
        },
    }
    results = {  # exit codes: None for a mutant mutmut has not run
        "same.x__mutmut_1": ("same.py", None),
        "part.x__mutmut_1": ("part.py", 1),
        "part.x__mutmut_2": ("part.py", None),
        "changed.x__mutmut_1": ("changed.py", None),
        "new.x__mutmut_1": ("new.py", None),
        "run.x__mutmut_1": ("run.py", 1),
        "run.x__mutmut_2": ("run.py", 0),
    }
    hashes = {"same.py": "h1", "part.py": "h2", "changed.py": "h9", "new.py": "h5", "run.py": "h6"}
    return previous, results, hashes


def test_an_unchanged_file_keeps_the_lines_of_the_mutants_the_cache_has_not_run():
    """A fresh ``mutants/`` has judged nothing: the record keeps its lines of an unchanged file
    and judges anew what mutmut ran in it; a changed file, and one it never entered, are
    pending; a file mutmut judged whole is judged anew."""
    previous, results, hashes = _triage_case()
    judged, kept, pending = RUN.triage_files(results, previous, None, hashes)
    assert set(kept) == {"same.x__mutmut_1", "part.x__mutmut_2"}
    assert kept["same.x__mutmut_1"] == previous["mutants"]["same.x__mutmut_1"]
    assert [n for n, _, _ in judged] == ["part.x__mutmut_1", "run.x__mutmut_1", "run.x__mutmut_2"]
    assert pending == {"changed.py": 1, "new.py": 1}


def test_files_enters_only_the_named_files_beside_the_records():
    """A file mutmut judged whole is entered by a plain run, and with ``--files`` only when
    named (its second stage takes minutes a mutant)."""
    previous, results, hashes = _triage_case()
    results["new.x__mutmut_1"] = ("new.py", 0)  # new.py judged whole
    _, _, pending = RUN.triage_files(results, previous, None, hashes)
    assert pending == {"changed.py": 1}
    _, _, pending = RUN.triage_files(results, previous, [], hashes)
    assert pending == {"changed.py": 1, "new.py": 1}
    _, _, pending = RUN.triage_files(results, previous, ["new.py"], hashes)
    assert pending == {"changed.py": 1}


def test_nothing_is_kept_from_another_mutmut_or_from_other_mutants():
    """mutmut numbers a file's mutants: another version, or other mutants of the same file,
    make the last record's names mean other changes."""
    previous, results, hashes = _triage_case()
    older = {**previous, "tool": "mutmut 0.0.1"}
    assert RUN.triage_files(results, older, None, hashes)[1] == {}
    results["same.x__mutmut_2"] = ("same.py", None)  # a mutant the record does not have
    _, kept, pending = RUN.triage_files(results, previous, None, hashes)
    assert "same.x__mutmut_1" not in kept and pending["same.py"] == 2


def test_a_file_with_no_mutants_in_the_cache_is_refused_unless_the_record_holds_it():
    """``--no-run`` where mutmut has not generated a file's mutants: an unchanged file of the
    record keeps its lines, any other stops the job before it writes the record."""
    previous, results, hashes = _triage_case()
    del results["new.x__mutmut_1"]  # mutmut never generated new.py's mutants
    with pytest.raises(SystemExit, match=r"no mutants of \['new.py'\]"):
        RUN.triage_files(results, previous, None, hashes)
    del results["same.x__mutmut_1"]  # same.py: the record holds it as it is
    hashes.pop("new.py")
    _, kept, _ = RUN.triage_files(results, previous, None, hashes)
    assert "same.x__mutmut_1" in kept


def test_a_kept_line_is_argued_by_the_arguments_as_they_are_now():
    """equivalents.toml decides a survivor's verdict each time the record is written: an argument
    added argues it, one removed makes it a survivor again, a CUDA-only one says so."""
    survivor = {"file": "f.py", "verdict": "survived", "by": {}}
    argued = {**survivor, "verdict": "equivalent", "argument": "path: the same values"}
    assert RUN.argued("m", argued, {}) == survivor
    assert RUN.argued("m", survivor, {"m": "path: x"})["verdict"] == "equivalent"
    reason = f"{RUN.CUDA_ONLY} on CUDA it mixes devices"
    cuda = RUN.argued("m", argued, {"m": reason})
    assert (cuda["verdict"], cuda["argument"]) == ("cuda_only", reason)
    killed = {"file": "f.py", "verdict": "killed_test", "by": {"test": "t.py"}}
    assert RUN.argued("m", killed, {"m": "path: x"}) == killed  # a kill is not argued away


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
