"""The Triton kernels' packed variable-length sequences through the launchers, under
the interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1), against the float64
reference computed per sequence (mhakern.reference runs a packed record sequence by sequence),
by the contract's tolerance rule. Tiny shapes: the interpreter runs every program in Python."""
from __future__ import annotations

import math

import pytest
import torch

import mhakern
from attn_testing import rule_check
from mhakern import reference
from mhakern.backends import Modes

_WHY = mhakern.available_backends().get("triton", "absent")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"triton backend unavailable: {_WHY}")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _packed(T, H, D, dtype, g):
    """A packed (T, H, D) tensor seen as the kernels' (1, H, T, D) view (non-contiguous)."""
    return torch.randn(T, H, D, generator=g).to(dtype).transpose(0, 1).unsqueeze(0).to(DEVICE)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _check_lse(lse, lse64):
    dead = torch.isneginf(lse64)
    assert torch.equal(torch.isneginf(lse.double().cpu()), dead), "lse: -inf pattern differs from the reference"
    if (~dead).any():
        err = (lse.double().cpu() - lse64)[~dead].abs().max().item()
        assert err <= 1e-3 * max(1.0, lse64[~dead].abs().max().item()), f"lse: max error {err:.3e}"


def run_varlen(lq, lk, H=2, Hkv=2, D=16, Dv=None, dtype=torch.float32, causal=False, top_left=False,
               window=(-1, -1), dropout_p=0.0, softcap=0.0, alibi=False, seed=0, backward=True,
               bwd_mode=None):
    from mhakern.kernels import attention_forward

    Dv = Dv or D
    g = torch.Generator().manual_seed(seed)
    Tq, Tk, S = sum(lq), sum(lk), len(lq)
    q, k, v = _packed(Tq, H, D, dtype, g), _packed(Tk, Hkv, D, dtype, g), _packed(Tk, Hkv, Dv, dtype, g)
    al = (torch.rand(S, H, generator=g) * 0.5 + 0.01).to(DEVICE) if alibi else None
    m = Modes(None, dropout_p, 777 if dropout_p else 0, top_left, window[0], window[1], False, softcap, al)
    m = m._replace(cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    scale = D ** -0.5
    out = torch.full((1, H, Tq, Dv), math.nan, dtype=dtype, device=DEVICE)
    lse = torch.full((1, H, Tq), math.nan, dtype=torch.float32, device=DEVICE)
    attention_forward(q, k, v, out, lse, scale, causal, None, m)
    cpu = lambda x: x.cpu()  # noqa: E731
    m_cpu = m._replace(cu_seqlens_q=cpu(m.cu_seqlens_q), cu_seqlens_k=cpu(m.cu_seqlens_k),
                       alibi_slopes=None if al is None else cpu(al))
    qc, kc, vc = cpu(q), cpu(k), cpu(v)
    o64, l64 = reference.attention_forward(qc.double(), kc.double(), vc.double(), scale, causal, None, upcast=True,
                                           modes=m_cpu)
    oT, _ = reference.attention_forward(qc, kc, vc, scale, causal, None, upcast=False, modes=m_cpu)
    rule_check("out", out, o64, oT, dtype, 2.0)
    _check_lse(lse, l64)
    if backward:
        from mhakern.kernels import attention_backward

        dout = _packed(Tq, H, Dv, dtype, g)
        dq, dk, dv = (torch.full(x.shape, math.nan, dtype=dtype, device=DEVICE) for x in (q, k, v))
        attention_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, None, m, bwd_mode=bwd_mode)
        doc = cpu(dout)
        g64 = reference.attention_backward_modes(doc.double(), qc.double(), kc.double(), vc.double(), o64, l64,
                                                 scale, causal, None, upcast=True, modes=m_cpu)
        oT32, lT = reference.attention_forward(qc, kc, vc, scale, causal, None, upcast=False, modes=m_cpu)
        gT = reference.attention_backward_modes(doc, qc, kc, vc, oT32, lT, scale, causal, None, upcast=False,
                                                modes=m_cpu)
        for name, got, r64, rT in zip(("dq", "dk", "dv"), (dq, dk, dv), g64[:3], gT[:3]):
            rule_check(name, got, r64, rT, dtype, 3.0)
        return q, k, v, out, lse, m, (dout, dq, dk, dv)
    return q, k, v, out, lse, m


# Lengths: empty sequences on either side, one-token ones, sequences longer than a row tile and a
# key block (the interpreter's tiles are 16..64 rows), Lq_s != Lk_s both ways. Gradients too,
# except where tests/test_varlen_kvcache.py's cases already check them for this backend (no
# mode, a two-sided window: interpreter time is CI time).
CASES = [
    ("plain", dict(lq=[5, 0, 1, 40, 3], lk=[9, 4, 1, 70, 0], backward=False)),
    ("causal-gqa", dict(lq=[5, 0, 1, 40, 3], lk=[9, 4, 1, 70, 0], H=4, Hkv=2, D=32, Dv=24, causal=True)),
    ("causal-topleft", dict(lq=[40, 7, 1], lk=[13, 30, 5], causal=True, top_left=True)),
    ("window", dict(lq=[33, 0, 20], lk=[50, 3, 20], window=(6, 2), backward=False)),
    ("dropout-causal", dict(lq=[17, 1, 30], lk=[17, 9, 40], causal=True, dropout_p=0.3)),
    ("softcap-alibi-mqa", dict(lq=[19, 4, 1], lk=[29, 4, 77], H=4, Hkv=1, causal=True, softcap=3.0, alibi=True)),
    ("fp16", dict(lq=[20, 0, 45], lk=[33, 6, 45], Hkv=1, dtype=torch.float16, causal=True)),
]


@pytest.mark.parametrize("case", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_varlen_forward_and_backward(case):
    run_varlen(**case)


@pytest.mark.parametrize("bwd_mode", ["deterministic", "split"])
def test_varlen_never_reads_other_sequences(bwd_mode):
    # NaN keys and values of sequence 1 reach nothing of sequences 0 and 2: not their outputs,
    # not their gradients (the fused kernel's dQ shares included), bit for bit.
    from mhakern.kernels import attention_backward, attention_forward

    q, k, v, out, lse, m = run_varlen([9, 30, 4], [12, 40, 5], backward=False)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 12:52] = math.nan
    v2[:, :, 12:52] = math.nan
    res = []
    for kk, vv in ((k, v), (k2, v2)):
        o, l = torch.empty_like(out), torch.empty_like(lse)
        attention_forward(q, kk, vv, o, l, 0.25, False, None, m)
        grads = [torch.empty_like(x) for x in (q, kk, vv)]
        attention_backward(dout, q, kk, vv, o, l, *grads, 0.25, False, None, m, bwd_mode=bwd_mode)
        res.append((o, l, *grads))
    (o1, l1, dq1, dk1, dv1), (o2, l2, dq2, dk2, dv2) = res
    rows = torch.ones(out.shape[2], dtype=torch.bool)
    rows[9:39] = False
    keys = torch.ones(k.shape[2], dtype=torch.bool)
    keys[12:52] = False
    for name, a, b in (("out", o1, o2), ("lse", l1, l2), ("dq", dq1, dq2)):
        assert torch.equal(a[:, :, rows], b[:, :, rows]), name
    assert torch.equal(dk1[:, :, keys], dk2[:, :, keys]) and torch.equal(dv1[:, :, keys], dv2[:, :, keys])
    assert torch.isnan(dk2[:, :, 12:52]).all() and not torch.isnan(dk1).any()
