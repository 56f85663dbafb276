// Host side of the cpu kernels; see attention_cpu.h.
#include "attention_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_params.h"
#include "../capabilities.h"
#include "../op_common.h"

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

bool cpu_has_avx512_bf16() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// The bf16 twin of the plain table in use: its bf16 products on the software model of
// vdpbf16ps (kernel/bf16_dot.h), so every machine runs the bf16 variant's numerics.
const KernelTable& model_kernels() {
  const std::string isa = kernels().isa;
#ifdef MHAKERN_CPU_AVX512
  if (isa == "AVX512") return kernels_AVX512_BF16MODEL();
#endif
#ifdef MHAKERN_CPU_AVX2
  if (isa == "AVX2") return kernels_AVX2_BF16MODEL();
#endif
  return kernels_DEFAULT_BF16MODEL();
}

// The instruction's table, or nullptr where the build or the CPU (or ATen's capability, which
// must allow AVX512) lacks it.
const KernelTable* hw_bf16_kernels() {
#ifdef MHAKERN_CPU_AVX512BF16
  static const bool ok = std::string(kernels().isa) == "AVX512" && cpu_has_avx512_bf16();
  if (ok) return &kernels_AVX512BF16();
#endif
  (void)&cpu_has_avx512_bf16;
  return nullptr;
}

// MHAKERN_CPU_ISA chooses the kernels of bf16 inputs, read at every bf16 call (so a test can
// switch it): unset, "" or "auto": vdpbf16ps where the CPU has it, else the plain kernels
// (fp32 products on converted inputs); "avx512bf16": the instruction, an error where it is
// missing; "avx512bf16_model": its software model (any CPU); "fp32": the plain kernels.
// Other dtypes always run the plain kernels.
const KernelTable& bf16_kernels() {
  const char* e = std::getenv("MHAKERN_CPU_ISA");
  const std::string v = e ? e : "";
  if (v.empty() || v == "auto") {
    const KernelTable* hw = hw_bf16_kernels();
    return hw ? *hw : kernels();
  }
  if (v == "avx512bf16") {
    const KernelTable* hw = hw_bf16_kernels();
    TORCH_CHECK(hw != nullptr, "MHAKERN_CPU_ISA=avx512bf16: ",
                "this build or CPU has no AVX512-BF16 kernels (the CPU needs avx512_bf16 and ATen's capability "
                "AVX512; the build compiles them on x86-64); use avx512bf16_model for the software model");
    return *hw;
  }
  if (v == "avx512bf16_model") return model_kernels();
  if (v == "fp32") return kernels();
  TORCH_CHECK_VALUE(false, "MHAKERN_CPU_ISA: expected one of auto, avx512bf16, avx512bf16_model, fp32, got '", v, "'");
  return kernels();  // not reached
}

const KernelTable& kernels_for(DType dt) { return dt == DType::BFloat16 ? bf16_kernels() : kernels(); }

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

void check_cpu(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), name, ": expected a CPU tensor, got one on ", x.device(),
                    " (the cpu kernels serve CPU tensors only)");
}

View view_of(const at::Tensor& x) {
  return View{x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)};
}

MutView mut_view_of(const at::Tensor& x) {
  return MutView{x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)};
}

