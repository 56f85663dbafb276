"""The trainer's dense products on the extension's micro-kernel (``mhakern.memorize.products``,
csrc/cpu/products.cpp): each op against a float64 reference over awkward shapes, its checks, and
the contract that lets the trainer use them: where a shape's bits agree with the ATen composite
the trainer trains bit for bit as with the composite, and where they do not it keeps the
composite. Tiny shapes, one thread: a few seconds.
"""
import contextlib

import pytest
import torch

from mhakern import _extension
from mhakern.memorize import products as Pr
from mhakern.memorize import train as T
from mhakern.memorize.config import RunConfig

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),  # tests/conftest.py
    pytest.mark.skipif(_extension.load() is None or not hasattr(torch.ops.mhakern_C, "dense_bmm"),
                       reason="mhakern._C with the trainer's products is not built"),
]


def _ops():
    return torch.ops.mhakern_C


def _close(got, want):
    # fp32 products of length <= 70 against float64: a few ulps of the sum of magnitudes
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("R,d,H,e,f", [(1, 64, 20, 64, 64), (2, 5, 3, 7, 9), (3, 17, 1, 33, 16), (1, 8, 2, 0, 8)])
def test_fold_heads_against_float64(R, d, H, e, f):
    g = torch.Generator().manual_seed(R * 1000 + d)
    wq, wk = torch.randn(R, d, H, e, generator=g), torch.randn(R, H, f, e, generator=g)
    grad = torch.randn(R, d, H * f, generator=g)
    want = torch.einsum("rdhe,rhfe->rdhf", wq.double(), wk.double()).reshape(R, d, H * f)
    _close(_ops().fold_heads(wq, wk), want)
    gd = grad.double().view(R, d, H, f)
    dq, dk = _ops().fold_heads_backward(grad, wq, wk)
    _close(dq, torch.einsum("rdhf,rhfe->rdhe", gd, wk.double()))
    _close(dk, torch.einsum("rdhf,rdhe->rhfe", gd, wq.double()))
    # strided inputs give the same numbers as contiguous ones
    wq_t = wq.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(_ops().fold_heads(wq_t, wk), _ops().fold_heads(wq, wk))


