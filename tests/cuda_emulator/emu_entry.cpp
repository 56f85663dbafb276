// C entry points of the CPU emulation library (built by tests/cuda_emulator_harness.py with g++
// from this file and csrc/cuda/mma/*.cu compiled as C++ with -DMHAKERN_CUDA_EMULATE). They fill the
// kernels' parameter structs from raw pointers and strides with the helpers cuda_host.cpp uses
// on tensors (make_fwd_params / make_bwd_params), and go through the same dispatch switch, so
// the emulated run covers everything from the parameter struct down. "Device memory" is host memory here.
#include <cstddef>
#include <string>
#include <vector>

#include "mma/attn_bwd_fused_kernel.cuh"
#include "common/attn_dispatch.h"
#include "mma/attn_fwd_kernel.cuh"
#include "cuda_emu.h"
#include "emu_entry_util.h"

// An emulator build may compile only some of the instantiation files (compiling all of them
// takes a while); the others resolve to these weak definitions, which report that they are
// missing instead of failing the link. One per instance of capabilities.h.
#define MHK_WEAK_INSTANCE_(tag, D)                                                                            \
  namespace mhakern {                                                                                         \
  namespace cuda {                                                                                            \
  __attribute__((weak)) cudaError_t run_attn_fwd_##tag##_d##D(const FwdParams&, cudaStream_t) {             \
    mhk_emu::fail("run_attn_fwd_" #tag "_d" #D " is not compiled into this emulator build");                \
    return cudaErrorInvalidValue;                                                                             \
  }                                                                                                           \
  __attribute__((weak)) cudaError_t run_attn_bwd_##tag##_d##D(const BwdParams&, cudaStream_t) {             \
    mhk_emu::fail("run_attn_bwd_" #tag "_d" #D " is not compiled into this emulator build");                \
    return cudaErrorInvalidValue;                                                                             \
  }                                                                                                           \
  }                                                                                                           \
  }
MHK_CUDA_FOR_EACH_INSTANCE(MHK_WEAK_INSTANCE_)
#undef MHK_WEAK_INSTANCE_
#define MHK_WEAK_BWD_ONLY_INSTANCE_(tag, D)                                                                   \
  namespace mhakern {                                                                                         \
  namespace cuda {                                                                                            \
  __attribute__((weak)) cudaError_t run_attn_bwd_##tag##_d##D(const BwdParams&, cudaStream_t) {             \
    mhk_emu::fail("run_attn_bwd_" #tag "_d" #D " is not compiled into this emulator build");                \
    return cudaErrorInvalidValue;                                                                             \
  }                                                                                                           \
  }                                                                                                           \
  }
MHK_CUDA_BWD_ONLY_INSTANCE(MHK_WEAK_BWD_ONLY_INSTANCE_)
#undef MHK_WEAK_BWD_ONLY_INSTANCE_

