// What the mhakern_C::fwd / mhakern_C::bwd ops (schemas in csrc/bindings.cpp) check and do the
// same way on every device: the memory-safety checks that hold whoever calls the ops (ranks,
// shapes, strides, dtypes, devices, index ranges: what a kernel would read or write out of
// bounds without them), the optional modes (docs/contract.md), the outputs' allocation, and
// filling the mode fields of a kernel family's parameter struct. The argument checks a user
// meets (finite scale, window sizes, softcap, mask_grad's mask, messages that name every
// combination) are the Python operator layer's (mhakern/checks.py), made before any call
// reaches here; a direct caller who skips them gets the kernels' arithmetic, never a bad read. Header-only, included by the cpu host code
// (cpu/attention_cpu.cpp), the CUDA host code (cuda/cuda_host.cpp) and the meta (fake) kernels
// (bindings.cpp), so the three agree by construction.
//
// Errors are TORCH_CHECK_* (c10::Error subclasses) thrown from inside dispatcher kernels: torch's
// own operator machinery turns them into Python ValueError / TypeError / NotImplementedError /
// RuntimeError, whatever pybind11 this module was built with.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "capabilities.h"
#include "generated/modes.h"

namespace mhakern {
namespace op {

// The optional modes of one call (the C++ side of the call record, mhakern/modes.py). Built from
// the op schemas' flattened arguments in exactly one place, fwd_op / bwd_op below; every host
// function takes this record.
struct ModeArgs {
  // One member per mode that reaches the backends, in record order (mhakern/mode_table.py through
  // generated/modes.h): tensors as pointers to the op's own optionals (nullptr: not given).
#define MHK_MODE_ARG_MEMBER_(name, type, init) type name = init;
  MHK_MODE_ARGS(MHK_MODE_ARG_MEMBER_)
#undef MHK_MODE_ARG_MEMBER_

  bool has_mask() const { return attn_mask != nullptr && attn_mask->has_value() && (*attn_mask)->defined(); }
  const at::Tensor& mask() const { return **attn_mask; }
  bool has_alibi() const {
    return alibi_slopes != nullptr && alibi_slopes->has_value() && (*alibi_slopes)->defined();
  }
  const at::Tensor& alibi() const { return **alibi_slopes; }
  static bool given(const std::optional<at::Tensor>* t) { return t != nullptr && t->has_value() && (*t)->defined(); }
  bool varlen() const { return given(cu_seqlens_q) || given(cu_seqlens_k); }
  bool has_cache_batch_idx() const { return given(cache_batch_idx); }
  bool paged() const { return given(block_table); }
  // K/V rows chosen per batch element: k's batch dim need not be q's.
  bool kv_indexed() const { return has_cache_batch_idx() || paged(); }

  // caps::Feature bits this call needs (each feature's test is the table's).
  unsigned required() const {
    unsigned need = 0;
#define MHK_MODE_REQUIRED_(bit, test) \
  if (test) need |= caps::bit;
    MHK_MODE_FEATURE_TESTS(MHK_MODE_REQUIRED_)
#undef MHK_MODE_REQUIRED_
    return need;
  }
};

// Sizes of one call: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv).
struct Sizes {
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
};

inline const char* op_name(bool backward) { return backward ? "mhakern_C::bwd" : "mhakern_C::fwd"; }

// A (batch, heads, length, head_dim) operand: defined, 4 dims, unit stride on the last dim.
inline void check_rank4(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.defined(), name, ": expected a tensor, got None (an undefined tensor)");
  TORCH_CHECK_VALUE(x.dim() == 4, name, ": expected 4 dims (batch, heads, length, head_dim), got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.size(3) <= 1 || x.stride(3) == 1, name,
                    ": expected unit stride on the last dim (head_dim), got strides ", x.strides());
}

inline void check_same_dtype(const at::Tensor& x, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(x.scalar_type() == q.scalar_type(), name, ": expected dtype ", q.scalar_type(), " (q's), got ",
                   x.scalar_type());
}

inline void check_same_device(const at::Tensor& x, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(x.device() == q.device(), name, ": expected a tensor on ", q.device(), " (q's device), got one on ",
                    x.device());
}

inline void check_shape(const at::Tensor& x, const char* name, at::IntArrayRef want, const char* what) {
  TORCH_CHECK_VALUE(x.sizes() == want, name, ": expected shape ", want, " ", what, ", got ", x.sizes());
}

// q, k, v: ranks, relations between their shapes, one dtype, one device. (`scale` is the
// kernels' arithmetic: a non-finite one gives non-finite outputs, no bad read.)
inline Sizes check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double /*scale*/,
                       const ModeArgs* m = nullptr) {
  check_rank4(q, "q");
  check_rank4(k, "k");
  check_rank4(v, "v");
  check_same_device(k, "k", q);
  check_same_device(v, "v", q);
  check_same_dtype(k, "k", q);
  check_same_dtype(v, "v", q);
  const Sizes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  // With a KV cache's batch index or block table, k's batch dim holds cache rows or pages.
  const bool kv_indexed = m != nullptr && m->kv_indexed();
  TORCH_CHECK_VALUE(kv_indexed || k.size(0) == s.B, "k: expected batch size ", s.B, " (q's), got ", k.size(0));
  TORCH_CHECK_VALUE(k.size(3) == s.D, "k: expected head dim ", s.D, " (q's), got ", k.size(3));
  TORCH_CHECK_VALUE(v.size(0) == k.size(0) && v.size(1) == s.Hkv && v.size(2) == s.Lk,
                    "v: expected (batch, kv heads, length) = (", k.size(0), ", ", s.Hkv, ", ", s.Lk,
                    ") (k's), got shape ", v.sizes());
  TORCH_CHECK_VALUE(s.Hkv > 0 && s.H % s.Hkv == 0, "k: number of kv heads (", s.Hkv,
                    ") must be positive and divide q's number of heads (", s.H, ")");
  return s;
}

