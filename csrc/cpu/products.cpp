// The memorization trainer's dense products (mhakern/memorize/products.py) on the cpu kernels'
// micro-kernel (kernel/dense.h): the folded query weights A_h = W_Q,h W_K,h^T and their
// gradients (fold_heads, fold_heads_backward: one chain over the contraction), and any batched
// product, with a bias row added as each tile is made (dense_bmm: the token embeddings
// x W_E + (b_E + pe), the decoder, every weight gradient; the contraction in blocks, kc).
//
// Those chains and blocks are how ATen's products (MKL) sum on the hosts measured, but they are a
// property of the BLAS and the CPU: the caller compares the bits with the ATen call it replaces,
// once per shape, layout and process, and keeps the ATen call where they differ.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "attention_cpu.h"
#include "attention_params.h"

namespace mhakern::cpu {
namespace {

void check_float_cpu(const at::Tensor& t, const char* op, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name,
                    " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must have ", dim, " dims, got shape ", t.sizes());
}

struct FoldSizes {
  int64_t R, d, H, e, f;
};

// wq (R, d, H, e), wk (R, H, f, e): their sizes after the checks of `op`.
FoldSizes fold_sizes(const at::Tensor& wq, const at::Tensor& wk, const char* op) {
  check_float_cpu(wq, op, "wq", 4);
  check_float_cpu(wk, op, "wk", 4);
  const int64_t R = wq.size(0), d = wq.size(1), H = wq.size(2), e = wq.size(3), f = wk.size(2);
  TORCH_CHECK_VALUE(wk.size(0) == R && wk.size(1) == H && wk.size(3) == e, op,
                    ": wk must be (R, H, f, e) for wq (R, d, H, e) = ", wq.sizes(), ", got ", wk.sizes());
  return {R, d, H, e, f};
}

// A (R, d, H * f): A[r, i, h * f + j] = sum_c wq[r, i, h, c] wk[r, h, j, c].
at::Tensor fold_heads(const at::Tensor& wq_in, const at::Tensor& wk_in) {
  const FoldSizes z = fold_sizes(wq_in, wk_in, "fold_heads");
  const int64_t R = z.R, d = z.d, H = z.H, e = z.e, f = z.f;
  const at::Tensor wq = wq_in.contiguous(), wk = wk_in.contiguous();
  at::Tensor out = at::empty({R, d, H * f}, wq.options());
  const float* q = wq.const_data_ptr<float>();
  const float* k = wk.const_data_ptr<float>();
  float* a = out.data_ptr<float>();
  at::parallel_for(0, R * H, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / H, h = t % H;
      DenseProduct p;
      p.M = d, p.N = f, p.K = e;
      p.A = q + r * d * H * e + h * e, p.ars = H * e, p.acs = 1;
      p.B = k + t * f * e, p.brs = 1, p.bcs = e;  // B[c, j] = wk[r, h, j, c]
      p.C = a + r * d * H * f + h * f, p.ldc = H * f;
      dense_product(p);
    }
  });
  return out;
}

// The gradients of fold_heads from grad (R, d, H * f): (dwq, dwk), shaped as wq and wk.
std::tuple<at::Tensor, at::Tensor> fold_heads_backward(const at::Tensor& grad_in, const at::Tensor& wq_in,
                                                       const at::Tensor& wk_in) {
  const FoldSizes z = fold_sizes(wq_in, wk_in, "fold_heads_backward");
  const int64_t R = z.R, d = z.d, H = z.H, e = z.e, f = z.f;
  check_float_cpu(grad_in, "fold_heads_backward", "grad", 3);
  TORCH_CHECK_VALUE(grad_in.size(0) == R && grad_in.size(1) == d && grad_in.size(2) == H * f,
                    "fold_heads_backward: grad must be (R, d, H * f) = (", R, ", ", d, ", ", H * f, "), got ",
                    grad_in.sizes());
  const at::Tensor g = grad_in.contiguous(), wq = wq_in.contiguous(), wk = wk_in.contiguous();
  at::Tensor dwq = at::empty({R, d, H, e}, wq.options()), dwk = at::empty({R, H, f, e}, wq.options());
  const float* gp = g.const_data_ptr<float>();
  const float* q = wq.const_data_ptr<float>();
  const float* k = wk.const_data_ptr<float>();
  float* dq = dwq.data_ptr<float>();
  float* dk = dwk.data_ptr<float>();
  at::parallel_for(0, R * H, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / H, h = t % H;
      const float* gh = gp + r * d * H * f + h * f;  // G_h[i, j] = grad[r, i, h * f + j]
      DenseProduct p;                                   // dwq[r, :, h, :] = G_h wk[r, h]
      p.M = d, p.N = e, p.K = f;
      p.A = gh, p.ars = H * f, p.acs = 1;
      p.B = k + t * f * e, p.brs = e, p.bcs = 1;
      p.C = dq + r * d * H * e + h * e, p.ldc = H * e;
      dense_product(p);
      DenseProduct s;                                   // dwk[r, h] = G_h^T wq[r, :, h, :]
      s.M = f, s.N = e, s.K = d;
      s.A = gh, s.ars = 1, s.acs = H * f;
      s.B = q + r * d * H * e + h * e, s.brs = H * e, s.bcs = 1;
      s.C = dk + t * f * e, s.ldc = e;
      dense_product(s);
    }
  });
  return {dwq, dwk};
}

