"""The reference against an independent naive float64 loop, and its hand-written backward
against autograd through the naive computation."""
import math

import pytest
import torch

from attn_testing import HARD_CASES, case_id, make_inputs
from mhakern import reference


def naive_loop(q, k, v, scale, causal, key_lengths):
    """Row-by-row float64 attention, written directly from the masking rules."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, Lq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, H, Lq), -math.inf, dtype=torch.float64)
    for b in range(B):
        lk = Lk if key_lengths is None else int(key_lengths[b])
        for h in range(H):
            hk = h // (H // Hkv)
            for i in range(Lq):
                js = [j for j in range(lk) if not causal or j <= i + lk - Lq]
                if not js:
                    continue
                s = torch.stack([(q[b, h, i].double() @ k[b, hk, j].double()) * scale for j in js])
                lse[b, h, i] = torch.logsumexp(s, 0)
                p = torch.softmax(s, 0)
                out[b, h, i] = sum(p[t] * v[b, hk, j].double() for t, j in enumerate(js))
    return out, lse


@pytest.mark.parametrize("case", HARD_CASES[:9], ids=case_id)
def test_reference_matches_naive_loop(case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, min(Lq, 20), min(Lk, 24), D, Dv, requires_grad=False)
    kl_t = None if kl is None else torch.tensor([min(x, k.shape[2]) for x in kl])
    scale = 1 / math.sqrt(D)
    out, lse = reference.attention_forward(q, k, v, scale, causal, kl_t, upcast=True)
    exp_out, exp_lse = naive_loop(q, k, v, scale, causal, kl_t)
    torch.testing.assert_close(out, exp_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, exp_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", HARD_CASES, ids=case_id)
def test_reference_backward_matches_autograd(case):
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = case
    q, k, v = make_inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=torch.float64)
    kl_t = None if kl is None else torch.tensor(kl)
    out = reference.attention(q, k, v, None, causal, kl_t)
    dout = torch.randn_like(out)
    out.backward(dout)
    o2, lse = reference.attention_forward(q.detach(), k.detach(), v.detach(), None, causal, kl_t, upcast=True)
    torch.testing.assert_close(out.detach(), o2)
    dq, dk, dv = reference.attention_backward(dout, q.detach(), k.detach(), v.detach(), o2, lse, None, causal, kl_t, upcast=True)
    for name, got, want in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)
        assert torch.isfinite(got).all(), name


def test_fully_masked_rows_are_zero_with_neg_inf_lse():
    q, k, v = make_inputs(2, 2, 2, 6, 4, 16, requires_grad=False)
    out, lse = reference.attention_forward(q, k, v, None, True, torch.tensor([0, 4]), upcast=True)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    # causal with Lq > Lk: the first Lq - Lk rows of element 1 see nothing
    assert torch.all(out[1, :, :2] == 0) and torch.all(torch.isneginf(lse[1, :, :2]))
    assert torch.isfinite(lse[1, :, 2:]).all()
