"""fovi 2.4.0, the release users install, run through its own code and judged by fovi_ref.

- :mod:`~fovi_ref.check.fovi.load`: importing fovi, its resnet18 and its layers.
- :mod:`~fovi_ref.check.fovi.backends`: its backends at three depths, its dispatcher,
  :class:`FoviOps` (fovi in fovi_ref's ops protocol), and its bench contenders.
- :mod:`~fovi_ref.check.fovi.models`: fovi models with fovi_ref layers swapped in, compared.
- :mod:`~fovi_ref.check.fovi.verify`: verdicts, diagnoses, the table (``verify --fovi``).

Everything is re-exported here: ``from fovi_ref.check import fovi as upstream``.
"""

from fovi_ref.check.fovi.backends import *  # noqa: F403
from fovi_ref.check.fovi.load import *  # noqa: F403
from fovi_ref.check.fovi.models import *  # noqa: F403
from fovi_ref.check.fovi.verify import *  # noqa: F403
