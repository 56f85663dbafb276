"""The build of mhakern._C in its three situations, and what the backends then say.

setup.py's decisions are plain functions (``_plan``, ``_extension_modules``, the build_ext
class), so they are checked here directly or in a short subprocess, without compiling:
* the skip switch MHAKERN_NO_EXTENSION=1: nothing to build, one line saying so;
* no torch in the build environment (pip's build isolation): nothing to build, one line naming
  ``pip install -e . --no-build-isolation``, and the pure-Python install proceeds;
* a CPU-only torch: the CPU code alone (the per-ISA kernel files with their own flags); with a
  CUDA torch and nvcc, the CUDA sources too (checked on a fake environment);
* a failed compile warns and does not abort, unless MHAKERN_REQUIRE_EXTENSION=1;
* with mhakern._C missing, available_backends()["cpu"] says why and how to build it.
"""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "setup.py")
HINT = "pip install -e . --no-build-isolation"

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


def _load_setup():
    spec = importlib.util.spec_from_file_location("mhakern_setup_under_test", SETUP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # __name__ is not "__main__": setup() does not run
    return mod


@pytest.fixture(scope="module")
def setup_mod():
    return _load_setup()


def _fake_torch(cuda=None, nvcc=None, machine="x86_64", platform="linux"):
    return {"version": "2.13.0", "cuda": cuda, "hip": None, "nvcc": nvcc, "openmp": True, "machine": machine, "platform": platform}


def _stderr_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# Situation 1: the skip switch


def test_skip_switch_builds_nothing_and_says_so(setup_mod, capsys):
    assert setup_mod._extension_modules({"MHAKERN_NO_EXTENSION": "1"}) == ([], {})
    lines = _stderr_lines(capsys)
    assert len(lines) == 1
    assert "MHAKERN_NO_EXTENSION is set: skipping the C++ extension mhakern._C" in lines[0]
    assert "backend 'cpu' unavailable" in lines[0]
    for off in ("", "0", "false", "no"):
        assert setup_mod._plan({"MHAKERN_NO_EXTENSION": off}, _fake_torch())["build"]


# ---------------------------------------------------------------------------------------------
# Situation 2: no torch in the build environment


def test_no_torch_in_build_env_skips_with_one_line_and_installs_pure_python():
    # setup.py run as pip runs it (__main__), with torch unimportable: it must print one line
    # naming the no-build-isolation install and still produce the package metadata.
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
    ours = [line for line in res.stderr.splitlines() if line.startswith("mhakern setup:")]
    assert len(ours) == 1, res.stderr
    assert "torch is not importable in this build environment" in ours[0]
    assert HINT in ours[0]
    assert res.stdout.strip().splitlines()[-1] == "mhakern"


def test_no_torch_plan(setup_mod):
    plan = setup_mod._plan({}, None)
    assert plan["build"] is False and HINT in plan["message"]


# ---------------------------------------------------------------------------------------------
# Situation 3: torch present (CPU-only here; CUDA on a fake environment)


def test_this_torch_gives_the_expected_extension(setup_mod, capsys):
    import torch
    from torch.utils.cpp_extension import BuildExtension

    exts, cmdclass = setup_mod._extension_modules({})
    lines = _stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("mhakern setup: building mhakern._C with CPU kernels")
    assert len(exts) == 1 and exts[0].name == "mhakern._C"
    assert issubclass(cmdclass["build_ext"], BuildExtension)
    srcs = exts[0].sources
    assert {"csrc/bindings.cpp", "csrc/cpu/attention_cpu.cpp", "csrc/cpu/kernels_default.cpp"} <= set(srcs)
    macros = dict(exts[0].define_macros)
    if torch.version.cuda is None:
        assert "no CUDA code: torch has no CUDA" in lines[0]
        assert not any(s.endswith(".cu") for s in srcs) and "csrc/cuda_host.cpp" not in srcs
        assert "MHAKERN_WITH_CUDA" not in macros
    flags = exts[0].extra_compile_args["cxx"]
    assert "-march=native" not in flags and not any(f.startswith("-mavx") for f in flags)
    # optional: a module that failed to build is not copied (editable installs go on) ...
    assert exts[0].optional is True
    # ... unless CI asks for it.
    (strict,), _ = setup_mod._extension_modules({"MHAKERN_REQUIRE_EXTENSION": "1"})
    assert strict.optional is False


def test_cpu_plan_compiles_isa_variants_with_their_own_flags(setup_mod):
    plan = setup_mod._plan({}, _fake_torch())
    assert plan["build"] and not plan["cuda"]
    isa = dict(plan["isa_sources"])
    assert isa["csrc/cpu/kernels_avx2.cpp"][:2] == ["-mavx2", "-mfma"]
    assert "-mavx512f" in isa["csrc/cpu/kernels_avx512.cpp"]
    assert not any(s in plan["sources"] for s in isa)  # never compiled with the common flags
    assert ("MHAKERN_CPU_AVX2", None) in plan["define_macros"]
    assert "-fopenmp" in plan["cxx_flags"] and "-fopenmp" in plan["link_flags"]
    assert all("native" not in f for f in plan["cxx_flags"] + sum(isa.values(), []))
    assert "CPU kernels (DEFAULT, AVX2, AVX512)" in plan["message"]
    for src in list(isa) + plan["sources"]:
        assert os.path.exists(os.path.join(ROOT, src)), src
    # Not x86: the portable kernels only.
    arm = setup_mod._plan({}, _fake_torch(machine="aarch64"))
    assert arm["isa_sources"] == [] and "CPU kernels (DEFAULT)" in arm["message"]


@pytest.fixture
def fake_cuda_tree(setup_mod, tmp_path, monkeypatch):
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    for name in ("csrc/cuda/attn_fwd_x.cu", "csrc/cuda/attn_bwd_x.cu", "csrc/cuda_host.cpp"):
        (tmp_path / name).write_text("// test\n")
    monkeypatch.setattr(setup_mod, "ROOT", str(tmp_path))
    return tmp_path


def test_cuda_torch_with_nvcc_adds_the_cuda_sources(setup_mod, fake_cuda_tree):
    plan = setup_mod._plan({}, _fake_torch(cuda="13.0", nvcc="/opt/cuda/bin/nvcc"))
    assert plan["cuda"]
    assert "csrc/cuda_host.cpp" in plan["sources"]
    assert {"csrc/cuda/attn_fwd_x.cu", "csrc/cuda/attn_bwd_x.cu"} <= set(plan["sources"])
    assert ("MHAKERN_WITH_CUDA", None) in plan["define_macros"]
    nv = plan["nvcc_flags"]
    assert "-Xptxas" in nv and "-v" in nv and "--use_fast_math" not in nv
    assert {
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    } <= set(nv)
    assert "CUDA kernels (2 .cu files, torch CUDA 13.0, arch 8.0;9.0+PTX)" in plan["message"]
    # TORCH_CUDA_ARCH_LIST overrides the default list (torch then adds its own -gencode flags).
    plan = setup_mod._plan({"TORCH_CUDA_ARCH_LIST": "8.6"}, _fake_torch(cuda="13.0", nvcc="/opt/cuda/bin/nvcc"))
    assert not any("gencode" in f for f in plan["nvcc_flags"]) and "arch 8.6" in plan["message"]


@pytest.mark.parametrize(
    "env,info,why",
    [
        ({"MHAKERN_NO_CUDA": "1"}, dict(cuda="13.0", nvcc="/x/nvcc"), "MHAKERN_NO_CUDA is set"),
        ({}, dict(cuda=None, nvcc="/x/nvcc"), "torch has no CUDA"),
        ({}, dict(cuda="13.0", nvcc=None), "nvcc not found (set CUDA_HOME)"),
    ],
)
def test_cuda_part_skipped_with_its_reason(setup_mod, fake_cuda_tree, env, info, why):
    plan = setup_mod._plan(env, _fake_torch(**info))
    assert plan["build"] and not plan["cuda"]
    assert not any(s.endswith(".cu") for s in plan["sources"])
    assert plan["message"].endswith("no CUDA code: " + why)


def test_cuda_part_skipped_without_cu_files(setup_mod, tmp_path, monkeypatch):
    monkeypatch.setattr(setup_mod, "ROOT", str(tmp_path))
    plan = setup_mod._plan({}, _fake_torch(cuda="13.0", nvcc="/x/nvcc"))
    assert not plan["cuda"] and plan["message"].endswith("csrc/cuda/ holds no .cu file")


def test_cuda_extension_object_on_a_fake_cuda_torch(setup_mod, fake_cuda_tree, monkeypatch):
    from torch.utils import cpp_extension

    # A CPU-only torch leaves CUDA_HOME unset; CUDAExtension only joins paths under it.
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(fake_cuda_tree))
    monkeypatch.setattr(setup_mod, "_torch_info", lambda: _fake_torch(cuda="13.0", nvcc="/x/nvcc"))
    (ext,), _ = setup_mod._extension_modules({})
    assert "csrc/cuda/attn_fwd_x.cu" in ext.sources
    assert "nvcc" in ext.extra_compile_args and "-Xptxas" in ext.extra_compile_args["nvcc"]


