"""The project's benchmarks, run from the repository root as modules: ``python -m benchmarks.<name>``.

Shared pieces live in :mod:`benchmarks.harness` (result files, ``fedmeta fit`` runs, report helpers) and
:mod:`benchmarks.paper` (the Per-FedAvg paper's setting, shared by ``reproduce`` and ``equal_work``).
See benchmarks/README.md.
"""
