"""The rule's mutation record (scripts/mutations/rule_record.json) stays true: no mutant of the
tolerance rule survived unargued, every argument is for an equivalent mutant of the record, and
the README states the score beside the backends'.

The record is made by ``make rule-mutations`` (``scripts/mutations/rule.py``); CI reruns a
seeded sample of it. A function whose code changed since the record judged it is *pending*:
these tests pass over it (its verdicts no longer hold) until the job judges it again.
"""

from __future__ import annotations

import json
import re
import tomllib

import pytest
from conftest import ROOT, load_script

pytest.importorskip("mutmut", reason="scripts/mutations/rule.py reads mutmut's status names")
RULE = load_script("scripts/mutations/rule.py")
RECORD = json.loads(RULE.RECORD.read_text())
EQUIVALENTS = RULE.run.load_arguments(RULE.EQUIVALENTS)
PENDING = set(RULE.stale_functions(RECORD, RULE.current_keys()))
KILLED = {"killed", "timeout", "crashed"}


def held(mutant: dict) -> bool:
    """Whether the record's line still holds: its function is not pending."""
    return (mutant["file"], mutant["function"]) not in PENDING


def test_every_function_of_the_rule_is_judged_or_pending_and_nothing_else():
    """A function the job has not judged whole yet is listed as pending with its mutant count,
    and none of its mutants is in the record."""
    judged = {(m["file"], m["function"]) for m in RECORD["mutants"].values()}
    rule = {(f, name) for f, names in RULE.FUNCTIONS.items() for name in names}
    assert judged | PENDING == rule and judged <= rule
    listed = {tuple(key.split("::")) for key in RECORD["pending"]}
    assert listed <= PENDING and not listed & judged
    assert RECORD["tool"] == "mutmut 3.8.1" and RECORD["tests"] == RULE.TESTS
    assert set(RECORD["functions"]) == set(RULE.FUNCTIONS)


def test_no_mutant_of_the_rule_survived_unargued():
    for name, mutant in RECORD["mutants"].items():
        if not held(mutant):
            continue
        assert mutant["verdict"] in {*KILLED, "equivalent"}, (name, mutant)
        if mutant["verdict"] == "equivalent":
            assert len(mutant["argument"]) > 20 and mutant["argument"] == EQUIVALENTS[name]["why"]
            assert mutant["change"] == EQUIVALENTS[name]["change"], name
        assert "->" in mutant["change"] and mutant["line"] >= 1, name


def test_every_argument_is_for_an_equivalent_mutant_of_the_record():
    """An argument for a mutant of a pending function waits for the job to judge it."""
    for name in EQUIVALENTS:
        mutant = RECORD["mutants"].get(name)
        if mutant is None:
            function = (RULE.run.file_of(name), RULE.keys.function_of(name))
            assert function in PENDING, name
            continue
        assert not held(mutant) or mutant["verdict"] == "equivalent", name


def test_a_changed_function_is_pending_and_a_changed_module_pends_its_file():
    now = RULE.current_keys()
    record = {"functions": {f: dict(keys) for f, keys in now.items()}}
    assert RULE.stale_functions(record, now) == []
    record["functions"]["fovi_ref/check/tolerances.py"]["gamma"] = "another"
    assert RULE.stale_functions(record, now) == [("fovi_ref/check/tolerances.py", "gamma")]
    record["functions"]["fovi_ref/check/magnitude.py"][RULE.keys.MODULE] = "another"
    stale = RULE.stale_functions(record, now)
    assert {name for f, name in stale if f == "fovi_ref/check/magnitude.py"} == set(
        RULE.FUNCTIONS["fovi_ref/check/magnitude.py"]
    )


def test_the_job_has_its_own_mutmut_configuration_and_cache():
    """mutmut reads ``[tool.mutmut]`` from, and writes ``mutants/`` to, the directory it runs
    in: the rule's job runs in ``mutants-rule/``, never in the backends' ``mutants/``."""
    config = tomllib.loads(RULE.mutmut_config())["tool"]["mutmut"]
    assert config["only_mutate"] == list(RULE.FUNCTIONS)
    assert config["pytest_add_cli_args_test_selection"] == RULE.TESTS
    assert RULE.WORK != ROOT and RULE.MUTANTS != ROOT / "mutants"
    backends = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert not set(backends["only_mutate"]) & set(config["only_mutate"])
    assert "mutants-rule/" in (ROOT / ".gitignore").read_text().split()


