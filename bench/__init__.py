"""The benchmarks, grouped by what they measure; run each from the repository root as ``python -m bench.<group>.<name>``
(bench/README.md lists them)."""