// key_lengths: int32 (B,) on q's device. Values in [0, Lk] are checked by the caller where
// reading them is free (on the CPU); the kernels clamp them in any case.
inline void check_key_lengths_meta(const std::optional<at::Tensor>& key_lengths, const at::Tensor& q,
                                   const Sizes& s) {
  if (!key_lengths.has_value() || !key_lengths->defined()) return;
  const at::Tensor& kl = *key_lengths;
  TORCH_CHECK_TYPE(kl.scalar_type() == at::kInt, "key_lengths: expected dtype int32, got ", kl.scalar_type());
  TORCH_CHECK_VALUE(kl.dim() == 1 && kl.size(0) == s.B, "key_lengths: expected shape (", s.B,
                    ",) (one length per batch element), got ", kl.sizes());
  check_same_device(kl, "key_lengths", q);
}

// The host-side values check (a CPU tensor).
inline void check_key_length_values(const int32_t* lens, const Sizes& s) {
  for (int64_t b = 0; b < s.B; ++b)
    TORCH_CHECK_VALUE(lens[b] >= 0 && lens[b] <= s.Lk, "key_lengths: values must lie in [0, Lk=", s.Lk, "], got ",
                      lens[b], " at index ", b);
}

// An int32 index tensor of the modes: defined, int32, `dims` dims, on q's device.
inline void check_index_tensor(const at::Tensor& t, const char* name, int64_t dims, const at::Tensor& q) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, name, ": expected dtype int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dims, name, ": expected ", dims, " dim(s), got shape ", t.sizes());
  check_same_device(t, name, q);
}

