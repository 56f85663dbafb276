"""A traced flex modifier (graph.py's :class:`~mhakern.flex.graph.Traced`) written as Triton.

The analogue of :func:`mhakern.flex.graph.cpp` for the Triton kernels: :func:`source` returns
the text of a Python module holding ``score_fwd``, ``score_bwd`` (graph.py's one walk over the
nodes, forward and reverse mode, written through the Triton :class:`~mhakern.flex.graph.Syntax`
here) and ``mask_fn`` as ``@triton.jit`` functions over tiles, followed by the flex kernels
(forward, dQ, dK/dV) with the captures' parameters spliced into their signatures. ``@triton.jit``
reads its function's source, so the module is written to a file (triton_backend.py caches it by
hash) and imported.

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

from typing import List, Optional, Tuple

from .graph import Emitter, Syntax, Traced


class _Triton(Syntax):
    """The Triton of the generated ``@triton.jit`` functions (helpers ``_wrap``, ``_load``,
    ``_floordiv``... in _HELPERS below): values are tiles or program scalars that broadcast."""

    name, indent = "triton", "    "
    types = {"f": "tl.float32", "i": "tl.int32", "b": "tl.int1"}
    true, false, int_lit = "True", "False", "{}"
    nan, inf, neg_inf = "_NAN", "_INF", "(-_INF)"
    unary = {
        "exp": "tl.exp({0})", "exp2": "tl.math.exp2({0})", "log": "tl.log({0})", "log2": "tl.math.log2({0})",
        "log1p": "_log1p({0})", "expm1": "_expm1({0})", "sqrt": "tl.sqrt({0})", "rsqrt": "(1.0 / tl.sqrt({0}))",
        "sin": "tl.sin({0})", "cos": "tl.cos({0})", "tanh": "tanh_f32({0})",
        "sigmoid": "(1.0 / (1.0 + tl.exp(-({0}))))",
        "erf": "tl.math.erf({0})", "floor": "tl.floor({0})", "ceil": "tl.ceil({0})", "round": "_rint({0})",
        "trunc": "_trunc({0})", "reciprocal": "(1.0 / ({0}))",
    }
    ops = {
        "const": "tl.full([], {0}, {t})", "scalar": "tl.full([], {0}, {t})",
        "select": "tl.where({0}, {1}, {2})", "add_b": "({0} | {1})", "and_b": "({0} & {1})", "or_b": "({0} | {1})",
        "xor_b": "({0} ^ {1})",
        "not_b": "({0} == 0)", "abs": "tl.abs({0})", "fsign": "(({0} > 0).to(tl.float32) - ({0} < 0).to(tl.float32))",
        "wrap": "_wrap({0}, {1})", "sign": "(({0} > 0).to({t}) - ({0} < 0).to({t}))", "relu": "tl.maximum({0}, {1})",
        "min": "tl.minimum({0}, {1})", "max": "tl.maximum({0}, {1})",
        "floordiv_i": "_floordiv({0}, {1})", "truncdiv_i": "_truncdiv({0}, {1})",
        "mod_i": "({0} - _floordiv({0}, {1}) * {1})", "mod_f": "({0} - tl.floor({0} / {1}) * {1})",
        "fmod_i": "({0} - _truncdiv({0}, {1}) * {1})", "fmod_f": "({0} - _trunc({0} / {1}) * {1})",
        "define": "{0} = {1}", "zero": "{0} = 0.0", "assign": "{0} = {1}", "acc": "{0} = {0} + {1}",
    }

    def float_lit(self, text):
        return text + "0" if text.endswith(".") else text

    def cast(self, expr, kind):
        if kind == "b":
            return f"({expr} != 0)"
        return f"{expr if expr.isidentifier() else '(' + expr + ')'}.to({self.types[kind]})"

    def all_of(self, conds):
        return " & ".join(f"({c})" for c in conds) or "True"

    def load(self, cap, flat, src_float, kind):
        return f"_load(C{cap}, {flat}, C{cap}_n).to({self.types[kind]})"

    def size(self, cap, d):
        return f"C{cap}_s{d}"

    def flat(self, terms):
        # int32 whatever the operands (a scalar sum of constants would be a Python int).
        return "(tl.full([], 0, tl.int32) + " + (" + ".join(terms) or "0") + ")"

    @staticmethod
    def _small(exponent):
        return exponent is not None and float(exponent).is_integer() and 0 <= float(exponent) <= 4

    def pow(self, a, b, exponent, kind):
        if kind != "f":
            return None
        if self._small(exponent):
            n = int(exponent)
            return "(" + (" * ".join([a] * n) if n else f"({a} * 0.0 + 1.0)") + ")"
        # exp(y log x): NaN for a negative base, as for a non-integer exponent.
        return f"tl.exp({b} * tl.log({a}))"

    def pow_base_grad(self, a, b, exponent):
        if self._small(exponent) and exponent >= 1:
            # n a^(n-1) by products, as the forward: a negative base has a derivative too.
            n = int(exponent)
            return " * ".join([f"{float(n)!r}"] + [a] * (n - 1))
        return f"{b} * tl.exp(({b} - 1.0) * tl.log({a}))"

    def scatter(self, k, cap, flat, g):
        # Per-score adjoint and flat index into dense (B, H, Lq, Lk) buffers, summed by the host
        # in a fixed order; broadcast to the tile's shape (zi). Where nothing flows (keep false)
        # the adjoint is 0, not what an infinite derivative made of it.
        i = self.indent
        return [f"{i}if STORE:", f"{i}    zi = goff * 0",
                f"{i}    tl.store(GV{k} + gbase + goff, tl.where(keep, {g}, 0.0) + zi.to(tl.float32), mask=gmask)",
                f"{i}    tl.store(GI{k} + gbase + goff, ({flat} + zi).to(tl.int64), mask=gmask)"]


TRITON = _Triton()


def cap_params(caps) -> str:
    """The captures' parameters in every generated signature: pointer, sizes, element count."""
    out = []
    for i, c in enumerate(caps):
        out += [f"C{i}"] + [f"C{i}_s{d}" for d in range(c.dim())] + [f"C{i}_n"]
    return "".join(", " + p for p in out)


