"""``python -m fovi_ref``: the harness's command line (:mod:`fovi_ref.check.cli`)."""

from fovi_ref.check.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