// Packed sequences and the KV cache: shapes, dtypes, devices and the combinations a kernel
// cannot index (values are checked where reading them is free: check_packing_values, on the
// CPU). The messages are short: a user's call meets mhakern/checks.py's first.
inline void check_packing_and_cache(const ModeArgs& m, const at::Tensor& q, const Sizes& s, bool backward) {
  if (m.varlen()) {
    TORCH_CHECK_VALUE(ModeArgs::given(m.cu_seqlens_q) && ModeArgs::given(m.cu_seqlens_k),
                      "cu_seqlens_q, cu_seqlens_k: both or neither, got only ",
                      ModeArgs::given(m.cu_seqlens_q) ? "cu_seqlens_q" : "cu_seqlens_k");
    const at::Tensor& cq = **m.cu_seqlens_q;
    const at::Tensor& ck = **m.cu_seqlens_k;
    check_index_tensor(cq, "cu_seqlens_q", 1, q);
    check_index_tensor(ck, "cu_seqlens_k", 1, q);
    TORCH_CHECK_VALUE(cq.numel() >= 1 && cq.numel() == ck.numel(), "cu_seqlens_q, cu_seqlens_k: expected one entry "
                      "more than there are sequences on both sides, got ", cq.numel(), " and ", ck.numel());
    TORCH_CHECK_VALUE(s.B == 1, "q: packed sequences are one batch element of tokens (batch size 1), got ", s.B);
    TORCH_CHECK_VALUE(m.max_seqlen_q >= 0 && m.max_seqlen_q <= s.Lq, "max_seqlen_q: expected a length in [0, ",
                      s.Lq, "] (the query tokens), got ", m.max_seqlen_q);
    TORCH_CHECK_VALUE(m.max_seqlen_k >= 0 && m.max_seqlen_k <= s.Lk, "max_seqlen_k: expected a length in [0, ",
                      s.Lk, "] (the key tokens), got ", m.max_seqlen_k);
    TORCH_CHECK_VALUE(!m.has_mask(), "attn_mask: not with packed sequences (cu_seqlens_q); use causal, a window "
                      "or key padding per sequence instead");
    TORCH_CHECK_VALUE(!m.kv_indexed(), "cache_batch_idx, block_table: not with packed sequences");
  }
  if (m.has_cache_batch_idx()) {
    check_index_tensor(**m.cache_batch_idx, "cache_batch_idx", 1, q);
    TORCH_CHECK_VALUE((*m.cache_batch_idx)->size(0) == s.B, "cache_batch_idx: expected shape (", s.B,
                      ",) (one K/V row per batch element), got ", (*m.cache_batch_idx)->sizes());
    TORCH_CHECK_VALUE(!m.paged(), "cache_batch_idx, block_table: one or the other, got both");
  }
  if (m.paged()) {
    const at::Tensor& bt = **m.block_table;
    check_index_tensor(bt, "block_table", 2, q);
    TORCH_CHECK_VALUE(bt.size(0) == s.B, "block_table: expected (", s.B, ", pages per sequence), got shape ",
                      bt.sizes());
  }
  // The backward kernels index k by q's batch: a cache's rows or pages would be read past.
  TORCH_CHECK_VALUE(!backward || !m.kv_indexed(), "cache_batch_idx, block_table: not in ", op_name(backward));
}

// The key length the kernels see: pages per sequence x page size for a paged cache (k is
// (num_pages, Hkv, page_size, D)), else k's length.
inline int64_t kernel_key_len(const ModeArgs& m, const at::Tensor& k) {
  return m.paged() ? (*m.block_table)->size(1) * k.size(2) : k.size(2);
}

// Values of the packing and cache index tensors, read on the host (CPU tensors): prefix sums from
// 0 to the token count, non-decreasing, each length within its maximum; cache rows and pages in
// range. Kernels of other devices clamp instead (the Python layer checks before the call).
inline void check_packing_values(const ModeArgs& m, const at::Tensor& q, const at::Tensor& k) {
  auto prefix = [](const at::Tensor& cu_t, const char* name, int64_t total, int64_t max_len, const char* max_name) {
    const at::Tensor cu_c = cu_t.contiguous();
    const int32_t* cu = cu_c.const_data_ptr<int32_t>();
    const int64_t n = cu_c.numel() - 1;
    TORCH_CHECK_VALUE(cu[0] == 0, name, ": expected 0 first, got ", cu[0]);
    TORCH_CHECK_VALUE(cu[n] == total, name, ": expected the token count ", total, " last, got ", cu[n]);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK_VALUE(cu[i + 1] >= cu[i], name, ": decreases at index ", i, " (", cu[i], " then ", cu[i + 1], ")");
      TORCH_CHECK_VALUE(cu[i + 1] - cu[i] <= max_len, name, ": sequence ", i, " has ", cu[i + 1] - cu[i], " tokens, more than ",
                        max_name, " = ", max_len);
    }
  };
  auto rows = [](const at::Tensor& t, const char* name, int64_t bound, const char* what) {
    const at::Tensor c = t.contiguous();
    const int32_t* x = c.const_data_ptr<int32_t>();
    for (int64_t i = 0; i < c.numel(); ++i)
      TORCH_CHECK_VALUE(x[i] >= 0 && x[i] < bound, name, ": values must lie in [0, ", bound, ") (", what, "), got ",
                        x[i], " at flat index ", i);
  };
  if (m.varlen()) {
    prefix(**m.cu_seqlens_q, "cu_seqlens_q", q.size(2), m.max_seqlen_q, "max_seqlen_q");
    prefix(**m.cu_seqlens_k, "cu_seqlens_k", k.size(2), m.max_seqlen_k, "max_seqlen_k");
  }
  if (m.has_cache_batch_idx()) rows(**m.cache_batch_idx, "cache_batch_idx", k.size(0), "k's batch rows");
  if (m.paged()) rows(**m.block_table, "block_table", k.size(0), "k's pages");
}