// Rows of the output per parallel task of dense_bmm.
constexpr int64_t kTaskRows = 384;

// (R, M, N): out[r] = a[r] b[r] (+ bias[r, m % P] on row m) for a (R, M, K), b (R, K, N) of any
// strides and bias (R, P, N); k split as DenseProduct::kc says.
at::Tensor dense_bmm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias_in,
                     int64_t kc) {
  check_float_cpu(a, "dense_bmm", "a", 3);
  check_float_cpu(b, "dense_bmm", "b", 3);
  const int64_t R = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  TORCH_CHECK_VALUE(b.size(0) == R && b.size(1) == K, "dense_bmm: b must be (R, K, N) for a (R, M, K) = ", a.sizes(),
                    ", got ", b.sizes());
  TORCH_CHECK_VALUE(kc >= 0, "dense_bmm: kc must be >= 0, got ", kc);
  at::Tensor bias;
  int64_t P = 1;
  if (bias_in.has_value()) {
    check_float_cpu(*bias_in, "dense_bmm", "bias", 3);
    P = bias_in->size(1);
    TORCH_CHECK_VALUE(bias_in->size(0) == R && bias_in->size(2) == N && P > 0, "dense_bmm: bias must be (R, P, N) with ",
                      "P >= 1 for a (R, M, K) and b (R, K, N) = ", b.sizes(), ", got ", bias_in->sizes());
    bias = bias_in->contiguous();
  }
  at::Tensor out = at::empty({R, M, N}, a.options());
  if (out.numel() == 0) return out;
  const float* ap = a.const_data_ptr<float>();
  const float* bp = b.const_data_ptr<float>();
  const float* biasp = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t chunks = (M + kTaskRows - 1) / kTaskRows;
  at::parallel_for(0, R * chunks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / chunks, m0 = (t % chunks) * kTaskRows;
      DenseProduct p;
      p.M = std::min(kTaskRows, M - m0), p.N = N, p.K = K, p.kc = kc;
      p.A = ap + r * a.stride(0) + m0 * a.stride(1), p.ars = a.stride(1), p.acs = a.stride(2);
      p.B = bp + r * b.stride(0), p.brs = b.stride(1), p.bcs = b.stride(2);
      p.C = op + (r * M + m0) * N, p.ldc = N;
      if (biasp != nullptr) p.bias = biasp + r * P * N, p.bias_ld = N, p.period = P, p.row0 = m0;
      dense_product(p);
    }
  });
  return out;
}

}  // namespace
}  // namespace mhakern::cpu

TORCH_LIBRARY_FRAGMENT(mhakern_C, m) {
  m.def("fold_heads(Tensor wq, Tensor wk) -> Tensor", &mhakern::cpu::fold_heads);
  m.def("fold_heads_backward(Tensor grad, Tensor wq, Tensor wk) -> (Tensor, Tensor)",
        &mhakern::cpu::fold_heads_backward);
  m.def("dense_bmm(Tensor a, Tensor b, Tensor? bias, int kc) -> Tensor", &mhakern::cpu::dense_bmm);
}
