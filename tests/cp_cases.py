"""The context-parallel cases the worker processes run (tests/cp_workers.py): every rank runs
the same case; each builds the whole sequence's inputs from one seed, computes the
single-process reference in float64 over the whole sequence, runs its shard through
mhakern.distributed and returns the violations of the tolerance rule it found (strings) and
digests of its results (for the bit-identity tests)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import mhakern
from mhakern import distributed as cpd
from mhakern.reference import rule_violation

from cp_workers import digest

_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _compare(errors, name, got, ref64, math_T, dtype, factor):
    if got.shape != ref64.shape:
        errors.append(f"{name}: shape {tuple(got.shape)} != reference {tuple(ref64.shape)}")
        return
    fin_g, fin_r = torch.isfinite(got), torch.isfinite(ref64)
    if not torch.equal(fin_g, fin_r):
        errors.append(f"{name}: finite at different places than the reference")
        return
    bad = rule_violation(torch.where(fin_g, got.double(), 0.0), torch.where(fin_r, ref64, 0.0),
                         torch.where(fin_r, math_T.double(), 0.0), dtype, factor)
    if bad:
        errors.append(f"{name}: {bad}")


def _lse_compare(errors, got, ref64, dtype):
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    fin = torch.isfinite(ref64)
    if not torch.equal(torch.isfinite(got), fin) or not torch.equal(got[~fin].double(), ref64[~fin]):
        errors.append("lse: non-finite values differ from the reference")
        return
    err = ((got.double() - ref64).abs() / ref64.abs().clamp_min(1.0))[fin]
    if err.numel() and err.max().item() > tol:
        errors.append(f"lse: relative error {err.max().item():.3e} > {tol}")


def _inputs(seed, shapes, dtype):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def dense(method="ring", layout="zigzag", B=1, H=2, Hkv=1, L=32, D=16, Dv=16, causal=False,
          causal_align="bottom_right", window=None, key_lengths=None, softcap=None, alibi=False, sinks=False,
          dtype="float32", seed=0, scale_inputs=1.0, group_ranks=None, mesh=False, dropout_p=0.0, strided=False):
    """One dense case; returns {"errors": [...], "digest": ...} (digest over out, lse, grads)."""
    dt = _DT[dtype]
    group = None
    if group_ranks is not None:  # a subgroup: every rank must create it, members run the case
        group = dist.new_group(group_ranks)
        if dist.get_rank() not in group_ranks:
            return {"errors": [], "digest": None}
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    q, k, v, dout = _inputs(seed, [(B, H, L, D), (B, Hkv, L, D), (B, Hkv, L, Dv), (B, H, L, Dv)], torch.float32)
    q, k = q * scale_inputs, k * scale_inputs
    kl = None if key_lengths is None else torch.tensor(key_lengths)
    slopes = torch.linspace(0.1, 0.8, H) if alibi else None
    sk = (torch.linspace(-1.0, 1.0, H)).requires_grad_() if sinks else None
    kw = dict(causal=causal, causal_align=causal_align, window=window, key_lengths=kl, softcap=softcap,
              alibi_slopes=slopes)

    def full(dtype_, backend):
        xs = [x.detach().to(dtype_).clone().requires_grad_() for x in (q, k, v)]
        s = None if sk is None else sk.detach().to(dtype_ if dtype_ == torch.float64 else torch.float32).requires_grad_()
        out, lse = mhakern.attention(*xs, sinks=s, backend=backend, return_lse=True, dropout_p=dropout_p,
                                     generator=torch.Generator().manual_seed(seed + 7), **kw)
        (out.to(torch.float64) * dout.double()).sum().backward()
        return out.detach(), lse.detach(), [x.grad for x in xs], None if s is None else s.grad

    ref = full(torch.float64, "reference")
    math = full(dt, "reference")
    sh = (lambda x: cpd.shard(x, group, layout))
    if strided:  # (B, L, H, D) memory seen as (B, H, L, D), as FusedMHA and most models hold it
        xs = [sh(x.to(dt)).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
        views = [x.transpose(1, 2) for x in xs]
    else:
        xs = views = [sh(x.to(dt)).requires_grad_() for x in (q, k, v)]
    # Every rank's generator in the same state, as a single-device call's: rank 0's draw is used.
    out, lse = cpd.context_parallel_attention(*views, group=group, method=method, layout=layout, sinks=sk,
                                              return_lse=True, dropout_p=dropout_p,
                                              generator=torch.Generator().manual_seed(seed + 7), **kw)
    (out.to(torch.float64) * sh(dout).double()).sum().backward()
    errors = []
    _compare(errors, "out", out, sh(ref[0]), sh(math[0]), dt, 2)
    _lse_compare(errors, lse, sh(ref[1]), dt)
    grads = [x.grad.transpose(1, 2) if strided else x.grad for x in xs]
    for name, g, r64, rT in zip(("dq", "dk", "dv"), grads, ref[2], math[2]):
        _compare(errors, name, g, sh(r64), sh(rT), dt, 3)
    if strided and out.stride(1) > out.stride(2):
        errors.append(f"out: laid out {out.stride()}, not like q's (B, L, H, D) memory")
    tensors = [out, lse] + grads
    if sinks:
        total = sk.grad.clone()
        dist.all_reduce(total, group=group if not mesh else group.get_group())
        _compare(errors, "dsinks", total, ref[3], math[3], dt, 3)
        tensors.append(sk.grad)
    return {"errors": errors, "digest": digest(*tensors)}


def packed(method="ring", layout="zigzag", lengths=(5, 17, 1, 9), H=2, Hkv=1, D=16, causal=True, window=None,
           softcap=None, alibi=False, sinks=False, seed=0):
    """One packed case (float32): the whole pack's attention_varlen against each rank's share."""
    dt = torch.float32
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    T, mx = int(cu[-1]), max(lengths)
    q, k, v, dout = _inputs(seed, [(T, H, D), (T, Hkv, D), (T, Hkv, D), (T, H, D)], dt)
    slopes = torch.linspace(0.1, 0.8, H) if alibi else None
    sk = torch.linspace(-1.0, 1.0, H).requires_grad_() if sinks else None
    kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)

    def full(dtype_):
        xs = [x.detach().to(dtype_).clone().requires_grad_() for x in (q, k, v)]
        s = None if sk is None else sk.detach().to(dtype_).requires_grad_()
        out, lse = mhakern.attention_varlen(*xs, cu, cu, mx, mx, sinks=s, backend="reference", return_lse=True,
                                            **kw)
        (out.double() * dout.double()).sum().backward()
        return out.detach(), lse.detach(), [x.grad for x in xs], None if s is None else s.grad

    ref, math = full(torch.float64), full(dt)
    sh = (lambda x, d=0: cpd.shard_varlen(x, cu, layout=layout, seq_dim=d))
    xs = [sh(x).requires_grad_() for x in (q, k, v)]
    out, lse = cpd.context_parallel_attention_varlen(*xs, cu, mx, method=method, layout=layout, sinks=sk,
                                                     return_lse=True, **kw)
    (out.double() * sh(dout).double()).sum().backward()
    errors = []
    _compare(errors, "out", out, sh(ref[0]), sh(math[0]), dt, 2)
    _lse_compare(errors, lse, sh(ref[1], 1), dt)
    for name, g, r64, rT in zip(("dq", "dk", "dv"), [x.grad for x in xs], ref[2], math[2]):
        _compare(errors, name, g, sh(r64), sh(rT), dt, 3)
    if sinks:
        total = sk.grad.clone()
        dist.all_reduce(total)
        _compare(errors, "dsinks", total, ref[3], math[3], dt, 3)
    back = cpd.unshard_varlen(out.detach(), cu, layout=layout)
    if not torch.equal(cpd.shard_varlen(back, cu, layout=layout), out.detach()):
        errors.append("unshard_varlen then shard_varlen does not give the shard back")
    return {"errors": errors, "digest": digest(out, lse, *[x.grad for x in xs])}


def layouts(L=24, layout="zigzag"):
    """shard / unshard round trip and the chunks each rank holds; a length the layout cannot cut
    is refused naming x."""
    P, r = dist.get_world_size(), dist.get_rank()
    x = torch.arange(2 * L, dtype=torch.float32).view(1, 2, L, 1)
    s = cpd.shard(x, layout=layout)
    errors = []
    c = L // (2 * P if layout == "zigzag" else P)
    want = [r] + ([2 * P - 1 - r] if layout == "zigzag" else [])
    got_first = [int(s[0, 0, i * c, 0]) // c for i in range(len(want))]
    if got_first != want:
        errors.append(f"rank {r} holds chunks {got_first}, expected {want}")
    if not torch.equal(cpd.unshard(s, layout=layout), x):
        errors.append("unshard(shard(x)) != x")
    try:
        cpd.shard(torch.zeros(1, 1, L + 1, 1), layout=layout)
        errors.append("a length not divisible by the chunk count was accepted")
    except ValueError as exc:
        if "x: sequence length" not in str(exc):
            errors.append(f"wrong refusal: {exc}")
    return {"errors": errors}


def refusal(kind):
    """A bad input on one rank (or inputs that differ between ranks): every rank must raise a
    ContextParallelError naming the rank and the cause, and the group stays usable."""
    r = dist.get_rank()
    q = torch.randn(1, 2, 8, 16)
    k = v = torch.randn(1, 2, 8, 16)
    kw = {}
    if kind == "length":  # mismatched shards: a different L_local on rank 1
        if r == 1:
            q = k = v = torch.randn(1, 2, 12, 16)
    elif kind == "odd":  # a zigzag shard is two equal chunks: an odd local length cannot be one
        q = k = v = torch.randn(1, 2, 7, 16)
    elif kind == "dtype":
        if r == 1:
            q, k, v = q.double(), k.double(), v.double()
    elif kind == "heads_local":  # bad shapes on rank 1 only: its own check fails
        if r == 1:
            k = torch.randn(1, 3, 8, 16)
    elif kind == "key_lengths":
        kw["key_lengths"] = torch.tensor([5 + r])
    elif kind == "ulysses_heads":
        kw["method"] = "ulysses"
        q = torch.randn(1, 3, 8, 16)
        k = v = torch.randn(1, 1, 8, 16)
    elif kind == "generator":  # a bad argument on rank 1 only: its own check fails
        kw["dropout_p"] = 0.1
        kw["generator"] = torch.Generator() if r == 0 else 1234
    elif kind == "kernel":  # a kernel error on rank 1 in the middle of the ring
        from mhakern.distributed import context_parallel as cpm

        orig = cpm.piece_forward

        def failing(p, *a, **k_):
            raise RuntimeError("injected kernel failure")

        cpm.piece_forward = failing if r == 1 else orig
    try:
        cpd.context_parallel_attention(q, k, v, causal=True, **kw)
        message = None
    except cpd.ContextParallelError as exc:
        message = str(exc)
    finally:
        if kind == "kernel":
            cpm.piece_forward = orig
    # The group still works: a plain call afterwards agrees with itself across ranks.
    x = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(1))
    out = cpd.context_parallel_attention(x, x, x, causal=True)
    return {"message": message, "after": tuple(out.shape)}


def bits(method="ring", layout="zigzag", runs=2, **kw):
    """The same case ``runs`` times: the digests of out, lse and the gradients."""
    return [dense(method=method, layout=layout, **kw)["digest"] for _ in range(runs)]


def compiled():
    """torch.compile around a function calling context_parallel_attention: it graph-breaks with
    the reason mhakern gives, and the result matches the eager call."""
    import torch._dynamo as dynamo

    q = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(2))

    def f(x):
        return cpd.context_parallel_attention(x * 2.0, x, x, causal=True) + 1.0

    explained = dynamo.explain(f)(q)
    reasons = [str(getattr(b, "reason", b)) for b in explained.break_reasons]
    got = torch.compile(f, backend="eager")(q)
    return {"graph_breaks": explained.graph_break_count, "reasons": reasons,
            "equal": bool(torch.equal(got, f(q)))}


def fused_mha(method="ring", layout="zigzag", causal=True, seed=0):
    """FusedMHA with a context_parallel_group against the same module over the whole sequence."""
    torch.manual_seed(seed)
    E, Hh, L = 32, 4, 16
    m = mhakern.FusedMHA(E, Hh, batch_first=True)
    cp = mhakern.FusedMHA(E, Hh, batch_first=True, context_parallel_group=dist.group.WORLD,
                          context_parallel_method=method, context_parallel_layout=layout)
    cp.load_state_dict(m.state_dict())
    x = torch.randn(2, L, E, generator=torch.Generator().manual_seed(seed))
    xf = x.clone().requires_grad_()
    ref, _ = m(xf, xf, xf, need_weights=False, is_causal=causal, attn_mask=None)
    ref.sum().backward()
    xs = cpd.shard(x, layout=layout, seq_dim=1).requires_grad_()
    out, _ = cp(xs, xs, xs, need_weights=False, is_causal=causal, attn_mask=None)
    out.sum().backward()
    errors = []
    e = (out - cpd.shard(ref, layout=layout, seq_dim=1)).abs().max().item()
    if e > 1e-4:
        errors.append(f"out: max error {e:.3e}")
    e = (xs.grad - cpd.shard(xf.grad, layout=layout, seq_dim=1)).abs().max().item()
    if e > 1e-4:
        errors.append(f"dx: max error {e:.3e}")
    w = cp.in_proj_weight.grad.clone()
    dist.all_reduce(w)
    e = (w - m.in_proj_weight.grad).abs().max().item()
    if e > 1e-3:
        errors.append(f"in_proj_weight grad (summed over ranks): max error {e:.3e}")
    return {"errors": errors}


def exit_rank(dead=1, where="before"):
    """Rank ``dead`` exits (a crash) before the call, or in the middle of the ring (``where``
    "ring": at its second block); the others must raise a ContextParallelError naming a peer
    within the group's timeout, not hang. Ends the group: the last case of a pool."""
    import os

    r = dist.get_rank()
    q = torch.randn(1, 2, 16, 16)
    if r == dead and where == "before":
        os._exit(3)
    if r == dead:
        from mhakern.distributed import context_parallel as cpm

        calls = []
        orig = cpm.piece_forward

        def dying(*a, **k):
            calls.append(1)
            if len(calls) > 2:
                os._exit(3)
            return orig(*a, **k)

        cpm.piece_forward = dying
    try:
        cpd.context_parallel_attention(q, q, q, causal=True)
        return {"message": None}
    except cpd.ContextParallelError as exc:
        return {"message": str(exc)}
