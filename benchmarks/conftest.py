"""pytest configuration of the benchmark suites (``pytest benchmarks/ --benchmark-only``).

* Collects ``bench_*.py`` files here as well as ``test_*.py`` (other suites, e.g. the trainer's
  and the CPU extension's targets, are named bench_*).
* ``--bench-set`` chooses the attention rows: ``auto`` (default: the ``gpu`` set when CUDA is
  present, else the ``cpu`` set), ``cpu``, ``gpu``, or ``headline`` (the device set's few
  headline rows). ``--bench-provider SUBSTR`` (repeatable) keeps only matching providers,
  ``--bench-skip SUBSTR`` (repeatable) leaves matching ones out.
* Adds the machine (CPU model and cores or GPU name, torch, triton, CUDA, the measured copy
  bandwidth, mhakern's backends) and the skipped providers with their reasons to the JSON's
  ``machine_info["mhakern"]``, and prints every figure next to its peer's at the end.
"""
import os
import sys

# The Triton interpreter is a correctness tool: a benchmark of it means nothing. It is switched
# off before mhakern's kernels can be imported, so Triton backends run compiled or not at all.
if os.environ.pop("TRITON_INTERPRET", None) not in (None, "", "0"):
    print("benchmarks: TRITON_INTERPRET was set; unset for the benchmarks (the interpreter is never benchmarked)",
          file=sys.stderr)

import pytest  # noqa: E402

try:
    import pytest_benchmark  # noqa: F401
except ImportError:
    raise pytest.UsageError(
        "the benchmark suites need pytest-benchmark (the 'test' extra of mhakern): pip install pytest-benchmark"
    ) from None


def pytest_addoption(parser):
    group = parser.getgroup("mhakern benchmarks")
    group.addoption(
        "--bench-set",
        default="auto",
        choices=("auto", "cpu", "gpu", "headline"),
        help="attention rows to run: auto (gpu with CUDA, else cpu), cpu, gpu, headline",
    )
    group.addoption(
        "--bench-skip",
        action="append",
        default=[],
        metavar="SUBSTR",
        help="leave out providers whose name contains SUBSTR (repeatable; after --bench-provider)",
    )
    group.addoption(
        "--bench-provider",
        action="append",
        default=[],
        metavar="SUBSTR",
        help="keep only providers whose name contains SUBSTR (repeatable)",
    )


def pytest_collect_file(file_path, parent):
    # Suites of other components live here as bench_*.py; pytest's default pattern is test_*.py.
    # A file named on the command line is collected by pytest itself.
    if parent.session.isinitpath(file_path):
        return None
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_benchmark_update_machine_info(config, machine_info):
    from benchmarks.harness import SESSION, bench_set_name, machine_description
    from benchmarks.providers import bench_device

    info = machine_description(bench_device())
    info["bench_set"] = bench_set_name(config)
    info["skipped"] = SESSION.skips
    machine_info["mhakern"] = info


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from benchmarks.harness import SESSION

    if not SESSION.results:
        return
    from benchmarks.report import text_summary

    terminalreporter.section("mhakern: every figure next to its peer's (same run)")
    for line in text_summary(SESSION.results):
        terminalreporter.write_line(line)