@pytest.mark.parametrize("R,M,K,N,P", [(1, 8192, 64, 64, 32), (3, 37, 10, 9, 1), (2, 50, 70, 33, 5), (1, 6, 0, 16, 3),
                                       (2, 0, 8, 8, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_bmm_against_float64(R, M, K, N, P, with_bias):
    g = torch.Generator().manual_seed(M + K)
    x, w = torch.rand(R, M, K, generator=g), torch.randn(R, K, N, generator=g)
    bias = torch.randn(R, P, N, generator=g) if with_bias else None
    want = torch.bmm(x.double(), w.double())
    if with_bias:
        want = want + bias.double()[:, torch.arange(M) % P]
    _close(_ops().dense_bmm(x, w, bias, 0), want)
    # any strides: transposed operands, as the backward passes them
    _close(_ops().dense_bmm(x.transpose(1, 2).contiguous().transpose(1, 2), w.transpose(1, 2).contiguous().transpose(1, 2),
                            bias, 0), want)


@pytest.mark.parametrize("K,blocks", [(100, [100]), (192, [192]), (256, [128, 128]), (384, [192, 192]),
                                      (500, [192, 192, 116]), (1280, [192] * 6 + [128])])
def test_dense_bmm_sums_blocks_of_k_in_order(K, blocks):
    """kc = 192: each block of k one chain from zero, the blocks' sums added in order."""
    g = torch.Generator().manual_seed(K)
    a, b = torch.randn(1, 24, K, generator=g), torch.randn(1, K, 40, generator=g)
    want, k0 = None, 0
    for n in blocks:
        part = _ops().dense_bmm(a[:, :, k0:k0 + n], b[:, k0:k0 + n], None, 0)
        want = part if want is None else want + part
        k0 += n
    assert k0 == K
    assert torch.equal(_ops().dense_bmm(a, b, None, 192), want)
    _close(want, torch.bmm(a.double(), b.double()))


def test_products_name_their_bad_arguments():
    ops, z = _ops(), torch.zeros
    with pytest.raises(ValueError, match="fold_heads: wq must be a float32 CPU tensor"):
        ops.fold_heads(z(1, 2, 3, 4, dtype=torch.float64), z(1, 3, 2, 4))
    with pytest.raises(ValueError, match=r"fold_heads: wk must be \(R, H, f, e\)"):
        ops.fold_heads(z(1, 2, 3, 4), z(1, 2, 2, 4))
    with pytest.raises(ValueError, match="fold_heads_backward: grad must have 3 dims"):
        ops.fold_heads_backward(z(1, 2, 6, 1), z(1, 2, 3, 4), z(1, 3, 2, 4))
    with pytest.raises(ValueError, match=r"fold_heads_backward: grad must be \(R, d, H \* f\)"):
        ops.fold_heads_backward(z(1, 2, 5), z(1, 2, 3, 4), z(1, 3, 2, 4))
    with pytest.raises(ValueError, match="dense_bmm: a must have 3 dims"):
        ops.dense_bmm(z(2, 3), z(1, 3, 4), None, 0)
    with pytest.raises(ValueError, match=r"dense_bmm: b must be \(R, K, N\)"):
        ops.dense_bmm(z(1, 2, 3), z(1, 4, 4), None, 0)
    with pytest.raises(ValueError, match=r"dense_bmm: bias must be \(R, P, N\)"):
        ops.dense_bmm(z(1, 2, 3), z(1, 3, 4), z(1, 2, 5), 0)
    with pytest.raises(ValueError, match="dense_bmm: kc must be >= 0"):
        ops.dense_bmm(z(1, 2, 3), z(1, 3, 4), None, -1)


STACKS = [
    # the fold order (d_h = d), R 1 and 3: fold, the folded queries' bmm and both embeddings
    [RunConfig(heads=4, context=8, d_model=32, T=60, batch=16, steps=6, eval_every=10**6, seed=s) for s in (0,)],
    [RunConfig(heads=4, context=8, d_model=32, T=60, batch=16, steps=6, eval_every=10**6, seed=s) for s in (0, 1, 2)],
    # shared context (embeddings of (R, n, d_in)), regression, d_v = 2, the other query order
    [RunConfig(heads=3, context=6, d_model=16, d_head=4, d_value=2, T=40, batch=8, steps=6, eval_every=10**6,
               task="regress", data="shared", seed=s) for s in (0, 1)],
]


def _train(cfgs, on):
    with contextlib.nullcontext() if on else Pr.disabled():
        st = T._Stack(cfgs, torch.device("cpu"), "rows", 1 << 30)
        eng = T.StepEngine(st)
        eng.run(cfgs[0].steps)
        return [t.detach().clone() for t in st.P.tensors()] + eng.m + eng.v, st.evaluate(list(range(len(cfgs))))


@pytest.mark.parametrize("i", range(len(STACKS)))
def test_trainer_keeps_the_composites_bits(i):
    """Steps with the products train bit for bit as with the ATen composites (weights, Adam
    moments, evaluation)."""
    Pr._AGREES.clear()
    a, ea = _train(STACKS[i], True)
    used = [k[0] for k, v in Pr._AGREES.items() if v is not None]
    b, eb = _train(STACKS[i], False)
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))
    assert ea == eb
    if not used:
        pytest.skip("no shape of this stack gives the composite's bits on this host (the composites ran)")


def test_a_shape_whose_bits_differ_keeps_the_composite(monkeypatch):
    g = torch.Generator().manual_seed(5)
    wq = torch.randn(1, 8, 2, 8, generator=g, requires_grad=True)
    wk = torch.randn(1, 2, 8, 8, generator=g, requires_grad=True)
    x, w = torch.rand(2, 3, 4, 8, generator=g), torch.randn(2, 8, 16, generator=g, requires_grad=True)
    b, pe = torch.randn(2, 16, generator=g, requires_grad=True), torch.randn(4, 16, generator=g)
    monkeypatch.setattr(Pr, "_AGREES", {})
    # Every check answers "the bits differ".
    monkeypatch.setattr(Pr, "_checked", lambda key, check: Pr._AGREES.setdefault(key, None))

    def refuse(*a):
        raise AssertionError("the micro-kernel ran for a shape whose bits differ")

    monkeypatch.setattr(torch.ops.mhakern_C, "dense_bmm", refuse, raising=False)
    monkeypatch.setattr(Pr._Fold, "apply", refuse)
    A = Pr.fold(wq, wk)
    assert torch.equal(A, Pr.fold_reference(wq, wk))
    E = Pr.embed(x, w, b, pe)
    assert torch.equal(E, Pr.embed_reference(x, w, b, pe))
    y = Pr.bmm(x.reshape(2, 12, 8), w)
    gy = torch.autograd.grad(y.sum(), w)[0]
    assert torch.equal(gy, torch.autograd.grad(torch.bmm(x.reshape(2, 12, 8), w).sum(), w)[0])
    assert Pr._AGREES and all(v is None for v in Pr._AGREES.values())
    # float64 takes the composite without a check
    assert torch.equal(Pr.fold(wq.double(), wk.double()), Pr.fold_reference(wq.double(), wk.double()))


def test_the_check_runs_once_per_shape(monkeypatch):
    runs = []
    real = Pr._checked

    def counting(key, check):
        if key not in Pr._AGREES:
            runs.append(key)
        return real(key, check)

    monkeypatch.setattr(Pr, "_checked", counting)
    monkeypatch.setattr(Pr, "_AGREES", {})
    g = torch.Generator().manual_seed(6)
    x, w = torch.rand(1, 5, 4, 8, generator=g), torch.randn(1, 8, 16, generator=g)
    b, pe = torch.randn(1, 16, generator=g), torch.randn(4, 16, generator=g)
    for _ in range(3):
        out = Pr.embed(x, w, b, pe)
    assert len(runs) == 1 and len(Pr._AGREES) == 1
    torch.testing.assert_close(out, Pr.embed_reference(x, w, b, pe), rtol=0, atol=1e-6)
