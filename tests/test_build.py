"""The build of mhakern._C: the plan, the build command's fallbacks, and the first-use build.

mhakern/_build.py holds every decision (setup.py and the first-use build share it), as plain
functions checked here with faked environments, without compiling:
* the switches, and no torch in the build environment (pip's build isolation): nothing built
  during the install, one line saying it happens at first use;
* CPU sources found by glob, ISA variants with their own flags; CUDA sources when torch has CUDA
  and a matching nvcc; TORCH_CUDA_ARCH_LIST filtered to archs >= 8.0 (CPU only when none is
  left); an nvcc whose CUDA major differs from torch's gives a CPU-only build, not a failure;
* a CUDA part that fails (torch's own checks, or the compile) is rebuilt CPU-only;
* the first-use build: the cache key, the lock (concurrent processes build once), a failure
  remembered and reported with the compiler's first error (a real, deliberately broken build).
The real thing, in two parts that together cover the route without compiling the module a
second time (the install this suite runs in built it already, from the same plan):
* ``test_first_use_builds_links_and_loads_the_module`` (seconds): a real first-use build, the
  child process running torch's BuildExtension through to the link, the staging directory and
  the load, two processes at once building once, on a one-file source tree;
* ``test_plain_pip_install_uses_the_module_at_first_use`` (CI, or MHAKERN_TEST_INSTALL=1): a
  fresh venv, a plain ``pip install -e .`` under build isolation that compiles nothing, and
  the first use finding the module for that copy's sources at the cache key the copy computes
  (this run's own build put there, as a first-use build would), then a cpu-backend call.
"""
import importlib.util
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "setup.py")
HINT = "pip install -e . --no-build-isolation"
# 9.0 is built as sm_90a, the pass in which the sm90 family (wgmma, setmaxnreg) has its kernels.
DEFAULT_GENCODE = {
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
}

