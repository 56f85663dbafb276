// Host side of the cpu kernels; see attention_cpu.h.
#include "attention_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_params.h"

namespace mhakern::cpu {
namespace {

bool cpu_has_avx2() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// ATen's capability (which honours ATEN_CPU_CAPABILITY) caps the choice, and the CPU's own
// flags are checked too: ATen takes the environment variable at its word.
const KernelTable& pick_kernels() {
  const std::string cap = at::get_cpu_capability();
#ifdef MHAKERN_CPU_AVX512
  if (cap == "AVX512" && cpu_has_avx512()) return kernels_AVX512();
#endif
#ifdef MHAKERN_CPU_AVX2
  if ((cap == "AVX2" || cap == "AVX512") && cpu_has_avx2()) return kernels_AVX2();
#endif
  (void)cap;
  (void)&cpu_has_avx2;
  (void)&cpu_has_avx512;
  return kernels_DEFAULT();
}

const KernelTable& kernels() {
  static const KernelTable& table = pick_kernels();
  return table;
}

DType dtype_of(const at::Tensor& q) {
  switch (q.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Float16;
    default:
      TORCH_CHECK_TYPE(false, "q: expected dtype float32, bfloat16 or float16, got ", q.scalar_type());
  }
  return DType::Float32;  // not reached
}

// A (B, H, L, D) operand: CPU, 4 dims, unit stride on the last dim.
void check_heads(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.defined(), name, ": expected a tensor, got an undefined one");
  TORCH_CHECK_VALUE(x.device().is_cpu(), name, ": expected a CPU tensor, got one on ", x.device(),
                    " (mhakern._C cpu kernels serve CPU tensors only)");
  TORCH_CHECK_VALUE(x.dim() == 4, name, ": expected 4 dims (batch, heads, length, head_dim), got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.size(3) <= 1 || x.stride(3) == 1, name,
                    ": expected unit stride on the last dim (head_dim), got strides ", x.strides());
}

void check_same_dtype(const at::Tensor& x, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(x.scalar_type() == q.scalar_type(), name, ": expected dtype ", q.scalar_type(),
                   " (q's), got ", x.scalar_type());
}

void check_shape(const at::Tensor& x, const char* name, at::IntArrayRef want, const char* what) {
  TORCH_CHECK_VALUE(x.sizes() == want, name, ": expected shape ", want, " ", what, ", got ", x.sizes());
}

// An output written by the kernels: like an input, and without overlapping elements (one
// thread writes each element once).
void check_output(const at::Tensor& x, const char* name, at::IntArrayRef want, const at::Tensor& q, const char* what) {
  check_heads(x, name);
  check_same_dtype(x, name, q);
  check_shape(x, name, want, what);
  TORCH_CHECK_VALUE(x.is_non_overlapping_and_dense(), name,
                    ": expected a non-overlapping, dense tensor (any order of dims), got strides ", x.strides());
}

View view_of(const at::Tensor& x) {
  return View{x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)};
}

MutView mut_view_of(const at::Tensor& x) {
  return MutView{x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)};
}

// Checks shared by forward and backward; fills the sizes, flags and input views of `p`.
// Returns key_lengths as a contiguous int32 tensor (undefined when not given) that must
// outlive the kernel call.
at::Tensor check_common(AttnParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                        bool causal, const std::optional<at::Tensor>& key_lengths) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  p.dtype = dtype_of(q);
  check_same_dtype(k, "k", q);
  check_same_dtype(v, "v", q);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Dv = v.size(3);
  TORCH_CHECK_VALUE(k.size(0) == B, "k: expected batch size ", B, " (q's), got ", k.size(0));
  TORCH_CHECK_VALUE(k.size(3) == D, "k: expected head dim ", D, " (q's), got ", k.size(3));
  TORCH_CHECK_VALUE(v.size(0) == B && v.size(1) == Hkv && v.size(2) == Lk, "v: expected (batch, kv heads, length) = (",
                    B, ", ", Hkv, ", ", Lk, ") (k's), got shape ", v.sizes());
  TORCH_CHECK_VALUE(Hkv > 0 && H % Hkv == 0, "k: number of kv heads (", Hkv,
                    ") must be positive and divide q's number of heads (", H, ")");
  TORCH_CHECK_VALUE(D <= kMaxHeadDim, "q: head dim ", D, " exceeds the cpu kernels' maximum of ", kMaxHeadDim);
  TORCH_CHECK_VALUE(Dv <= kMaxHeadDim, "v: head dim ", Dv, " exceeds the cpu kernels' maximum of ", kMaxHeadDim);
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale: expected a finite number, got ", scale);
  p.B = B;
  p.H = H;
  p.Hkv = Hkv;
  p.Lq = Lq;
  p.Lk = Lk;
  p.D = D;
  p.Dv = Dv;
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.q = view_of(q);
  p.k = view_of(k);
  p.v = view_of(v);
  at::Tensor kl;
  if (key_lengths.has_value() && key_lengths->defined()) {
    kl = *key_lengths;
    TORCH_CHECK_VALUE(kl.device().is_cpu(), "key_lengths: expected a CPU tensor, got one on ", kl.device());
    TORCH_CHECK_TYPE(kl.scalar_type() == at::kInt, "key_lengths: expected dtype int32, got ", kl.scalar_type());
    TORCH_CHECK_VALUE(kl.dim() == 1 && kl.size(0) == B, "key_lengths: expected shape (", B,
                      ",) (one length per batch element), got ", kl.sizes());
    kl = kl.contiguous();
    const int32_t* lens = kl.const_data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK_VALUE(lens[b] >= 0 && lens[b] <= Lk, "key_lengths: values must lie in [0, Lk=", Lk,
                        "], got ", lens[b], " at index ", b);
    p.key_lengths = lens;
  }
  return kl;
}

