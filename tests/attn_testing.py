"""Shared test helpers: input construction and the tolerance rule of docs/contract.md.

Rule, for a kernel computing in dtype T:
    max|kernel - ref64| <= factor * max|torch_math_in_T - ref64| + atol_T
with factor 2 for outputs and 3 for gradients, where ``torch_math_in_T`` is the naive PyTorch
computation carried out in T and ``ref64`` the same in float64.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from mhakern import reference
from mhakern.backends import Modes
from mhakern.checks import draw_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float64 is left out of the backend dtypes: only the reference serves it (the kernels refuse
# it); tests/test_reference.py and tests/test_float64_edges.py check the float64 path itself.
BACKEND_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def usable_backends():
    """Registered backends that can run in this process (the others' reasons are in
    ``mhakern.available_backends()``)."""
    import mhakern

    return [n for n, why in mhakern.available_backends().items() if why is None]


def dtypes_of(name: str):
    """The dtypes a backend's ``supports`` accepts on a small probe (no dtype list per backend)."""
    from mhakern import backends

    be = backends.get(name)
    probes = [torch.zeros(1, 2, 3, 16, device=DEVICE, dtype=dt) for dt in BACKEND_DTYPES]
    return [p.dtype for p in probes if be.supports(p, p, p, False, None) is None]


ATOL = reference.ATOL  # the rule's floors, written once (mhakern/reference.py)


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
    assert got64.shape == ref64.shape, f"{name}: shape {tuple(got64.shape)} != reference {tuple(ref64.shape)}"
    assert torch.isfinite(got64).all(), f"{name}: non-finite values at {torch.nonzero(~torch.isfinite(got64))[:5].tolist()}"
    why = reference.rule_violation(got64, ref64, math_T, dtype, factor, extra)
    assert why is None, f"{name}: {why}"


