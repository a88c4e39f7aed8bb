"""A pytest plugin for the rule's mutation job (``run.py rule``): run the judge's tests file by file
in the order of :data:`TESTS`, so that a mutant stops at the quickest test that fails it.

mutmut hands pytest the tests that call a mutated function in no set order, and stops at the
first failure (``-x``); the files below run from the quickest and most pointed (the rule's
exact numbers, a fraction of a second each) to the slowest (whole batteries).
"""

from __future__ import annotations

TESTS = [
    "tests/test_tolerance_rule.py",
    "tests/test_tolerances_flush.py",
    "tests/test_tolerances.py",
    "tests/test_battery.py",
    "tests/test_testing_check_ops.py",
]
"""The judge's test files, quickest first."""


def pytest_collection_modifyitems(items) -> None:
    """Items sorted by their file's place in :data:`TESTS` (stable: a file's own order kept)."""

    def rank(item) -> int:
        path = item.nodeid.partition("::")[0]
        return TESTS.index(path) if path in TESTS else len(TESTS)

    items.sort(key=rank)
