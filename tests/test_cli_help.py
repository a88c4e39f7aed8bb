"""``python -m fovi_ref --help``: every subcommand and option explains itself in plain text."""

from __future__ import annotations

import argparse

import pytest

from fovi_ref.check.cli import parser


def subparsers() -> dict[str, argparse.ArgumentParser]:
    top = parser()
    (sub,) = (a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"": top, **sub.choices}


@pytest.mark.parametrize("name", ["", "verify", "bench"])
def test_every_option_has_help_and_shows_its_default(name):
    p = subparsers()[name]
    assert p.description and "``" not in p.description and ":mod:" not in p.description
    for action in p._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        assert action.help, f"{name} {action.option_strings} has no help"
        if action.default not in (None, False):  # an option with a value to default to
            assert "(default: " in p.format_help().split(action.option_strings[-1], 1)[1]


def test_help_lists_the_bench_targets():
    from fovi_ref.check.bench import targets

    text = subparsers()["bench"].format_help()
    for target in targets.ALL:
        assert target.name in text and str(target.at_most) in text


def test_one_spelling_of_dtypes_and_refusals_print_their_subcommands_usage(capsys):
    from fovi_ref.check.cli import main

    for name in ("verify", "bench"):
        assert "--dtypes" in subparsers()[name].format_help()
        assert "--dtype " not in subparsers()[name].format_help()
    refused = {
        "bench": ["bench", "--boundary", "--dtypes", "float32"],
        "verify": ["verify", "--repeats", "3"],
    }
    for usage, argv in refused.items():
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.startswith(f"usage: python -m fovi_ref {usage} ")


def test_verify_help_gives_the_exit_codes_fovi_checks_gate_on():
    """``verify --fovi`` and ``--fovi-model`` can gate CI: --help says when each exits 0, 1 and
    2, and what --strict changes; --strict is refused where nothing honours it."""
    text = " ".join(subparsers()["verify"].format_help().split())
    gate = "Exit status of --fovi and --fovi-model, for gating CI: 0 when every check passes or"
    assert f"{gate} every failure is a known finding about fovi" in text
    assert "1 on a new failure" in text and "with --strict, 1 on any failure" in text
    assert "--strict with --fovi or --fovi-model: exit 1 on any FAIL" in text
    assert "float32 float64 with --fovi-model" in text
    from fovi_ref.check.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--strict"])
    assert exit_.value.code == 2
