"""Interop: fovi_ref's op in other runtimes and training setups, outside the op itself.

It reaches the op only through the op's public names; the op never imports it (as for
:mod:`fovi_ref.check`, ``tests/test_project.py`` checks both).

- :mod:`~fovi_ref.interop.onnx`: an ONNX translation of ``fovi_ref::knn_conv`` and
  :func:`~fovi_ref.interop.onnx.export_onnx` (needs ``pip install -e ".[onnx]"``).
- :mod:`~fovi_ref.interop.ddp`: ``DistributedDataParallel`` without sending the graphs every step.
- :mod:`~fovi_ref.interop.fovi`: fovi's models on fovi_ref's op, the adapter a fovi user calls
  (:func:`~fovi_ref.interop.fovi.to_fovi_ref`, needs fovi installed).
"""
