// C entry points of the emulated sm90 family (tests/test_cuda_sm90.py builds this with g++ next
// to emu_entry.cpp, emu_schedule.cpp and csrc/cuda/sm90/*.cu compiled as C++ with
// -DMHAKERN_CUDA_EMULATE): the forward through the family's own dispatch switch, the family
// choice by compute capability, and toy kernels that check the emulated sm_90 instructions
// (wgmma after TMA against a plain product, mbarrier transaction counts, setmaxnreg's plan).
#include <cmath>
#include <string>

#include "common/attn_dispatch.h"
#include "sm90/attn_fwd_sm90_kernel.cuh"
#include "sm90/primitives_sm90.cuh"
#include "cuda_emu_sm90.h"
#include "emu_entry_util.h"

#define MHK_WEAK_SM90_INSTANCE_(tag, D)                                                          \
  namespace mhakern {                                                                            \
  namespace cuda {                                                                               \
  __attribute__((weak)) cudaError_t run_attn_fwd_sm90_##tag##_d##D(const FwdParams&, cudaStream_t) { \
    mhk_emu::fail("run_attn_fwd_sm90_" #tag "_d" #D " is not compiled into this emulator build"); \
    return cudaErrorInvalidValue;                                                                \
  }                                                                                              \
  }                                                                                              \
  }
MHK_SM90_FOR_EACH_INSTANCE(MHK_WEAK_SM90_INSTANCE_)
#undef MHK_WEAK_SM90_INSTANCE_

using mhakern::cuda::CallSizes;
using mhakern::cuda::ElemType;
using mhakern::cuda::FwdParams;