#if defined(__x86_64__)
// mhk_emu_switch(save_sp, load_sp): push the System V callee-saved registers, store the stack
// pointer in *save_sp, switch to load_sp, pop that fiber's registers and return into it.
asm(R"(
  .text
  .globl mhk_emu_switch
  .type mhk_emu_switch, @function
mhk_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mhk_emu_switch, .-mhk_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

using mhakern::cuda::CallSizes;
using mhakern::cuda::ElemType;
using mhakern::cuda::HeadStrides;
using mhk_emu::finish;
using mhk_emu::operand;

namespace {

// The mma.sync backward the next emulated backward calls request (capabilities.h CudaBwdKernel;
// -1: the default), as the op's MHAKERN_CUDA_MMA_BWD setting does.
int g_bwd_kernel_request = -1;

// Fills the backward's kernel choice and, for the fused kernel, its zeroed workspace (owned by
// `ws` until the call returns), as cuda_host.cpp's attn_bwd does with torch allocations.
struct FusedWorkspace {
  std::vector<float> dq_accum;
  std::vector<uint32_t> counters;
};
void fill_bwd_kernel(mhakern::cuda::BwdParams& p, FusedWorkspace& ws) {
  p.bwd_kernel = mhakern::caps::cuda_bwd_kernel(p.D, g_bwd_kernel_request, p.cu_seqlens_q != nullptr);
  if (p.bwd_kernel == mhakern::caps::kBwdSplit) return;
  ws.dq_accum.assign(static_cast<size_t>(p.B) * p.H * p.Lq * p.D, 0.f);
  ws.counters.assign(static_cast<size_t>(mhakern::caps::cuda_fused_bwd_counters(p.B, p.Hkv, static_cast<int64_t>(p.group) * p.Lq, p.D)), 0u);
  p.dq_accum = ws.dq_accum.data();
  p.dq_counters = ws.counters.data();
}

}  // namespace

extern "C" {

// Which mma.sync backward the following emulated backward calls run: -1 the default, else a
// CudaBwdKernel (0 split, 1 fused, 2 fused_atomic). Returns the backward head dim d gets then.
int mhk_emu_set_bwd_kernel(int requested, int d) {
  g_bwd_kernel_request = requested;
  return mhakern::caps::cuda_bwd_kernel(d, requested);
}

int mhk_emu_bwd_head_dim_supported(int d) { return mhakern::caps::cuda_bwd_head_dim_supported(d) ? 1 : 0; }

// The fused backward's tiles as compiled (FusedBwdConfig): out = {keys per CTA, rows per step,
// warps per key strip, threads, shared memory of the plain kernel}. Returns 1 for a head dim
// without a backward instance.
int mhk_emu_fused_bwd_tiles(int d, int* out) {
  using namespace mhakern::cuda;
  auto fill = [out](auto cfg) {
    using C = decltype(cfg);
    out[0] = C::kBlockN;
    out[1] = C::kBlockM;
    out[2] = C::kDSplit;
    out[3] = C::kThreads;
    out[4] = C::kSmemBytes;
  };
#define MHK_FUSED_TILES_CASE_(tag, D) \
  if (d == D) {                       \
    fill(FusedBwdConfig<D>{});        \
    return 0;                         \
  }
  MHK_CUDA_FOR_EACH_HEAD_DIM(MHK_FUSED_TILES_CASE_, _)
  MHK_CUDA_BWD_ONLY_HEAD_DIM(MHK_FUSED_TILES_CASE_, _)
#undef MHK_FUSED_TILES_CASE_
  return 1;
}

// Resets the error state. defer_async: cp.async data lands only at the covering wait (1) or at
// once (0). max_smem: the per-block shared-memory limit to enforce, in bytes.
void mhk_emu_configure(int defer_async, long long max_smem) {
  mhk_emu::State& s = mhk_emu::state();
  s.error.clear();
  s.defer_async = defer_async != 0;
  s.max_smem = max_smem;
}

const char* mhk_emu_last_error() { return mhk_emu::state().error.c_str(); }

int mhk_emu_head_dim_supported(int d) { return mhakern::caps::cuda_head_dim_supported(d) ? 1 : 0; }

// Tile sizes of the compiled configs (FwdConfig / BwdConfig), for tests to compare with
// capabilities.h's table: out = {fwd rows, fwd keys, dq rows, dq keys, dkdv keys, dkdv rows,
// keys of the forward with attn_mask / dropout}.
// Returns 1 for a head dim without an instance.
int mhk_emu_tiles(int d, int* out) {
  using namespace mhakern::cuda;
  auto fill = [out](auto fwd, auto bwd, auto fwd_modes) {
    using F = decltype(fwd);
    using Bw = decltype(bwd);
    out[0] = F::kBlockM;
    out[1] = F::kBlockN;
    out[2] = Bw::kDqBlockM;
    out[3] = Bw::kDqBlockN;
    out[4] = Bw::kDkvBlockN;
    out[5] = Bw::kDkvBlockM;
    out[6] = decltype(fwd_modes)::kBlockN;
  };
#define MHK_TILES_CASE_(tag, D) \
  if (d == D) {                 \
    fill(FwdConfig<D>{}, BwdConfig<D>{}, FwdConfig<D, true>{}); \
    return 0;                   \
  }
  MHK_CUDA_FOR_EACH_HEAD_DIM(MHK_TILES_CASE_, _)
#undef MHK_TILES_CASE_
  return 1;
}

// The decode configuration of the mma.sync forward as compiled (FwdDecodeConfig): out = {rows,
// keys per tile, stages, keys per warp, warps, shared memory the launcher asks for, the
// largest group * Lq it serves}, for tests to compare with capabilities.h's table. Returns 1 for
// a head dim without an instance.
int mhk_emu_decode_tiles(int d, int* out) {
  using namespace mhakern::cuda;
  auto fill = [out](auto cfg) {
    using C = decltype(cfg);
    out[0] = C::kBlockM;
    out[1] = C::kBlockN;
    out[2] = C::kStages;
    out[3] = C::kWarpN;
    out[4] = C::kWarps;
    out[5] = C::kLaunchSmemBytes;
    out[6] = static_cast<int>(mhakern::caps::kCudaDecodeMaxRows);
  };
#define MHK_DECODE_CASE_(tag, D) \
  if (d == D) {                  \
    fill(FwdDecodeConfig<D>{});  \
    return 0;                    \
  }
  MHK_CUDA_FOR_EACH_HEAD_DIM(MHK_DECODE_CASE_, _)
#undef MHK_DECODE_CASE_
  return 1;
}

// Split count the host plans for a forward on the mma.sync family (cuda_host.cpp attn_fwd: the
// call's tiles from capabilities.h fwd_plan_tiles, then plan_splits), and whether run_attn_fwd
// launches the decode kernel for it (*decode).
int mhk_emu_fwd_plan_mma(int D, int B, int Hkv, int group, int Lq, int Lk, int num_sms, int modes_kernel,
                         int* decode) {
  const int64_t rows = static_cast<int64_t>(group) * Lq;
  *decode = mhakern::caps::use_cuda_decode_fwd(rows, modes_kernel != 0) ? 1 : 0;
  const mhakern::caps::FwdPlanTiles t = mhakern::caps::fwd_plan_tiles(false, D, rows, modes_kernel != 0);
  return static_cast<int>(mhakern::caps::plan_fwd_splits(B, Hkv, group, Lq, Lk, D, num_sms, t));
}

// The family the host gives a call with the score modifiers (0 mma.sync, 1 sm90: attn_dispatch.h
// choose_fwd_family / choose_bwd_family) on a device of capability major.minor, dense operands of
// head dim D: softcap > 0 and / or ALiBi slopes (alibi != 0). And the kernels it runs there:
// *modes_kernel 1 for the kModes instantiations (needs_modes_kernel).
int mhk_emu_modifier_family(int major, int minor, int sm90_compiled, int D, float softcap, int alibi, int backward,
                            int* modes_kernel) {
  static const float slope = 0.5f;
  auto fill = [&](auto& p) {
    p.D = D;
    p.B = 1;
    p.H = p.Hkv = 1;
    p.Lq = p.Lk = 100;
    p.num_splits = 1;
    p.softcap = softcap;
    p.alibi = alibi ? &slope : nullptr;
    p.k_stride = p.v_stride = p.q_stride = {100LL * D, 100LL * D, D};
    *modes_kernel = mhakern::cuda::needs_modes_kernel(p) ? 1 : 0;
  };
  if (backward) {
    mhakern::cuda::BwdParams p;
    fill(p);
    p.do_stride = p.q_stride;
    return static_cast<int>(mhakern::cuda::choose_bwd_family(major, minor, sm90_compiled != 0, p));
  }
  mhakern::cuda::FwdParams p;
  fill(p);
  return static_cast<int>(mhakern::cuda::choose_fwd_family(major, minor, sm90_compiled != 0, p));
}

// The family the host gives a packed call (cu_seqlens set: attn_dispatch.h choose_fwd_family /
// choose_bwd_family) of head dim D on a device of capability major.minor (0 mma.sync, 1 sm90),
// and in *sm90_serves whether the sm90 family's features for that pass (capabilities.h
// kSm90FwdFeatures / kSm90BwdFeatures) list packed sequences.
int mhk_emu_varlen_family(int major, int minor, int sm90_compiled, int D, int backward, int* sm90_serves) {
  static const int32_t cu[3] = {0, 40, 100};
  auto fill = [&](auto& p) {
    p.D = D;
    p.B = 1;
    p.H = p.Hkv = 1;
    p.Lq = p.Lk = 100;
    p.num_splits = 1;
    p.cu_seqlens_q = p.cu_seqlens_k = cu;
    p.num_seqs = 2;
    p.max_seqlen_q = p.max_seqlen_k = 60;
    p.k_stride = p.v_stride = p.q_stride = {100LL * D, 100LL * D, D};
  };
  using mhakern::caps::kVarlen;
  if (backward) {
    mhakern::cuda::BwdParams p;
    fill(p);
    p.do_stride = p.q_stride;
    *sm90_serves = (mhakern::caps::kSm90BwdFeatures & kVarlen) != 0;
    return static_cast<int>(mhakern::cuda::choose_bwd_family(major, minor, sm90_compiled != 0, p));
  }
  mhakern::cuda::FwdParams p;
  fill(p);
  *sm90_serves = (mhakern::caps::kSm90FwdFeatures & kVarlen) != 0;
  return static_cast<int>(mhakern::cuda::choose_fwd_family(major, minor, sm90_compiled != 0, p));
}

// Strides are (batch, head, row) in elements. Returns 0 on success, 1 with mhk_emu_last_error().
// Parameters are filled by the helpers the host code uses (attn_params.h).
int mhk_emu_fwd(int elem, int D, const void* q, const int64_t* q_st, const void* k, const int64_t* k_st, const void* v,
                const int64_t* v_st, void* o, const int64_t* o_st, float* lse, const int32_t* key_lengths, int B, int H,
                int Hkv, int Lq, int Lk, float scale, int causal, int num_splits, float* o_partial, float* lse_partial) {
  const CallSizes s{B, H, Hkv, Lq, Lk, D};
  const auto p = mhakern::cuda::make_fwd_params(s, operand(q, q_st), operand(k, k_st), operand(v, v_st),
                                                operand(o, o_st), lse, key_lengths, scale, causal != 0, num_splits,
                                                o_partial, lse_partial);
  return finish(mhakern::cuda::dispatch_attn_fwd(static_cast<ElemType>(elem), D, p, nullptr));
}

int mhk_emu_bwd(int elem, int D, const void* dout, const int64_t* do_st, const void* q, const int64_t* q_st, const void* k,
                const int64_t* k_st, const void* v, const int64_t* v_st, const void* o, const int64_t* o_st,
                const float* lse, void* dq, const int64_t* dq_st, void* dk, const int64_t* dk_st, void* dv,
                const int64_t* dv_st, float* delta, const int32_t* key_lengths, int B, int H, int Hkv, int Lq, int Lk,
                float scale, int causal, int num_splits, float* dq_partial) {
  const CallSizes s{B, H, Hkv, Lq, Lk, D};
  auto p = mhakern::cuda::make_bwd_params(s, operand(dout, do_st), operand(q, q_st), operand(k, k_st),
                                                operand(v, v_st), operand(o, o_st), lse, operand(dq, dq_st),
                                                operand(dk, dk_st), operand(dv, dv_st), delta, key_lengths, scale,
                                                causal != 0, num_splits, dq_partial);
  FusedWorkspace ws;
  fill_bwd_kernel(p, ws);
  return finish(mhakern::cuda::dispatch_attn_bwd(static_cast<ElemType>(elem), D, p, nullptr));
}

// The forward and backward with the optional modes of docs/contract.md: the parameters filled as
// above, then the mode fields of ModeParams from *modes (null: none), which the caller fills as
// op_common.h's fill_mode_params does (tests/cuda_emulator_harness.py mode_params, whose ctypes
// struct follows the mode table's PARAMS; mhk_emu_mode_params_layout checks it). Packed
// sequences: B = 1, Lq / Lk the token counts, no key_lengths and num_splits 1 (the kernels run
// packed calls unsplit); a KV cache: Lk the logical length, k and v paged when block_table is set.
int mhk_emu_fwd_modes(int elem, int D, const void* q, const int64_t* q_st, const void* k, const int64_t* k_st,
                      const void* v, const int64_t* v_st, void* o, const int64_t* o_st, float* lse,
                      const int32_t* key_lengths, int B, int H, int Hkv, int Lq, int Lk, float scale, int causal,
                      int num_splits, float* o_partial, float* lse_partial, const mhakern::ModeParams* modes) {
  const CallSizes s{B, H, Hkv, Lq, Lk, D};
  auto p = mhakern::cuda::make_fwd_params(s, operand(q, q_st), operand(k, k_st), operand(v, v_st), operand(o, o_st),
                                          lse, key_lengths, scale, causal != 0, num_splits, o_partial, lse_partial);
  mhk_emu::set_modes(p, modes);
  return finish(mhakern::cuda::dispatch_attn_fwd(static_cast<ElemType>(elem), D, p, nullptr));
}

// The backward with *modes as the forward above (dmask among them: the float32 (B, H, Lq, Lk)
// gradient of an additive mask, zeroed by the caller as the op's alloc_dmask does); the kernels
// whatever mhk_emu_set_bwd_kernel says (capabilities.h cuda_bwd_kernel), as the host runs them.
int mhk_emu_bwd_modes(int elem, int D, const void* dout, const int64_t* do_st, const void* q, const int64_t* q_st,
                      const void* k, const int64_t* k_st, const void* v, const int64_t* v_st, const void* o,
                      const int64_t* o_st, const float* lse, void* dq, const int64_t* dq_st, void* dk,
                      const int64_t* dk_st, void* dv, const int64_t* dv_st, float* delta, const int32_t* key_lengths,
                      int B, int H, int Hkv, int Lq, int Lk, float scale, int causal, int num_splits, float* dq_partial,
                      const mhakern::ModeParams* modes) {
  const CallSizes s{B, H, Hkv, Lq, Lk, D};
  auto p = mhakern::cuda::make_bwd_params(s, operand(dout, do_st), operand(q, q_st), operand(k, k_st),
                                          operand(v, v_st), operand(o, o_st), lse, operand(dq, dq_st),
                                          operand(dk, dk_st), operand(dv, dv_st), delta, key_lengths, scale,
                                          causal != 0, num_splits, dq_partial);
  mhk_emu::set_modes(p, modes);
  FusedWorkspace ws;
  fill_bwd_kernel(p, ws);
  return finish(mhakern::cuda::dispatch_attn_bwd(static_cast<ElemType>(elem), D, p, nullptr));
}

// ModeParams' layout as compiled: out[0] its size, out[1 + i] the offset of its i-th field in
// the table's order (generated/modes.h MHK_MODE_PARAMS). Returns the field count; n: room in out.
int mhk_emu_mode_params_layout(long long* out, int n) {
  int i = 0;
  if (i < n) out[i] = static_cast<long long>(sizeof(mhakern::ModeParams));
  ++i;
#define MHK_MODE_PARAM_OFFSET_(type, name, init)                                        \
  if (i < n) out[i] = static_cast<long long>(offsetof(mhakern::ModeParams, name));      \
  ++i;
  MHK_MODE_PARAMS(MHK_MODE_PARAM_OFFSET_)
#undef MHK_MODE_PARAM_OFFSET_
  return i - 1;
}

}  // extern "C"
