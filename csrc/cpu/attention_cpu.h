// Host side of the cpu kernels: the CPU implementations of the dispatcher ops mhakern_C::fwd and
// mhakern_C::bwd (schemas in csrc/bindings.cpp, registered for the CPU key in attention_cpu.cpp),
// plus the choice of the instruction-set variant.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "../op_common.h"

namespace mhakern::cpu {

// Forward: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), CPU, one dtype among
// float32, bfloat16, float16, unit stride on the last dim. Returns out (B, H, Lq, Dv) in q's
// dtype, laid out like q, and lse float32 (B, H, Lq), natural log, -inf for rows that see no
// key. The modes follow docs/contract.md.
std::tuple<at::Tensor, at::Tensor> attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
                                            const op::ModeArgs& modes);

// Backward from lse: returns (dq, dk, dv) shaped and laid out like q, k, v (dk and dv summed
// over the query heads sharing a KV head) and dmask ((B, H, Lq, Lk) float32 dL/dscore when
// mask_grad, else an empty (0,) float32 tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attn_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
    const op::ModeArgs& modes);

// The plain backward (no modes) of a call whose k and v are one float32 tensor kv: (dq, dkv),
// dkv = dK + dV rounded as autograd sums the two gradients of one tensor.
std::tuple<at::Tensor, at::Tensor> attn_bwd_kv_sum(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& kv,
                                                   const at::Tensor& out, const at::Tensor& lse, double scale,
                                                   bool causal, const std::optional<at::Tensor>& key_lengths);

// Name of the instruction-set variant in use: "AVX512", "AVX2" or "DEFAULT".
std::string kernel_isa();

// The kernels bf16 inputs run now (MHAKERN_CPU_ISA, see attention_cpu.cpp): "AVX512BF16"
// (vdpbf16ps), "<ISA>_BF16MODEL" (its software model) or the plain kernels' name.
std::string bf16_kernel_isa();

// One vdpbf16ps step per lane (acc[i] += a[i] . b[i], a and b one bf16 pair per int32) on the
// instruction ("avx512bf16") or its software model ("avx512bf16_model"); a copy of acc.
at::Tensor bf16_dot_lanes(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, const std::string& variant);

// The variant's rounding of fp32 into bf16 pairs (vcvtne2ps2bf16 or its model) on n = x.numel() / 2
// lanes, one pair per int32: (x[i], x[n + i]), or with `runs` (x[2 i], x[2 i + 1]).
at::Tensor bf16_round_lanes(const at::Tensor& x, bool runs, const std::string& variant);

// A dense fp32 product (attention_params.h) on the plain kernels of this CPU, serially.
struct DenseProduct;
void dense_product(const DenseProduct& d);

// How many distinct threads at::parallel_for ran `tasks` tasks on (checks that the module was
// built with the same parallel runtime as torch: 1 would mean the kernels run serially).
int64_t parallel_threads_probe(int64_t tasks);

}  // namespace mhakern::cpu