namespace {

namespace sm = mhakern::cuda::sm90;
using mhk_emu::sm90::TensorMap;

// Toy: one warpgroup (plus `extra` idle warpgroups). Thread 0 loads A (64 x 64, row-major,
// K inner) and B by TMA into 128-byte swizzled tiles, everyone waits on the mbarrier, then
//   variant 0: D = A B^T with B (N x 64, K inner): wgmma with A and B from K-major descriptors;
//   variant 1: D = A B with B (64 x N, N inner): A from registers (the A fragment read from
//              the swizzled tile), B N-major (transposed) in 64-column panels;
//   variant 2: as 0 without wgmma.fence (an error);
//   variant 3: as 0, but the barrier expects 16 bytes fewer than land (never completes).
// out: D (64 x N) row-major, written by each thread from its accumulator fragment.
template <typename Elem, int N>
void wgmma_toy(int variant, const Elem* A, const Elem* B, float* out) {
  unsigned char* smem = mhk_emu::dynamic_smem();
  unsigned char* sA = smem;                // 64 rows x 128 bytes = 8 KB
  unsigned char* sB = smem + 8192;         // variant 0: N rows x 128 B; variant 1: N / 64 panels of 64 rows
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 8192 + 64 * 2 * N * 2);
  const int tid = mhakern::cuda::thread_index();
  if (tid == 0) sm::mbar_init(bar, 1);
  mhakern::cuda::block_sync();
  if (tid >= 128) return;
  if (tid == 0) {
    TensorMap ma, mb;
    const uint64_t da[4] = {64, 64, 1, 1}, sa[3] = {128, 8192, 8192};
    const uint32_t box[4] = {64, 64, 1, 1};
    mhk_emu::sm90::encode_tensor_map(ma, A, 4, 2, da, sa, box, 128);
    int bytes = 8192;
    sm::tma_load_4d(sA, &ma, 0, 0, 0, 0, bar);
    if (variant != 1) {
      const uint64_t db[4] = {64, static_cast<uint64_t>(N), 1, 1}, sb[3] = {128, 128u * N, 128u * N};
      const uint32_t bb[4] = {64, static_cast<uint32_t>(N), 1, 1};
      mhk_emu::sm90::encode_tensor_map(mb, B, 4, 2, db, sb, bb, 128);
      sm::tma_load_4d(sB, &mb, 0, 0, 0, 0, bar);
    } else {
      const uint64_t db[4] = {static_cast<uint64_t>(N), 64, 1, 1}, sb[3] = {2u * N, 128u * N, 128u * N};
      const uint32_t bb[4] = {64, 64, 1, 1};
      mhk_emu::sm90::encode_tensor_map(mb, B, 4, 2, db, sb, bb, 128);
      for (int pn = 0; pn < N / 64; ++pn) sm::tma_load_4d(sB + pn * 8192, &mb, 64 * pn, 0, 0, 0, bar);
    }
    bytes += 64 * N * 2;
    sm::mbar_arrive_expect_tx(bar, variant == 3 ? bytes - 16 : bytes);
  }
  sm::mbar_wait(bar, 0);
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  if (variant != 2) sm::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) {
    if (variant != 1) {
      const uint64_t a = sm::desc_bits(sm::shared_u32(sA + kk * 32), 16, 1024);
      const uint64_t b = sm::desc_bits(sm::shared_u32(sB + kk * 32), 16, 1024);
      sm::wgmma_ss<N, Elem>(d, a, b, kk > 0);
    } else {
      // A fragment of rows 16 w + g (+8), columns 16 kk + 2 t (+1, +8, +9), read from the
      // swizzled tile with the swizzle written out here (bits 4-6 ^ bits 7-9).
      const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
      auto at = [&](int r, int c) {
        const uint32_t off = r * 128 + c * 2;
        const uint32_t sw = off ^ (((off >> 7) & 7u) << 4);
        uint16_t bits;
        std::memcpy(&bits, sA + sw, 2);
        return static_cast<uint32_t>(bits);
      };
      const int r = 16 * w + g, c = 16 * kk + 2 * t;
      const uint32_t a[4] = {at(r, c) | at(r, c + 1) << 16, at(r + 8, c) | at(r + 8, c + 1) << 16,
                             at(r, c + 8) | at(r, c + 9) << 16, at(r + 8, c + 8) | at(r + 8, c + 9) << 16};
      const uint64_t b = sm::desc_bits(sm::shared_u32(sB + kk * 16 * 128), 8192, 1024);
      sm::wgmma_rs_tb<N, Elem>(d, a, b);
    }
  }
  sm::wgmma_commit();
  if (variant == 4) {
    // A stage released too early: A is loaded again over the tile the committed wgmma still
    // reads, and lands before the wgmma.wait_group that covers it (an error in the emulator,
    // whatever the data: on the GPU the product may read either version).
    if (tid == 0) {
      TensorMap ma;
      const uint64_t da[4] = {64, 64, 1, 1}, sa[3] = {128, 8192, 8192};
      const uint32_t box[4] = {64, 64, 1, 1};
      mhk_emu::sm90::encode_tensor_map(ma, A, 4, 2, da, sa, box, 128);
      sm::mbar_arrive_expect_tx(bar, 8192);
      sm::tma_load_4d(sA, &ma, 0, 0, 0, 0, bar);
    }
    sm::mbar_wait(bar, 1);
  }
  sm::wgmma_wait<0>();
  const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  for (int i = 0; i < N / 2; ++i) out[(16 * w + g + 8 * ((i % 4) / 2)) * N + 8 * (i / 4) + 2 * t + i % 2] = d[i];
}

}  // namespace