// SCAFFOLDING (cpu-modes), until the mhakern_C::fwd/bwd ops (INTERFACE.md section 4) fill
// these fields: checks the mode arguments and fills the section-3 fields of `p`. Returns the
// mask as the kernels read it (kept alive by the caller).
at::Tensor set_modes(AttnParams& p, const std::optional<at::Tensor>& attn_mask, double dropout_p, int64_t seed,
                     bool top_left, int64_t window_left, int64_t window_right) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p: expected a value in [0, 1), got ", dropout_p);
  TORCH_CHECK_VALUE(window_left >= -1, "window_left: expected -1 (unbounded) or a size >= 0, got ", window_left);
  TORCH_CHECK_VALUE(window_right >= -1, "window_right: expected -1 (unbounded) or a size >= 0, got ", window_right);
  p.top_left = top_left;
  p.window_left = window_left;
  p.window_right = window_right;
  p.dropout_p = static_cast<float>(dropout_p);
  p.seed = static_cast<uint64_t>(seed);
  at::Tensor m;
  if (attn_mask.has_value() && attn_mask->defined()) {
    m = *attn_mask;
    TORCH_CHECK_VALUE(m.device().is_cpu(), "attn_mask: expected a CPU tensor, got one on ", m.device());
    TORCH_CHECK_VALUE(m.sizes() == at::IntArrayRef({p.B, p.H, p.Lq, p.Lk}), "attn_mask: expected a view of shape (",
                      p.B, ", ", p.H, ", ", p.Lq, ", ", p.Lk, ") (batch, heads, q length, k length), got ", m.sizes());
    TORCH_CHECK_TYPE(m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat,
                     "attn_mask: expected dtype bool or float32, got ", m.scalar_type());
    p.mask = m.data_ptr();
    p.mask_kind = m.scalar_type() == at::kBool ? 1 : 2;
    p.mask_sb = m.stride(0);
    p.mask_sh = m.stride(1);
    p.mask_sq = m.stride(2);
    p.mask_sk = m.stride(3);
  }
  return m;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
                                            const std::optional<at::Tensor>& out) {
  AttnParams p;
  const at::Tensor kl = check_common(p, q, k, v, scale, causal, key_lengths);
  const std::vector<int64_t> out_shape{p.B, p.H, p.Lq, p.Dv};
  at::Tensor o;
  if (out.has_value() && out->defined()) {
    o = *out;
    check_output(o, "out", out_shape, q, "(batch, heads, q length, v head dim)");
  } else {
    o = at::empty(out_shape, q.options());
  }
  at::Tensor lse = at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  p.out = mut_view_of(o);
  p.lse = lse.data_ptr<float>();
  kernels().forward(p);
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk, const std::optional<at::Tensor>& dv) {
  AttnParams p;
  const at::Tensor kl = check_common(p, q, k, v, scale, causal, key_lengths);
  const std::vector<int64_t> o_shape{p.B, p.H, p.Lq, p.Dv};
  check_heads(dout, "dout");
  check_same_dtype(dout, "dout", q);
  check_shape(dout, "dout", o_shape, "(like the forward's out)");
  check_heads(out, "out");
  check_same_dtype(out, "out", q);
  check_shape(out, "out", o_shape, "(the forward's output)");
  TORCH_CHECK_VALUE(lse.defined() && lse.device().is_cpu(), "lse: expected a CPU tensor");
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "lse: expected dtype float32, got ", lse.scalar_type());
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef({p.B, p.H, p.Lq}), "lse: expected shape ",
                    at::IntArrayRef({p.B, p.H, p.Lq}), " (batch, heads, q length), got ", lse.sizes());
  const at::Tensor lse_c = lse.contiguous();

  auto output = [&](const std::optional<at::Tensor>& given, const at::Tensor& like, const char* name) {
    if (given.has_value() && given->defined()) {
      check_output(*given, name, like.sizes(), q, "(like the input it is the gradient of)");
      return *given;
    }
    return at::empty(like.sizes(), like.options());
  };
  at::Tensor gq = output(dq, q, "dq");
  at::Tensor gk = output(dk, k, "dk");
  at::Tensor gv = output(dv, v, "dv");

  p.out = mut_view_of(out);  // read only in the backward
  p.lse = const_cast<float*>(lse_c.const_data_ptr<float>());
  p.dout = view_of(dout);
  p.dq = mut_view_of(gq);
  p.dk = mut_view_of(gk);
  p.dv = mut_view_of(gv);
  kernels().backward(p);
  return {gq, gk, gv};
}