# ---------------------------------------------------------------------------------------------
# A failed compile


def _build_cmd(setup_mod, env):
    from setuptools import Distribution

    return setup_mod._build_ext_class(env)(Distribution())


def test_failed_compile_warns_and_the_install_goes_on(setup_mod, capsys, monkeypatch):
    from setuptools.errors import CompileError

    cmd = _build_cmd(setup_mod, {})

    def boom(ext):
        raise CompileError("kernels_avx2.cpp:1: error: something\nmore output")

    monkeypatch.setattr(cmd, "_build_with_isa_variants", boom)
    cmd.build_extension(type("Ext", (), {"name": "mhakern._C"})())
    lines = _stderr_lines(capsys)
    assert len(lines) == 1
    assert "WARNING: building the C++ extension mhakern._C failed (CompileError: kernels_avx2.cpp:1: error: something)" in lines[0]
    assert "backend 'cpu' is unavailable" in lines[0] and "MHAKERN_REQUIRE_EXTENSION=1" in lines[0]

    strict = _build_cmd(setup_mod, {"MHAKERN_REQUIRE_EXTENSION": "1"})
    monkeypatch.setattr(strict, "_build_with_isa_variants", boom)
    with pytest.raises(CompileError):
        strict.build_extension(type("Ext", (), {"name": "mhakern._C"})())


def test_max_jobs_sets_the_parallel_compile_without_ninja(setup_mod):
    cmd = _build_cmd(setup_mod, {"MAX_JOBS": "3"})
    cmd.use_ninja = False
    cmd.finalize_options()
    assert cmd.parallel == 3


# ---------------------------------------------------------------------------------------------
# The backends without the extension


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
    assert HINT in why and "MHAKERN_NO_EXTENSION=1" in why