def functions(score: Optional[Traced], mask: Optional[Traced], want_caps: List[bool]) -> Tuple[str, List[int]]:
    """The ``@triton.jit`` text of score_fwd, score_bwd and mask_fn, and per gradient buffer
    pair that score_bwd stores (one per load node that feeds a wanted capture gradient) the
    capture it belongs to. Captures are numbered as :func:`mhakern.flex.graph.merge_captures`
    numbers them."""
    caps = (score.captures if score is not None else mask.captures if mask is not None else [])
    cp = cap_params(caps)
    out = []
    sig = f"b, h, q_idx, kv_idx{cp}"
    loads: List[int] = []
    if score is None:
        out += ["@triton.jit", f"def score_fwd(s, {sig}):", "    return s", "",
                "@triton.jit", f"def score_bwd(s, {sig}, g, gbase, goff, gmask, GV, GI, STORE: tl.constexpr):",
                "    return g", ""]
    else:
        e = Emitter(score, "score_mod", TRITON)
        n = score.inputs
        bind = f"    v_{n[0]} = s\n    v_{n[1]} = b\n    v_{n[2]} = h\n    v_{n[3]} = q_idx\n    v_{n[4]} = kv_idx"
        fwd = e.forward_lines()
        spec = {name: sp for name, _, sp, _ in score.nodes}
        loads = [spec[name][0] for name in e.grad_loads(want_caps)]
        gparams = "".join(f", GV{k}, GI{k}" for k in range(len(loads))) or ", GV0, GI0"
        out += ["@triton.jit", f"def score_fwd(s, {sig}):", bind, *fwd,
                f"    return v_{score.output}.to(tl.float32)", "",
                "@triton.jit", f"def score_bwd(s, {sig}, g, gbase, goff, gmask{gparams}, STORE: tl.constexpr):",
                "    # Where the gradient at the modified score is 0 (hidden, or p = 0) nothing flows:",
                "    # a derivative that is infinite there must not turn 0 into NaN (graph.py's C++ skips it).",
                "    keep = g != 0.0", bind, *fwd, *e.backward_lines(want_caps),
                f"    return tl.where(keep, g_{n[0]}, 0.0)", ""]
    if mask is None:
        out += ["@triton.jit", f"def mask_fn({sig}):", "    return True", ""]
    else:
        e = Emitter(mask, "mask_mod", TRITON)
        n = mask.inputs
        out += ["@triton.jit", f"def mask_fn({sig}):",
                f"    v_{n[0]} = b\n    v_{n[1]} = h\n    v_{n[2]} = q_idx\n    v_{n[3]} = kv_idx",
                *e.forward_lines(), f"    return {e.val(('node', mask.output), 'b')}", ""]
    return "\n".join(out), loads


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


def source(score: Optional[Traced], mask: Optional[Traced], want_caps: List[bool]) -> Tuple[str, List[int]]:
    """The whole generated module (helpers, the modifier functions, the kernels) and, per
    gradient buffer pair its backward stores, the capture it belongs to (:func:`functions`)."""
    from . import triton_kernels

    caps = (score.captures if score is not None else mask.captures if mask is not None else [])
    fns, loads = functions(score, mask, want_caps)
    gp = "".join(f", GV{k}, GI{k}" for k in range(max(len(loads), 1)))
    kernels = triton_kernels.TEMPLATE.replace("__CAPS__", cap_params(caps)).replace("__GRADS__", gp)
    header = "".join(f"# capture {i}: {'float' if c.dtype.is_floating_point else 'int'} rank {c.dim()} "
                     f"grad {int(w)}\n" for i, (c, w) in enumerate(zip(caps, want_caps)))
    return "# Generated by mhakern/flex/triton_gen.py: do not edit.\n" + header + _HELPERS + "\n\n" + fns + \
        "\n\n" + kernels, loads
