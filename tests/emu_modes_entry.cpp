// Test-only entry points of the CPU emulation (tests/test_cuda_host.py links this file into the
// emulator library next to csrc/cuda/emulation/emu_entry.cpp): the forward and backward with the
// optional modes of docs/contract.md. The parameter structs are filled exactly as
// csrc/cuda_host.cpp fills them: make_fwd_params / make_bwd_params (attn_params.h), then the
// mode fields of ModeParams (what op_common.h's fill_mode_params copies from the op's
// arguments), then the same dispatch switch.
#include <string>

#include "../csrc/cuda/attn_bwd_kernel.cuh"
#include "../csrc/cuda/attn_dispatch.h"
#include "../csrc/cuda/attn_fwd_kernel.cuh"

using mhakern::ModeParams;
using mhakern::cuda::CallSizes;
using mhakern::cuda::ElemType;
using mhakern::cuda::Operand;

namespace {

Operand operand(const void* ptr, const int64_t* s) {
  Operand o;
  o.ptr = ptr;
  o.stride.batch = s[0];
  o.stride.head = s[1];
  o.stride.row = s[2];
  return o;
}

// mask_strides: the (B, H, Lq, Lk) view's element strides; mask_kind 0 none, 1 bool, 2 float32.
void fill_modes(ModeParams& p, int top_left, long long window_left, long long window_right, const void* mask,
                int mask_kind, const int64_t* mask_strides, float* dmask, double dropout_p, unsigned long long seed) {
  p.top_left = top_left != 0;
  p.window_left = window_left;
  p.window_right = window_right;
  p.dropout_p = dropout_p;
  p.seed = seed;
  if (mask != nullptr && mask_kind != 0) {
    p.mask = mask;
    p.mask_kind = mask_kind;
    p.mask_sb = mask_strides[0];
    p.mask_sh = mask_strides[1];
    p.mask_sq = mask_strides[2];
    p.mask_sk = mask_strides[3];
  }
  p.dmask = dmask;
}

int finish(cudaError_t err) {
  if (err != cudaSuccess && mhk_emu::state().error.empty()) mhk_emu::fail("launcher returned error " + std::to_string(static_cast<int>(err)));
  return mhk_emu::state().error.empty() ? 0 : 1;
}

}  // namespace

extern "C" {

int mhk_emu_fwd_modes(int elem, int D, const void* q, const int64_t* q_st, const void* k, const int64_t* k_st,
                      const void* v, const int64_t* v_st, void* o, const int64_t* o_st, float* lse,
                      const int32_t* key_lengths, int B, int H, int Hkv, int Lq, int Lk, float scale, int causal,
                      int num_splits, float* o_partial, float* lse_partial, int top_left, long long window_left,
                      long long window_right, const void* mask, int mask_kind, const int64_t* mask_strides,
                      double dropout_p, unsigned long long seed) {
  const CallSizes s{B, H, Hkv, Lq, Lk, D};
  auto p = mhakern::cuda::make_fwd_params(s, operand(q, q_st), operand(k, k_st), operand(v, v_st), operand(o, o_st),
                                          lse, key_lengths, scale, causal != 0, num_splits, o_partial, lse_partial);
  fill_modes(p, top_left, window_left, window_right, mask, mask_kind, mask_strides, nullptr, dropout_p, seed);
  return finish(mhakern::cuda::dispatch_attn_fwd(static_cast<ElemType>(elem), D, p, nullptr));
}

int mhk_emu_bwd_modes(int elem, int D, const void* dout, const int64_t* do_st, const void* q, const int64_t* q_st,
                      const void* k, const int64_t* k_st, const void* v, const int64_t* v_st, const void* o,
                      const int64_t* o_st, const float* lse, void* dq, const int64_t* dq_st, void* dk,
                      const int64_t* dk_st, void* dv, const int64_t* dv_st, float* delta, const int32_t* key_lengths,
                      int B, int H, int Hkv, int Lq, int Lk, float scale, int causal, int num_splits, float* dq_partial,
                      int top_left, long long window_left, long long window_right, const void* mask, int mask_kind,
                      const int64_t* mask_strides, float* dmask, double dropout_p, unsigned long long seed) {
  const CallSizes s{B, H, Hkv, Lq, Lk, D};
  auto p = mhakern::cuda::make_bwd_params(s, operand(dout, do_st), operand(q, q_st), operand(k, k_st),
                                          operand(v, v_st), operand(o, o_st), lse, operand(dq, dq_st),
                                          operand(dk, dk_st), operand(dv, dv_st), delta, key_lengths, scale,
                                          causal != 0, num_splits, dq_partial);
  fill_modes(p, top_left, window_left, window_right, mask, mask_kind, mask_strides, dmask, dropout_p, seed);
  return finish(mhakern::cuda::dispatch_attn_bwd(static_cast<ElemType>(elem), D, p, nullptr));
}

}  // extern "C"