extern "C" {

// Strides are (batch, head, row) in elements; *modes: the call's modes as mhk_emu_fwd_modes
// takes them (null: none; packed sequences with B = 1, no key_lengths and num_splits 1). Returns
// 0, or 1 with mhk_emu_last_error().
int mhk_emu_sm90_fwd(int elem, int D, const void* q, const int64_t* q_st, const void* k, const int64_t* k_st,
                     const void* v, const int64_t* v_st, void* o, const int64_t* o_st, float* lse,
                     const int32_t* key_lengths, int B, int H, int Hkv, int Lq, int Lk, float scale, int causal,
                     int num_splits, float* o_partial, float* lse_partial, const mhakern::ModeParams* modes) {
  const CallSizes s{B, H, Hkv, Lq, Lk, D};
  FwdParams p = mhakern::cuda::make_fwd_params(s, mhk_emu::operand(q, q_st), mhk_emu::operand(k, k_st),
                                               mhk_emu::operand(v, v_st), mhk_emu::operand(o, o_st), lse,
                                               key_lengths, scale, causal != 0, num_splits, o_partial, lse_partial);
  mhk_emu::set_modes(p, modes);
  return mhk_emu::finish(mhakern::cuda::dispatch_attn_fwd_sm90(static_cast<ElemType>(elem), D, p, nullptr));
}

// The family the host would pick (0 mma.sync, 1 sm90) for a device of capability major.minor,
// for a call with the modes *modes (null: none) and key lengths (key_lengths != 0) on dense
// operands (B 1, Lk 100, the K head stride as given).
int mhk_emu_fwd_family(int major, int minor, int sm90_compiled, int D, int num_splits,
                       const mhakern::ModeParams* modes, int key_lengths, int Hkv, long long k_head_stride) {
  FwdParams p;
  mhk_emu::set_modes(p, modes);
  p.D = D;
  p.num_splits = num_splits;
  p.B = 1;
  p.Hkv = Hkv;
  p.Lk = 100;
  p.k_stride = {Hkv * 100LL * D, k_head_stride, D};
  p.v_stride = {Hkv * 100LL * D, 100LL * D, D};
  static const int32_t lengths[1] = {50};
  if (key_lengths != 0) p.key_lengths = lengths;
  return static_cast<int>(mhakern::cuda::choose_fwd_family(major, minor, sm90_compiled != 0, p));
}

// The split-K count the host plans for a forward without modes on dense (B, H, L, D) operands,
// on a device of capability major.minor with num_sms multiprocessors: csrc/cuda/cuda_host.cpp's
// sequence (the family choice, then capabilities.h fwd_plan_tiles of that family, then
// plan_splits).
int mhk_emu_fwd_plan_splits(int major, int minor, int sm90_compiled, int D, int B, int Hkv, int group, int Lq, int Lk,
                            int num_sms) {
  FwdParams p;
  p.D = D;
  p.B = B;
  p.Hkv = Hkv;
  p.Lk = Lk;
  p.k_stride = p.v_stride = {static_cast<int64_t>(Hkv) * Lk * D, static_cast<int64_t>(Lk) * D, D};
  const bool sm90 = mhakern::cuda::choose_fwd_family(major, minor, sm90_compiled != 0, p) == mhakern::cuda::FwdFamily::sm90;
  // the call's tiles as the host takes them (a mma.sync call of few packed rows: the decode kernel's)
  const mhakern::caps::FwdPlanTiles t =
      mhakern::caps::fwd_plan_tiles(sm90, D, static_cast<int64_t>(group) * Lq, false);
  return static_cast<int>(mhakern::caps::plan_fwd_splits(B, Hkv, group, Lq, Lk, D, num_sms, t));
}

// The forward's deliberate defect for the next calls (0 none, 1 K's stage released before S
// lands, 2 V's before P V lands, 3 a consumer's Q half before its products read it): a suite
// that still passes with one would not see the bug.
void mhk_emu_sm90_fwd_fault(int fault) { mhk_emu::sm90::fwd_fault() = fault; }

// The multiprocessors the forward's persistent grid is sized for (cuda_emu_sm90.h
// emulated_sms; 2 by default). Returns the previous count.
int mhk_emu_sm90_set_sms(int n) {
  const int old = mhk_emu::sm90::emulated_sms();
  mhk_emu::sm90::emulated_sms() = n;
  return old;
}

// The key tiles of each work item of the sm90 forward (D 128 tiles), in the order the grid
// takes them (tile_scheduler.cuh fwd_work_block): out[w] for w < n_items. Returns the
// number of items (at most cap written).
int mhk_emu_sm90_work_tiles(int B, int Hkv, int group, int Lq, int Lk, int causal, int num_splits, int* out, int cap) {
  using C = mhakern::cuda::sm90::FwdConfigSm90<128>;
  FwdParams p;
  p.B = B;
  p.Hkv = Hkv;
  p.H = Hkv * group;
  p.group = group;
  p.Lq = Lq;
  p.Lk = Lk;
  p.D = 128;
  p.causal = causal != 0;
  p.num_splits = num_splits;
  const int n_mtiles = (group * Lq + C::kBlockM - 1) / C::kBlockM;
  const int n = B * Hkv * n_mtiles * num_splits;
  for (int w = 0; w < n && w < cap; ++w)
    out[w] = mhakern::cuda::sm90::row_tile_work<C::kBlockM, C::kBlockN>(
                 p, mhakern::cuda::sm90::fwd_work_block(p, n_mtiles, w)).n_tiles;
  return n;
}

// What the compiled sm90 forward config (FwdConfigSm90<D>) holds, for tests to compare with
// capabilities.h: out = {query rows, keys per stage, K stages, dynamic shared memory asked,
// V stages}.
// Returns 1 for a head dim without an instance.
int mhk_emu_sm90_config(int d, int* out) {
#define MHK_SM90_CONFIG_CASE_(tag, D)                          \
  if (d == D) {                                                \
    using C = mhakern::cuda::sm90::FwdConfigSm90<D>;           \
    out[0] = C::kBlockM;                                       \
    out[1] = C::kBlockN;                                       \
    out[2] = C::kStagesK;                                      \
    out[3] = C::kSmemAlloc;                                    \
    out[4] = C::kStagesV;                                      \
    return 0;                                                  \
  }
  MHK_SM90_FOR_EACH_HEAD_DIM(MHK_SM90_CONFIG_CASE_, _)
#undef MHK_SM90_CONFIG_CASE_
  return 1;
}

// The toy above: elem 0 fp16 / 1 bf16, N 64 or 128, `warpgroups` in the block (only the first
// computes), launch_regs the per-thread registers at launch (0: setmaxnreg unchecked),
// regs_first / regs_rest: setmaxnreg targets of the first and the other warpgroups (0: none).
int mhk_sm90_selftest_wgmma(int variant, int elem, int N, const void* A, const void* B, float* out) {
  mhk_emu::state().error.clear();
  mhk_emu::sm90::install();
  mhk_emu::sm90::set_launch_registers(0);
  auto body = [&] {
    if (elem == 0 && N == 64) wgmma_toy<__half, 64>(variant, static_cast<const __half*>(A), static_cast<const __half*>(B), out);
    if (elem == 0 && N == 128) wgmma_toy<__half, 128>(variant, static_cast<const __half*>(A), static_cast<const __half*>(B), out);
    if (elem == 1 && N == 64)
      wgmma_toy<__nv_bfloat16, 64>(variant, static_cast<const __nv_bfloat16*>(A), static_cast<const __nv_bfloat16*>(B), out);
    if (elem == 1 && N == 128)
      wgmma_toy<__nv_bfloat16, 128>(variant, static_cast<const __nv_bfloat16*>(A), static_cast<const __nv_bfloat16*>(B), out);
  };
  mhk_emu::launch(body, 1, 128, 8192 + 64 * 2 * 128 * 2 + 64);
  return mhk_emu::state().error.empty() ? 0 : 1;
}

// setmaxnreg's plan: a block of `warpgroups` warpgroups starting at launch_regs per thread;
// warpgroup 0 moves to regs_first, the others to regs_rest (dec when lower, inc when higher).
int mhk_sm90_selftest_setmaxnreg(int warpgroups, int launch_regs, int regs_first, int regs_rest) {
  mhk_emu::state().error.clear();
  mhk_emu::sm90::install();
  mhk_emu::sm90::set_launch_registers(launch_regs);
  auto body = [&] {
    const int wg = mhakern::cuda::thread_index() / 128;
    const int target = wg == 0 ? regs_first : regs_rest;
    mhk_emu::sm90::setmaxnreg(target, target > launch_regs);
  };
  mhk_emu::launch(body, 1, 128 * warpgroups, 0);
  mhk_emu::sm90::set_launch_registers(0);
  return mhk_emu::state().error.empty() ? 0 : 1;
}

// Named barriers: a block of 2 warpgroups; variant 0: warpgroup 1 arrives, warpgroup 0 syncs
// (passes); 1: warpgroup 0 syncs and nobody arrives (a deadlock); 2: the two name different
// thread counts (an error).
int mhk_sm90_selftest_named(int variant) {
  mhk_emu::state().error.clear();
  mhk_emu::sm90::install();
  mhk_emu::sm90::set_launch_registers(0);
  auto body = [&] {
    const int wg = mhakern::cuda::thread_index() / 128;
    if (wg == 1 && variant != 1) mhk_emu::sm90::named_barrier(3, variant == 2 ? 192 : 256, false);
    if (wg == 0) mhk_emu::sm90::named_barrier(3, 256, true);
  };
  mhk_emu::launch(body, 1, 256, 0);
  return mhk_emu::state().error.empty() ? 0 : 1;
}

}  // extern "C"