# Makes `import torch` (or `import mhakern._C`) fail in a child process, as in a build
# environment without torch or an install without the extension.
_BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == {name!r} or name.startswith({name!r} + "."):
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
            return None
    sys.meta_path.insert(0, _Block())
    """
)


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def B():
    """mhakern/_build.py loaded by path, as setup.py loads it (without importing mhakern)."""
    return _load(os.path.join(ROOT, "mhakern", "_build.py"), "mhakern_build_under_test")


def _fake_torch(cuda=None, nvcc=None, nvcc_version=None, machine="x86_64", platform="linux"):
    if nvcc and nvcc_version is None:
        nvcc_version = cuda
    return {"version": "2.13.0", "cuda": cuda, "hip": None, "nvcc": nvcc, "nvcc_version": nvcc_version,
            "openmp": True, "machine": machine, "platform": platform}


CUDA_TORCH = dict(cuda="13.0", nvcc="/opt/cuda/bin/nvcc")


def _stderr_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# Nothing to build during the install


def test_skip_switch_builds_nothing_and_says_so(B, capsys):
    assert B.extension_modules({"MHAKERN_NO_EXTENSION": "1"}, ROOT) == ([], {})
    lines = _stderr_lines(capsys)
    assert len(lines) == 1
    assert "MHAKERN_NO_EXTENSION is set: skipping the C++ extension mhakern._C" in lines[0]
    for off in ("", "0", "false", "no"):
        assert B.plan({"MHAKERN_NO_EXTENSION": off}, _fake_torch(), ROOT)["build"]


def test_no_torch_in_build_env_skips_with_one_line_and_installs_pure_python():
    # setup.py run as pip runs it (__main__), with torch unimportable: one line saying the module
    # is built at first use, and the package metadata still comes out.
    script = _BLOCKER.format(name="torch") + textwrap.dedent(
        f"""
        import runpy
        sys.argv = ["setup.py", "--name"]
        runpy.run_path({SETUP!r}, run_name="__main__")
        assert "torch" not in sys.modules
        """
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    ours = [line for line in res.stderr.splitlines() if line.startswith("mhakern:")]
    assert len(ours) == 1, res.stderr
    assert "torch is not importable in this build environment" in ours[0]
    assert "built on first use" in ours[0] and "python -m mhakern.build" in ours[0] and HINT in ours[0]
    assert res.stdout.strip().splitlines()[-1] == "mhakern"


# ---------------------------------------------------------------------------------------------
# CPU sources


def test_this_torch_gives_the_expected_extension(B, capsys):
    import torch
    from torch.utils.cpp_extension import BuildExtension

    exts, cmdclass = B.extension_modules({}, ROOT)
    lines = _stderr_lines(capsys)
    assert lines[0].startswith("mhakern: building mhakern._C with CPU kernels")
    assert len(exts) == 1 and exts[0].name == "mhakern._C"
    assert issubclass(cmdclass["build_ext"], BuildExtension)
    srcs = exts[0].sources
    assert {"csrc/bindings.cpp", "csrc/cpu/attention_cpu.cpp", "csrc/cpu/kernels_default.cpp"} <= set(srcs)
    if torch.version.cuda is None:
        assert "no CUDA code: torch has no CUDA" in lines[0]
        assert not any(s.endswith(".cu") or "cuda" in s for s in srcs)
        assert "MHAKERN_WITH_CUDA" not in dict(exts[0].define_macros)
    flags = exts[0].extra_compile_args["cxx"]
    assert "-march=native" not in flags and not any(f.startswith("-mavx") for f in flags)
    # optional: a module that failed to build is not copied (editable installs go on) ...
    assert exts[0].optional is True
    # ... unless CI asks for it.
    (strict,), _ = B.extension_modules({"MHAKERN_REQUIRE_EXTENSION": "1"}, ROOT)
    assert strict.optional is False


def test_cpu_plan_compiles_isa_variants_with_their_own_flags(B):
    plan = B.plan({}, _fake_torch(), ROOT)
    assert plan["build"] and not plan["cuda"]
    isa = dict(plan["isa_sources"])
    assert isa["csrc/cpu/kernels_avx2.cpp"][:2] == ["-mavx2", "-mfma"]
    assert "-mavx512f" in isa["csrc/cpu/kernels_avx512.cpp"]
    assert not any(s in plan["sources"] for s in isa)  # never compiled with the common flags
    assert ("MHAKERN_CPU_AVX2", None) in plan["define_macros"]
    assert "-fopenmp" in plan["cxx_flags"] and "-fopenmp" in plan["link_flags"]
    assert all("native" not in f for f in plan["cxx_flags"] + sum(isa.values(), []))
    assert "-mavx512bf16" in isa["csrc/cpu/kernels_avx512bf16.cpp"]
    assert "-mavx512bf16" not in isa["csrc/cpu/kernels_avx512.cpp"]
    assert "CPU kernels (DEFAULT, AVX2, AVX512, AVX512BF16)" in plan["message"]
    for src in list(isa) + plan["sources"]:
        assert os.path.exists(os.path.join(ROOT, src)), src
    # Not x86: the portable kernels only (the ISA files are not compiled at all).
    arm = B.plan({}, _fake_torch(machine="aarch64"), ROOT)
    assert arm["isa_sources"] == [] and "CPU kernels (DEFAULT)" in arm["message"]
    assert not any("avx" in s for s in arm["sources"])


@pytest.fixture
def tree(tmp_path):
    """A fake source tree: the files the globs must find (and the emulator's, outside csrc/, which
    they must not)."""
    for name in (
        "csrc/bindings.cpp", "csrc/cpu/attention_cpu.cpp", "csrc/cpu/kernels_default.cpp",
        "csrc/cpu/kernels_avx2.cpp", "csrc/cpu/kernels_avx512.cpp", "csrc/cpu/new_part.cpp",
        "csrc/cuda/cuda_host.cpp", "csrc/cuda/cuda_graphs.cpp", "csrc/cuda/mma/attn_fwd_x.cu",
        "csrc/cuda/mma/attn_bwd_x.cu", "csrc/cuda/sm90/attn_fwd_y.cu", "csrc/cpu/attention_params.h",
        "tests/cuda_emulator/emu_entry.cpp", "tests/cuda_emulator/emu.cu",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("// test\n")
    return str(tmp_path)


def test_sources_are_globbed_by_role(B, tree):
    cpu = B.plan({}, _fake_torch(), tree)
    assert cpu["sources"] == ["csrc/bindings.cpp", "csrc/cpu/attention_cpu.cpp", "csrc/cpu/kernels_default.cpp",
                              "csrc/cpu/new_part.cpp"]
    assert [s for s, _ in cpu["isa_sources"]] == ["csrc/cpu/kernels_avx2.cpp", "csrc/cpu/kernels_avx512.cpp"]
    cuda = B.plan({}, _fake_torch(**CUDA_TORCH), tree)
    assert cuda["cuda"]
    assert cuda["sources"] == cpu["sources"] + [
        "csrc/cuda/cuda_graphs.cpp", "csrc/cuda/cuda_host.cpp", "csrc/cuda/mma/attn_bwd_x.cu",
        "csrc/cuda/mma/attn_fwd_x.cu", "csrc/cuda/sm90/attn_fwd_y.cu",
    ]
    assert cuda["cpu_sources"] == cpu["sources"]
    assert "CUDA kernels (3 .cu files, torch CUDA 13.0, arch 8.0;9.0+PTX)" in cuda["message"]


# ---------------------------------------------------------------------------------------------
# CUDA: archs, nvcc/torch mismatch, reasons to leave it out


def test_cuda_torch_with_nvcc_adds_the_cuda_sources(B):
    plan = B.plan({}, _fake_torch(**CUDA_TORCH), ROOT)
    assert plan["cuda"] and plan["notes"] == []
    assert "csrc/cuda/cuda_host.cpp" in plan["sources"]
    assert any(s.startswith("csrc/cuda/") and s.endswith(".cu") for s in plan["sources"])
    assert ("MHAKERN_WITH_CUDA", None) in plan["define_macros"]
    assert ("MHAKERN_WITH_SM90A", None) in plan["define_macros"]  # the default list has 9.0
    nv = plan["nvcc_flags"]
    assert "-Xptxas" in nv and "-v" in nv and "--use_fast_math" not in nv
    assert {f for f in nv if "gencode" in f} == DEFAULT_GENCODE
    assert plan["arch_list"] == "8.0;9.0+PTX"


@pytest.mark.parametrize(
    "arch_list,kept,gencode,dropped",
    [
        ("8.6", "8.6", {"-gencode=arch=compute_86,code=sm_86"}, None),
        ("7.5;8.0;8.6+PTX", "8.0;8.6+PTX", {"-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_86,code=sm_86",
                                            "-gencode=arch=compute_86,code=compute_86"}, "7.5"),
        ("6.0 6.1 7.0 7.5 8.0 8.6", "8.0;8.6", {"-gencode=arch=compute_80,code=sm_80",
                                               "-gencode=arch=compute_86,code=sm_86"}, "6.0, 6.1, 7.0, 7.5"),
        ("Turing;Hopper", "9.0+PTX", {"-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90"},
         "7.5+PTX"),
        ("9.0a", "9.0a", {"-gencode=arch=compute_90a,code=sm_90a"}, None),
    ],
)
def test_arch_list_keeps_only_sm80_and_newer(B, capsys, monkeypatch, tmp_path, arch_list, kept, gencode, dropped):
    plan = B.plan({"TORCH_CUDA_ARCH_LIST": arch_list}, _fake_torch(**CUDA_TORCH), ROOT)
    assert plan["cuda"] and plan["arch_list"] == kept
    assert {f for f in plan["nvcc_flags"] if "gencode" in f} == gencode
    assert (("MHAKERN_WITH_SM90A", None) in plan["define_macros"]) == ("sm_90a" in " ".join(gencode))
    assert f"arch {kept})" in plan["message"]
    if dropped is None:
        assert plan["notes"] == []
    else:
        (note,) = plan["notes"]
        assert note == (f"TORCH_CUDA_ARCH_LIST ({arch_list}): dropped {dropped} (the CUDA kernels need sm_80 or newer); "
                        f"building for {kept}")
        # setup prints it as its own line after the plan's
        from torch.utils import cpp_extension

        monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))  # CUDAExtension joins paths under it
        B.extension_modules({"TORCH_CUDA_ARCH_LIST": arch_list, "MHAKERN_NO_EXTENSION": "0"}, ROOT, plan)
        assert _stderr_lines(capsys)[1] == "mhakern: " + note


@pytest.mark.parametrize("arch_list", ["7.5", "6.1;7.0+PTX", "Volta", "sm_80"])
def test_arch_list_without_sm80_builds_cpu_only(B, arch_list):
    plan = B.plan({"TORCH_CUDA_ARCH_LIST": arch_list}, _fake_torch(**CUDA_TORCH), ROOT)
    assert plan["build"] and not plan["cuda"]
    assert not any(s.endswith(".cu") for s in plan["sources"]) and plan["nvcc_flags"] == []
    assert plan["message"].endswith(f"no CUDA code: TORCH_CUDA_ARCH_LIST ({arch_list}) names no GPU arch of 8.0 or newer")
    assert plan["notes"][0].startswith(f"TORCH_CUDA_ARCH_LIST ({arch_list}): dropped ")


def test_the_builds_minimum_arch_is_the_capability_tables(B):
    # One fact in one place: the build drops archs below the minimum the kernels state in
    # csrc/capabilities.h, which the run-time check reads too.
    import json

    import torch
    C = pytest.importorskip("mhakern._C", reason="mhakern._C is not built")
    assert list(B.min_arch()) == json.loads(torch.ops.mhakern_C.capabilities())["cuda"]["min_capability"]
    below = "%d.%d" % (B.min_arch()[0] - 1, 5)
    assert B.filter_arch_list(below + ";" + "%d.%d" % B.min_arch()) == (["%d.%d" % B.min_arch()], [below])
    del C


def test_first_use_build_targets_the_visible_gpus(B):
    plan = B.plan({}, _fake_torch(**CUDA_TORCH), ROOT, gpu_archs=["8.6", "9.0"])
    assert plan["arch_list"] == "8.6;9.0+PTX"
    plan = B.plan({}, _fake_torch(**CUDA_TORCH), ROOT, gpu_archs=["7.5", "9.0"])
    assert plan["arch_list"] == "9.0+PTX" and "dropped 7.5" in plan["notes"][0]
    # An old GPU alone: nothing the kernels could run on, so no CUDA code.
    plan = B.plan({}, _fake_torch(**CUDA_TORCH), ROOT, gpu_archs=["7.0"])
    assert not plan["cuda"] and "names no GPU arch of 8.0 or newer" in plan["message"]
    # TORCH_CUDA_ARCH_LIST wins over the devices.
    plan = B.plan({"TORCH_CUDA_ARCH_LIST": "8.0"}, _fake_torch(**CUDA_TORCH), ROOT, gpu_archs=["9.0"])
    assert plan["arch_list"] == "8.0"


def test_visible_gpu_archs_are_clamped_to_what_torch_knows(B, monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(8, 6), (12, 0), (8, 6)][i])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90", "compute_90"])
    assert B.visible_gpu_archs() == ["8.6", "9.0"]


def test_nvcc_of_another_cuda_major_builds_cpu_only(B):
    plan = B.plan({}, _fake_torch(cuda="13.0", nvcc="/usr/local/cuda-12.4/bin/nvcc", nvcc_version="12.4"), ROOT)
    assert plan["build"] and not plan["cuda"]
    assert not any(s.endswith(".cu") for s in plan["sources"])
    assert "no CUDA code: nvcc is CUDA 12.4 but torch was built with CUDA 13.0" in plan["message"]
    assert "CUDA 13.x toolkit" in plan["message"]
    # A minor difference is fine (torch only warns).
    assert B.plan({}, _fake_torch(cuda="13.0", nvcc="/x/nvcc", nvcc_version="13.1"), ROOT)["cuda"]


def test_nvcc_version_is_read_from_nvcc(B, tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    assert B.nvcc_version(str(nvcc)) == "12.4"
    assert B.nvcc_version(str(tmp_path / "missing")) is None and B.nvcc_version(None) is None


@pytest.mark.parametrize(
    "env,info,why",
    [
        ({"MHAKERN_NO_CUDA": "1"}, CUDA_TORCH, "MHAKERN_NO_CUDA is set"),
        ({}, dict(cuda=None, nvcc="/x/nvcc"), "torch has no CUDA"),
        ({}, dict(cuda="13.0", nvcc=None), "nvcc not found (set CUDA_HOME)"),
    ],
)
def test_cuda_part_skipped_with_its_reason(B, env, info, why):
    plan = B.plan(env, _fake_torch(**info), ROOT)
    assert plan["build"] and not plan["cuda"]
    assert not any(s.endswith(".cu") for s in plan["sources"])
    assert plan["message"].endswith("no CUDA code: " + why)


def test_cuda_extension_object_on_a_fake_cuda_torch(B, tree, monkeypatch):
    from torch.utils import cpp_extension

    # A CPU-only torch leaves CUDA_HOME unset; CUDAExtension only joins paths under it.
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", tree)
    plan = B.plan({}, _fake_torch(**CUDA_TORCH), tree)
    (ext,), _ = B.extension_modules({}, tree, plan)
    assert "csrc/cuda/mma/attn_fwd_x.cu" in ext.sources and ext.mhakern_cuda
    assert "-Xptxas" in ext.extra_compile_args["nvcc"]
    assert "cudart" in ext.libraries


# ---------------------------------------------------------------------------------------------
# The build command: a CUDA failure costs only the CUDA kernels; a failure warns


def _cuda_ext_and_cmd(B, tree, monkeypatch, env):
    from setuptools import Distribution
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", tree)
    plan = B.plan(env, _fake_torch(**CUDA_TORCH), tree)
    (ext,), cmdclass = B.extension_modules(env, tree, plan)
    cmd = cmdclass["build_ext"](Distribution({"ext_modules": [ext]}))
    cmd.extensions = [ext]  # what finalize_options would set
    return ext, cmd


def test_failed_cuda_compile_rebuilds_the_module_cpu_only(B, tree, monkeypatch, capsys):
    ext, cmd = _cuda_ext_and_cmd(B, tree, monkeypatch, {})
    built = []

    def compile_(ext):
        if any(s.endswith(".cu") for s in ext.sources):
            raise RuntimeError("Error compiling objects for extension\nattn_fwd_x.cu(3): error: identifier undefined")
        built.append((list(ext.sources), dict(ext.define_macros), list(ext.libraries)))

    monkeypatch.setattr(cmd, "_build_with_isa_variants", compile_)
    capsys.readouterr()
    cmd.build_extension(ext)
    (sources, macros, libs), = built
    assert sources == ext.mhakern_plan["cpu_sources"] and "MHAKERN_WITH_CUDA" not in macros
    assert "MHAKERN_CPU_AVX2" in macros and "cudart" not in libs and "torch_cuda" not in libs
    (line,) = _stderr_lines(capsys)
    assert line == (
        "mhakern: WARNING: the CUDA part of mhakern._C failed (RuntimeError: attn_fwd_x.cu(3): error: identifier "
        "undefined); building the CPU kernels alone (MHAKERN_REQUIRE_CUDA=1 makes this an error)"
    )
    assert cmd.mhakern_cuda_error.startswith("RuntimeError: attn_fwd_x.cu(3): error")


def test_torch_cuda_checks_failing_before_the_build_fall_back_to_cpu(B, tree, monkeypatch, capsys):
    # torch's BuildExtension.build_extensions raises on an nvcc/torch CUDA mismatch (or a host
    # compiler outside CUDA's bounds) before building any extension.
    from torch.utils.cpp_extension import BuildExtension

    ext, cmd = _cuda_ext_and_cmd(B, tree, monkeypatch, {})
    built = []

    def torch_build_extensions(self):
        if any(s.endswith(".cu") for x in self.extensions for s in x.sources):
            raise RuntimeError("The detected CUDA version (12.4) mismatches the version that was used to compile "
                               "PyTorch (13.0). Please make sure to use the same CUDA versions.")
        built.extend(list(x.sources) for x in self.extensions)

    monkeypatch.setattr(BuildExtension, "build_extensions", torch_build_extensions)
    capsys.readouterr()
    cmd.build_extensions()
    assert built == [ext.mhakern_plan["cpu_sources"]]
    (line,) = _stderr_lines(capsys)
    assert "the CUDA part of mhakern._C failed (RuntimeError: The detected CUDA version (12.4) mismatches" in line

    # MHAKERN_REQUIRE_CUDA=1: the failure is the build's.
    ext, cmd = _cuda_ext_and_cmd(B, tree, monkeypatch, {"MHAKERN_REQUIRE_CUDA": "1"})
    with pytest.raises(RuntimeError, match="mismatches"):
        cmd.build_extensions()


def test_failed_compile_warns_and_the_install_goes_on(B, capsys, monkeypatch):
    from setuptools import Distribution
    from setuptools.errors import CompileError

    def boom(ext):
        raise CompileError("kernels_avx2.cpp:1: error: something\nmore output")

    ext = type("Ext", (), {"name": "mhakern._C"})()
    cmd = B.build_ext_class({})(Distribution())
    monkeypatch.setattr(cmd, "_build_with_isa_variants", boom)
    cmd.build_extension(ext)
    lines = _stderr_lines(capsys)
    assert len(lines) == 1
    assert "WARNING: building the C++ extension mhakern._C failed (CompileError: kernels_avx2.cpp:1: error: something)" in lines[0]
    assert "built on first use instead" in lines[0] and "MHAKERN_REQUIRE_EXTENSION=1" in lines[0]

    strict = B.build_ext_class({"MHAKERN_REQUIRE_EXTENSION": "1"})(Distribution())
    monkeypatch.setattr(strict, "_build_with_isa_variants", boom)
    with pytest.raises(CompileError):
        strict.build_extension(ext)


def test_max_jobs_sets_the_parallel_compile_without_ninja(B):
    from setuptools import Distribution

    cmd = B.build_ext_class({"MAX_JOBS": "3"})(Distribution())
    cmd.use_ninja = False
    cmd.finalize_options()
    assert cmd.parallel == 3


def test_first_error_finds_the_compilers_first_error(B):
    log = textwrap.dedent(
        """\
        mhakern: building mhakern._C with CPU kernels (DEFAULT); no CUDA code: torch has no CUDA
        [1/3] c++ -MMD -MF x.o.d -O3 -c csrc/cpu/attention_cpu.cpp -o x.o
        csrc/cpu/attention_cpu.cpp:10:5: warning: unused variable 'error_count'
        FAILED: /tmp/k/tmp/csrc/bindings.o
        csrc/bindings.cpp:3:10: fatal error: torch/extension.h: No such file or directory
        csrc/bindings.cpp:9:1: error: expected ';' before '}' token
        RuntimeError: Error compiling objects for extension
        """
    )
    assert B.first_error(log) == "csrc/bindings.cpp:3:10: fatal error: torch/extension.h: No such file or directory"
    assert B.first_error("ptxas fatal   : Unresolved extern function 'f'\nninja: build stopped") == \
        "ptxas fatal   : Unresolved extern function 'f'"
    assert B.first_error("x.cu(3): error: identifier \"y\" is undefined\n") == 'x.cu(3): error: identifier "y" is undefined'
    assert B.first_error("") == "no output"


def test_a_regular_install_carries_the_sources(tmp_path):
    # A non-editable install (a wheel) has no checkout beside it: setup's build_py copies csrc/
    # into the package as mhakern/_src/csrc, where the first-use build finds it.
    from setuptools import Distribution

    setup_mod = _load(SETUP, "mhakern_setup_under_test")
    cmd = setup_mod.BuildPyWithSources(Distribution({"packages": []}))
    cmd.initialize_options()
    cmd.build_lib = str(tmp_path)
    cmd.finalize_options()
    cmd.run()
    copied = tmp_path / "mhakern" / "_src" / "csrc"
    assert (copied / "bindings.cpp").read_bytes() == open(os.path.join(ROOT, "csrc", "bindings.cpp"), "rb").read()
    assert (copied / "cpu" / "kernels_avx2.cpp").exists() and list((copied / "cuda" / "mma").glob("*.cu"))


def test_source_root_prefers_the_checkout_then_the_carried_copy(B, tmp_path, monkeypatch):
    assert B.source_root() == ROOT  # this checkout
    pkg = tmp_path / "site-packages" / "mhakern"
    (pkg / "_src" / "csrc").mkdir(parents=True)
    monkeypatch.setattr(B, "package_dir", lambda: str(pkg))
    assert B.source_root() is None  # no bindings.cpp anywhere
    (pkg / "_src" / "csrc" / "bindings.cpp").write_text("// test\n")
    assert B.source_root() == str(pkg / "_src")


# ---------------------------------------------------------------------------------------------
# First-use build: cache key, lock, remembered failures


def test_build_key_follows_sources_torch_python_and_archs(B, tree):
    info = _fake_torch()
    plan = B.plan({}, info, tree)
    key = B.build_key(tree, info, plan)
    assert key.startswith("torch2.13.0-cpu-py%d%d-" % sys.version_info[:2])
    assert B.build_key(tree, info, plan) == key  # deterministic
    assert B.build_key(tree, dict(info, version="2.14.0"), plan) != key
    with open(os.path.join(tree, "csrc", "cpu", "attention_params.h"), "a") as fh:
        fh.write("// a header changed\n")
    assert B.build_key(tree, info, plan) != key
    # The emulator's files (test infrastructure, outside csrc/) are not part of the module.
    key = B.build_key(tree, info, plan)
    with open(os.path.join(tree, "tests", "cuda_emulator", "emu_entry.cpp"), "a") as fh:
        fh.write("// changed\n")
    assert B.build_key(tree, info, plan) == key
    cinfo = _fake_torch(**CUDA_TORCH)
    k80 = B.build_key(tree, cinfo, B.plan({"TORCH_CUDA_ARCH_LIST": "8.0"}, cinfo, tree))
    k90 = B.build_key(tree, cinfo, B.plan({"TORCH_CUDA_ARCH_LIST": "9.0"}, cinfo, tree))
    assert k80 != k90 and k80.startswith("torch2.13.0-cu130-")


def test_cache_dir_follows_the_environment(B, tmp_path):
    assert B.cache_dir({"MHAKERN_CACHE_DIR": str(tmp_path / "c")}) == str(tmp_path / "c")
    assert B.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "mhakern")
    assert B.cache_dir({}).endswith(os.path.join(".cache", "mhakern"))


def _fake_build(key_dir, calls_dir=None, go=None):
    """Stands in for the compiler: records the call, waits for ``go`` (if given), writes the module."""
    if calls_dir:
        with open(os.path.join(calls_dir, f"call-{os.getpid()}"), "w"):
            pass
    while go and not os.path.exists(go):
        time.sleep(0.01)
    lib = os.path.join(key_dir, "lib", "mhakern")
    os.makedirs(lib, exist_ok=True)
    with open(os.path.join(lib, "_C" + sysconfig.get_config_var("EXT_SUFFIX")), "w") as fh:
        fh.write("not really a module\n")


def _contender(build_path, key_dir, calls_dir, go, ready):
    B = _load(build_path, "mhakern_build_contender")
    with open(ready, "w"):
        pass
    print(B.ensure_built(key_dir, lambda d: _fake_build(d, calls_dir, go)), flush=True)


def test_concurrent_first_uses_build_once(B, tmp_path):
    key_dir = str(tmp_path / "cache" / "key")
    calls = tmp_path / "calls"
    calls.mkdir()
    go = str(tmp_path / "go")
    ctx = mp.get_context("spawn")
    build_path = os.path.join(ROOT, "mhakern", "_build.py")
    # The first process takes the lock and builds until `go` exists; the second starts while it
    # holds the lock; once the second has started, the first may finish.
    first = ctx.Process(target=_contender, args=(build_path, key_dir, str(calls), go, str(tmp_path / "r1")))
    first.start()
    while not list(calls.iterdir()):
        time.sleep(0.01)
    second = ctx.Process(target=_contender, args=(build_path, key_dir, str(calls), go, str(tmp_path / "r2")))
    second.start()
    while not (tmp_path / "r2").exists():
        time.sleep(0.01)
    open(go, "w").close()
    first.join(120)
    second.join(120)
    assert first.exitcode == 0 and second.exitcode == 0
    assert len(list(calls.iterdir())) == 1  # built once
    # A later use finds it without building.
    assert B.ensure_built(key_dir, lambda d: pytest.fail("built again")).startswith(key_dir)


def test_a_failed_build_is_remembered_and_forced_again(B, tmp_path):
    key_dir = str(tmp_path / "key")
    attempts = []

    def failing(d):
        attempts.append(d)
        raise B.BuildFailed("building mhakern._C at first use failed: x.cpp:1:1: error: nope")

    for _ in range(2):
        with pytest.raises(ImportError, match="x.cpp:1:1: error: nope"):
            B.ensure_built(key_dir, failing)
    assert len(attempts) == 1  # the second process-level attempt read failed.json
    with open(os.path.join(key_dir, "failed.json")) as fh:
        assert "error: nope" in json.load(fh)["message"]
    assert B.ensure_built(key_dir, _fake_build, force=True).startswith(key_dir)
    assert not os.path.exists(os.path.join(key_dir, "failed.json"))


def test_a_broken_source_fails_at_first_use_with_the_compilers_first_error(tmp_path):
    # A real first-use build (a child process running torch's BuildExtension) of a tree whose
    # bindings.cpp does not compile: the error names the compiler's first error and the log, the
    # cpu backend reports it through available_backends(), and the failure is not retried.
    src = tmp_path / "src"
    (src / "csrc" / "cpu").mkdir(parents=True)
    (src / "csrc" / "bindings.cpp").write_text("#error mhakern test: deliberately broken source\n")
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        import mhakern._build as B
        B.source_root = lambda: {str(src)!r}
        # Resolve mhakern._C to the stand-in module even where a compiled one sits in the checkout.
        class _StandIn:
            def find_spec(self, name, path=None, target=None):
                if name == "mhakern._C":
                    return importlib.util.spec_from_file_location(name, {os.path.join(ROOT, "mhakern", "_C.py")!r})
        sys.meta_path.insert(0, _StandIn())
        import mhakern
        print("CPU:", mhakern.available_backends()["cpu"])
        try:
            import mhakern._C
        except ImportError as e:
            print("AGAIN:", e)
        """
    )
    env = dict(os.environ, MHAKERN_CACHE_DIR=str(tmp_path / "cache"), MAX_JOBS="1")
    env.pop("MHAKERN_NO_JIT", None)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    cpu = res.stdout.split("CPU: ", 1)[1].splitlines()[0]
    assert re.search(r"building mhakern._C at first use failed: \S*csrc/bindings.cpp:1:2: error: #error mhakern test: "
                     r"deliberately broken source \(full log: ", cpu), cpu
    (key_dir,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert f"full log: {key_dir / 'build.log'}" in cpu and "python -m mhakern.build --force" in cpu
    assert (key_dir / "failed.json").exists()
    again = res.stdout.split("AGAIN: ", 1)[1]
    assert "deliberately broken source" in again
    assert res.stderr.count("mhakern: building mhakern._C for this machine") == 1, res.stderr


def test_no_jit_switch_refuses_to_build(B, monkeypatch):
    monkeypatch.setenv("MHAKERN_NO_JIT", "1")
    monkeypatch.setattr(B, "_failed", [])
    with pytest.raises(ImportError, match="MHAKERN_NO_JIT=1 forbids building it at first use") as e:
        B.load_built_module()
    assert "python -m mhakern.build" in str(e.value) and HINT in str(e.value)


def test_cpu_backend_says_why_when_the_extension_is_missing():
    script = _BLOCKER.format(name="mhakern._C") + textwrap.dedent(
        """
        from mhakern.backends import cpu_backend
        print(cpu_backend.CpuBackend().unavailable())
        """
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    why = res.stdout.strip()
    assert why.startswith("mhakern._C is not available (No module named 'mhakern._C'")


# ---------------------------------------------------------------------------------------------
# The real thing: a first-use build through to a loaded module; a fresh venv, a plain
# `pip install -e .`, the first use

# A module with Python's C API alone (a second, not the minutes of the real sources), built by
# the real first-use route: the child process, torch's BuildExtension, ninja, the link, the
# staging directory renamed into place, the load.
_TINY_MODULE = textwrap.dedent(
    """
    #include <Python.h>
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {nullptr, nullptr, 0, nullptr}};
    static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
    PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
    """
)

_TINY_FIRST_USE = textwrap.dedent(
    """
    import importlib.util, sys
    import mhakern._build as B
    B.source_root = lambda: {src!r}
    # Resolve mhakern._C to the stand-in module even where a compiled one sits in the checkout.
    class _StandIn:
        def find_spec(self, name, path=None, target=None):
            if name == "mhakern._C":
                return importlib.util.spec_from_file_location(name, {stand_in!r})
    sys.meta_path.insert(0, _StandIn())
    if {ahead!r} and B.main([]) != 0:  # before the import: it asks the import system where the module is
        sys.exit(1)
    import mhakern._C as C
    print("OK", C.__file__, C.answer())
    """
)


def test_first_use_builds_links_and_loads_the_module(tmp_path):
    src = tmp_path / "src"
    (src / "csrc").mkdir(parents=True)
    (src / "csrc" / "bindings.cpp").write_text(_TINY_MODULE)
    cache = tmp_path / "cache"
    env = dict(os.environ, MHAKERN_CACHE_DIR=str(cache), MAX_JOBS="1")
    env.pop("MHAKERN_NO_JIT", None)

    def script(ahead):
        return _TINY_FIRST_USE.format(src=str(src), stand_in=os.path.join(ROOT, "mhakern", "_C.py"), ahead=ahead)

    # Two processes at once, one importing the module, one building it ahead (`python -m
    # mhakern.build`): one builds (one line, then its time), the other waits, and both load it.
    procs = [subprocess.Popen([sys.executable, "-c", script(ahead)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for ahead in (False, True)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, out + err[-5000:]
    err = "".join(e for _, e in results)
    assert err.count("mhakern: building mhakern._C for this machine (CPU kernels") == 1, err
    assert err.count("mhakern: built mhakern._C in ") == 1, err
    (key_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    path = str(key_dir / "lib" / "mhakern" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX")))
    assert results[0][0].splitlines() == [f"OK {path} 42"], results[0][0]
    assert results[1][0].splitlines() == [f"mhakern._C: {path}", f"OK {path} 42"], results[1][0]
    assert not (key_dir / "staging").exists() and not (key_dir / "tmp").exists()  # renamed; objects removed
    assert json.loads((key_dir / "lib" / "build_info.json").read_text())["cuda"] is False


install_test = pytest.mark.skipif(
    os.environ.get("CI") != "true" and os.environ.get("MHAKERN_TEST_INSTALL") != "1",
    reason="a fresh venv and a pip install under build isolation (half a minute): runs on CI, or with "
           "MHAKERN_TEST_INSTALL=1",
)

_FIRST_USE = textwrap.dedent(
    """
    import torch, mhakern
    why = mhakern.available_backends()["cpu"]
    assert why is None, why
    import mhakern._C as C
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 40, dtype=torch.float64) for _ in range(3))
    out = mhakern.attention(q.float(), k.float(), v.float(), causal=True, backend="cpu")
    ref = mhakern.attention(q, k, v, causal=True, backend="reference")
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-5, err
    print("OK", C.__file__, err)
    """
)


def _copy_checkout(dst):
    # The checkout without what a build left in it (an in-place mhakern/_C*.so would be used
    # instead of the first-use build).
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(
        ".git", "*.so", "build", "*.egg-info", "__pycache__", ".pytest_cache", "results", ".hypothesis", ".benchmarks"))


def _venv_with_this_torch(venv):
    """A fresh venv that sees this interpreter's packages (torch, pip's wheels) without copying
    them: --system-site-packages plus a .pth naming this environment's site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "zz_parent_env.pth"), "w") as fh:
        fh.write("\n".join(sorted(here)) + "\n")
    return py


@install_test
def test_plain_pip_install_uses_the_module_at_first_use(B, tmp_path):
    src = tmp_path / "mhakern-src"
    _copy_checkout(src)
    py = _venv_with_this_torch(tmp_path / "venv")
    cache = tmp_path / "cache"
    env = dict(os.environ, MHAKERN_CACHE_DIR=str(cache), PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.setdefault("MAX_JOBS", "2")
    for name in ("MHAKERN_NO_JIT", "MHAKERN_NO_EXTENSION", "PIP_NO_BUILD_ISOLATION", "VIRTUAL_ENV", "PYTHONPATH"):
        env.pop(name, None)
    # As people type it: build isolation on.
    pip = subprocess.run([str(py), "-m", "pip", "install", "-e", str(src)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    # No compiled module in the checkout: the install built nothing.
    assert not list((src / "mhakern").glob("_C*.so"))

    # The module this run built from the same sources and plan, where a first-use build of the
    # copy would put it: the key is computed here as jit_build computes it there, so a key that
    # drifted between processes, a loader that cannot load from the cache or a stand-in that
    # is not reached fails below (the first use would build, and "building" would be printed).
    import mhakern._C as C  # noqa: PLC0415 -- CI's own build (tests/test_ci_requirements.py: built)

    info = B.torch_info()
    key_env = {k: v for k, v in env.items() if k != "MHAKERN_NO_EXTENSION"}
    plan = B.plan(key_env, info, str(src), B.visible_gpu_archs())
    lib = cache / B.build_key(str(src), info, plan) / "lib" / "mhakern"
    lib.mkdir(parents=True)
    shutil.copy2(C.__file__, lib / ("_C" + sysconfig.get_config_var("EXT_SUFFIX")))

    # `python -m mhakern.build` says where it is, then the first import loads it and the cpu
    # backend runs on it; nothing is built (the lock and a real build: the test above).
    script = "import sys, mhakern._build as B\nif B.main([]) != 0:\n    sys.exit(1)\n" + _FIRST_USE
    use = subprocess.run([str(py), "-c", script], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=600)
    assert use.returncode == 0 and "building" not in use.stderr, use.stdout + use.stderr[-3000:]
    ahead, ok = use.stdout.splitlines()
    path = str(lib / ("_C" + sysconfig.get_config_var("EXT_SUFFIX")))
    assert ahead == "mhakern._C: " + path and ok.startswith(f"OK {path} "), use.stdout


def _fake_cxx(tmp_path, dev_link: bool):
    """A compiler driver that answers -print-file-name like GCC: the path when it has the file,
    the bare name when not (a slimmed image without libstdc++'s development link)."""
    runtime = tmp_path / "lib" / "libstdc++.so.6"
    runtime.parent.mkdir(parents=True, exist_ok=True)
    runtime.write_bytes(b"")
    dev = tmp_path / "lib" / "libstdc++.so"
    if dev_link:
        dev.symlink_to(runtime)
    script = tmp_path / "fakecxx"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$1" in\n'
        f'  -print-file-name=libstdc++.so) [ -e "{dev}" ] && echo "{dev}" || echo libstdc++.so ;;\n'
        f'  -print-file-name=libstdc++.so.6) echo "{runtime}" ;;\n'
        f'  *) echo "$1" ;;\n'
        "esac\n"
    )
    script.chmod(0o755)
    return str(script), str(runtime)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the probe runs on Linux only")
def test_the_shared_cxx_runtime_is_linked_by_name(B, tmp_path):
    # A toolchain that would link libstdc++.a into the module puts a second C++ runtime beside
    # torch's: the first string or exception across the two crashes. Naming the shared runtime
    # on the link line resolves every runtime symbol there; the note says when the driver had
    # no shared one of its own.
    for dev_link in (False, True):
        d = tmp_path / str(dev_link)
        cxx, runtime = _fake_cxx(d, dev_link=dev_link)
        assert B.cxx_runtime_to_link(cxx) == os.path.realpath(runtime)
        assert B.cxx_runtime_is_static_only(cxx) is (not dev_link)
        info = dict(_fake_torch(), cxx_runtime=os.path.realpath(runtime), cxx_runtime_static_only=not dev_link)
        p = B.plan({}, info, ROOT)
        assert p["link_flags"][-1] == os.path.realpath(runtime)
        assert any("no shared libstdc++" in n for n in p["notes"]) is (not dev_link)
    # This machine's own compiler has the shared runtime (the module built here imports).
    assert B.cxx_runtime_to_link() is not None and not B.cxx_runtime_is_static_only()