// Everything forward and backward check and fill alike: q, k, v, scale, causal, key lengths and
// the modes. Returns key_lengths as a contiguous int32 tensor (undefined when not given) that
// must outlive the kernel call.
at::Tensor check_common(AttnParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                        bool causal, const std::optional<at::Tensor>& key_lengths, const op::ModeArgs& modes,
                        bool backward) {
  // check_qkv first: it names an undefined operand (None from Python) before anything reads its device.
  const op::Sizes s = op::check_qkv(q, k, v, scale, &modes);
  check_cpu(q, "q");
  p.dtype = dtype_of(q);
  TORCH_CHECK_VALUE(s.D <= caps::kCpuMaxHeadDim, "q: head dim ", s.D, " exceeds the cpu kernels' maximum of ",
                    caps::kCpuMaxHeadDim);
  TORCH_CHECK_VALUE(s.Dv <= caps::kCpuMaxHeadDim, "v: head dim ", s.Dv, " exceeds the cpu kernels' maximum of ",
                    caps::kCpuMaxHeadDim);
  // A paged cache's logical key length (key_lengths are checked against it).
  op::Sizes sk = s;
  sk.Lk = op::kernel_key_len(modes, k);
  op::check_key_lengths_meta(key_lengths, q, sk);
  op::check_modes(modes, q, s, caps::kCpuFeatures, "cpu", backward);
  const bool has_kl = key_lengths.has_value() && key_lengths->defined();
  TORCH_CHECK_VALUE(!(has_kl && modes.varlen()), "key_lengths: not with packed sequences (cu_seqlens_k gives each "
                    "sequence's keys)");
  op::check_packing_values(modes, q, k);
  p.B = s.B;
  p.H = s.H;
  p.Hkv = s.Hkv;
  p.Lq = s.Lq;
  p.Lk = sk.Lk;
  p.D = s.D;
  p.Dv = s.Dv;
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.q = view_of(q);
  p.k = view_of(k);
  p.v = view_of(v);
  op::fill_mode_params(p, modes);
  p.lse_sh = p.Lq;
  if (modes.paged()) p.page_size = k.size(2);
  at::Tensor kl;
  if (has_kl) {
    kl = key_lengths->contiguous();
    // Read here, where it is free: an out-of-range length is refused, never clamped into a
    // silently different answer.
    op::check_key_length_values(kl.const_data_ptr<int32_t>(), sk);
    p.key_lengths = kl.const_data_ptr<int32_t>();
  }
  return kl;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
                                            const op::ModeArgs& modes) {
  AttnParams p;
  const at::Tensor kl = check_common(p, q, k, v, scale, causal, key_lengths, modes, false);
  at::Tensor o = op::empty_like_heads(q, p.Dv);
  at::Tensor lse = at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  p.out = mut_view_of(o);
  p.lse = lse.data_ptr<float>();
  kernels_for(p.dtype).forward(p);
  return {o, lse};
}

// A backward call's checks and read-only operands into p; `keep` holds what p points into (the
// converted key lengths, lse made contiguous).
static op::Sizes backward_inputs(AttnParams& p, at::Tensor (&keep)[2], const at::Tensor& dout, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                 double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
                                 const op::ModeArgs& modes) {
  keep[0] = check_common(p, q, k, v, scale, causal, key_lengths, modes, true);
  const op::Sizes s{p.B, p.H, p.Hkv, p.Lq, p.Lk, p.D, p.Dv};
  op::check_bwd_operands(dout, q, out, lse, s);
  keep[1] = lse.contiguous();
  p.out = mut_view_of(out);  // read only in the backward
  p.lse = const_cast<float*>(keep[1].const_data_ptr<float>());
  p.dout = view_of(dout);
  return s;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attn_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
    const op::ModeArgs& modes) {
  AttnParams p;
  at::Tensor keep[2];
  const op::Sizes s = backward_inputs(p, keep, dout, q, k, v, out, lse, scale, causal, key_lengths, modes);
  at::Tensor gq = op::empty_like_heads(q, p.D);
  at::Tensor gk = op::empty_like_heads(k, p.D);
  at::Tensor gv = op::empty_like_heads(v, p.Dv);
  at::Tensor dmask = op::alloc_dmask(modes, q, s);
  p.dq = mut_view_of(gq);
  p.dk = mut_view_of(gk);
  p.dv = mut_view_of(gv);
  if (modes.mask_grad) p.dmask = dmask.data_ptr<float>();
  kernels_for(p.dtype).backward(p);
  return {gq, gk, gv, dmask};
}

// The plain backward of a call whose k and v are one float32 tensor kv: (dq, dK + dV), the sum
// rounded as autograd sums the two gradients of one tensor, without a dV tensor or the separate
// sum's pass (mhakern/ops.py, backward_impl with kv_sum).
std::tuple<at::Tensor, at::Tensor> attn_bwd_kv_sum(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& kv,
                                                   const at::Tensor& out, const at::Tensor& lse, double scale,
                                                   bool causal, const std::optional<at::Tensor>& key_lengths) {
  TORCH_CHECK_VALUE(kv.scalar_type() == at::kFloat, "bwd_plain_kv_sum: kv: expected float32, got ", kv.scalar_type());
  AttnParams p;
  at::Tensor keep[2];
  backward_inputs(p, keep, dout, q, kv, kv, out, lse, scale, causal, key_lengths, op::ModeArgs{});
  at::Tensor gq = op::empty_like_heads(q, p.D);
  at::Tensor gkv = op::empty_like_heads(kv, p.D);
  p.dq = mut_view_of(gq);
  p.dk = p.dv = mut_view_of(gkv);
  p.kv_sum = true;
  kernels_for(p.dtype).backward(p);
  return {gq, gkv};
}

std::string kernel_isa() { return kernels().isa; }

std::string bf16_kernel_isa() { return bf16_kernels().isa; }