def _max_visible_logit(q64, k64, scale, causal, kl, modes=Modes()) -> float:
    """max |q . k| * |scale| over visible (query, key) pairs, in float64."""
    H, Hkv, D = q64.shape[1], k64.shape[1], q64.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    s = torch.matmul(q64, k64.repeat_interleave(H // Hkv, dim=1).transpose(-1, -2)).abs() * abs(scale)
    mask = reference.visible_mask(
        q64.shape[2], k64.shape[2], causal, kl, q64.device,
        top_left=modes.top_left, window_left=modes.window_left, window_right=modes.window_right,
    )
    if mask is not None:
        s = s.masked_fill(~mask, 0.0)
    return s.max().item() if s.numel() else 0.0


def oracle_modes(attn_mask=None, dropout_p=0.0, generator=None, causal_align="bottom_right", window=None,
                 softcap=None, alibi_slopes=None, sinks=None) -> Modes:
    """The reference's Modes for the public arguments of one call, written from the contract
    (not from the API's own normalisation). ``generator`` is read without being advanced: the
    seed is drawn from a copy, as ``mhakern.attention`` will draw it. ``alibi_slopes`` (H,) or
    (B, H) as given (the reference broadcasts them); ``sinks`` as given."""
    seed = 0
    if dropout_p > 0.0:
        g = None
        if generator is not None:
            g = torch.Generator(device=generator.device)
            g.set_state(generator.get_state())
        else:
            g = torch.Generator()
            g.set_state(torch.random.get_rng_state())
        seed = draw_seed(g)
    wl, wr = (-1, -1) if window is None else window
    return Modes(attn_mask, dropout_p, seed, causal_align == "top_left", wl, wr, False,
                 0.0 if softcap is None else float(softcap), alibi_slopes, sinks)


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
    *,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    causal_align: str = "bottom_right",
    window=None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    roundoff_floor: bool = False,
) -> None:
    """Run ``fn(q, k, v, causal=..., key_lengths=..., scale=..., return_lse=True)`` and check
    out, lse and (with ``grads``) dq, dk, dv against the float64 reference by the rule.

    The modes (``attn_mask``, ``dropout_p`` with ``generator``, ``causal_align``, ``window``)
    and the score modifiers (``softcap``, ``alibi_slopes``, ``sinks``) are passed on to ``fn``
    only when set; a floating ``attn_mask`` or ``sinks`` that requires grad has its gradient
    checked too (float64 oracle: the same tensor in float64; torch math in T: in T). Dropout is compared
    exactly: the oracle regenerates the keep mask from the seed the call will draw.

    ``large_logits`` widens the gradient bound by the error that one rounding of the largest
    logit brings into every probability a backward recomputes from lse:
    8 * u_T * max|s| * max|grad| (u_T the unit roundoff of T). With logits in the thousands in
    fp32 that rounding dominates; the naive math escapes it only because its forward and
    backward share one score matrix (autograd's softmax backward even cancels exactly on
    saturated rows), which no tiled kernel that recomputes scores can reproduce. Outputs and
    lse keep the plain rule.

    ``roundoff_floor`` (the property tests, on tiny random tensors) adds what the rule's
    "torch math in T" term stands for but can miss by luck when a tensor has a handful of
    elements: one rounding of each result in T (``2 u_T max|ref|``), and for dq, dk and dmask
    the rounding of ``out`` in T that the contract's ``delta = rowsum(dout * out)`` carries
    (``u_T * max_i sum|dout_i * out_i|`` per probability, times ``|scale| max|k|`` for dq,
    ``|scale| max|q| * rows`` for dk, the summed count for dmask). The naive autograd math
    never forms delta, so for one visible key it is exactly 0 where any lse-based backward
    is not.
    """
    dtype = q.dtype
    kw = {}
    if attn_mask is not None:
        kw["attn_mask"] = attn_mask
    if dropout_p:
        kw["dropout_p"] = dropout_p
        if generator is not None:
            kw["generator"] = generator
    if causal_align != "bottom_right":
        kw["causal_align"] = causal_align
    if window is not None:
        kw["window"] = window
    # softcap 0 is "off" (callers may pass it), not a value to hand on
    for name, val in (("softcap", softcap or None), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if val is not None:
            kw[name] = val
    a64 = None if alibi_slopes is None else alibi_slopes.detach().cpu().double()
    modes = oracle_modes(None, dropout_p, generator, causal_align, window, softcap, a64)
    out, lse = fn(q, k, v, causal=causal, key_lengths=key_lengths, scale=scale, return_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == reference.lse_dtype(dtype)
    kl = None if key_lengths is None else key_lengths.cpu()

    def leaf(x, dt):
        return x.detach().cpu().to(dt).requires_grad_(True)

    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad
    sink_grad = sinks is not None and sinks.requires_grad
    s64 = sT = None
    if sinks is not None:
        s64, sT = leaf(sinks, torch.float64), leaf(sinks, dtype)
    m64 = mT = None
    if attn_mask is not None:
        m64 = leaf(attn_mask, torch.float64) if attn_mask.is_floating_point() else attn_mask.cpu()
        mT = leaf(attn_mask, dtype) if attn_mask.is_floating_point() else attn_mask.cpu()
    q64, k64, v64 = (leaf(x, torch.float64) for x in (q, k, v))
    ref = reference.attention(q64, k64, v64, scale, causal, kl, upcast=True,
                              modes=modes._replace(attn_mask=m64, sinks=s64))
    _, ref_lse = reference.attention_forward(
        q64.detach(), k64.detach(), v64.detach(), scale, causal, kl, upcast=True,
        modes=modes._replace(attn_mask=None if m64 is None else m64.detach(), sinks=None if s64 is None else s64.detach()),
    )
    qT, kT, vT = (leaf(x, dtype) for x in (q, k, v))
    math_out = reference.attention(qT, kT, vT, scale, causal, kl, upcast=False,
                                   modes=modes._replace(attn_mask=mT, sinks=sT))
    u = torch.finfo(dtype).eps / 2

    def floor(ref_t):
        if not roundoff_floor or ref_t.numel() == 0:
            return 0.0
        return 2 * u * ref_t.detach().abs().max().item()

    rule_check("out", out, ref, math_out, dtype, 2.0, floor(ref))
    # lse: -inf exactly where the row sees no key, finite elsewhere.
    dead = torch.isinf(ref_lse)
    got_lse = lse.detach().cpu().double()
    assert torch.equal(torch.isneginf(got_lse), dead), "lse: -inf pattern differs from the reference"
    if (~dead).any():
        err = (got_lse[~dead] - ref_lse[~dead]).abs().max().item()
        # lse is float32 for every kernel dtype
        tol = 1e-3 if dtype in (torch.float32, torch.float64) else 2e-2
        assert err <= tol * max(1.0, ref_lse[~dead].abs().max().item()), f"lse: max error {err:.3e}"
    if not grads:
        return
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    inputs = [q, k, v] + ([attn_mask] if mask_grad else []) + ([sinks] if sink_grad else [])
    for x in inputs:
        x.grad = None
    out.backward(dout.to(device=out.device, dtype=dtype))
    ref.backward(dout)
    math_out.backward(dout.to(dtype))
    names = ["dq", "dk", "dv"] + (["dmask"] if mask_grad else []) + (["dsinks"] if sink_grad else [])
    refs = [q64, k64, v64] + ([m64] if mask_grad else []) + ([s64] if sink_grad else [])
    maths = [qT, kT, vT] + ([mT] if mask_grad else []) + ([sT] if sink_grad else [])
    extra = 0.0
    if large_logits:
        extra = 8 * torch.finfo(dtype).eps / 2 * _max_visible_logit(q64.detach(), k64.detach(), scale, causal, kl, modes)
    delta_extra = dict.fromkeys(names, 0.0)
    if roundoff_floor and out.numel():
        sc = abs(q.shape[-1] ** -0.5 if scale is None else scale)
        row = (dout * out.detach().cpu().double()).abs().sum(-1).max().item() * u
        mx = lambda t: t.detach().abs().max().item() if t.numel() else 0.0  # noqa: E731
        rows = q.shape[2] * (q.shape[1] // k.shape[1])
        delta_extra["dq"] = sc * row * mx(k64) * k.shape[2]
        delta_extra["dk"] = sc * row * mx(q64) * rows
        if mask_grad:
            delta_extra["dmask"] = row * out.numel() / max(1, v.shape[-1]) * k.shape[2] / max(1, attn_mask.numel())
    for name, x, x64, xT in zip(names, inputs, refs, maths):
        assert x.grad is not None, f"{name}: no gradient reached the input"
        assert x.grad.shape == x.shape, f"{name}: gradient shape {tuple(x.grad.shape)} != input {tuple(x.shape)}"
        top = x64.grad.abs().max().item() if x64.grad.numel() else 0.0
        rule_check(name, x.grad, x64.grad, xT.grad, dtype, 3.0, extra * top + floor(x64.grad) + delta_extra[name])


class HardCase(NamedTuple):
    """One hard case: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), causal or not,
    and the per-element key lengths (None: all Lk keys). A tuple, so it unpacks in that order."""
    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    causal: bool
    key_lengths: Optional[Tuple[int, ...]]


# Hard cases every backend's suite runs.
HARD_CASES: Sequence[HardCase] = tuple(HardCase(*c) for c in (
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
))


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
