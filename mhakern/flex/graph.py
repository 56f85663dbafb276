"""Tracing a flex modifier into a pointwise graph, and that graph (with its derivative) into C++.

``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` are traced once
with ``make_fx`` over one-element tensors (a float32 score, int32 indices: torch's own dtypes for
them). One element rather than 0-d, so that ``table[h, q_idx - kv_idx]`` is a gather
(``aten.index.Tensor``) and not a Python integer index; a value read out of a tensor
(``.item()``, ``if score > 0:``) stops the trace, and is refused as data-dependent control flow.
Tensors the modifier captures appear as constants of the graph (the same tensor objects), so
their gradient can be asked for.

:func:`trace` returns a :class:`Traced` (the nodes in order, the captures, a readable reason when
the graph cannot be compiled). :class:`Emitter` walks it once for every target language, the
values forward and their adjoints in reverse mode, writing through a :class:`Syntax` (the C++
one here, triton_gen.py's Triton one); :func:`cpp` writes it as the C++ the kernel template
(csrc/flex/flex_kernel.cpp) expects: ``score_fwd``, ``score_bwd`` (reverse mode over the graph:
the gradient with respect to the score, and scatter-adds into the gradients of captured tables
that require grad) and ``mask_fn``. Every value is computed in float (floating nodes), int64
(integer nodes) or bool, whatever the traced dtype: the contract's fp32 accumulation.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

Tensor = torch.Tensor


class Untraceable(Exception):
    """A modifier that cannot become a compiled graph; the message says why in one line."""


@dataclass
class Traced:
    """A traced modifier: ``nodes`` are (name, op, args, kind) in order, ``kind`` one of "f", "i",
    "b" (float, integer, bool); ``inputs`` the placeholder names; ``output`` the output node's
    name; ``captures`` the captured tensors in order of first use, read by "load" nodes
    (spec: capture number and one index argument per dim)."""

    nodes: List[Tuple[str, str, tuple, str]]
    inputs: List[str]
    output: str
    captures: List[Tensor] = field(default_factory=list)


_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_IDENTITY = {"clone", "alias", "detach", "lift_fresh_copy", "view", "reshape", "squeeze", "unsqueeze", "expand",
             "contiguous", "_unsafe_view", "positive"}
# Ops whose value is a function of integers/bools only, or piecewise constant: no derivative.
_NO_GRAD = {"floor", "ceil", "round", "trunc", "sign", "eq", "ne", "lt", "le", "gt", "ge"}


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "b"
    if dtype.is_floating_point:
        return "f"
    if dtype.is_complex:
        raise Untraceable(f"complex values ({dtype}) are not supported in a modifier")
    return "i"


def _dummy_inputs(with_score: bool, device) -> List[Tensor]:
    idx = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(4)]
    return ([torch.zeros(1, dtype=torch.float32, device=device)] if with_score else []) + idx


def trace(fn: Callable, is_score: bool, device="cpu") -> Traced:
    """Traces ``fn`` (a score_mod when ``is_score``, else a mask_mod) with its arguments on
    ``device``, the call's: a modifier mixes them with the tensors it captures, which live
    there (``kv < prefix[b]`` with ``prefix`` on a GPU). Captures left on the CPU (the kernels
    read a copy of each on the call's device) trace with the arguments there: where the call's
    device fails, the CPU is tried before giving up. Raises Untraceable (the call's device's
    reason)."""
    try:
        gm = _make_fx(fn, is_score, device)
    except Untraceable as first:
        if torch.device(device).type == "cpu":
            raise
        try:
            gm = _make_fx(fn, is_score, "cpu")
        except Untraceable:
            raise first from None
    return _from_graph(gm, is_score)


def _make_fx(fn: Callable, is_score: bool, device):
    from torch.fx.experimental.proxy_tensor import make_fx

    what = "score_mod" if is_score else "mask_mod"
    try:
        return make_fx(fn)(*_dummy_inputs(is_score, device))
    except RuntimeError as e:
        text = str(e)
        if "data-dependent" in text or "_local_scalar_dense" in text:
            raise Untraceable(f"{what} reads a value out of a tensor (data-dependent control flow or .item()); "
                              "write it with torch.where") from None
        raise Untraceable(f"{what} could not be traced: {text.splitlines()[0] if text else type(e).__name__}") from None
    except Exception as e:  # noqa: BLE001 -- any failure of user code while tracing is the modifier's
        raise Untraceable(f"{what} could not be traced: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def _from_graph(gm, is_score: bool) -> Traced:
    what = "score_mod" if is_score else "mask_mod"
    t = Traced(nodes=[], inputs=[], output="")
    cap_index: Dict[int, int] = {}
    # Captured tensors and partly indexed views of them: name -> (capture, fixed indices, one
    # per dim: an argument or None). A view becomes a value ("load" node) once every dim is fixed.
    views: Dict[str, Tuple[int, list]] = {}

    def load(name, cap, fixed, kind):
        t.nodes.append((name, "load", (cap, tuple(fixed)), kind))

    def as_value(a):
        """An argument that names a view: a one-element capture is read at index 0."""
        if a[0] == "node" and a[1] in views:
            cap, fixed = views[a[1]]
            tensor = t.captures[cap]
            if any(f is None for f in fixed) and tensor.numel() != 1:
                raise Untraceable(f"{what} uses a captured tensor of shape {tuple(tensor.shape)} whole; "
                                  "index every dimension")
            name = f"{a[1]}_value"
            if name not in {n[0] for n in t.nodes}:
                load(name, cap, [f if f is not None else ("const", 0) for f in fixed], _kind(tensor.dtype))
            return ("node", name)
        if a[0] == "list":
            return ("list", tuple(as_value(x) for x in a[1]))
        return a

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            t.inputs.append(n.name)
            continue
        if n.op == "output":
            out = n.args[0]
            out = out[0] if isinstance(out, (tuple, list)) else out
            if not isinstance(out, torch.fx.Node):
                raise Untraceable(f"{what} returns a constant, not a tensor computed from its arguments")
            if out.name in views:
                t.output = as_value(("node", out.name))[1]
            else:
                t.output = out.name
            continue
        val = n.meta.get("val")
        if n.op == "get_attr":
            cap = getattr(gm, n.target)
            if not isinstance(cap, Tensor):
                raise Untraceable(f"{what} captures a {type(cap).__name__}, not a tensor")
            if cap.dim() > 4:
                raise Untraceable(f"{what} captures a {cap.dim()}-d tensor; at most 4 dims are supported")
            if cap.dtype.is_complex:
                raise Untraceable(f"{what} captures a complex tensor")
            if id(cap) not in cap_index:
                cap_index[id(cap)] = len(t.captures)
                t.captures.append(cap)
            views[n.name] = (cap_index[id(cap)], [None] * cap.dim())
            continue
        if n.op != "call_function" or not hasattr(n.target, "_opname"):
            raise Untraceable(f"{what}: unsupported graph node {n.op} {n.target}")
        if not isinstance(val, Tensor):
            raise Untraceable(f"{what}: op {n.target} gives a non-tensor value")
        op = n.target._opname
        args = tuple(_arg(a, what) for a in n.args)
        kw = {k: _arg(v, what) for k, v in n.kwargs.items()}
        src = args[0] if args else None
        if op in ("select", "index") and src is not None and src[0] == "node" and src[1] in views:
            cap, fixed = views[src[1]]
            fixed = list(fixed)
            free = [d for d, f in enumerate(fixed) if f is None]
            if op == "select":
                dim, idx = args[1], args[2]
                if dim[0] != "const":
                    raise Untraceable(f"{what}: select over a computed dim")
                fixed[free[dim[1] % len(free)]] = idx
            else:
                idxs = args[1][1]
                if len(idxs) > len(free) or any(i[0] == "const" and i[1] is None for i in idxs):
                    raise Untraceable(f"{what}: slicing a captured tensor is not supported; index every dimension")
                for d, i in zip(free, idxs):
                    fixed[d] = as_value(i)
            if all(f is not None for f in fixed):
                load(n.name, cap, fixed, _kind(val.dtype))
            else:
                views[n.name] = (cap, fixed)
            continue
        if val.numel() != 1:
            raise Untraceable(f"{what}: op {n.target} gives a value of shape {tuple(val.shape)}, not one element "
                              "per score (index a captured tensor with every dimension)")
        args = tuple(as_value(a) for a in args)
        kw = {k: as_value(v) for k, v in kw.items()}
        t.nodes.append((n.name, op, (args, kw, n.target._overloadname), _kind(val.dtype)))
    return t


def _arg(a, what):
    if isinstance(a, torch.fx.Node):
        return ("node", a.name)
    if isinstance(a, (list, tuple)):
        return ("list", tuple(_arg(x, what) for x in a))
    if isinstance(a, bool) or a is None:
        return ("const", a)
    if isinstance(a, (int, float)):
        return ("const", a)
    if isinstance(a, torch.dtype):
        return ("dtype", a)
    if isinstance(a, (torch.device, torch.layout, torch.memory_format)):
        return ("ignored", str(a))
    raise Untraceable(f"{what}: unsupported argument {a!r}")


# ------------------------------------------------------------------------------------------
# Emission: one walk over the nodes (forward values, then reverse mode) for every target
# language; a Syntax says how that language writes each piece. CPP (below) is the cpu kernel's,
# mhakern/flex/triton_gen.py's TRITON the Triton kernels'.

_CASTS = ("_to_copy", "to", "_to_dtype", "type_as", "_autocast_to_reduced_precision", "convert_element_type")
_MINMAX = ("minimum", "maximum", "min", "max", "fmin", "fmax")
_CONSTANTS = ("scalar_tensor", "full", "full_like", "zeros_like", "ones_like", "zeros", "ones")
# (ops, the Syntax key of their bool form, their integer operator)
_LOGICAL = ((("logical_and", "bitwise_and", "__and__"), "and_b", "&"),
            (("logical_or", "bitwise_or", "__or__"), "or_b", "|"),
            (("logical_xor", "bitwise_xor", "__xor__"), "xor_b", "^"))


class Syntax:
    """How one target language writes what :class:`Emitter` emits. ``ops`` holds format
    templates (``{0}``, ``{1}``... the operands, ``{t}`` the result's type name); ``unary`` the
    forward unary functions of a float (``{0}``). A value is named ``v_<node>``, its adjoint
    ``g_<node>``; ``g`` is the gradient arriving at the modifier's output.

    ``ops`` keys: ``cast`` (to type t), ``const`` (the constant {0} of type t), ``scalar`` (a
    traced scalar), ``select`` ({0} ? {1} : {2}), ``add_b``/``and_b``/``or_b``/``xor_b``/``not_b``
    (bool forms), ``abs``, ``sign``, ``fsign`` (a float's sign: abs's derivative), ``relu`` ({1}
    is 0 as the language writes it), ``min``, ``max``, ``wrap`` (index {0} wrapped into size {1}
    as Python's negative indices), ``floordiv_i``, ``truncdiv_i``, ``mod_i``/``mod_f`` (Python's
    %), ``fmod_i``/``fmod_f`` (C's fmod); statements ``define``, ``zero``, ``assign``, ``acc``."""

    name = ""  # in messages: "no derivative ... in the <name> code generator"
    indent = ""
    types: Dict[str, str] = {}  # "f" / "i" / "b" -> the language's type
    ops: Dict[str, str] = {}
    unary: Dict[str, str] = {}
    true, false = "", ""
    int_lit = "{}"
    nan, inf, neg_inf = "", "", ""

    def float_lit(self, text: str) -> str:
        """A float constant from Python's repr of it, or written with a trailing "." ("1.")."""
        raise NotImplementedError

    def lit(self, v, kind: Optional[str] = None) -> str:
        if isinstance(v, bool):
            return self.true if v else self.false
        if isinstance(v, int) and kind != "f":
            return self.int_lit.format(int(v))
        v = float(v)
        if math.isnan(v):
            return self.nan
        if math.isinf(v):
            return self.inf if v > 0 else self.neg_inf
        return self.float_lit(repr(v))

    def op(self, key: str, *a, kind: str = "f") -> str:
        return self.ops[key].format(*a, t=self.types[kind])

    def cast(self, expr: str, kind: str) -> str:
        return self.op("cast", expr, kind=kind)

    def all_of(self, conds: List[str]) -> str:
        """The conjunction of conditions (a clamp's gradient mask)."""
        raise NotImplementedError

    def load(self, cap: int, flat: str, src_float: bool, kind: str) -> str:
        """Element ``flat`` of capture ``cap`` (stored as float, or int64), as ``kind``."""
        raise NotImplementedError

    def size(self, cap: int, d: int) -> str:
        raise NotImplementedError

    def flat(self, terms: List[str]) -> str:
        raise NotImplementedError

    def pow(self, a: str, b: str, exponent, kind: str) -> Optional[str]:
        """a ** b; ``exponent`` is b's value when it is a constant, else None. None: not
        supported for ``kind``."""
        raise NotImplementedError

    def pow_base_grad(self, a: str, b: str, exponent) -> str:
        """d(a ** b) / da for floats."""
        raise NotImplementedError

    def scatter(self, k: int, cap: int, flat: str, g: str) -> List[str]:
        """Statements adding adjoint ``g`` to element ``flat`` of capture ``cap``'s gradient:
        the ``k``-th load node (in graph order) that feeds a wanted capture gradient."""
        raise NotImplementedError

    # Statements, indented.
    def define(self, name: str, expr: str, kind: str) -> str:
        return self.indent + self.ops["define"].format(name, expr, t=self.types[kind])

    def stmt(self, key: str, *a) -> str:
        return self.indent + self.ops[key].format(*a)


class _Cpp(Syntax):
    """The C++ of csrc/flex/flex_kernel.cpp's ``Mod`` structs: floats in float, integers in
    int64_t; wrap_index, fsign, py_floordiv, py_mod, py_fmod are that file's helpers."""

    name, indent = "cpu", "  "
    types = {"f": "float", "i": "int64_t", "b": "bool"}
    true, false, int_lit = "true", "false", "INT64_C({})"
    nan = "std::numeric_limits<float>::quiet_NaN()"
    inf, neg_inf = "std::numeric_limits<float>::infinity()", "-std::numeric_limits<float>::infinity()"
    unary = {
        "exp": "std::exp({0})", "exp2": "std::exp2({0})", "log": "std::log({0})", "log2": "std::log2({0})",
        "log1p": "std::log1p({0})", "expm1": "std::expm1({0})", "sqrt": "std::sqrt({0})",
        "rsqrt": "(1.f / std::sqrt({0}))", "sin": "std::sin({0})", "cos": "std::cos({0})", "tanh": "std::tanh({0})",
        "sigmoid": "(1.f / (1.f + std::exp(-({0}))))", "erf": "std::erf({0})", "floor": "std::floor({0})",
        "ceil": "std::ceil({0})", "round": "std::nearbyint({0})", "trunc": "std::trunc({0})",
        "reciprocal": "(1.f / ({0}))",
    }
    ops = {
        "cast": "static_cast<{t}>({0})", "const": "static_cast<{t}>({0})", "scalar": "{0}",
        "select": "({0} ? {1} : {2})", "add_b": "({0} + {1})", "and_b": "({0} && {1})", "or_b": "({0} || {1})",
        "xor_b": "({0} != {1})",
        "not_b": "(!{0})", "abs": "std::abs({0})", "fsign": "fsign({0})", "wrap": "wrap_index({0}, {1})",
        "sign": "static_cast<{t}>(({0} > 0) - ({0} < 0))", "relu": "std::max<{t}>({0}, 0)",
        "min": "std::min<{t}>({0}, {1})", "max": "std::max<{t}>({0}, {1})",
        "floordiv_i": "py_floordiv({0}, {1})", "truncdiv_i": "({0} / {1})",
        "mod_i": "py_mod({0}, {1})", "mod_f": "py_fmod({0}, {1})", "fmod_i": "({0} % {1})",
        "fmod_f": "std::fmod({0}, {1})",
        "define": "const {t} {0} = {1};", "zero": "float {0} = 0.f;", "assign": "{0} = {1};", "acc": "{0} += {1};",
    }

    def float_lit(self, text):
        return text + "f"

    def all_of(self, conds):
        return "(" + " && ".join(["true"] + conds) + ")"

    def load(self, cap, flat, src_float, kind):
        src = "float" if src_float else "int64_t"
        return f"static_cast<{self.types[kind]}>(static_cast<const {src}*>(c.ptr[{cap}])[{flat}])"

    def size(self, cap, d):
        return f"c.size[{cap * 4 + d}]"

    def flat(self, terms):
        return " + ".join(terms) or "0"

    def pow(self, a, b, exponent, kind):
        if kind == "f":
            return f"std::pow({a}, {b})"
        return f"static_cast<int64_t>(std::pow(double({a}), double({b})))"

    def pow_base_grad(self, a, b, exponent):
        return f"{b} * std::pow({a}, {b} - 1.f)"

    def scatter(self, k, cap, flat, g):
        return [f"{self.indent}if (kCapGrad) gcap[{cap}][{flat}] += {g};"]


CPP = _Cpp()


def _clamp_bounds(op, args, kw) -> List[Tuple[str, tuple]]:
    """The bounds a clamp applies, as ("max", lower bound) and ("min", upper bound)."""
    lo = kw.get("min", args[1] if len(args) > 1 and op != "clamp_max" else ("const", None))
    hi = kw.get("max", args[2] if len(args) > 2 else (args[1] if op == "clamp_max" else ("const", None)))
    return [(f, b) for f, b in (("max", lo), ("min", hi)) if b[1] is not None or b[0] == "node"]


class Emitter:
    """Writes the nodes of a Traced in ``syntax``'s language: :meth:`forward_lines` (every
    value), :meth:`backward_lines` (reverse mode); ``kinds`` maps names to "f"/"i"/"b"."""

    def __init__(self, t: Traced, what: str, syntax: Syntax = CPP):
        self.t, self.what, self.L = t, what, syntax
        self.kinds = {n: ("f" if (i == 0 and what == "score_mod") else "i") for i, n in enumerate(t.inputs)}
        for name, op, args, kind in t.nodes:
            self.kinds[name] = kind

    def val(self, a, want: Optional[str] = None) -> str:
        tag, x = a
        if tag == "node":
            k = self.kinds[x]
            if want and k != want:
                return self.L.cast(f"v_{x}", want)
            return f"v_{x}"
        if tag == "const":
            if x is None:
                raise Untraceable(f"{self.what}: unexpected None argument")
            if want == "f":
                return self.L.lit(float(x), "f")
            if want == "i":
                return self.L.lit(int(x))
            if want == "b":
                return self.L.lit(bool(x))
            return self.L.lit(x, "f" if isinstance(x, float) else None)
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
        """The flat element index of a load: Python's negative indices wrap."""
        L, dims = self.L, self.t.captures[cap].dim()
        terms = []
        for d, ia in enumerate(idx_args):
            stride = " * ".join(L.size(cap, e) for e in range(d + 1, dims)) or "1"
            terms.append(f"{L.op('wrap', self.val(ia, 'i'), L.size(cap, d))} * {stride}")
        return L.flat(terms)

    def expr(self, name: str, op: str, spec) -> str:
        kind = self.kinds[name]
        L, V = self.L, self.val

        def O(key, *a):  # noqa: E743
            return L.op(key, *a, kind=kind)

        if op == "load":
            cap, idx = spec
            return L.load(cap, self.flat_index(cap, idx), self.t.captures[cap].dtype.is_floating_point, kind)
        args, kw, overload = spec
        if op in _IDENTITY or op in _CASTS:
            return V(args[0], kind)
        if op in ("add", "sub", "rsub"):
            alpha = kw.get("alpha", args[2] if len(args) > 2 else ("const", 1))
            a, b = (args[1], args[0]) if op == "rsub" else (args[0], args[1])
            if kind == "b":  # bool + bool: or
                return O("add_b", V(a, "b"), V(b, "b"))
            sgn = "-" if op != "add" else "+"
            al = "" if alpha == ("const", 1) else f"{V(alpha, kind)} * "
            return f"({V(a, kind)} {sgn} {al}{V(b, kind)})"
        if op == "mul":
            return f"({V(args[0], kind)} * {V(args[1], kind)})" if kind != "b" else O("and_b", V(args[0], "b"),
                                                                                       V(args[1], "b"))
        if op in ("div", "floor_divide"):
            mode = "floor" if op == "floor_divide" else kw.get("rounding_mode", ("const", None))[1]
            if mode is None:
                return f"({V(args[0], 'f')} / {V(args[1], 'f')})"
            if kind == "i":
                return O("floordiv_i" if mode == "floor" else "truncdiv_i", V(args[0], "i"), V(args[1], "i"))
            return L.unary["floor" if mode == "floor" else "trunc"].format(f"{V(args[0], 'f')} / {V(args[1], 'f')}")
        if op in ("remainder", "fmod"):
            w = "i" if kind == "i" else "f"
            return O(f"{'mod' if op == 'remainder' else 'fmod'}_{w}", V(args[0], w), V(args[1], w))
        if op == "neg":
            return f"(-{V(args[0], kind)})"
        if op in ("abs", "sign", "relu"):
            return O(op, V(args[0], kind), L.lit(0, kind))  # relu's 0 as the language writes it
        if op == "sgn":
            return O("sign", V(args[0], kind))
        if op in L.unary:
            e = L.unary[op].format(V(args[0], "f"))
            return e if kind == "f" else L.cast(e, kind)
        if op == "pow":
            ex = args[1][1] if args[1][0] == "const" else None
            w = "f" if kind == "f" else "i"
            e = L.pow(V(args[0], w), V(args[1], w), ex, kind)
            if e is None:
                raise Untraceable(f"{self.what}: integer aten.pow is not supported by the {L.name} code generator")
            return e
        if op in _MINMAX:
            if len(args) != 2:
                raise Untraceable(f"{self.what}: {op} over a dimension is not pointwise")
            return O("min" if op in ("minimum", "min", "fmin") else "max", V(args[0], kind), V(args[1], kind))
        if op in ("clamp", "clamp_min", "clamp_max"):
            x = V(args[0], kind)
            for f, bound in _clamp_bounds(op, args, kw):
                x = O(f, x, V(bound, kind))
            return x
        if op == "where":
            return O("select", V(args[0], "b"), V(args[1], kind), V(args[2], kind))
        if op in _CMP:
            w = self.common(args[0], args[1])
            return f"({V(args[0], w)} {_CMP[op]} {V(args[1], w)})"
        for ops, key, sym in _LOGICAL:
            if op in ops:
                if kind == "b" or op.startswith("logical"):
                    return O(key, V(args[0], "b"), V(args[1], "b"))
                return f"({V(args[0], 'i')} {sym} {V(args[1], 'i')})"
        if op in ("logical_not", "bitwise_not"):
            return O("not_b", V(args[0], "b")) if kind == "b" or op == "logical_not" else f"(~{V(args[0], 'i')})"
        if op in ("scalar_tensor", "full", "full_like"):
            return O("scalar", V(args[-1] if op == "full" else (args[1] if op == "full_like" else args[0]), kind))
        if op in ("zeros_like", "zeros", "new_zeros"):
            return O("const", "0")
        if op in ("ones_like", "ones", "new_ones"):
            return O("const", "1")
        raise Untraceable(f"{self.what}: op aten.{op} is not supported by the {L.name} code generator")

    def forward_lines(self) -> List[str]:
        return [self.L.define(f"v_{name}", self.expr(name, op, spec), kind) for name, op, spec, kind in self.t.nodes]

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

    def grad_loads(self, want_caps: List[bool]) -> List[str]:
        """The load nodes whose adjoint feeds a wanted capture gradient, in graph order."""
        act = self.active(want_caps)
        return [name for name, op, _, _ in self.t.nodes if op == "load" and name in act]

    def backward_lines(self, want_caps: List[bool]) -> List[str]:
        """Reverse mode: from ``g`` (the gradient at the output) to ``g_<score>``, each node's
        adjoint ``g_<name>`` the sum over its uses; the loads of a wanted capture scatter theirs."""
        act = self.active(want_caps)
        loads = self.grad_loads(want_caps)
        score, out, L = self.t.inputs[0], self.t.output, self.L
        lines = [L.stmt("zero", f"g_{n}") for n in [score] + [n for n, _, _, k in self.t.nodes if n in act]]
        if out in act:
            lines.append(L.stmt("assign", f"g_{out}", "g"))
        for name, op, spec, kind in reversed(self.t.nodes):
            if name not in act:
                continue
            if op == "load":
                cap, idx = spec
                lines += L.scatter(loads.index(name), cap, self.flat_index(cap, idx), f"g_{name}")
                continue
            lines += [L.stmt("acc", f"g_{a}", e) for a, e in self._adjoint(name, op, spec, act)]
        return lines

    def _adjoint(self, name, op, spec, act) -> List[Tuple[str, str]]:
        """(input, term) pairs: ``term`` is added to the adjoint of ``input``."""
        L = self.L
        g, y = f"g_{name}", f"v_{name}"
        args, kw, _ = spec
        V = lambda a: self.val(a, "f")  # noqa: E731
        F = L.float_lit
        zero = F("0.")

        def acc(a, expr):
            return [(a[1], expr)] if a[0] == "node" and a[1] in act else []

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
            return acc(args[0], f"{g} * {L.op('fsign', V(args[0]))}")
        if op == "relu":
            return acc(args[0], L.op("select", f"{y} > {zero}", g, zero))
        x = V(args[0])
        ln2 = F("0.6931471805599453")
        d = {
            "exp": f"{g} * {y}", "exp2": f"{g} * {y} * {ln2}",
            "log": f"{g} / {x}", "log2": f"{g} / ({x} * {ln2})",
            "log1p": f"{g} / ({F('1.')} + {x})", "expm1": f"{g} * ({y} + {F('1.')})",
            "sqrt": f"{g} * {F('0.5')} / {y}", "rsqrt": f"-{F('0.5')} * {g} * {y} * {y} * {y}",
            "sin": f"{g} * {L.unary['cos'].format(x)}", "cos": f"-{g} * {L.unary['sin'].format(x)}",
            "tanh": f"{g} * ({F('1.')} - {y} * {y})", "sigmoid": f"{g} * {y} * ({F('1.')} - {y})",
            "erf": f"{g} * {F('1.1283791670955126')} * {L.unary['exp'].format(f'-{x} * {x}')}",
            "reciprocal": f"-{g} * {y} * {y}",
        }
        if op in d:
            return acc(args[0], d[op])
        if op == "pow":
            b = V(args[1])
            ex = args[1][1] if args[1][0] == "const" else None
            return (acc(args[0], f"{g} * {L.pow_base_grad(x, b, ex)}")
                    + acc(args[1], f"{g} * {y} * {L.unary['log'].format(x)}"))
        if op in _MINMAX:
            a, b = V(args[0]), V(args[1])
            first = f"({a} < {b})" if op in ("minimum", "min", "fmin") else f"({a} > {b})"
            half = f"{F('0.5')} * {g}"
            # Ties split the gradient evenly, as torch's derivative of minimum/maximum does.
            return (acc(args[0], L.op("select", first, g, L.op("select", f"{a} == {b}", half, zero)))
                    + acc(args[1], L.op("select", first, zero, L.op("select", f"{a} == {b}", half, g))))
        if op in ("clamp", "clamp_min", "clamp_max"):
            conds = [f"{x} {'>=' if f == 'max' else '<='} {V(bound)}" for f, bound in _clamp_bounds(op, args, kw)]
            return acc(args[0], L.op("select", L.all_of(conds), g, zero))
        if op == "where":
            c = self.val(args[0], "b")
            return acc(args[1], L.op("select", c, g, zero)) + acc(args[2], L.op("select", c, zero, g))
        if op in _CONSTANTS:
            return []
        raise Untraceable(f"{self.what}: no derivative for aten.{op} in the {L.name} code generator")


def _node_args(args) -> List[str]:
    out = []
    for a in args:
        if a[0] == "node":
            out.append(a[1])
        elif a[0] == "list":
            out += _node_args(a[1])
    return out


def cpp(score: Optional[Traced], mask: Optional[Traced], want_caps: List[bool], name: str) -> str:
    """The C++ of one modifier pair, as the struct ``name`` that csrc/flex/flex_kernel.cpp's
    loops take as their ``Mod``: ``kHasScoreMod``, ``kHasCapGrad``, ``score_fwd``,
    ``score_bwd<kCapGrad>`` and ``mask_fn``. Captures are numbered score_mod's first, then
    mask_mod's (:func:`merge_captures` renumbers ``mask``)."""
    out = [f"struct {name} {{"]
    sig = "int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, const Caps& c"
    if score is None:
        out += ["static constexpr bool kHasScoreMod = false;", "static constexpr bool kHasCapGrad = false;",
                f"static inline float score_fwd(float s, {sig}) {{ return s; }}",
                "template <bool kCapGrad>",
                f"static inline float score_bwd(float s, {sig}, float g, float* const* gcap) {{ return g; }}"]
    else:
        e = Emitter(score, "score_mod")
        names = score.inputs
        bind = (f"  const float v_{names[0]} = s; const int64_t v_{names[1]} = b, v_{names[2]} = h, "
                f"v_{names[3]} = q_idx, v_{names[4]} = kv_idx;")
        fwd = e.forward_lines()
        bwd = e.backward_lines(want_caps)
        has_cap_grad = any(want_caps[i] for i in range(len(want_caps)) if i < len(score.captures))
        out += ["static constexpr bool kHasScoreMod = true;",
                f"static constexpr bool kHasCapGrad = {'true' if has_cap_grad else 'false'};",
                f"static inline float score_fwd(float s, {sig}) {{", bind, *fwd,
                f"  return static_cast<float>(v_{score.output});", "}",
                "template <bool kCapGrad>",
                f"static inline float score_bwd(float s, {sig}, float g, float* const* gcap) {{", bind, *fwd, *bwd,
                f"  return g_{names[0]};", "}"]
    if mask is None:
        out.append(f"static inline bool mask_fn({sig}) {{ return true; }}")
    else:
        e = Emitter(mask, "mask_mod")
        names = mask.inputs
        out += [f"static inline bool mask_fn({sig}) {{",
                f"  const int64_t v_{names[0]} = b, v_{names[1]} = h, v_{names[2]} = q_idx, v_{names[3]} = kv_idx;",
                *e.forward_lines(), f"  return static_cast<bool>(v_{mask.output});", "}"]
    return "\n".join(out) + "\n};\n"


def merge_captures(score: Optional[Traced], mask: Optional[Traced]) -> List[Tensor]:
    """One numbering of the captured tensors of both modifiers (score_mod's first); renumbers
    ``mask``'s references in place. Returns the captures in that order."""
    caps: List[Tensor] = list(score.captures) if score is not None else []
    if mask is not None:
        remap = {}
        for i, t in enumerate(mask.captures):
            for j, u in enumerate(caps):
                if u is t:
                    remap[i] = j
                    break
            else:
                remap[i] = len(caps)
                caps.append(t)
        mask.captures = caps
        mask.nodes = [(n, op, (remap[spec[0]], spec[1]) if op == "load" else spec, k) for n, op, spec, k in mask.nodes]
    return caps


def reads(t: Traced) -> List[bool]:
    """Per input of ``t`` (in order: score_mod's score, b, h, q_idx, kv_idx; mask_mod's b, h,
    q_idx, kv_idx) whether the graph reads it: the cpu kernel evaluates a mask that reads
    neither b nor h once for all batch elements and heads."""
    used = {t.output}
    for _name, op, spec, _kind in t.nodes:
        if op == "load":
            used.update(_node_args(spec[1]))
        else:
            args, kw, _ = spec
            used.update(_node_args(args) + _node_args(tuple(kw.values())))
    return [n in used for n in t.inputs]


def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]
