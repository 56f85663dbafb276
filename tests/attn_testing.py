"""Shared test helpers: input construction and the tolerance rule of GUIDE.md section 4.

Rule, for a kernel computing in dtype T:
    max|kernel - ref64| <= factor * max|torch_math_in_T - ref64| + atol_T
with factor 2 for outputs and 3 for gradients, where ``torch_math_in_T`` is the naive PyTorch
computation carried out in T and ``ref64`` the same in float64.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from mhakern import reference

ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}


def make_inputs(
    B: int,
    H: int,
    Hkv: int,
    Lq: int,
    Lk: int,
    D: int,
    Dv: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    layout: str = "bhld",
    scale_inputs: float = 1.0,
    seed: int = 0,
    requires_grad: bool = True,
):
    """Random q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv).

    ``layout="blhd"`` makes each tensor a (B, L, H, D) tensor viewed as (B, H, L, D), i.e.
    strided, with unit stride on the last dim only.
    """
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(seed)

    def mk(h, L, d):
        if layout == "blhd":
            x = torch.randn(B, L, h, d, generator=g).transpose(1, 2)
        else:
            x = torch.randn(B, h, L, d, generator=g)
        x = (x * scale_inputs).to(device=device, dtype=dtype)
        return x.requires_grad_(requires_grad)

    return mk(H, Lq, D), mk(Hkv, Lk, D), mk(Hkv, Lk, Dv)


def rule_check(
    name: str, got: torch.Tensor, ref64: torch.Tensor, math_T: torch.Tensor, dtype, factor: float, extra: float = 0.0
) -> None:
    """Assert the tolerance rule; the failure message names the worst index and both errors."""
    got64 = got.detach().to(torch.float64).cpu()
    ref64 = ref64.detach().to(torch.float64).cpu()
    math64 = math_T.detach().to(torch.float64).cpu()
    assert got64.shape == ref64.shape, f"{name}: shape {tuple(got64.shape)} != reference {tuple(ref64.shape)}"
    assert torch.isfinite(got64).all(), f"{name}: non-finite values at {torch.nonzero(~torch.isfinite(got64))[:5].tolist()}"
    if got64.numel() == 0:
        return
    err = (got64 - ref64).abs()
    math_err = (math64 - ref64).abs().max().item()
    bound = factor * math_err + ATOL[dtype] + extra
    worst = err.max().item()
    if worst > bound:
        idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(
            f"{name}: max error {worst:.3e} at {idx} exceeds {factor} x torch-math error {math_err:.3e} "
            f"+ atol {ATOL[dtype]:.0e} (+ {extra:.1e}) = {bound:.3e} (kernel {got64[idx].item():.6g}, reference {ref64[idx].item():.6g})"
        )


def _max_visible_logit(q64, k64, scale, causal, kl) -> float:
    """max |q . k| * |scale| over visible (query, key) pairs, in float64."""
    H, Hkv, D = q64.shape[1], k64.shape[1], q64.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    s = torch.matmul(q64, k64.repeat_interleave(H // Hkv, dim=1).transpose(-1, -2)).abs() * abs(scale)
    mask = reference.visible_mask(q64.shape[2], k64.shape[2], causal, kl, q64.device)
    if mask is not None:
        s = s.masked_fill(~mask, 0.0)
    return s.max().item() if s.numel() else 0.0


def check_against_reference(
    fn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_lengths: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    grads: bool = True,
    seed: int = 1,
    large_logits: bool = False,
) -> None:
    """Run ``fn(q, k, v, causal=..., key_lengths=..., scale=..., return_lse=True)`` and check
    out, lse and (with ``grads``) dq, dk, dv against the float64 reference by the rule.

    ``large_logits`` widens the gradient bound by the error that one rounding of the largest
    logit brings into every probability a backward recomputes from lse:
    8 * u_T * max|s| * max|grad| (u_T the unit roundoff of T). With logits in the thousands in
    fp32 that rounding dominates; the naive math escapes it only because its forward and
    backward share one score matrix (autograd's softmax backward even cancels exactly on
    saturated rows), which no tiled kernel that recomputes scores can reproduce. Outputs and
    lse keep the plain rule.
    """
    dtype = q.dtype
    out, lse = fn(q, k, v, causal=causal, key_lengths=key_lengths, scale=scale, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    kl = None if key_lengths is None else key_lengths.cpu()

    def leaf(x, dt):
        return x.detach().cpu().to(dt).requires_grad_(True)

    q64, k64, v64 = (leaf(x, torch.float64) for x in (q, k, v))
    ref = reference.attention(q64, k64, v64, scale, causal, kl, upcast=True)
    _, ref_lse = reference.attention_forward(q64, k64, v64, scale, causal, kl, upcast=True)
    qT, kT, vT = (leaf(x, dtype) for x in (q, k, v))
    math_out = reference.attention(qT, kT, vT, scale, causal, kl, upcast=False)
    rule_check("out", out, ref, math_out, dtype, 2.0)
    # lse: -inf exactly where the row sees no key, finite elsewhere.
    dead = torch.isinf(ref_lse)
    got_lse = lse.detach().cpu().double()
    assert torch.equal(torch.isneginf(got_lse), dead), "lse: -inf pattern differs from the reference"
    if (~dead).any():
        err = (got_lse[~dead] - ref_lse[~dead]).abs().max().item()
        tol = 1e-3 if dtype == torch.float32 else 2e-2
        assert err <= tol * max(1.0, ref_lse[~dead].abs().max().item()), f"lse: max error {err:.3e}"
    if not grads:
        return
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for x in (q, k, v):
        x.grad = None
    out.backward(dout.to(device=out.device, dtype=dtype))
    ref.backward(dout)
    math_out.backward(dout.to(dtype))
    math_grads = [qT.grad, kT.grad, vT.grad]
    extra = 0.0
    if large_logits:
        extra = 8 * torch.finfo(dtype).eps / 2 * _max_visible_logit(q64.detach(), k64.detach(), scale, causal, kl)
    for name, x, x64, gT in zip(("dq", "dk", "dv"), (q, k, v), (q64, k64, v64), math_grads):
        assert x.grad is not None, f"{name}: no gradient reached the input"
        rule_check(name, x.grad, x64.grad, gT, dtype, 3.0, extra * x64.grad.abs().max().item())


# Hard cases every backend's suite runs: (B, H, Hkv, Lq, Lk, D, Dv, causal, key_lengths).
HARD_CASES: Sequence[tuple] = (
    (1, 2, 2, 1, 1, 16, 16, False, None),
    (2, 2, 2, 17, 17, 64, 64, True, None),
    (1, 2, 1, 113, 37, 32, 32, False, None),
    (1, 2, 2, 37, 113, 32, 32, True, None),
    (1, 2, 2, 113, 37, 32, 32, True, None),  # leading rows see no key
    (3, 4, 2, 19, 29, 64, 48, False, (29, 0, 7)),
    (3, 4, 2, 19, 29, 64, 64, True, (29, 0, 13)),
    (2, 8, 1, 1, 67, 64, 64, False, (67, 5)),  # MQA decode
    (2, 8, 2, 1, 67, 80, 80, True, None),  # GQA decode
    (1, 4, 2, 33, 50, 80, 80, True, None),
    (1, 2, 2, 20, 40, 128, 128, False, None),
    (1, 2, 2, 20, 24, 24, 24, True, None),
)


def case_id(c) -> str:
    B, H, Hkv, Lq, Lk, D, Dv, causal, kl = c
    s = f"B{B}H{H}kv{Hkv}q{Lq}k{Lk}d{D}"
    if Dv != D:
        s += f"v{Dv}"
    if causal:
        s += "-causal"
    if kl is not None:
        s += "-kl" + "_".join(map(str, kl))
    return s