// The modes: the mask's and the slopes' dtype, shape and device, the dropout probability (an
// out-of-range one is an undefined conversion and a division by zero in every kernel), and
// whether the family implements them. Window sizes below -1 count as unbounded in every
// kernel; softcap and mask_grad without a float32 mask are arithmetic (dmask is allocated
// whatever the mask): the Python layer names them.
inline void check_modes(const ModeArgs& m, const at::Tensor& q, const Sizes& s, unsigned family_features,
                        const char* family, bool backward) {
  TORCH_CHECK_VALUE(std::isfinite(m.dropout_p) && m.dropout_p >= 0.0 && m.dropout_p < 1.0,
                    "dropout_p: expected a number in [0, 1), got ", m.dropout_p);
  if (m.has_mask()) {
    const at::Tensor& mk = m.mask();
    TORCH_CHECK_TYPE(mk.scalar_type() == at::kBool || mk.scalar_type() == at::kFloat,
                     "attn_mask: expected dtype bool (True = may attend) or float32 (additive), got ",
                     mk.scalar_type(), " (convert other float dtypes to float32 first)");
    TORCH_CHECK_VALUE(mk.dim() == 4, "attn_mask: expected a 4-D view broadcast to (batch, heads, q length, k length) = (",
                      s.B, ", ", s.H, ", ", s.Lq, ", ", s.Lk, "), got shape ", mk.sizes());
    check_shape(mk, "attn_mask", {s.B, s.H, s.Lq, s.Lk}, "(batch, heads, q length, k length; expand() to broadcast)");
    check_same_device(mk, "attn_mask", q);
  }
  if (m.has_alibi()) {
    const at::Tensor& a = m.alibi();
    TORCH_CHECK_TYPE(a.scalar_type() == at::kFloat, "alibi_slopes: expected dtype float32, got ", a.scalar_type());
    // One slope row per batch element, or per sequence of a packed call.
    const int64_t rows = m.varlen() && ModeArgs::given(m.cu_seqlens_q) ? (*m.cu_seqlens_q)->numel() - 1 : s.B;
    TORCH_CHECK_VALUE(a.dim() == 2, "alibi_slopes: expected a 2-D view (batch or sequences, heads) = (", rows, ", ",
                      s.H, ") (expand() a (heads,) tensor), got shape ", a.sizes());
    check_shape(a, "alibi_slopes", {rows, s.H}, "(batch or sequences, heads; expand() to broadcast)");
    check_same_device(a, "alibi_slopes", q);
  }
  check_packing_and_cache(m, q, s, backward);
  const unsigned missing = m.required() & ~family_features;
  for (int f = 0; f < caps::kNumFeatures; ++f)
    TORCH_CHECK_NOT_IMPLEMENTED(!(missing & (1u << f)), op_name(backward), ": the ", family,
                                " kernels do not implement ", caps::kFeatureNames[f],
                                " (backend features come from torch.ops.mhakern_C.capabilities())");
}

