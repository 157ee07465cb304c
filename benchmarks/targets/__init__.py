"""SPEC §5's target table (``python -m benchmarks.targets [--quick]``; :mod:`.__main__` says what it measures and
writes), the first stage of scripts/gpu_checks.sh, one job per file:

* :mod:`.workloads`: the workloads (full and quick), SPEC §5's targets and the verdicts of a row (``assess``);
* :mod:`.measure`: the timing, the inputs, the environment record, the rows of the targets part (``measure_group``)
  and the :class:`~.measure.Recorder` that writes them;
* :mod:`.comparisons`: the native part's A/B rows of CERTIFY (fused, graph, compile, ``gamma_batch``, the exact
  bound's pieces) and the CUDA kernels against Triton;
* :mod:`.report`: the CSV fields, the CSV and markdown tables and their cells, the one-line summary of a row;
* :mod:`.__main__`: the command line.

The benchmark modules import each other by bare name (``floor``, ``compile_watch``, ``conftest``,
``test_bench_certify``), as under pytest, where benchmarks/conftest.py puts benchmarks/ on ``sys.path``: this package
puts it there too, before any of its modules imports them, so ``python -m benchmarks.targets`` and ``import targets``
under pytest import the same files.
"""
from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
if str(BENCHMARKS) not in sys.path:  # the benchmark modules import each other by bare name, as under pytest
    sys.path.insert(0, str(BENCHMARKS))
