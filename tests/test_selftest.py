"""The first-use self-test of the kernel families (mhakern/selftest.py, issue 29), run for real on
a CPU through a test-only family whose kernels are the CUDA emulator's mma.sync kernels
(tests/selftest_families.py: ``emu_mma``), served to calls by a test backend (``emu``) gated as
the cuda backend is: a planted wrong answer and a planted hang are caught in the child and the
call routes to the next backend; a pass is tested once for processes starting together; the
switches and the build digest decide when to test again. ``mhakern.self_test()`` prints its
table on this CPU machine (the CUDA families named with why, Triton through its interpreter)."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import mhakern
from mhakern import backends, reference, selftest
from mhakern.backends import DEFAULT_MODES, Backend

import cuda_emulator_harness as emu_harness
import selftest_families

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def emu_lib(request):
    why = emu_harness.missing_toolchain()
    if why:
        pytest.skip(why)
    cache = Path(request.config.cache.mkdir("mhakern_cuda_emu"))
    return str(emu_harness.build(cache, (selftest_families.INSTANCE,)))


@pytest.fixture
def st(tmp_path, monkeypatch, emu_lib):
    """A fresh self-test cache, the emu_mma family registered, a run counter."""
    monkeypatch.setenv(selftest.ENV_DIR, str(tmp_path / "selftest"))
    monkeypatch.setenv(selftest_families.EMU_LIB_ENV, emu_lib)
    runs = tmp_path / "runs"
    monkeypatch.setenv(selftest_families.RUNS_ENV, str(runs))
    for var in (selftest.ENV_MODE, selftest.ENV_PLANT, selftest.ENV_TIMEOUT):
        monkeypatch.delenv(var, raising=False)
    selftest.register_family(selftest_families.EMU_MMA)
    yield lambda: len(runs.read_text().splitlines()) if runs.exists() else 0
    selftest.unregister_family("emu_mma")
    selftest.forget()


class EmuBackend(Backend):
    """The emulated mma.sync kernels on CPU tensors (fp16, D 32), gated by the self-test as the
    cuda backend gates its families."""

    name = "emu"
    priority = 45

    def __init__(self, lib):
        self.fwd, self.bwd = selftest_families.emulated_kernels(lib)

    def supports(self, q, k, v, causal, key_lengths):
        if q.device.type != "cpu" or q.dtype != torch.float16 or q.shape[-1] != 32 or v.shape[-1] != 32:
            return "fp16, head dim 32, CPU tensors only"
        return selftest.gate("emu_mma", q.device)

    def forward(self, q, k, v, scale, causal, key_lengths, modes=DEFAULT_MODES):
        return self.fwd(q, k, v, scale, causal, key_lengths)

    def backward(self, dout, q, k, v, out, lse, scale, causal, key_lengths, modes=DEFAULT_MODES):
        return self.bwd(dout, q, k, v, out, lse, scale, causal, key_lengths)


@pytest.fixture
def emu_backend(st, emu_lib):
    be = backends.register(EmuBackend(emu_lib))
    yield be
    del backends._REGISTRY["emu"]
    backends._ORDER = None
    backends.clear_dispatch_cache()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 20, 32, generator=g).half() for _ in range(3)]


def _entry():
    files = list(Path(os.environ[selftest.ENV_DIR]).glob("emu_mma-*.json"))
    assert len(files) == 1, files
    import json

    return json.loads(files[0].read_text())


def _assert_routed_away(capfd, what):
    q, k, v = _inputs()
    out = mhakern.attention(q, k, v, causal=True)
    assert mhakern.last_backend() == "cpu"
    ref, _ = reference.attention_forward(q.double(), k.double(), v.double(), None, True, upcast=True)
    assert (out.double() - ref).abs().max() < 1e-2
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "self-test" in ln]
    assert len(lines) == 1 and "family 'emu_mma' disabled" in lines[0] and what in lines[0], lines
    mhakern.attention(q, k, v)  # disabled: no second test, no second line
    assert not [ln for ln in capfd.readouterr().err.splitlines() if "self-test" in ln]
    with pytest.raises(ValueError, match="emu_mma kernels"):
        mhakern.attention(q, k, v, backend="emu")


def test_a_planted_wrong_answer_disables_the_family_and_auto_routes_away(emu_backend, st, monkeypatch, capfd):
    monkeypatch.setenv(selftest.ENV_PLANT, "wrong:emu_mma")
    _assert_routed_away(capfd, "forward out error")
    assert st() == 1
    assert _entry()["verdict"] == "fail"


def test_a_planted_hang_is_killed_at_the_timeout_and_routed_away(emu_backend, st, monkeypatch, capfd):
    monkeypatch.setenv(selftest.ENV_PLANT, "hang:emu_mma")
    monkeypatch.setenv(selftest.ENV_TIMEOUT, "6")
    t0 = time.monotonic()
    _assert_routed_away(capfd, "did not finish within 6 s (killed)")
    assert time.monotonic() - t0 < 6 + 10
    assert _entry()["verdict"] == "hang"


_RANK = """
import sys, torch
import selftest_families
from mhakern import selftest
print("verdict", selftest.gate("emu_mma", torch.device("cpu")))
"""


def test_a_pass_is_tested_once_by_processes_starting_together_and_then_served(emu_backend, st):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    rank = subprocess.Popen([sys.executable, "-c", _RANK], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert selftest.gate("emu_mma", CPU) is None  # this process is the other rank
    out = rank.communicate(timeout=120)[0]
    assert "verdict None" in out, out
    assert st() == 1  # one tested, the other read (or waited for) the entry
    assert _entry()["verdict"] == "pass"
    # The family serves the call, without another test.
    q, k, v = (x.requires_grad_() for x in _inputs())
    out = mhakern.attention(q, k, v, causal=True)
    assert mhakern.last_backend() == "emu" and st() == 1
    out.sum().backward()
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = reference.attention_forward(q64, k64, v64, None, True, upcast=True)
    ref.sum().backward()
    assert (out.double() - ref).abs().max() < 1e-2 and (q.grad.double() - q64.grad).abs().max() < 2e-2


def test_switches_and_the_build_digest_decide_when_to_test(st, monkeypatch):
    """MHAKERN_SELF_TEST=0 trusts without testing, =force re-tests, a changed digest loses the
    pass, a pass recorded from outside (the device check) counts. The child is stubbed: the
    decisions are the cache's."""
    calls = []
    monkeypatch.setattr(selftest, "run_child", lambda fam, dev: calls.append(fam.digest()) or ("pass", "stub", 0.0))
    monkeypatch.setenv(selftest.ENV_MODE, "0")
    assert selftest.gate("emu_mma", CPU) is None and calls == []
    assert not Path(os.environ[selftest.ENV_DIR]).exists()
    monkeypatch.delenv(selftest.ENV_MODE)
    selftest.forget()
    assert selftest.gate("emu_mma", CPU) is None and len(calls) == 1
    assert selftest.gate("emu_mma", CPU) is None and len(calls) == 1  # the process's flag
    selftest.forget()
    assert selftest.gate("emu_mma", CPU) is None and len(calls) == 1  # the cache entry
    monkeypatch.setenv(selftest.ENV_MODE, "force")
    selftest.forget()
    assert selftest.gate("emu_mma", CPU) is None and len(calls) == 2
    assert selftest.gate("emu_mma", CPU) is None and len(calls) == 2  # force: once per process
    monkeypatch.delenv(selftest.ENV_MODE)
    # A process that finds the entry's lock held waits for the entry, then tests nothing.
    _, path = selftest.entry_key("emu_mma", CPU)
    os.remove(path)
    selftest.forget()
    got = []
    with selftest._Lock(path + ".lock", wait_s=0) as held:
        assert held.acquired
        waiter = threading.Thread(target=lambda: got.append(selftest.gate("emu_mma", CPU)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and not got
        facts, _ = selftest.entry_key("emu_mma", CPU)
        selftest._write(path, {"key": facts, "verdict": "pass", "reason": "the other rank", "time": time.time()})
    waiter.join(30)
    assert got == [None] and len(calls) == 2
    # A kernel whose digest changes loses its pass.
    changed = selftest.Family(**{**selftest_families.EMU_MMA.__dict__, "digest": lambda: "changed"})
    selftest.register_family(changed)
    assert selftest.gate("emu_mma", CPU) is None and calls == [calls[0], calls[0], "changed"]
    # The device check's record of a pass is the gate's pass.
    selftest.register_family(selftest.Family(**{**changed.__dict__, "digest": lambda: "checked-on-device"}))
    selftest.record("emu_mma", CPU)
    assert selftest.gate("emu_mma", CPU) is None and len(calls) == 3


def test_self_test_prints_its_table_on_a_cpu_machine(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CPU machine's table (this machine has a CUDA device)")
    monkeypatch.setenv(selftest.ENV_DIR, str(tmp_path / "selftest"))
    selftest.unregister_family("emu_mma")
    records = mhakern.self_test()
    table = capsys.readouterr().out
    got = {r.family: r for r in records}
    assert set(got) == {"sm90", "mma", "triton"}
    for fam in ("sm90", "mma"):
        assert got[fam].verdict == "untestable" and got[fam].reason == "not testable here: no CUDA device"
    assert got["triton"].verdict == "pass", got["triton"]
    assert table.splitlines()[0].split() == ["family", "device", "verdict", "reason"]
    assert all(r.family in table and r.reason in table for r in records)


def test_the_cuda_backend_gates_its_families_on_a_pretend_hopper(monkeypatch):
    """A failed sm90 family pins both passes to mma.sync and refuses the head dim only it serves
    (D 256), so that auto routes on; a failed mma family refuses every call. (Tensor stand-ins on
    a pretend 9.0 device; the gate's verdicts stubbed.)"""
    from cuda_emulator_harness import _FakeCudaTensor, _compiled_table, _fresh_backend

    def qkv(D):
        return _FakeCudaTensor((1, 4, 64, D)), _FakeCudaTensor((1, 2, 64, D)), _FakeCudaTensor((1, 2, 64, D))

    table = _compiled_table()
    table["cuda"]["sm90"]["compiled"] = True
    be = _fresh_backend(monkeypatch, "13.0", table)
    assert be.unavailable() is None
    asked = []
    verdicts = {"mma": None, "sm90": "the sm90 kernels failed their self-test on this device: planted"}
    monkeypatch.setattr(selftest, "gate", lambda fam, dev: asked.append(fam) or verdicts[fam])
    prev_fwd = torch.ops.mhakern_C.cuda_force_fwd_family("auto")
    prev_bwd = torch.ops.mhakern_C.cuda_force_bwd_family("auto")
    try:
        assert be.supports(*qkv(64), True, None) is None
        assert asked == ["mma", "sm90"]
        assert torch.ops.mhakern_C.cuda_force_fwd_family("auto") == "mma_sync"  # pinned
        assert torch.ops.mhakern_C.cuda_force_bwd_family("auto") == "mma_sync"
        why = be.supports(*qkv(256), True, None)
        assert why is not None and "head dim 256 is served only by the sm_90a family" in why and "planted" in why
        verdicts["mma"] = "the mma kernels hung their self-test on this device: killed"
        assert "killed" in be.supports(*qkv(64), True, None)
    finally:
        torch.ops.mhakern_C.cuda_force_fwd_family(prev_fwd)
        torch.ops.mhakern_C.cuda_force_bwd_family(prev_bwd)