std::string kernel_isa() { return kernels().isa; }

int64_t parallel_threads_probe(int64_t tasks) {
  TORCH_CHECK_VALUE(tasks > 0, "tasks: expected a positive number, got ", tasks);
  std::vector<std::atomic<int>> seen(static_cast<size_t>(std::max(at::get_num_threads(), 1)));
  for (auto& s : seen) s.store(0);
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    const int tid = at::get_thread_num();
    if (tid >= 0 && static_cast<size_t>(tid) < seen.size()) seen[tid].store(1);
  });
  int64_t n = 0;
  for (auto& s : seen) n += s.load();
  return n;
}

// SCAFFOLDING (cpu-modes): the entry points with every mode, to drive the kernels until
// mhakern_C::fwd/bwd exist. Same semantics as INTERFACE.md section 4.
std::tuple<at::Tensor, at::Tensor> attn_fwd_modes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  double scale, bool causal,
                                                  const std::optional<at::Tensor>& key_lengths,
                                                  const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                                  int64_t seed, bool top_left, int64_t window_left,
                                                  int64_t window_right) {
  AttnParams p;
  const at::Tensor kl = check_common(p, q, k, v, scale, causal, key_lengths);
  const at::Tensor m = set_modes(p, attn_mask, dropout_p, seed, top_left, window_left, window_right);
  at::Tensor o = at::empty({p.B, p.H, p.Lq, p.Dv}, q.options());
  at::Tensor lse = at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  p.out = mut_view_of(o);
  p.lse = lse.data_ptr<float>();
  kernels().forward(p);
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attn_bwd_modes(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, int64_t seed, bool top_left, int64_t window_left,
    int64_t window_right, bool mask_grad) {
  AttnParams p;
  const at::Tensor kl = check_common(p, q, k, v, scale, causal, key_lengths);
  const at::Tensor m = set_modes(p, attn_mask, dropout_p, seed, top_left, window_left, window_right);
  const std::vector<int64_t> o_shape{p.B, p.H, p.Lq, p.Dv};
  check_heads(dout, "dout");
  check_same_dtype(dout, "dout", q);
  check_shape(dout, "dout", o_shape, "(like the forward's out)");
  check_heads(out, "out");
  check_same_dtype(out, "out", q);
  check_shape(out, "out", o_shape, "(the forward's output)");
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "lse: expected dtype float32, got ", lse.scalar_type());
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef({p.B, p.H, p.Lq}), "lse: expected shape (batch, heads, q length)");
  TORCH_CHECK_VALUE(!mask_grad || p.mask_kind == 2, "mask_grad: needs a float32 attn_mask");
  const at::Tensor lse_c = lse.contiguous();
  at::Tensor gq = at::empty(q.sizes(), q.options());
  at::Tensor gk = at::empty(k.sizes(), k.options());
  at::Tensor gv = at::empty(v.sizes(), v.options());
  at::Tensor gm = mask_grad ? at::empty({p.B, p.H, p.Lq, p.Lk}, q.options().dtype(at::kFloat))
                            : at::empty({0}, q.options().dtype(at::kFloat));
  p.out = mut_view_of(out);
  p.lse = const_cast<float*>(lse_c.const_data_ptr<float>());
  p.dout = view_of(dout);
  p.dq = mut_view_of(gq);
  p.dk = mut_view_of(gk);
  p.dv = mut_view_of(gv);
  p.dmask = mask_grad ? gm.data_ptr<float>() : nullptr;
  kernels().backward(p);
  return {gq, gk, gv, gm};
}

}  // namespace mhakern::cpu
