// Torch-facing host code of the CUDA attention kernels: see cuda_host.h.
//
// The kernels (csrc/cuda/*.cu) see no torch type: this file checks the tensors, fills the plain
// parameter structs (pointers, strides in elements, sizes), allocates the split-K workspaces
// through torch's caching allocator, and launches on torch's current stream of the tensors'
// device.
#include "cuda_host.h"

// Light torch headers (not torch/extension.h): this file needs tensors, the stream and the
// pybind11 casters only, and compiles in a third of the time.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "cuda/attn_dispatch.h"

namespace mhakern {
namespace cuda {
namespace {

// Limits of the kernels' index arithmetic: rows of a KV-head group (H / Hkv * Lq) and key
// positions are 32-bit ints, with room for a key block past the end.
constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxKeys = int64_t{1} << 30;

ElemType elem_type_of(const at::Tensor& q) {
  if (q.scalar_type() == at::kHalf) return ElemType::kFloat16;
  if (q.scalar_type() == at::kBFloat16) return ElemType::kBFloat16;
  TORCH_CHECK_TYPE(false, "q: the cuda backend takes float16 or bfloat16 tensors, got ", q.scalar_type(),
                   " (float32 is served by the triton and reference backends)");
  return ElemType::kFloat16;
}

HeadStrides strides_of(const at::Tensor& x) {
  HeadStrides s;
  s.batch = x.stride(0);
  s.head = x.stride(1);
  s.row = x.stride(2);
  return s;
}

// A (B, H, L, D) tensor the kernels can read or write as it is: on q's device, q's dtype, unit
// stride on D, 16-byte aligned rows (cp.async and the 16-byte stores move 8 elements at a time).
void check_heads(const at::Tensor& x, const char* name, const at::Tensor& q, int64_t B, int64_t H, int64_t L,
                 int64_t D) {
  TORCH_CHECK_VALUE(x.defined(), name, ": expected a tensor, got None");
  TORCH_CHECK_VALUE(x.is_cuda(), name, ": expected a CUDA tensor, got one on ", x.device());
  TORCH_CHECK_VALUE(x.device() == q.device(), name, ": expected a tensor on ", q.device(), " (q's device), got ",
                    x.device());
  TORCH_CHECK_VALUE(x.dim() == 4, name, ": expected 4 dims (batch, heads, length, head_dim), got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.size(0) == B && x.size(1) == H && x.size(2) == L && x.size(3) == D, name, ": expected shape (",
                    B, ", ", H, ", ", L, ", ", D, "), got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == q.scalar_type(), name, ": expected dtype ", q.scalar_type(), " (q's), got ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(x.stride(3) == 1, name, ": expected unit stride on the head dim, got strides ", x.strides());
  for (int d = 0; d < 3; ++d)
    TORCH_CHECK_VALUE(x.size(d) <= 1 || x.stride(d) % 8 == 0, name,
                      ": strides of dims 0-2 must be multiples of 8 elements (16 bytes), got strides ", x.strides());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, name,
                    ": data must be 16-byte aligned (got a view at an odd offset; pass .contiguous())");
}

void check_lse(const at::Tensor& lse, const char* name, const at::Tensor& q, int64_t B, int64_t H, int64_t Lq) {
  TORCH_CHECK_VALUE(lse.is_cuda() && lse.device() == q.device(), name, ": expected a CUDA tensor on ", q.device(),
                    ", got one on ", lse.device());
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, name, ": expected float32, got ", lse.scalar_type());
  TORCH_CHECK_VALUE(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == Lq, name,
                    ": expected shape (", B, ", ", H, ", ", Lq, "), got ", lse.sizes());
  TORCH_CHECK_VALUE(lse.is_contiguous(), name, ": expected a contiguous tensor");
}

const int32_t* key_lengths_ptr(const c10::optional<at::Tensor>& key_lengths, const at::Tensor& q, int64_t B) {
  if (!key_lengths.has_value() || !key_lengths->defined()) return nullptr;
  const at::Tensor& kl = *key_lengths;
  TORCH_CHECK_VALUE(kl.is_cuda() && kl.device() == q.device(), "key_lengths: expected a CUDA tensor on ", q.device(),
                    ", got one on ", kl.device());
  TORCH_CHECK_TYPE(kl.scalar_type() == at::kInt, "key_lengths: expected int32, got ", kl.scalar_type());
  TORCH_CHECK_VALUE(kl.dim() == 1 && kl.size(0) == B && kl.is_contiguous(),
                    "key_lengths: expected a contiguous tensor of shape (", B, ",), got ", kl.sizes());
  // Values are validated in [0, Lk] by the caller (mhakern.ops), where reading them is free.
  return kl.data_ptr<int32_t>();
}

struct Dims {
  int64_t B, H, Hkv, Lq, Lk, D;
};

Dims check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t num_splits) {
  TORCH_CHECK_VALUE(q.is_cuda(), "q: expected a CUDA tensor, got one on ", q.device());
  TORCH_CHECK_VALUE(q.dim() == 4, "q: expected 4 dims (batch, heads, length, head_dim), got shape ", q.sizes());
  elem_type_of(q);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(k.dim() == 4, "k: expected 4 dims (batch, kv heads, length, head_dim), got shape ", k.sizes());
  const int64_t Hkv = k.size(1), Lk = k.size(2);
  TORCH_CHECK_VALUE(head_dim_supported(static_cast<int>(D)), "q: head dim ", D,
                    " has no compiled cuda kernel (supported: 32, 64, 96, 128)");
  TORCH_CHECK_VALUE(Hkv > 0 && H % Hkv == 0, "k: number of kv heads (", Hkv, ") must divide q's number of heads (", H,
                    ")");
  check_heads(q, "q", q, B, H, Lq, D);
  check_heads(k, "k", q, B, Hkv, Lk, D);
  check_heads(v, "v", q, B, Hkv, Lk, D);
  TORCH_CHECK_VALUE((H / Hkv) * Lq <= kMaxRows, "q: (heads per kv head) x Lq = ", (H / Hkv) * Lq, " exceeds ",
                    kMaxRows);
  TORCH_CHECK_VALUE(Lk < kMaxKeys, "k: length ", Lk, " exceeds the cuda kernels' limit of ", kMaxKeys);
  TORCH_CHECK_VALUE(num_splits >= 1 && num_splits <= 1024, "num_splits: expected 1..1024, got ", num_splits);
  return {B, H, Hkv, Lq, Lk, D};
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse, const c10::optional<at::Tensor>& key_lengths, double scale, bool causal,
              int64_t num_splits) {
  const Dims d = check_qkv(q, k, v, num_splits);
  check_heads(out, "out", q, d.B, d.H, d.Lq, d.D);
  check_lse(lse, "lse", q, d.B, d.H, d.Lq);
  const c10::cuda::CUDAGuard guard(q.device());

  FwdParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.key_lengths = key_lengths_ptr(key_lengths, q, d.B);
  p.q_stride = strides_of(q);
  p.k_stride = strides_of(k);
  p.v_stride = strides_of(v);
  p.o_stride = strides_of(out);
  p.B = static_cast<int>(d.B);
  p.H = static_cast<int>(d.H);
  p.Hkv = static_cast<int>(d.Hkv);
  p.Lq = static_cast<int>(d.Lq);
  p.Lk = static_cast<int>(d.Lk);
  p.D = static_cast<int>(d.D);
  p.group = static_cast<int>(d.H / d.Hkv);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.causal = causal;
  p.num_splits = static_cast<int>(num_splits);
  at::Tensor o_partial, lse_partial;  // kept alive until the kernels are queued (caching allocator)
  if (num_splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    o_partial = at::empty({num_splits, d.B, d.H, d.Lq, d.D}, f32);
    lse_partial = at::empty({num_splits, d.B, d.H, d.Lq}, f32);
    p.o_partial = o_partial.data_ptr<float>();
    p.lse_partial = lse_partial.data_ptr<float>();
  }
  if (d.B == 0 || d.H == 0 || d.Lq == 0) return;
  if (d.Lk == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return;
  }
  check_launch(dispatch_attn_fwd(elem_type_of(q), p.D, p, c10::cuda::getCurrentCUDAStream().stream()), "cuda_attn_fwd");
}

void attn_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
              const at::Tensor& dv, const c10::optional<at::Tensor>& key_lengths, double scale, bool causal,
              int64_t num_splits) {
  const Dims d = check_qkv(q, k, v, num_splits);
  check_heads(dout, "dout", q, d.B, d.H, d.Lq, d.D);
  check_heads(out, "out", q, d.B, d.H, d.Lq, d.D);
  check_lse(lse, "lse", q, d.B, d.H, d.Lq);
  check_heads(dq, "dq", q, d.B, d.H, d.Lq, d.D);
  check_heads(dk, "dk", q, d.B, d.Hkv, d.Lk, d.D);
  check_heads(dv, "dv", q, d.B, d.Hkv, d.Lk, d.D);
  const c10::cuda::CUDAGuard guard(q.device());

  BwdParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.key_lengths = key_lengths_ptr(key_lengths, q, d.B);
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.q_stride = strides_of(q);
  p.k_stride = strides_of(k);
  p.v_stride = strides_of(v);
  p.o_stride = strides_of(out);
  p.do_stride = strides_of(dout);
  p.dq_stride = strides_of(dq);
  p.dk_stride = strides_of(dk);
  p.dv_stride = strides_of(dv);
  p.B = static_cast<int>(d.B);
  p.H = static_cast<int>(d.H);
  p.Hkv = static_cast<int>(d.Hkv);
  p.Lq = static_cast<int>(d.Lq);
  p.Lk = static_cast<int>(d.Lk);
  p.D = static_cast<int>(d.D);
  p.group = static_cast<int>(d.H / d.Hkv);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.causal = causal;
  p.num_splits = static_cast<int>(num_splits);
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor delta = at::empty({d.B, d.H, d.Lq}, f32);
  p.delta = delta.data_ptr<float>();
  at::Tensor dq_partial;
  if (num_splits > 1) {
    dq_partial = at::empty({num_splits, d.B, d.H, d.Lq, d.D}, f32);
    p.dq_partial = dq_partial.data_ptr<float>();
  }
  if (d.B == 0 || d.H == 0 || d.Lq == 0 || d.Lk == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return;
  }
  check_launch(dispatch_attn_bwd(elem_type_of(q), p.D, p, c10::cuda::getCurrentCUDAStream().stream()), "cuda_attn_bwd");
}

}  // namespace

void register_ops(pybind11::module& m) {
  namespace py = pybind11;
  m.def("cuda_attn_fwd", &attn_fwd,
        "Fused attention forward on tensor cores (fp16/bf16, sm_80+). Writes out (B, H, Lq, D) and "
        "lse (B, H, Lq) float32; q (B, H, Lq, D), k and v (B, Hkv, Lk, D); key_lengths int32 (B,) or None; "
        "num_splits > 1 splits the keys (combined through their lse).",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("key_lengths"),
        py::arg("scale"), py::arg("causal"), py::arg("num_splits") = 1);
  m.def("cuda_attn_bwd", &attn_bwd,
        "Fused attention backward on tensor cores, deterministic. Writes dq, dk, dv (dk, dv summed over "
        "the query heads of each kv head); num_splits > 1 splits the keys of the dq pass.",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"),
        py::arg("dk"), py::arg("dv"), py::arg("key_lengths"), py::arg("scale"), py::arg("causal"),
        py::arg("num_splits") = 1);
  m.def(
      "cuda_head_dims", [] { return std::vector<int>(std::begin(kHeadDims), std::end(kHeadDims)); },
      "Head dims with compiled cuda kernels.");
}

}  // namespace cuda
}  // namespace mhakern