// Fills the mode fields of a parameter struct (cpu AttnParams, cuda FwdParams / BwdParams: the
// same names, docs/contract.md). The mask's storage must outlive the kernel call.
template <typename Params>
void fill_mode_params(Params& p, const ModeArgs& m) {
  // The scalar modes the kernels read as given (the table's copied params).
#define MHK_MODE_COPY_(name, type) p.name = static_cast<type>(m.name);
  MHK_MODE_PARAM_COPIES(MHK_MODE_COPY_)
#undef MHK_MODE_COPY_
  // The modes carried by tensors: pointers, strides, kinds.
  if (m.has_mask()) {
    const at::Tensor& mk = m.mask();
    p.mask = mk.data_ptr();
    p.mask_kind = mk.scalar_type() == at::kBool ? 1 : 2;
    p.mask_sb = mk.stride(0);
    p.mask_sh = mk.stride(1);
    p.mask_sq = mk.stride(2);
    p.mask_sk = mk.stride(3);
  }
  if (m.has_alibi()) {
    const at::Tensor& a = m.alibi();
    p.alibi = a.const_data_ptr<float>();
    p.alibi_sb = a.stride(0);
    p.alibi_sh = a.stride(1);
  }
  // The index tensors must be contiguous (the Python layer makes them so; checked here).
  auto index_ptr = [](const std::optional<at::Tensor>* t, const char* name) -> const int32_t* {
    if (!ModeArgs::given(t)) return nullptr;
    TORCH_CHECK_VALUE((*t)->is_contiguous(), name, ": expected a contiguous tensor");
    return (*t)->const_data_ptr<int32_t>();
  };
  if (m.varlen()) {
    p.cu_seqlens_q = index_ptr(m.cu_seqlens_q, "cu_seqlens_q");
    p.cu_seqlens_k = index_ptr(m.cu_seqlens_k, "cu_seqlens_k");
    p.num_seqs = (*m.cu_seqlens_q)->numel() - 1;
    p.max_seqlen_q = m.max_seqlen_q;
    p.max_seqlen_k = m.max_seqlen_k;
  }
  p.kv_batch_idx = index_ptr(m.cache_batch_idx, "cache_batch_idx");
  if (m.paged()) {
    p.block_table = index_ptr(m.block_table, "block_table");
    p.block_table_stride = (*m.block_table)->stride(0);
  }
}

// The C++ adapter of the call record: the op schemas (csrc/bindings.cpp) pass the modes flattened,
// in this order; these wrappers gather them into a ModeArgs, once, for every device's kernel
// (registered as fwd_op<f> / bwd_op<f>).
using FwdFn = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     double scale, bool causal,
                                                     const std::optional<at::Tensor>& key_lengths, const ModeArgs& m);
using BwdFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> (*)(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths, const ModeArgs& m);

// The mode parameters of an op (MHK_MODE_FWD_PARAMS / MHK_MODE_BWD_PARAMS: the schema's), each
// stored into the ModeArgs m (tensors by address: the op's arguments outlive the call).
#define MHK_MODE_OP_PARAM_(name, type, addr) , type name
#define MHK_MODE_OP_GATHER_(name, type, addr) m.name = addr name;

template <FwdFn F>
std::tuple<at::Tensor, at::Tensor> fwd_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                          bool causal, const std::optional<at::Tensor>& key_lengths
                                          MHK_MODE_FWD_PARAMS(MHK_MODE_OP_PARAM_)) {
  ModeArgs m;
  MHK_MODE_FWD_PARAMS(MHK_MODE_OP_GATHER_)
  return F(q, k, v, scale, causal, key_lengths, m);
}

template <BwdFn F>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_op(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths
    MHK_MODE_BWD_PARAMS(MHK_MODE_OP_PARAM_)) {
  ModeArgs m;
  MHK_MODE_BWD_PARAMS(MHK_MODE_OP_GATHER_)
  return F(dout, q, k, v, out, lse, scale, causal, key_lengths, m);
}
#undef MHK_MODE_OP_PARAM_
#undef MHK_MODE_OP_GATHER_

// The plain-call operators fwd_plain / bwd_plain: the same kernels with the default record
// (ModeArgs{}), for calls without any mode. Their schemas end at key_lengths, so a plain call
// from Python parses six (nine) arguments and fills no defaults: torch's argument parser looks
// every defaulted argument up in the keyword dict by a freshly made name, about 0.1 us each,
// which on the full schemas' fourteen-argument tail was most of the plain call's overhead.
template <FwdFn F>
std::tuple<at::Tensor, at::Tensor> fwd_plain_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double scale, bool causal,
                                                const std::optional<at::Tensor>& key_lengths) {
  return F(q, k, v, scale, causal, key_lengths, ModeArgs{});
}

template <BwdFn F>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_plain_op(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths) {
  return F(dout, q, k, v, out, lse, scale, causal, key_lengths, ModeArgs{});
}

// Registers one device's kernels (forward FWD, backward BWD: FwdFn / BwdFn) under the four
// schemas of csrc/bindings.cpp, inside a TORCH_LIBRARY_IMPL(mhakern_C, <device>, m) block.
#define MHAKERN_IMPL_ATTENTION_OPS(m, FWD, BWD)                 \
  do {                                                          \
    (m).impl("fwd", &::mhakern::op::fwd_op<FWD>);               \
    (m).impl("bwd", &::mhakern::op::bwd_op<BWD>);               \
    (m).impl("fwd_plain", &::mhakern::op::fwd_plain_op<FWD>);   \
    (m).impl("bwd_plain", &::mhakern::op::bwd_plain_op<BWD>);   \
  } while (0)

