"""The SDPA drop-in's plain no-gradient calls served from the remembered calls (routing.plain_nograd):
the same answer on the first (checked) call and on later (cached) ones, the checks that read
values still made on every call, and the gradient and strict paths untouched."""
import pytest
import torch

import mhakern
from mhakern import backends, reference


def _plain_entries():
    return backends.remembered_calls()


def test_cached_call_matches_first_and_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 16, generator=g).transpose(1, 2)  # (B, L, H, D) memory
    k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(2))
    backends.clear_dispatch_cache()
    with torch.no_grad():
        first = mhakern.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert len(_plain_entries()) == 1
        again = mhakern.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert mhakern.last_backend() == "cpu"
    assert torch.equal(first, again) and first.stride() == again.stride()
    ref = reference.attention(q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
                              0.25, False, None)
    torch.testing.assert_close(again.double(), ref, atol=1e-5, rtol=1e-5)
    # The GQA condition is part of the key: without enable_gqa these heads are refused.
    with pytest.raises(Exception, match="key"):
        mhakern.scaled_dot_product_attention(q, k, v)
    # The scale is checked on every call, cached or not.
    with pytest.raises(TypeError, match="scale"):
        mhakern.scaled_dot_product_attention(q, k, v, scale="x", enable_gqa=True)
    # A call needing a gradient leaves the cache to autograd.
    qg = q.detach().requires_grad_()
    mhakern.scaled_dot_product_attention(qg, k, v, enable_gqa=True).sum().backward()
    assert qg.grad is not None and qg.grad.abs().sum() > 0


def test_fallback_never_cached_and_clear_forgets():
    q, k, v = (torch.randn(1, 2, 3, 8, dtype=torch.float64) for _ in range(3))
    backends.clear_dispatch_cache()
    with torch.no_grad():
        mhakern.scaled_dot_product_attention(q, k, v)
    assert _plain_entries() == []  # float64: the reference backend, a fallback
    prev = mhakern.set_strict(True)
    try:
        with pytest.raises(mhakern.FallbackError), torch.no_grad():
            mhakern.scaled_dot_product_attention(q, k, v)
    finally:
        mhakern.set_strict(prev)
    with torch.no_grad():
        mhakern.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert len(_plain_entries()) == 1
    backends.clear_dispatch_cache()
    assert _plain_entries() == []