// The table of a test variant: the instruction's ("avx512bf16") or the model's.
const KernelTable& bf16_test_table(const std::string& variant) {
  if (variant == "avx512bf16") {
    const KernelTable* t = hw_bf16_kernels();
    TORCH_CHECK(t != nullptr, "variant 'avx512bf16': no AVX512-BF16 kernels on this build or CPU");
    return *t;
  }
  TORCH_CHECK_VALUE(variant == "avx512bf16_model", "variant: expected avx512bf16 or avx512bf16_model, got '", variant,
                    "'");
  return model_kernels();
}

at::Tensor bf16_dot_lanes(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, const std::string& variant) {
  TORCH_CHECK_VALUE(acc.scalar_type() == at::kFloat && acc.dim() == 1 && acc.is_contiguous() && acc.device().is_cpu(),
                    "acc: expected a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK_VALUE(a.scalar_type() == at::kInt && b.scalar_type() == at::kInt && a.sizes() == acc.sizes() &&
                    b.sizes() == acc.sizes() && a.is_contiguous() && b.is_contiguous() && a.device().is_cpu() &&
                    b.device().is_cpu(),
                    "a, b: expected contiguous int32 CPU tensors of acc's size (one bf16 pair each)");
  TORCH_CHECK_VALUE(acc.numel() % 64 == 0, "acc: expected a multiple of 64 lanes, got ", acc.numel());
  const KernelTable* t = &bf16_test_table(variant);
  at::Tensor out = acc.clone();
  t->dot_lanes(out.data_ptr<float>(), reinterpret_cast<const uint32_t*>(a.const_data_ptr<int32_t>()),
               reinterpret_cast<const uint32_t*>(b.const_data_ptr<int32_t>()), out.numel());
  return out;
}

// x (2 n float32) rounded into n bf16 pairs (int32): lane i of (x[i], x[n + i]), or with `runs`
// of (x[2 i], x[2 i + 1]).
at::Tensor bf16_round_lanes(const at::Tensor& x, bool runs, const std::string& variant) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous() && x.device().is_cpu(),
                    "x: expected a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK_VALUE(x.numel() % 128 == 0, "x: expected a multiple of 128 values, got ", x.numel());
  const KernelTable* t = &bf16_test_table(variant);
  at::Tensor out = at::empty({x.numel() / 2}, x.options().dtype(at::kInt));
  t->round_lanes(x.const_data_ptr<float>(), reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()), out.numel(), runs);
  return out;
}

// The address of instruction set isa's flex runtime table (flex_runtime.h) for
// mhakern/flex/build.py to hand to the generated libraries, or 0 when this build lacks it or
// the CPU cannot run it.
int64_t flex_runtime(const std::string& isa) {
  const flex_rt::Runtime* t = nullptr;
#ifdef MHAKERN_CPU_AVX512
  if (isa == "AVX512" && cpu_has_avx512()) t = flex_runtime_AVX512();
#endif
#ifdef MHAKERN_CPU_AVX2
  if (isa == "AVX2" && cpu_has_avx2()) t = flex_runtime_AVX2();
#endif
  if (isa == "DEFAULT") t = flex_runtime_DEFAULT();
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t));
}

void dense_product(const DenseProduct& d) { kernels().dense(d); }

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

}  // namespace mhakern::cpu

// The bf16 variant's introspection (issue 35): which kernels bf16 inputs run now, and one
// vdpbf16ps step or one rounding into pairs per lane on the instruction or its model (the
// bit-identity checks).
TORCH_LIBRARY_FRAGMENT(mhakern_C, m) {
  m.def("cpu_bf16_kernel_isa() -> str", &mhakern::cpu::bf16_kernel_isa);
  m.def("cpu_flex_runtime(str isa) -> int", &mhakern::cpu::flex_runtime);
  m.def("cpu_bf16_dot_lanes(Tensor acc, Tensor a, Tensor b, str variant) -> Tensor", &mhakern::cpu::bf16_dot_lanes);
  m.def("cpu_bf16_round_lanes(Tensor x, bool runs, str variant) -> Tensor", &mhakern::cpu::bf16_round_lanes);
  // A CPU-only plain backward for k and v given as one tensor (float32): (dq, dK + dV).
  m.def("bwd_plain_kv_sum(Tensor dout, Tensor q, Tensor kv, Tensor out, Tensor lse, float scale, bool causal, "
        "Tensor? key_lengths) -> (Tensor dq, Tensor dkv)");
}

// The CPU kernels of the ops whose schemas csrc/bindings.cpp defines.
TORCH_LIBRARY_IMPL(mhakern_C, CPU, m) {
  MHAKERN_IMPL_ATTENTION_OPS(m, &mhakern::cpu::attn_fwd, &mhakern::cpu::attn_bwd);
  m.impl("bwd_plain_kv_sum", &mhakern::cpu::attn_bwd_kv_sum);
}
