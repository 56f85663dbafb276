// Host side of the cpu kernels: argument checks (TORCH_CHECK messages name the argument and
// what was expected), output allocation and the choice of the instruction-set variant.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace mhakern::cpu {

// Largest head dim (D and Dv) the kernels accept.
constexpr int64_t kMaxHeadDim = 256;

// Forward: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), CPU, one dtype among
// float32, bfloat16, float16, unit stride on the last dim. Returns out (B, H, Lq, Dv) in q's
// dtype (written into `out` when given) and lse float32 (B, H, Lq), natural log, -inf for rows
// that see no key.
std::tuple<at::Tensor, at::Tensor> attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
                                            const std::optional<at::Tensor>& out);

// Backward from lse: returns (dq, dk, dv) shaped like q, k, v (written into dq/dk/dv when
// given); dk and dv are summed over the query heads sharing a KV head.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk, const std::optional<at::Tensor>& dv);

// SCAFFOLDING (cpu-modes): forward and backward with every mode of INTERFACE.md section 4
// (attn_mask: a (B, H, Lq, Lk) bool or float32 view), until mhakern_C::fwd/bwd exist.
std::tuple<at::Tensor, at::Tensor> attn_fwd_modes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  double scale, bool causal,
                                                  const std::optional<at::Tensor>& key_lengths,
                                                  const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                                  int64_t seed, bool top_left, int64_t window_left,
                                                  int64_t window_right);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attn_bwd_modes(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, int64_t seed, bool top_left, int64_t window_left,
    int64_t window_right, bool mask_grad);

// Name of the instruction-set variant in use: "AVX512", "AVX2" or "DEFAULT".
std::string kernel_isa();

// How many distinct threads at::parallel_for ran `tasks` tasks on (checks that the module was
// built with the same parallel runtime as torch: 1 would mean the kernels run serially).
int64_t parallel_threads_probe(int64_t tasks);

}  // namespace mhakern::cpu
