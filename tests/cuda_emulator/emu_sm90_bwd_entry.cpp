// C entry points of the emulated sm90 backward (tests/test_cuda_sm90_bwd.py builds this with g++
// next to emu_entry.cpp, emu_schedule.cpp, emu_sm90_entry.cpp and csrc/cuda/sm90/*.cu compiled
// as C++ with -DMHAKERN_CUDA_EMULATE): the backward through the family's own dispatch switch, and
// the backward's family choice by compute capability.
#include <algorithm>
#include <string>
#include <vector>

#include "common/attn_dispatch.h"
#include "emu_entry_util.h"
#include "cuda_emu_sm90.h"

using mhakern::cuda::BwdParams;
using mhakern::cuda::CallSizes;
using mhakern::cuda::ElemType;

extern "C" {

// Strides are (batch, head, row) in elements. Returns 0, or 1 with mhk_emu_last_error().
int mhk_emu_sm90_bwd(int elem, int D, const void* dout, const int64_t* do_st, const void* q, const int64_t* q_st,
                     const void* k, const int64_t* k_st, const void* v, const int64_t* v_st, const void* o,
                     const int64_t* o_st, const float* lse, void* dq, const int64_t* dq_st, void* dk,
                     const int64_t* dk_st, void* dv, const int64_t* dv_st, float* delta, const int32_t* key_lengths,
                     int B, int H, int Hkv, int Lq, int Lk, float scale, int causal, int num_splits,
                     float* dq_partial) {
  using mhk_emu::operand;
  const CallSizes s{B, H, Hkv, Lq, Lk, D};
  const BwdParams p = mhakern::cuda::make_bwd_params(s, operand(dout, do_st), operand(q, q_st), operand(k, k_st),
                                                     operand(v, v_st), operand(o, o_st), lse, operand(dq, dq_st),
                                                     operand(dk, dk_st), operand(dv, dv_st), delta, key_lengths,
                                                     scale, causal != 0, num_splits, dq_partial);
  return mhk_emu::finish(mhakern::cuda::dispatch_attn_bwd_sm90(static_cast<ElemType>(elem), D, p, nullptr));
}

// The fused sm90 backward (attn_bwd_fused_sm90_kernel.cuh) with its zeroed workspace allocated
// here; deterministic: the ordered dQ adds; fault: a deliberate bug (BwdFusedParamsSm90::fault,
// 0 none); ws_out: null, or room for the workspace's final contents (mhk_emu_sm90_bwd_fused_ws_floats
// floats: the fp32 dQ sums, whose bits a bf16 dQ would round away). The other arguments as
// mhk_emu_sm90_bwd's.
int mhk_emu_sm90_bwd_fused(int elem, int D, const void* dout, const int64_t* do_st, const void* q, const int64_t* q_st,
                           const void* k, const int64_t* k_st, const void* v, const int64_t* v_st, const void* o,
                           const int64_t* o_st, const float* lse, void* dq, const int64_t* dq_st, void* dk,
                           const int64_t* dk_st, void* dv, const int64_t* dv_st, float* delta,
                           const int32_t* key_lengths, int B, int H, int Hkv, int Lq, int Lk, float scale, int causal,
                           int deterministic, int fault, float* ws_out) {
  using mhk_emu::operand;
  const CallSizes s{B, H, Hkv, Lq, Lk, D};
  const BwdParams p = mhakern::cuda::make_bwd_params(s, operand(dout, do_st), operand(q, q_st), operand(k, k_st),
                                                     operand(v, v_st), operand(o, o_st), lse, operand(dq, dq_st),
                                                     operand(dk, dk_st), operand(dv, dv_st), delta, key_lengths,
                                                     scale, causal != 0, 1, nullptr);
  std::vector<float> ws(static_cast<size_t>(mhakern::caps::sm90_bwd_fused_workspace_floats(B, Hkv, H / Hkv, Lq, D)), 0.f);
  mhk_emu::sm90::fused_bwd_fault() = fault;
  const cudaError_t err = mhakern::cuda::dispatch_attn_bwd_sm90_fused(static_cast<ElemType>(elem), D, p, ws.data(),
                                                                      deterministic != 0, nullptr);
  mhk_emu::sm90::fused_bwd_fault() = 0;
  if (ws_out != nullptr) std::copy(ws.begin(), ws.end(), ws_out);
  return mhk_emu::finish(err);
}

long long mhk_emu_sm90_bwd_fused_ws_floats(int B, int H, int Hkv, int Lq, int D) {
  return mhakern::caps::sm90_bwd_fused_workspace_floats(B, Hkv, H / Hkv, Lq, D);
}

// The family the host would pick for a backward (0 mma.sync, 1 sm90) on a device of capability
// major.minor, for a call with the modes *modes (null: none); the K head stride and the query
// head stride as given.
int mhk_emu_bwd_family(int major, int minor, int sm90_compiled, int D, int num_splits,
                       const mhakern::ModeParams* modes, int Hkv, long long k_head_stride, long long q_head_stride) {
  BwdParams p;
  mhk_emu::set_modes(p, modes);
  p.D = D;
  p.num_splits = num_splits;
  p.B = 1;
  p.Hkv = Hkv;
  p.H = 2 * Hkv;
  p.Lk = 100;
  p.Lq = 50;
  p.k_stride = {Hkv * 100LL * D, k_head_stride, D};
  p.v_stride = {Hkv * 100LL * D, 100LL * D, D};
  p.q_stride = {p.H * 50LL * D, q_head_stride, D};
  p.do_stride = {p.H * 50LL * D, 50LL * D, D};
  return static_cast<int>(mhakern::cuda::choose_bwd_family(major, minor, sm90_compiled != 0, p));
}

}  // extern "C"