def test_the_readme_states_the_rules_score():
    figures = RULE.score(RECORD)
    readme = " ".join((ROOT / "README.md").read_text().split())  # lines joined
    stated = re.search(
        r"the tolerance rule, is mutated too .*?mutation score \*\*(\d+)/(\d+)\*\* with "
        r"(\d+) argued equivalent, (\d+) of (\d+) functions",
        readme,
    )
    assert stated, "the README's validator section states no score for the rule"
    keys = ("killed", "judged", "equivalent", "functions", "of")
    rule = sum(len(names) for names in RULE.FUNCTIONS.values())
    # the record's own count, not today's: an edit to the rule changes nothing the README states
    # until the record is written again
    judged = sum(n != RULE.keys.MODULE for names in RECORD["functions"].values() for n in names)
    assert dict(zip(keys, map(int, stated.groups()), strict=True)) == figures | {
        "functions": judged,
        "of": rule,
    }


def judged(monkeypatch, last: dict, arguments: dict, slow: str | None) -> tuple[dict, list]:
    """``judged_line`` of a mutant the quick tests passed (mutmut's exit code 0) whose change
    is ``a  ->  b``, with ``last`` the record's previous line and a second stage that returns
    ``slow``; with the names the second stage was asked about."""
    asked = []

    def second_stage(name: str) -> str | None:
        asked.append(name)
        return slow

    monkeypatch.setattr(RULE.run, "change_of", lambda name, source: (3, "a  ->  b"))
    monkeypatch.setattr(RULE, "second_stage", second_stage)
    line = RULE.judged_line("m", "f.py", "g", 0, {"m": last}, arguments)
    return line, asked


def test_a_survivor_of_the_quick_tests_runs_the_slow_ones_unless_argued_or_killed_by_them(
    monkeypatch,
):
    """The second stage is skipped only where the argument names this change, or where the
    last record says a slow test killed this same change; an equivalent line whose argument
    is gone runs it (it never ran it), and so does a survivor."""
    argument = {"m": {"change": "a  ->  b", "why": "the same values come out, because ..."}}
    line, asked = judged(monkeypatch, {}, argument, slow=None)
    assert (line["verdict"], asked) == ("equivalent", [])
    slow = "tests/t.py::test_slow"
    kill = {"change": "a  ->  b", "verdict": "killed", "by": slow}
    line, asked = judged(monkeypatch, kill, {}, slow=None)
    assert (line["verdict"], line["by"], asked) == ("killed", slow, [])
    was_argued = {"change": "a  ->  b", "verdict": "equivalent", "argument": "gone now"}
    line, asked = judged(monkeypatch, was_argued, {}, slow=slow)
    assert (line["verdict"], line["by"], asked) == ("killed", slow, ["m"])
    survivor = {"change": "a  ->  b", "verdict": "survived"}
    line, asked = judged(monkeypatch, survivor, {}, slow=None)
    assert (line["verdict"], asked) == ("survived", ["m"])
    other = {"m": {"change": "c  ->  d", "why": "written for mutant m before an edit"}}
    line, asked = judged(monkeypatch, {}, other, slow=None)
    assert (line["verdict"], line["argued_change"], asked) == ("survived", "c  ->  d", ["m"])


def test_an_equivalents_entry_must_hold_its_change_and_why(tmp_path):
    path = tmp_path / "equivalents.toml"
    path.write_text('["m"]\nchange = "a  ->  b"\nwhy = "the same values"\n')
    assert RULE.run.load_arguments(path) == {"m": {"change": "a  ->  b", "why": "the same values"}}
    path.write_text('["m"]\nchnage = "a  ->  b"\nwhy = "the same values"\n')
    with pytest.raises(SystemExit, match="m must hold exactly 'change' and 'why'"):
        RULE.run.load_arguments(path)
    path.write_text('"m" = "an argument without its change"\n')
    with pytest.raises(SystemExit, match="m must hold"):
        RULE.run.load_arguments(path)
