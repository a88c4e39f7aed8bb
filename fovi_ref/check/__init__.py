"""The harness: everything that judges, times or imports fovi, around the op in ``fovi_ref``.

It reaches the op only through the op's public names; the op never imports it.

- :mod:`~fovi_ref.check.operands`: the one operand sampler and the one forward-and-gradients
  runner.
- :mod:`~fovi_ref.check.protocol`: the backend protocol checked and policed from outside.
- :mod:`~fovi_ref.check.magnitude`, :mod:`~fovi_ref.check.tolerances`: what "close enough to the
  float64 oracle" means, element by element; :mod:`~fovi_ref.check.tightness`: the legal
  computations that come nearest that bound.
- :mod:`~fovi_ref.check.arithmetic`: the device and math settings (TF32, cuBLAS's 16-bit
  reductions) a verdict is reached under, read for every report and set while judging.
- :mod:`~fovi_ref.check.graphs`, :mod:`~fovi_ref.check.check_ops`: the conformance battery for
  any ops object, and the graphs it spans; :mod:`~fovi_ref.check.check_command`: the same from
  a shell, ``python -m fovi_ref check FILE.py:OBJECT``.
- :mod:`~fovi_ref.check.verify`: every backend on every layer, the ``verify`` table.
- :mod:`~fovi_ref.check.fovi`: fovi 2.4.0 run through its own code and judged.
- :mod:`~fovi_ref.check.network`: the fovi-resnet18 trunk built from ``KNNConv`` layers.
- :mod:`~fovi_ref.check.bench`: timing, contenders, the profiler, targets, one module per job.
- :mod:`~fovi_ref.check.jobs`, :mod:`~fovi_ref.check.cli`: ``python -m fovi_ref``.
"""
