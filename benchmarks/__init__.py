"""mhakern's benchmark suites (pytest-benchmark), their report and the device check.

Not part of the installed package and not collected by the test run: run them with
``pytest benchmarks/ --benchmark-only`` and render with ``python -m benchmarks.report``
(see benchmarks/README.md).
"""