// True when x (B, H, L, D) is a (B, L, H, D) tensor seen through a transpose
// (mhakern/_layout.py's heads_inner; the two must agree).
inline bool heads_inner(const at::Tensor& x) { return x.size(1) > 1 && x.size(2) > 1 && x.stride(1) < x.stride(2); }

// Uninitialised (B, H, L, last_dim) tensor with x's head/sequence memory order, so that
// merging heads afterwards is free (mhakern/_layout.py's empty_like_heads).
inline at::Tensor empty_like_heads(const at::Tensor& x, int64_t last_dim, at::TensorOptions opts) {
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2);
  if (heads_inner(x)) return at::empty({B, L, H, last_dim}, opts).transpose(1, 2);
  return at::empty({B, H, L, last_dim}, opts);
}
inline at::Tensor empty_like_heads(const at::Tensor& x, int64_t last_dim) {
  return empty_like_heads(x, last_dim, x.options());
}

// dmask of the backward: (B, H, Lq, Lk) float32 zeros (kernels write the visible entries) when
// mask_grad, else an empty (0,) float32 tensor.
inline at::Tensor alloc_dmask(const ModeArgs& m, const at::Tensor& q, const Sizes& s) {
  const auto f32 = q.options().dtype(at::kFloat);
  return m.mask_grad ? at::zeros({s.B, s.H, s.Lq, s.Lk}, f32) : at::empty({0}, f32);
}

// Checks of the backward's extra operands, shared by every device.
inline void check_bwd_operands(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                               const at::Tensor& lse, const Sizes& s) {
  const std::vector<int64_t> o_shape{s.B, s.H, s.Lq, s.Dv};
  check_rank4(dout, "dout");
  check_same_device(dout, "dout", q);
  check_same_dtype(dout, "dout", q);
  check_shape(dout, "dout", o_shape, "(like the forward's out)");
  check_rank4(out, "out");
  check_same_device(out, "out", q);
  check_same_dtype(out, "out", q);
  check_shape(out, "out", o_shape, "(the forward's output)");
  TORCH_CHECK_VALUE(lse.defined(), "lse: expected a tensor, got None (an undefined tensor)");
  check_same_device(lse, "lse", q);
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "lse: expected dtype float32, got ", lse.scalar_type());
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef({s.B, s.H, s.Lq}), "lse: expected shape ",
                    at::IntArrayRef({s.B, s.H, s.Lq}), " (batch, heads, q length), got ", lse.sizes());
}

// Test hook of the CUDA host code: a split-K count to use instead of its planner's (0: plan), set
// through torch.ops.mhakern_C.cuda_force_splits so that GPU tests can drive every split path.
inline std::atomic<int64_t>& cuda_forced_splits() {
  static std::atomic<int64_t> n{0};
  return n;
}
constexpr int64_t kMaxForcedSplits = 1024;

