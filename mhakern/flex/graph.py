"""Tracing a flex modifier into a pointwise graph, and that graph (with its derivative) into C++.

``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` are traced once
with ``make_fx`` over one-element tensors (a float32 score, int32 indices: torch's own dtypes for
them). One element rather than 0-d, so that ``table[h, q_idx - kv_idx]`` is a gather
(``aten.index.Tensor``) and not a Python integer index; a value read out of a tensor
(``.item()``, ``if score > 0:``) stops the trace, and is refused as data-dependent control flow.
Tensors the modifier captures appear as constants of the graph (the same tensor objects), so
their gradient can be asked for.

:func:`trace` returns a :class:`Traced` (the nodes in order, the captures, a readable reason when
the graph cannot be compiled); :func:`cpp` writes it as the C++ the kernel template
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


_UNARY_F = {
    "exp": "std::exp({0})", "exp2": "std::exp2({0})", "log": "std::log({0})", "log2": "std::log2({0})",
    "log1p": "std::log1p({0})", "expm1": "std::expm1({0})", "sqrt": "std::sqrt({0})",
    "rsqrt": "(1.f / std::sqrt({0}))", "sin": "std::sin({0})", "cos": "std::cos({0})", "tanh": "std::tanh({0})",
    "sigmoid": "(1.f / (1.f + std::exp(-({0}))))", "erf": "std::erf({0})", "floor": "std::floor({0})",
    "ceil": "std::ceil({0})", "round": "std::nearbyint({0})", "trunc": "std::trunc({0})",
    "reciprocal": "(1.f / ({0}))",
}
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


def _dummy_inputs(with_score: bool) -> List[Tensor]:
    idx = [torch.zeros(1, dtype=torch.int32) for _ in range(4)]
    return ([torch.zeros(1, dtype=torch.float32)] if with_score else []) + idx


def trace(fn: Callable, is_score: bool) -> Traced:
    """Traces ``fn`` (a score_mod when ``is_score``, else a mask_mod). Raises Untraceable."""
    from torch.fx.experimental.proxy_tensor import make_fx

    what = "score_mod" if is_score else "mask_mod"
    try:
        gm = make_fx(fn)(*_dummy_inputs(is_score))
    except RuntimeError as e:
        text = str(e)
        if "data-dependent" in text or "_local_scalar_dense" in text:
            raise Untraceable(f"{what} reads a value out of a tensor (data-dependent control flow or .item()); "
                              "write it with torch.where") from None
        raise Untraceable(f"{what} could not be traced: {text.splitlines()[0] if text else type(e).__name__}") from None
    except Exception as e:  # noqa: BLE001 -- any failure of user code while tracing is the modifier's
        raise Untraceable(f"{what} could not be traced: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
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
# C++ emission.

_CT = {"f": "float", "i": "int64_t", "b": "bool"}


def _lit(v, kind: Optional[str] = None) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int) and kind != "f":
        return f"INT64_C({v})"
    v = float(v)
    if math.isnan(v):
        return "std::numeric_limits<float>::quiet_NaN()"
    if math.isinf(v):
        return ("" if v > 0 else "-") + "std::numeric_limits<float>::infinity()"
    return repr(v) + "f" if ("." in repr(v) or "e" in repr(v)) else repr(v) + ".f"


class _Emitter:
    """Writes the nodes of a Traced as C++ statements; ``kinds`` maps names to "f"/"i"/"b"."""

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
                return f"static_cast<{_CT[want]}>(v_{x})"
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

    def cap_index(self, cap: int, idx_args) -> str:
        """The flat element index of a load: Python's negative indices wrap."""
        tensor = self.t.captures[cap]
        terms = []
        for d, ia in enumerate(idx_args):
            i = self.val(ia, "i")
            stride = " * ".join(f"c.size[{cap * 4 + e}]" for e in range(d + 1, tensor.dim())) or "1"
            terms.append(f"wrap_index({i}, c.size[{cap * 4 + d}]) * {stride}")
        return " + ".join(terms) or "0"

    def expr(self, name: str, op: str, spec) -> str:
        kind = self.kinds[name]
        ct = _CT[kind]
        if op == "load":
            cap, idx = spec
            src = "float" if self.t.captures[cap].dtype.is_floating_point else "int64_t"
            return f"static_cast<{ct}>(static_cast<const {src}*>(c.ptr[{cap}])[{self.cap_index(cap, idx)}])"
        args, kw, overload = spec
        V = self.val
        if op in _IDENTITY:
            return V(args[0], kind)
        if op in ("_to_copy", "to", "_to_dtype", "type_as", "_autocast_to_reduced_precision", "convert_element_type"):
            return V(args[0], kind)
        if op in ("add", "sub", "rsub"):
            alpha = kw.get("alpha", args[2] if len(args) > 2 else ("const", 1))
            a, b = (args[1], args[0]) if op == "rsub" else (args[0], args[1])
            w = kind
            sgn = "-" if op != "add" else "+"
            al = "" if alpha == ("const", 1) else f"{V(alpha, w)} * "
            return f"({V(a, w)} {sgn} {al}{V(b, w)})"
        if op == "mul":
            return f"({V(args[0], kind)} * {V(args[1], kind)})" if kind != "b" else f"({V(args[0], 'b')} && {V(args[1], 'b')})"
        if op == "div":
            mode = kw.get("rounding_mode", ("const", None))[1]
            if mode is None:
                return f"({V(args[0], 'f')} / {V(args[1], 'f')})"
            if kind == "i":
                a, b = V(args[0], "i"), V(args[1], "i")
                return f"py_floordiv({a}, {b})" if mode == "floor" else f"({a} / {b})"
            a, b = V(args[0], "f"), V(args[1], "f")
            return f"std::{'floor' if mode == 'floor' else 'trunc'}({a} / {b})"
        if op == "floor_divide":
            if kind == "i":
                return f"py_floordiv({V(args[0], 'i')}, {V(args[1], 'i')})"
            return f"std::floor({V(args[0], 'f')} / {V(args[1], 'f')})"
        if op == "remainder":
            if kind == "i":
                return f"py_mod({V(args[0], 'i')}, {V(args[1], 'i')})"
            return f"py_fmod({V(args[0], 'f')}, {V(args[1], 'f')})"
        if op == "fmod":
            if kind == "i":
                return f"({V(args[0], 'i')} % {V(args[1], 'i')})"
            return f"std::fmod({V(args[0], 'f')}, {V(args[1], 'f')})"
        if op == "neg":
            return f"(-{V(args[0], kind)})"
        if op == "abs":
            return f"std::abs({V(args[0], kind)})"
        if op == "sign" or op == "sgn":
            return f"static_cast<{ct}>(({V(args[0], kind)} > 0) - ({V(args[0], kind)} < 0))"
        if op == "relu":
            return f"std::max<{ct}>({V(args[0], kind)}, 0)"
        if op in _UNARY_F:
            if kind != "f":
                return f"static_cast<{ct}>({_UNARY_F[op].format(V(args[0], 'f'))})"
            return _UNARY_F[op].format(V(args[0], "f"))
        if op == "pow":
            return f"std::pow({V(args[0], 'f')}, {V(args[1], 'f')})" if kind == "f" else \
                f"static_cast<int64_t>(std::pow(double({V(args[0], 'i')}), double({V(args[1], 'i')})))"
        if op in ("minimum", "maximum", "min", "max", "fmin", "fmax"):
            if len(args) != 2:
                raise Untraceable(f"{self.what}: {op} over a dimension is not pointwise")
            f = "min" if op in ("minimum", "min", "fmin") else "max"
            return f"std::{f}<{ct}>({V(args[0], kind)}, {V(args[1], kind)})"
        if op in ("clamp", "clamp_min", "clamp_max"):
            lo = kw.get("min", args[1] if len(args) > 1 and op != "clamp_max" else ("const", None))
            hi = kw.get("max", args[2] if len(args) > 2 else (args[1] if op == "clamp_max" else ("const", None)))
            x = V(args[0], kind)
            if lo[1] is not None or lo[0] == "node":
                x = f"std::max<{ct}>({x}, {V(lo, kind)})"
            if hi[1] is not None or hi[0] == "node":
                x = f"std::min<{ct}>({x}, {V(hi, kind)})"
            return x
        if op == "where":
            return f"({V(args[0], 'b')} ? {V(args[1], kind)} : {V(args[2], kind)})"
        if op in _CMP:
            w = self.common(args[0], args[1])
            return f"({V(args[0], w)} {_CMP[op]} {V(args[1], w)})"
        if op in ("logical_and", "bitwise_and", "__and__"):
            if kind == "b" or op == "logical_and":
                return f"({V(args[0], 'b')} && {V(args[1], 'b')})"
            return f"({V(args[0], 'i')} & {V(args[1], 'i')})"
        if op in ("logical_or", "bitwise_or", "__or__"):
            if kind == "b" or op == "logical_or":
                return f"({V(args[0], 'b')} || {V(args[1], 'b')})"
            return f"({V(args[0], 'i')} | {V(args[1], 'i')})"
        if op in ("logical_xor", "bitwise_xor", "__xor__"):
            if kind == "b" or op == "logical_xor":
                return f"({V(args[0], 'b')} != {V(args[1], 'b')})"
            return f"({V(args[0], 'i')} ^ {V(args[1], 'i')})"
        if op in ("logical_not", "bitwise_not"):
            return f"(!{V(args[0], 'b')})" if kind == "b" or op == "logical_not" else f"(~{V(args[0], 'i')})"
        if op in ("scalar_tensor", "full"):
            return V(args[-1] if op == "full" else args[0], kind)
        if op in ("zeros_like", "zeros", "new_zeros"):
            return f"static_cast<{ct}>(0)"
        if op in ("ones_like", "ones", "new_ones"):
            return f"static_cast<{ct}>(1)"
        if op == "full_like":
            return V(args[1], kind)
        raise Untraceable(f"{self.what}: op aten.{op} is not supported by the cpu code generator")

    def forward_lines(self) -> List[str]:
        lines = []
        for name, op, spec, kind in self.t.nodes:
            lines.append(f"  const {_CT[kind]} v_{name} = {self.expr(name, op, spec)};")
        return lines

    # Reverse mode: g_<name> is d(output)/d(name), for floating nodes on a path from the score
    # or from a captured tensor whose gradient is wanted.
    def backward_lines(self, want_caps: List[bool]) -> Tuple[List[str], bool]:
        score = self.t.inputs[0]
        active = {score}
        for name, op, spec, kind in self.t.nodes:
            if kind != "f":
                continue
            if op == "load":
                if want_caps[spec[0]]:
                    active.add(name)
                continue
            args, kw, _ = spec
            deps = _node_args(args) + _node_args(tuple(kw.values()))
            if op not in _NO_GRAD and any(d in active for d in deps):
                active.add(name)
        out = self.t.output
        lines = [f"  float g_{n} = 0.f;" for n in [score] + [n for n, _, _, k in self.t.nodes if n in active]]
        if out in active:
            lines.append(f"  g_{out} = g;")
        for name, op, spec, kind in reversed(self.t.nodes):
            if name not in active:
                continue
            lines += self._adjoint(name, op, spec, active)
        return lines, out in active

    def _adjoint(self, name, op, spec, active) -> List[str]:
        g = f"g_{name}"
        if op == "load":
            cap, idx = spec
            return [f"  if (kCapGrad) gcap[{cap}][{self.cap_index(cap, idx)}] += {g};"]
        args, kw, _ = spec
        y = f"v_{name}"  # the node's value
        V = lambda a: self.val(a, "f")  # noqa: E731

        def acc(a, expr):
            if a[0] == "node" and a[1] in active:
                return [f"  g_{a[1]} += {expr};"]
            return []

        if op in _IDENTITY or op in ("_to_copy", "to", "_to_dtype", "type_as", "convert_element_type"):
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
            return acc(args[0], f"{g} * fsign({V(args[0])})")
        if op == "relu":
            return acc(args[0], f"({y} > 0.f ? {g} : 0.f)")
        d = {
            "exp": f"{g} * {y}", "exp2": f"{g} * {y} * 0.6931471805599453f",
            "log": f"{g} / {V(args[0])}", "log2": f"{g} / ({V(args[0])} * 0.6931471805599453f)",
            "log1p": f"{g} / (1.f + {V(args[0])})", "expm1": f"{g} * ({y} + 1.f)",
            "sqrt": f"{g} * 0.5f / {y}", "rsqrt": f"-0.5f * {g} * {y} * {y} * {y}",
            "sin": f"{g} * std::cos({V(args[0])})", "cos": f"-{g} * std::sin({V(args[0])})",
            "tanh": f"{g} * (1.f - {y} * {y})", "sigmoid": f"{g} * {y} * (1.f - {y})",
            "erf": f"{g} * 1.1283791670955126f * std::exp(-{V(args[0])} * {V(args[0])})",
            "reciprocal": f"-{g} * {y} * {y}",
        }
        if op in d:
            return acc(args[0], d[op])
        if op == "pow":
            return (acc(args[0], f"{g} * {V(args[1])} * std::pow({V(args[0])}, {V(args[1])} - 1.f)")
                    + acc(args[1], f"{g} * {y} * std::log({V(args[0])})"))
        if op in ("minimum", "maximum", "min", "max", "fmin", "fmax"):
            a, b = V(args[0]), V(args[1])
            first = f"({a} < {b})" if op in ("minimum", "min", "fmin") else f"({a} > {b})"
            # Ties split the gradient evenly, as torch's derivative of minimum/maximum does.
            return (acc(args[0], f"({first} ? {g} : ({a} == {b} ? 0.5f * {g} : 0.f))")
                    + acc(args[1], f"({first} ? 0.f : ({a} == {b} ? 0.5f * {g} : {g}))"))
        if op in ("clamp", "clamp_min", "clamp_max"):
            x = V(args[0])
            lo = kw.get("min", args[1] if len(args) > 1 and op != "clamp_max" else ("const", None))
            hi = kw.get("max", args[2] if len(args) > 2 else (args[1] if op == "clamp_max" else ("const", None)))
            cond = ["true"]
            if lo[1] is not None or lo[0] == "node":
                cond.append(f"{x} >= {V(lo)}")
            if hi[1] is not None or hi[0] == "node":
                cond.append(f"{x} <= {V(hi)}")
            return acc(args[0], f"(({' && '.join(cond)}) ? {g} : 0.f)")
        if op == "where":
            c = self.val(args[0], "b")
            return acc(args[1], f"({c} ? {g} : 0.f)") + acc(args[2], f"({c} ? 0.f : {g})")
        if op in ("scalar_tensor", "full", "full_like", "zeros_like", "ones_like", "zeros", "ones"):
            return []
        raise Untraceable(f"{self.what}: no derivative for aten.{op} in the cpu code generator")


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
        e = _Emitter(score, "score_mod")
        names = score.inputs
        bind = (f"  const float v_{names[0]} = s; const int64_t v_{names[1]} = b, v_{names[2]} = h, "
                f"v_{names[3]} = q_idx, v_{names[4]} = kv_idx;")
        fwd = e.forward_lines()
        bwd, _ = e.backward_lines(want_caps)
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
        e = _Emitter(mask, "mask_mod")
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


def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]
