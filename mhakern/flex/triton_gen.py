"""A traced flex modifier (graph.py's :class:`~mhakern.flex.graph.Traced`) written as Triton.

The analogue of :func:`mhakern.flex.graph.cpp` for the Triton kernels: :func:`source` returns
the text of a Python module holding ``score_fwd``, ``score_bwd`` (reverse mode over the same
nodes, with the derivatives graph.py's C++ generator uses) and ``mask_fn`` as ``@triton.jit``
functions over tiles, followed by the flex kernels (forward, dQ, dK/dV) with the captures'
parameters spliced into their signatures. ``@triton.jit`` reads its function's source, so the
module is written to a file (triton_backend.py caches it by hash) and imported.

Values inside the functions: the score tile (rows x keys) in float32, ``b`` and ``h`` program
scalars, ``q_idx`` a (rows, 1) and ``kv_idx`` a (1, keys) int32 column and row: each node's value
broadcasts to whatever shape its inputs give, and every node is computed in float32 (floating
nodes), int32 (integer nodes: torch's dtype for the indices; int64 tiles doubled the registers
and spilled) or int1 (bool). graph.py's C++ computes integers in int64: the two differ only
where an index expression overflows int32.

Captured tensors arrive as pointers (float32 or int64, contiguous) with their sizes; an element
read outside a capture (a padding row's index, say) loads 0 rather than faulting. The gradient
of a captured tensor is not summed in the kernel: each load node that feeds a wanted gradient
stores its per-score adjoint and flat index into dense (B, H, Lq, Lk) buffers, and the host
reduces them deterministically (atomics in the kernel would sum in a varying order).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

from .graph import _CMP, _IDENTITY, _NO_GRAD, Traced, Untraceable, _node_args

_TT = {"f": "tl.float32", "i": "tl.int32", "b": "tl.int1"}
_CASTS = ("_to_copy", "to", "_to_dtype", "type_as", "_autocast_to_reduced_precision", "convert_element_type")

_UNARY_F = {
    "exp": "tl.exp({0})", "exp2": "tl.math.exp2({0})", "log": "tl.log({0})", "log2": "tl.math.log2({0})",
    "log1p": "_log1p({0})", "expm1": "_expm1({0})", "sqrt": "tl.sqrt({0})", "rsqrt": "(1.0 / tl.sqrt({0}))",
    "sin": "tl.sin({0})", "cos": "tl.cos({0})", "tanh": "tanh_f32({0})", "sigmoid": "(1.0 / (1.0 + tl.exp(-({0}))))",
    "erf": "tl.math.erf({0})", "floor": "tl.floor({0})", "ceil": "tl.ceil({0})", "round": "_rint({0})",
    "trunc": "_trunc({0})", "reciprocal": "(1.0 / ({0}))",
}


def _lit(v, kind: Optional[str] = None) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, int) and kind != "f":
        return repr(int(v))
    v = float(v)
    if math.isnan(v):
        return "_NAN"
    if math.isinf(v):
        return "_INF" if v > 0 else "(-_INF)"
    return repr(v)


class _Emitter:
    """Writes a Traced's nodes as Triton statements (``v_<name>``; adjoints ``g_<name>``)."""

    def __init__(self, t: Traced, what: str):
        self.t, self.what = t, what
        self.kinds = {n: ("f" if (i == 0 and what == "score_mod") else "i") for i, n in enumerate(t.inputs)}
        for name, op, args, kind in t.nodes:
            self.kinds[name] = kind

    def val(self, a, want: Optional[str] = None) -> str:
        tag, x = a
        if tag == "node":
            k = self.kinds[x]
            if want and k != want:
                return f"(v_{x} != 0)" if want == "b" else f"v_{x}.to({_TT[want]})"
            return f"v_{x}"
        if tag == "const":
            if x is None:
                raise Untraceable(f"{self.what}: unexpected None argument")
            if want == "f":
                return _lit(float(x), "f")
            if want == "i":
                return _lit(int(x))
            if want == "b":
                return _lit(bool(x))
            return _lit(x, "f" if isinstance(x, float) else None)
        raise Untraceable(f"{self.what}: unsupported argument {a}")

    def kind_of(self, a) -> str:
        tag, x = a
        if tag == "node":
            return self.kinds[x]
        if isinstance(x, bool):
            return "b"
        return "f" if isinstance(x, float) else "i"

    def common(self, *args) -> str:
        ks = [self.kind_of(a) for a in args]
        return "f" if "f" in ks else ("i" if "i" in ks else "b")

    def flat_index(self, cap: int, idx_args) -> str:
        """The flat element index of a load (int32), Python's negative indices wrapped."""
        tensor = self.t.captures[cap]
        terms = []
        for d, ia in enumerate(idx_args):
            i = self.val(ia, "i")
            stride = " * ".join(f"C{cap}_s{e}" for e in range(d + 1, tensor.dim())) or "1"
            terms.append(f"_wrap({i}, C{cap}_s{d}) * {stride}")
        return "(tl.full([], 0, tl.int32) + " + (" + ".join(terms) or "0") + ")"

    def expr(self, name: str, op: str, spec) -> str:
        kind = self.kinds[name]
        tt = _TT[kind]
        V = self.val
        if op == "load":
            cap, idx = spec
            return f"_load(C{cap}, {self.flat_index(cap, idx)}, C{cap}_n).to({tt})"
        args, kw, _ = spec
        if op in _IDENTITY or op in _CASTS:
            return V(args[0], kind)
        if op in ("add", "sub", "rsub"):
            alpha = kw.get("alpha", args[2] if len(args) > 2 else ("const", 1))
            a, b = (args[1], args[0]) if op == "rsub" else (args[0], args[1])
            sgn = "-" if op != "add" else "+"
            al = "" if alpha == ("const", 1) else f"{V(alpha, kind)} * "
            if kind == "b":
                return f"({V(a, 'b')} | {V(b, 'b')})"
            return f"({V(a, kind)} {sgn} {al}{V(b, kind)})"
        if op == "mul":
            if kind == "b":
                return f"({V(args[0], 'b')} & {V(args[1], 'b')})"
            return f"({V(args[0], kind)} * {V(args[1], kind)})"
        if op == "div":
            mode = kw.get("rounding_mode", ("const", None))[1]
            if mode is None:
                return f"({V(args[0], 'f')} / {V(args[1], 'f')})"
            if kind == "i":
                fn = "_floordiv" if mode == "floor" else "_truncdiv"
                return f"{fn}({V(args[0], 'i')}, {V(args[1], 'i')})"
            fn = "tl.floor" if mode == "floor" else "_trunc"
            return f"{fn}({V(args[0], 'f')} / {V(args[1], 'f')})"
        if op == "floor_divide":
            if kind == "i":
                return f"_floordiv({V(args[0], 'i')}, {V(args[1], 'i')})"
            return f"tl.floor({V(args[0], 'f')} / {V(args[1], 'f')})"
        if op in ("remainder", "fmod"):
            a, b = V(args[0], kind), V(args[1], kind)
            if kind == "i":
                div = "_floordiv" if op == "remainder" else "_truncdiv"
                return f"({a} - {div}({a}, {b}) * {b})"
            div = "tl.floor" if op == "remainder" else "_trunc"
            return f"({a} - {div}({a} / {b}) * {b})"
        if op == "neg":
            return f"(-{V(args[0], kind)})"
        if op == "abs":
            return f"tl.abs({V(args[0], kind)})"
        if op in ("sign", "sgn"):
            x = V(args[0], kind)
            return f"(({x} > 0).to({tt}) - ({x} < 0).to({tt}))"
        if op == "relu":
            return f"tl.maximum({V(args[0], kind)}, {_lit(0, kind)})"
        if op in _UNARY_F:
            e = _UNARY_F[op].format(V(args[0], "f"))
            return e if kind == "f" else f"({e}).to({tt})"
        if op == "pow":
            if kind != "f":
                raise Untraceable(f"{self.what}: integer aten.pow is not supported by the triton code generator")
            ex = args[1]
            if ex[0] == "const" and float(ex[1]).is_integer() and 0 <= float(ex[1]) <= 4:
                n = int(ex[1])
                x = V(args[0], "f")
                return "(" + (" * ".join([x] * n) if n else f"({x} * 0.0 + 1.0)") + ")"
            # exp(y log x): NaN for a negative base, as for a non-integer exponent.
            return f"tl.exp({V(args[1], 'f')} * tl.log({V(args[0], 'f')}))"
        if op in ("minimum", "maximum", "min", "max", "fmin", "fmax"):
            if len(args) != 2:
                raise Untraceable(f"{self.what}: {op} over a dimension is not pointwise")
            f = "tl.minimum" if op in ("minimum", "min", "fmin") else "tl.maximum"
            return f"{f}({V(args[0], kind)}, {V(args[1], kind)})"
        if op in ("clamp", "clamp_min", "clamp_max"):
            lo, hi = _clamp_bounds(op, args, kw)
            x = V(args[0], kind)
            if lo[1] is not None or lo[0] == "node":
                x = f"tl.maximum({x}, {V(lo, kind)})"
            if hi[1] is not None or hi[0] == "node":
                x = f"tl.minimum({x}, {V(hi, kind)})"
            return x
        if op == "where":
            return f"tl.where({V(args[0], 'b')}, {V(args[1], kind)}, {V(args[2], kind)})"
        if op in _CMP:
            w = self.common(args[0], args[1])
            return f"({V(args[0], w)} {_CMP[op]} {V(args[1], w)})"
        for ops, sym in ((("logical_and", "bitwise_and", "__and__"), "&"),
                         (("logical_or", "bitwise_or", "__or__"), "|"),
                         (("logical_xor", "bitwise_xor", "__xor__"), "^")):
            if op in ops:
                w = "b" if (kind == "b" or op.startswith("logical")) else "i"
                return f"({V(args[0], w)} {sym} {V(args[1], w)})"
        if op in ("logical_not", "bitwise_not"):
            if kind == "b" or op == "logical_not":
                return f"({V(args[0], 'b')} == 0)"
            return f"(~{V(args[0], 'i')})"
        if op in ("scalar_tensor", "full", "full_like"):
            src = args[-1] if op == "full" else (args[1] if op == "full_like" else args[0])
            return f"tl.full([], {V(src, kind)}, {tt})"
        if op in ("zeros_like", "zeros", "new_zeros"):
            return f"tl.full([], 0, {tt})"
        if op in ("ones_like", "ones", "new_ones"):
            return f"tl.full([], 1, {tt})"
        raise Untraceable(f"{self.what}: op aten.{op} is not supported by the triton code generator")

    def forward_lines(self, indent: str = "    ") -> List[str]:
        return [f"{indent}v_{name} = {self.expr(name, op, spec)}" for name, op, spec, kind in self.t.nodes]

    def active(self, want_caps: List[bool]) -> set:
        """Floating nodes on a path from the score or from a capture whose gradient is wanted."""
        act = {self.t.inputs[0]}
        for name, op, spec, kind in self.t.nodes:
            if kind != "f":
                continue
            if op == "load":
                if want_caps[spec[0]]:
                    act.add(name)
                continue
            args, kw, _ = spec
            if op not in _NO_GRAD and any(d in act for d in _node_args(args) + _node_args(tuple(kw.values()))):
                act.add(name)
        return act

    def backward_lines(self, want_caps: List[bool], indent: str = "    ") -> Tuple[List[str], List[str]]:
        """(lines, grad_loads): reverse mode from ``g`` (the gradient at the output) to ``g_<score>``;
        ``grad_loads`` names the load nodes whose adjoint feeds a wanted capture gradient."""
        act = self.active(want_caps)
        score, out = self.t.inputs[0], self.t.output
        lines = [f"{indent}g_{n} = 0.0" for n in [score] + [n for n, _, _, k in self.t.nodes if n in act]]
        if out in act:
            lines.append(f"{indent}g_{out} = g")
        loads = []
        for name, op, spec, kind in reversed(self.t.nodes):
            if name not in act:
                continue
            if op == "load":
                loads.append(name)
                continue
            lines += [indent + x for x in self._adjoint(name, op, spec, act)]
        return lines, loads[::-1]

    def _adjoint(self, name, op, spec, act) -> List[str]:
        g = f"g_{name}"
        args, kw, _ = spec
        y = f"v_{name}"
        V = lambda a: self.val(a, "f")  # noqa: E731

        def acc(a, expr):
            if a[0] == "node" and a[1] in act:
                return [f"g_{a[1]} = g_{a[1]} + {expr}"]
            return []

        if op in _IDENTITY or op in _CASTS:
            return acc(args[0], g)
        if op in ("add", "sub", "rsub"):
            alpha = kw.get("alpha", args[2] if len(args) > 2 else ("const", 1))
            a, b = (args[1], args[0]) if op == "rsub" else (args[0], args[1])
            sgn = "-" if op != "add" else ""
            al = "" if alpha == ("const", 1) else f"{V(alpha)} * "
            return acc(a, g) + acc(b, f"{sgn}{al}{g}")
        if op == "mul":
            return acc(args[0], f"{g} * {V(args[1])}") + acc(args[1], f"{g} * {V(args[0])}")
        if op == "div":
            if kw.get("rounding_mode", ("const", None))[1] is not None:
                return []
            return acc(args[0], f"{g} / {V(args[1])}") + acc(args[1], f"-{g} * {y} / {V(args[1])}")
        if op == "neg":
            return acc(args[0], f"-{g}")
        if op == "abs":
            x = V(args[0])
            return acc(args[0], f"{g} * (({x} > 0).to(tl.float32) - ({x} < 0).to(tl.float32))")
        if op == "relu":
            return acc(args[0], f"tl.where({y} > 0.0, {g}, 0.0)")
        x = V(args[0])
        d = {
            "exp": f"{g} * {y}", "exp2": f"{g} * {y} * 0.6931471805599453",
            "log": f"{g} / {x}", "log2": f"{g} / ({x} * 0.6931471805599453)",
            "log1p": f"{g} / (1.0 + {x})", "expm1": f"{g} * ({y} + 1.0)",
            "sqrt": f"{g} * 0.5 / {y}", "rsqrt": f"-0.5 * {g} * {y} * {y} * {y}",
            "sin": f"{g} * tl.cos({x})", "cos": f"-{g} * tl.sin({x})",
            "tanh": f"{g} * (1.0 - {y} * {y})", "sigmoid": f"{g} * {y} * (1.0 - {y})",
            "erf": f"{g} * 1.1283791670955126 * tl.exp(-{x} * {x})",
            "reciprocal": f"-{g} * {y} * {y}",
        }
        if op in d:
            return acc(args[0], d[op])
        if op == "pow":
            a, b = V(args[0]), V(args[1])
            ex = args[1]
            if ex[0] == "const" and float(ex[1]).is_integer() and 1 <= float(ex[1]) <= 4:
                # n a^(n-1) by products, as the forward: a negative base has a derivative too.
                n = int(ex[1])
                return acc(args[0], " * ".join([g, f"{float(n)!r}"] + [a] * (n - 1)))
            return (acc(args[0], f"{g} * {b} * tl.exp(({b} - 1.0) * tl.log({a}))")
                    + acc(args[1], f"{g} * {y} * tl.log({a})"))
        if op in ("minimum", "maximum", "min", "max", "fmin", "fmax"):
            a, b = V(args[0]), V(args[1])
            first = f"({a} < {b})" if op in ("minimum", "min", "fmin") else f"({a} > {b})"
            # Ties split the gradient evenly, as torch's derivative of minimum/maximum does.
            return (acc(args[0], f"tl.where({first}, {g}, tl.where({a} == {b}, 0.5 * {g}, 0.0))")
                    + acc(args[1], f"tl.where({first}, 0.0, tl.where({a} == {b}, 0.5 * {g}, {g}))"))
        if op in ("clamp", "clamp_min", "clamp_max"):
            lo, hi = _clamp_bounds(op, args, kw)
            cond = []
            if lo[1] is not None or lo[0] == "node":
                cond.append(f"({x} >= {V(lo)})")
            if hi[1] is not None or hi[0] == "node":
                cond.append(f"({x} <= {V(hi)})")
            return acc(args[0], f"tl.where({' & '.join(cond)}, {g}, 0.0)" if cond else g)
        if op == "where":
            c = self.val(args[0], "b")
            return acc(args[1], f"tl.where({c}, {g}, 0.0)") + acc(args[2], f"tl.where({c}, 0.0, {g})")
        if op in ("scalar_tensor", "full", "full_like", "zeros_like", "ones_like", "zeros", "ones"):
            return []
        raise Untraceable(f"{self.what}: no derivative for aten.{op} in the triton code generator")