// Which CUDA kernel family serves a pass: "auto" (the host's choice: on a 9.0 device the sm90
// family where it serves the call) or "mma_sync" (that family always, what sm_80-89 devices
// run). One setting per pass, set through torch.ops.mhakern_C.cuda_force_fwd_family /
// cuda_force_bwd_family (tests and benchmarks measure both families on Hopper), or at load from
// MHAKERN_CUDA_FWD_FAMILY / MHAKERN_CUDA_BWD_FAMILY (the same names); a bad value raises at the
// first call. Unset, the forward is "auto" and the backward caps::kSm90BwdByDefault's choice.
constexpr const char* kFamilyNames[] = {"auto", "mma_sync"};
constexpr int kNumFamilyNames = 2;
inline int family_index(const std::string& name) {  // -1: not a name
  for (int i = 0; i < kNumFamilyNames; ++i)
    if (name == kFamilyNames[i]) return i;
  return -1;
}
inline std::string family_choices() {
  std::string s;
  for (int i = 0; i < kNumFamilyNames; ++i) s += std::string(i ? " or '" : "'") + kFamilyNames[i] + "'";
  return s;
}
struct FamilySetting {
  const char* env;      // the environment variable read at load
  std::atomic<int> value;  // an index of kFamilyNames; -2: the variable held a bad value
  FamilySetting(const char* env_name, int unset) : env(env_name), value(unset) {
    const char* e = std::getenv(env_name);
    if (e != nullptr && *e != '\0') {
      const int i = family_index(e);
      value.store(i >= 0 ? i : -2);
    }
  }
  // The setting (0 auto, 1 mma_sync); raises when the environment variable was bad.
  int get() const {
    const int f = value.load(std::memory_order_relaxed);
    TORCH_CHECK_VALUE(f >= 0, env, ": expected ", family_choices(), ", got '", std::getenv(env) ? std::getenv(env) : "",
                      "'");
    return f;
  }
};
inline FamilySetting& cuda_fwd_family() {
  static FamilySetting f("MHAKERN_CUDA_FWD_FAMILY", 0);
  return f;
}
inline FamilySetting& cuda_bwd_family() {
  static FamilySetting f("MHAKERN_CUDA_BWD_FAMILY", caps::kSm90BwdByDefault ? 0 : 1);
  return f;
}
inline int forced_fwd_family() { return cuda_fwd_family().get(); }
inline int forced_bwd_family() { return cuda_bwd_family().get(); }

// A kernel chosen among named ones at run time: the choice is an index of `names`, -1 the
// default (the name "default", or the variable unset), set by a torch.ops.mhakern_C.cuda_force_*
// op (tests, benchmarks) or at load from the environment variable `env`; a bad value there raises
// at the first call that reads it.
struct KernelSetting {
  const char* env;
  const char* const* names;
  int count;
  std::atomic<int> value{-1};  // an index of names, -1 the default, -3 a bad environment value
  KernelSetting(const char* env_name, const char* const* kernel_names, int n)
      : env(env_name), names(kernel_names), count(n) {
    const char* e = std::getenv(env_name);
    if (e != nullptr && *e != '\0') {
      const int i = index(e);
      value.store(i >= -1 ? i : -3);
    }
  }
  int index(const std::string& name) const {  // -1: default, -2: not a name
    if (name == "default") return -1;
    for (int i = 0; i < count; ++i)
      if (name == names[i]) return i;
    return -2;
  }
  std::string choices() const {
    std::string s = "'default'";
    for (int i = 0; i < count; ++i) s += std::string(" or '") + names[i] + "'";
    return s;
  }
  int get() const {  // the request (-1: default); raises when the environment variable was bad
    const int v = value.load(std::memory_order_relaxed);
    TORCH_CHECK_VALUE(v >= -1, env, ": expected ", choices(), ", got '", std::getenv(env) ? std::getenv(env) : "", "'");
    return v;
  }
};

// Which backward the mma.sync family runs (capabilities.h CudaBwdKernel: "split", "fused",
// "fused_atomic"), set by torch.ops.mhakern_C.cuda_force_mma_bwd_kernel or at load from
// MHAKERN_CUDA_MMA_BWD; the default is caps::kCudaMmaBwdDefault. Head dims with only the fused
// kernel run it whatever is set (ordered unless "fused_atomic").
inline KernelSetting& mma_bwd_kernel() {
  static KernelSetting s("MHAKERN_CUDA_MMA_BWD", caps::kCudaBwdKernelNames, caps::kCudaNumBwdKernels);
  return s;
}

// Which backward the sm90 family runs (capabilities.h Sm90BwdKernel: "split", "fused"), set by
// torch.ops.mhakern_C.cuda_force_sm90_bwd_kernel or at load from MHAKERN_CUDA_SM90_BWD; the
// default is caps::kSm90BwdFused.
inline KernelSetting& sm90_bwd_kernel() {
  static KernelSetting s("MHAKERN_CUDA_SM90_BWD", caps::kSm90BwdKernelNames, caps::kSm90NumBwdKernels);
  return s;
}
// The sm90 backward a request (an Sm90BwdKernel, or -1 for the default) runs.
constexpr caps::Sm90BwdKernel sm90_bwd_kernel_for(int requested) {
  return requested >= 0 ? static_cast<caps::Sm90BwdKernel>(requested)
                        : (caps::kSm90BwdFused ? caps::kSm90BwdKernelFused : caps::kSm90BwdKernelSplit);
}

}  // namespace op
}  // namespace mhakern