def _clamp_bounds(op, args, kw):
    lo = kw.get("min", args[1] if len(args) > 1 and op != "clamp_max" else ("const", None))
    hi = kw.get("max", args[2] if len(args) > 2 else (args[1] if op == "clamp_max" else ("const", None)))
    return lo, hi


def cap_params(caps) -> str:
    """The captures' parameters in every generated signature: pointer, sizes, element count."""
    out = []
    for i, c in enumerate(caps):
        out += [f"C{i}"] + [f"C{i}_s{d}" for d in range(c.dim())] + [f"C{i}_n"]
    return "".join(", " + p for p in out)


def functions(score: Optional[Traced], mask: Optional[Traced], want_caps: List[bool]) -> Tuple[str, int]:
    """The ``@triton.jit`` text of score_fwd, score_bwd and mask_fn, and how many gradient
    buffers score_bwd stores (one pair per load node that feeds a wanted capture gradient).
    Captures are numbered as :func:`mhakern.flex.graph.merge_captures` numbers them."""
    caps = (score.captures if score is not None else mask.captures if mask is not None else [])
    cp = cap_params(caps)
    out = []
    sig = f"b, h, q_idx, kv_idx{cp}"
    n_grad = 0
    if score is None:
        out += ["@triton.jit", f"def score_fwd(s, {sig}):", "    return s", "",
                "@triton.jit", f"def score_bwd(s, {sig}, g, gbase, goff, gmask, GV, GI, STORE: tl.constexpr):",
                "    return g", ""]
    else:
        e = _Emitter(score, "score_mod")
        n = score.inputs
        bind = f"    v_{n[0]} = s\n    v_{n[1]} = b\n    v_{n[2]} = h\n    v_{n[3]} = q_idx\n    v_{n[4]} = kv_idx"
        fwd = e.forward_lines()
        bwd, loads = e.backward_lines(want_caps)
        n_grad = len(loads)
        gparams = "".join(f", GV{k}, GI{k}" for k in range(n_grad)) or ", GV0, GI0"
        stores = []
        if n_grad:
            stores.append("    if STORE:")
            # One value per score: broadcast the adjoint and the flat index to the tile's shape.
            stores.append("        zi = goff * 0")
            for k, name in enumerate(loads):
                cap, idx = next(spec for nm, op, spec, _ in score.nodes if nm == name)
                stores.append(f"        tl.store(GV{k} + gbase + goff, tl.where(keep, g_{name}, 0.0)"
                              " + zi.to(tl.float32), mask=gmask)")
                stores.append(f"        tl.store(GI{k} + gbase + goff, ({e.flat_index(cap, idx)} + zi).to(tl.int64),"
                              " mask=gmask)")
        out += ["@triton.jit", f"def score_fwd(s, {sig}):", bind, *fwd,
                f"    return v_{score.output}.to(tl.float32)", "",
                "@triton.jit", f"def score_bwd(s, {sig}, g, gbase, goff, gmask{gparams}, STORE: tl.constexpr):",
                "    # Where the gradient at the modified score is 0 (hidden, or p = 0) nothing flows:",
                "    # a derivative that is infinite there must not turn 0 into NaN (graph.py's C++ skips it).",
                "    keep = g != 0.0", bind, *fwd, *bwd, *stores,
                f"    return tl.where(keep, g_{n[0]}, 0.0)", ""]
    if mask is None:
        out += ["@triton.jit", f"def mask_fn({sig}):", "    return True", ""]
    else:
        e = _Emitter(mask, "mask_mod")
        n = mask.inputs
        out += ["@triton.jit", f"def mask_fn({sig}):",
                f"    v_{n[0]} = b\n    v_{n[1]} = h\n    v_{n[2]} = q_idx\n    v_{n[3]} = kv_idx",
                *e.forward_lines(), f"    return {e.val(('node', mask.output), 'b')}", ""]
    return "\n".join(out), n_grad


_HELPERS = '''
import triton
import triton.language as tl

from mhakern.kernels.tiles import tanh_f32

_NAN = tl.constexpr(float("nan"))
_INF = tl.constexpr(float("inf"))
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _wrap(i, n):
    return tl.where(i < 0, i + n, i)


@triton.jit
def _load(ptr, flat, n):
    # An index outside the capture (padding rows and keys evaluate the modifier too) reads 0.
    ok = (flat >= 0) & (flat < n)
    return tl.load(ptr + tl.where(ok, flat, 0), mask=ok, other=0)


@triton.jit
def _floordiv(a, b):
    # Integer // truncates in compiled Triton and floors in the interpreter (numpy): correct
    # either to Python's floor.
    q = a // b
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)


@triton.jit
def _truncdiv(a, b):
    q = _floordiv(a, b)
    r = a - q * b
    return tl.where((r != 0) & ((a < 0) != (b < 0)), q + 1, q)


@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def _rint(x):
    # Half to even, as torch.round.
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _log1p(x):
    # log(u) * x / (u - 1), u = 1 + x: the rounding of u cancels (Goldberg).
    u = 1.0 + x
    d = tl.where(u == 1.0, 1.0, u - 1.0)  # the branch not taken must not divide by 0
    return tl.where(u == 1.0, x, tl.log(u) * x / d)


@triton.jit
def _expm1(x):
    u = tl.exp(x)
    lu = tl.where((u == 1.0) | (u == 0.0), 1.0, tl.log(u))  # the branches not taken must not divide by 0
    return tl.where(u == 1.0, x, tl.where(u - 1.0 == -1.0, -1.0, (u - 1.0) * x / lu))
'''


def source(score: Optional[Traced], mask: Optional[Traced], want_caps: List[bool]) -> Tuple[str, int]:
    """The whole generated module (helpers, the modifier functions, the kernels) and the number
    of gradient buffer pairs its backward stores."""
    from . import triton_kernels

    caps = (score.captures if score is not None else mask.captures if mask is not None else [])
    fns, n_grad = functions(score, mask, want_caps)
    gp = "".join(f", GV{k}, GI{k}" for k in range(max(n_grad, 1)))
    kernels = triton_kernels.TEMPLATE.replace("__CAPS__", cap_params(caps)).replace("__GRADS__", gp)
    header = "".join(f"# capture {i}: {'float' if c.dtype.is_floating_point else 'int'} rank {c.dim()} "
                     f"grad {int(w)}\n" for i, (c, w) in enumerate(zip(caps, want_caps)))
    return "# Generated by mhakern/flex/triton_gen.py: do not edit.\n" + header + _HELPERS + "\n\n" + fns + \
        "\n\n" + kernels, n_grad
