// The few warp-level primitives the attention kernels are built from: ldmatrix, mma.sync
// m16n8k16 (fp16/bf16 in, fp32 accumulate), cp.async with zero fill, quad shuffles, exp2.
//
// Compiled by nvcc these are inline PTX for sm_80 and newer. Compiled by a host C++ compiler
// with MHAKERN_CUDA_EMULATE defined they call the CPU emulation in tests/cuda_emulator/cuda_emu.h, which
// runs the very same kernel source on CPU threads-as-fibers for the host-side tests; the
// emulation implements the PTX ISA's documented fragment layouts, so the kernels' index
// arithmetic, masking and softmax are exercised without a GPU.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, .f16/.bf16 inputs, .f32 accumulators), lane l,
// g = l / 4, t = l % 4; a 32-bit register holds two 16-bit values, the lower column first:
//   A (16x16, row major): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B (16x8, "col"):      b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8..2t+9, n = g)
//   C (16x8, fp32):       c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)
// ldmatrix.x4: lanes 8j..8j+7 give the row addresses of 8x8 matrix j; register j of lane l
// receives that matrix's (row g, cols 2t, 2t+1), or with .trans its (rows 2t, 2t+1, col g).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(MHAKERN_CUDA_EMULATE)
#include "cuda_emu.h"  // tests/cuda_emulator/, on the include path of every emulated build
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include "attn_params.h"

#if defined(MHAKERN_CUDA_EMULATE)
#define MHK_DEVICE inline
#define MHK_HD inline
#define MHK_LAUNCH_BOUNDS(n, min_blocks)
#define MHK_UNROLL
#define MHK_DYNAMIC_SMEM(name) unsigned char* name = ::mhk_emu::dynamic_smem()
#else
#define MHK_DEVICE __device__ __forceinline__
#define MHK_HD __host__ __device__ __forceinline__
// min_blocks = 2 for the 128-thread main kernels: without it ptxas caps them at 168 registers
// (room for three CTAs per SM) and the D = 128 forward spilled; two CTAs allow 255, as they use.
#define MHK_LAUNCH_BOUNDS(n, min_blocks) __launch_bounds__(n, min_blocks)
#define MHK_UNROLL _Pragma("unroll")
#define MHK_DYNAMIC_SMEM(name)                                   \
  extern __shared__ __align__(16) unsigned char mhk_smem_buf_[]; \
  unsigned char* name = mhk_smem_buf_
#endif

namespace mhakern {
namespace cuda {

// Element types: how to pack two fp32 values into one 32-bit register of the element type, and
// which mma flavour multiplies them.
template <typename Elem>
struct ElemTraits;

template <>
struct ElemTraits<__half> {
  static constexpr bool kIsBf16 = false;
  static MHK_DEVICE uint32_t pack2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, sizeof(u));  // well-defined type pun; compiles to a move
    return u;
  }
  static MHK_DEVICE float to_float(__half x) { return __half2float(x); }
  static MHK_DEVICE __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct ElemTraits<__nv_bfloat16> {
  static constexpr bool kIsBf16 = true;
  static MHK_DEVICE uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, sizeof(u));
    return u;
  }
  static MHK_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static MHK_DEVICE __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

MHK_HD int imin(int a, int b) { return a < b ? a : b; }
MHK_HD int imax(int a, int b) { return a > b ? a : b; }
MHK_HD constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

#if !defined(MHAKERN_CUDA_EMULATE)

MHK_DEVICE uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices from shared memory (see the layout note above).
MHK_DEVICE void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

MHK_DEVICE void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// d += a * b on a 16x8x16 tile; fp32 accumulation.
template <typename Elem>
MHK_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (ElemTraits<Elem>::kIsBf16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 16 bytes global -> shared, asynchronously; when !valid nothing is read and zeros are written,
// so tiles past the end of a tensor hold zeros, never garbage (0 * NaN would poison P @ V).
MHK_DEVICE void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

MHK_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
MHK_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

MHK_DEVICE void block_sync() { __syncthreads(); }

MHK_DEVICE float shfl_xor(float x, int mask) { return __shfl_xor_sync(0xffffffffu, x, mask); }

// 2^x with the hardware's approximate exponential (relative error ~2^-22, far below the input
// dtypes' resolution); exp2(-inf) = 0.
MHK_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x with the hardware's approximate reciprocal (relative error ~1 ulp); 1 / inf = 0.
MHK_DEVICE float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

MHK_DEVICE int thread_index() { return static_cast<int>(threadIdx.x); }
MHK_DEVICE int64_t block_index() { return static_cast<int64_t>(blockIdx.x); }

// Host side of a launch. Above 48 KB a kernel's dynamic shared memory must be opted into.
template <typename Params>
inline cudaError_t set_max_dynamic_smem(void (*kernel)(Params), int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// 1-D grid (up to 2^31 - 1 blocks: kernels decode their block index themselves, so no problem
// size hits the 65535 limit of grid dims y and z).
template <typename Params>
inline void launch_kernel(void (*kernel)(Params), int64_t grid, int threads, int smem_bytes, cudaStream_t stream,
                          const Params& params) {
  kernel<<<static_cast<unsigned int>(grid), threads, smem_bytes, stream>>>(params);
}

#else  // MHAKERN_CUDA_EMULATE

inline void ldsm_x4(uint32_t (&r)[4], const void* p) { ::mhk_emu::ldmatrix_x4(r, p, false); }
inline void ldsm_x4_trans(uint32_t (&r)[4], const void* p) { ::mhk_emu::ldmatrix_x4(r, p, true); }
template <typename Elem>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  ::mhk_emu::mma_m16n8k16(d, a, b0, b1, ElemTraits<Elem>::kIsBf16);
}
inline void cp_async_16(void* smem, const void* gmem, bool valid) { ::mhk_emu::cp_async_16(smem, gmem, valid); }
inline void cp_async_commit() { ::mhk_emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
  ::mhk_emu::cp_async_wait(N);
}
inline void block_sync() { ::mhk_emu::syncthreads(); }
inline float shfl_xor(float x, int mask) { return ::mhk_emu::shfl_xor(x, mask); }
inline float fast_exp2(float x) { return std::exp2(x); }
inline float fast_rcp(float x) { return 1.f / x; }
inline int thread_index() { return ::mhk_emu::thread_index(); }
inline int64_t block_index() { return ::mhk_emu::block_index(); }
template <typename Params>
inline cudaError_t set_max_dynamic_smem(void (*)(Params), int bytes) {
  return ::mhk_emu::check_dynamic_smem(bytes);
}
template <typename Params>
inline void launch_kernel(void (*kernel)(Params), int64_t grid, int threads, int smem_bytes, cudaStream_t,
                          const Params& params) {
  ::mhk_emu::launch([&] { kernel(params); }, grid, threads, smem_bytes);
}

#endif

// Reductions over the four lanes that hold one row of an mma accumulator (lanes 4g..4g+3).
MHK_DEVICE float quad_max(float x) {
  x = fmaxf(x, shfl_xor(x, 1));
  return fmaxf(x, shfl_xor(x, 2));
}
MHK_DEVICE float quad_sum(float x) {
  x += shfl_xor(x, 1);
  return x + shfl_xor(x, 2);
}

// Offsets, in elements, of a packed query row. The query rows of the H / Hkv heads that share
// KV head hkv are numbered r = (h - hkv * group) * Lq + i, so a tile of rows can span several
// query heads: a decode call (Lq = 1) puts all heads of a group into one tile, which then reads
// each key block once for all of them.
MHK_DEVICE int64_t packed_row_offset(const HeadStrides& s, int b, int hkv, int group, int Lq, int r) {
  const int h = hkv * group + r / Lq;
  const int i = r % Lq;
  return b * s.batch + h * s.head + static_cast<int64_t>(i) * s.row;
}

// Index of a packed row in a contiguous (B, H, Lq) array (lse, delta).
MHK_DEVICE int64_t packed_row_linear(int b, int H, int hkv, int group, int Lq, int r) {
  const int h = hkv * group + r / Lq;
  return (static_cast<int64_t>(b) * H + h) * Lq + r % Lq;
}

// Number of keys visible to query i with bottom-right causal masking only: keys [0, limit) are
// visible (limit <= 0: none). The kernels use Visibility below, which covers every alignment
// and window.
MHK_DEVICE int visible_limit(int i, int Lk_b, int Lq, bool causal) {
  return causal ? imin(Lk_b, i + Lk_b - Lq + 1) : Lk_b;
}

// Which keys the query rows of one batch element see through key_lengths, causal masking and
// the window (docs/contract.md "Visibility"; attn_mask aside): query i sees keys
// [key_lo(i), key_hi(i)), none when key_hi <= key_lo. Both bounds are nondecreasing in i, so the
// rows [i_lo, i_hi] of a tile together see keys in [key_lo(i_lo), key_hi(i_hi)) and each of
// them sees all of [key_lo(i_hi), key_hi(i_lo)): key blocks outside the first range are skipped,
// and only blocks not inside the second are masked per element.
struct Visibility {
  int Lk_b;   // keys at or past it are hidden (key_lengths)
  int diag;   // the diagonal key of row i is i + diag: 0 top-left, Lk_b - Lq bottom-right
  int right;  // visible keys satisfy j <= i + diag + right; -1: no such bound
  int left;   // visible keys satisfy j >= i + diag - left; -1: no such bound
};

template <typename Params>
MHK_HD Visibility visibility_of(const Params& p, int Lk_b) {
  // i + diag lies in [-Lq, max(Lk, Lq)), so a size of Lk + Lq already bounds nothing; clamping
  // there keeps every sum of key_lo / key_hi in 32 bits (Lk, Lq < 2^30: capabilities.h).
  const int64_t reach = static_cast<int64_t>(p.Lk) + p.Lq;
  Visibility v;
  v.Lk_b = Lk_b;
  v.diag = p.top_left ? 0 : Lk_b - p.Lq;
  // Causal is the window with right = min(right, 0), -1 counting as unbounded.
  const int64_t right = p.causal ? 0 : p.window_right;
  v.right = right < 0 ? -1 : static_cast<int>(right < reach ? right : reach);
  v.left = p.window_left < 0 ? -1 : static_cast<int>(p.window_left < reach ? p.window_left : reach);
  return v;
}

// One past the last key visible to query i (may be <= 0: none).
MHK_HD int key_hi(const Visibility& v, int i) {
  if (v.right < 0) return v.Lk_b;
  const int t = i + v.diag;
  return t >= v.Lk_b - v.right ? v.Lk_b : t + v.right + 1;
}

// The first key visible to query i (at most Lk_b).
MHK_HD int key_lo(const Visibility& v, int i) {
  if (v.left < 0) return 0;
  const int t = i + v.diag;
  return t <= v.left ? 0 : imin(t - v.left, v.Lk_b);
}

// Per-element masking of one key block (the block's keys are not all visible to all its rows).
enum MaskKind : int {
  kMaskNone = 0,  // every key of the block is visible to every row: no per-element test
  kMaskHi = 1,    // keys at or past the row's limit are hidden (key_lengths, causal)
  kMaskLoHi = 2,  // also keys below the row's first visible key (a left window)
};

// The keys of a tile of query rows [i_lo, i_hi] (see Visibility): the rows together see keys
// in [first, any) (first rounded down to a block of kBlockN), and each row sees all of
// [all_lo, all_hi): a block inside that needs no per-element mask.
template <int kBlockN>
MHK_DEVICE void tile_key_range(const Visibility& v, int i_lo, int i_hi, int& first, int& any, int& all_lo,
                               int& all_hi) {
  any = imax(0, key_hi(v, i_hi));
  first = imin(key_lo(v, i_lo), any) / kBlockN * kBlockN;
  all_lo = key_lo(v, i_hi);
  all_hi = imax(0, key_hi(v, i_lo));
}


// ---- attn_mask and dropout (docs/contract.md "Visibility", "Dropout") ----------------------
// The kernels built with kModes read these once per CTA; per query row they stage the offset of
// the row's mask row and the row's dropout hash in shared memory.

// Per query row data of the kModes kernels, staged in shared memory: the element offset of the
// row's mask row and its dropout hash r_i (dropout_row_hash); with ALiBi the row's slope in base
// 2 (-slope(b, h) * log2(e)) and its diagonal key i + off (alibi_row).
struct ModeRows {
  const int64_t* mask_row;
  const uint32_t* drop;
  const int64_t* dmask_row;  // the backward's dQ kernel: offset of the row in dmask, -1 past the end
  const float* alibi_slope;
  const int* alibi_pos;
};

// Added to a kernel's opt_in_dynamic_smem tag (smem_opt_in.cuh) for its kModes instantiation.
constexpr int kTagModes = 16;


struct ExtraModes {
  const void* mask;     // (B, H, Lq, Lk) view; nullptr: none
  int mask_kind;        // 0 none, 1 bool bytes (nonzero = visible), 2 additive float32
  int64_t mask_sk;      // element stride along the keys (0 when broadcast)
  bool dropout;         // dropout_p > 0
  uint32_t threshold;   // keep iff hash >= threshold
  float keep_scale;     // 1 / (1 - dropout_p)
  float* dmask;         // the backward: (B, H, Lq, Lk) float32 dL/dscore, or nullptr
  int Lk;
  // Score modifiers (mode_params.h): softcap > 0 and its constants (softcap_tanh), ALiBi slopes.
  bool softcap;
  float cap_k;    // 2 * log2(e) * scale / softcap: exp2(s * cap_k) = exp(2 * scale * s / softcap)
  float cap_out;  // softcap * log2(e): the capped score in base 2 is cap_out * tanh
  bool alibi;
};

template <typename Params>
MHK_HD ExtraModes extra_modes_of(const Params& p) {
  ExtraModes m;
  m.mask = p.mask;
  m.mask_kind = p.mask != nullptr ? p.mask_kind : 0;
  m.mask_sk = p.mask_sk;
  m.dropout = p.dropout_p > 0.0;
  m.threshold = dropout_threshold(p.dropout_p);  // mode_params.h
  m.keep_scale = m.dropout ? static_cast<float>(1.0 / (1.0 - p.dropout_p)) : 1.f;
  m.dmask = p.dmask;
  m.Lk = p.Lk;
  m.softcap = p.softcap > 0.f;
  m.cap_k = m.softcap ? 2.f * kLog2e * p.scale / p.softcap : 0.f;
  m.cap_out = p.softcap * kLog2e;
  m.alibi = p.alibi != nullptr;
  return m;
}

// tanh(scale * s / softcap) for the raw product s = q.k, as 1 - 2 / (1 + exp(2 z)): one ex2 and
// one rcp, absolute error a few ulp of 1 over the whole range; +-inf give +-1, NaN stays NaN.
// Not tanh.approx.f32: its documented relative error (2^-10.987) times the cap is an error in
// the logit, and modelled at that bound in the float64 reference (B 2, H 4, 64 x 128 keys,
// causal, D 64) it breaks the tolerance rule: fp16 out error 1.46e-3 against a bound of 1.48e-3
// at softcap 20, 0.53 against 0.016 at softcap 50 with logits x30 (bf16 0.54 against 0.135);
// this formula, in fp32, stays at 2.4e-4 / 7.5e-3 (bf16 6.2e-2). The scaled, capped score is softcap * tanh (base 2:
// cap_out * tanh), and the backward's chain factor 1 - tanh^2.
MHK_DEVICE float softcap_tanh(const ExtraModes& m, float s) {
  return 1.f - 2.f * fast_rcp(1.f + fast_exp2(s * m.cap_k));
}

// The cap's first step on a raw product s: its tanh when capped, else s itself. The backward
// kernels take the tanh over a whole score tile in a pass of their own (in place, so that the
// tile then holds what the chain factor 1 - tanh^2 reads; inline, with the dP tile live beside
// the ex2 / rcp chains and the tanh kept apart, the D 64 dK/dV kernel spilled in its loop and the
// D 96 fused kernel on sm_90).
MHK_DEVICE float cap_pass(const ExtraModes& m, float s) { return m.softcap ? softcap_tanh(m, s) : s; }

// The score modifiers of query row `row` (a tile row of ModeRows) and key j, in base 2
// (docs/contract.md "Score modifiers"): c is cap_pass of the raw product q.k; the scale and the
// cap, then the ALiBi bias -slope * |i + off - j|.
MHK_DEVICE float modified_score_log2(const ExtraModes& m, float c, float scale_log2, const ModeRows& rows, int row,
                                     int j) {
  float x = m.softcap ? m.cap_out * c : c * scale_log2;
  if (m.alibi) {
    const int d = rows.alibi_pos[row] - j;
    x += rows.alibi_slope[row] * static_cast<float>(d < 0 ? -d : d);
  }
  return x;
}

// The backward's chain factor through the cap for a pair whose cap_pass is c: dS_raw = dS *
// (1 - tanh^2). A hidden pair's is 0: its raw score may be NaN (a NaN key a tile loads).
MHK_DEVICE float cap_chain(const ExtraModes& m, float c, bool hidden) { return hidden ? 0.f : 1.f - c * c; }

// The ALiBi row data of query i of query head h, batch element b: the slope in base 2, negated
// (0 without ALiBi), and the diagonal key i + off (Visibility::diag).
template <typename Params>
MHK_HD void alibi_row(const Params& p, const Visibility& vis, int b, int h, int i, float& slope_log2, int& pos) {
  slope_log2 = p.alibi != nullptr ? -p.alibi[b * p.alibi_sb + h * p.alibi_sh] * kLog2e : 0.f;
  pos = i + vis.diag;
}

// Element offset of the mask row of query i of head h, batch element b.
template <typename Params>
MHK_HD int64_t mask_row_offset(const Params& p, int b, int h, int i) {
  return b * p.mask_sb + h * p.mask_sh + static_cast<int64_t>(i) * p.mask_sq;
}

// The contract's r_i for query i of query head h, batch element b: key j is kept iff
// mix32(r_i + j) >= threshold.
template <typename Params>
MHK_HD uint32_t dropout_row_hash(const Params& p, int b, int h, int i) {
  return ::mhakern::dropout_row_hash(p.seed, static_cast<uint32_t>(static_cast<int64_t>(b) * p.H + h),
                                     static_cast<uint32_t>(i));
}

// The mask's contribution to a base-2 score: a float bias times log2(e), or -inf where a bool
// mask hides the key.
MHK_DEVICE float mask_bias_log2(const ExtraModes& m, int64_t row_off, int j) {
  const int64_t at = row_off + j * m.mask_sk;
  if (m.mask_kind == 1) return static_cast<const unsigned char*>(m.mask)[at] != 0 ? 0.f : -INFINITY;
  return static_cast<const float*>(m.mask)[at] * kLog2e;
}

// The factor dropout applies to probability (i, j): 1 / (1 - p) if kept, else 0.
MHK_DEVICE float dropout_factor(const ExtraModes& m, uint32_t row_hash, int j) {
  return mix32(row_hash + static_cast<uint32_t>(j)) >= m.threshold ? m.keep_scale : 0.f;
}

// The range of query positions i covered by packed rows [r0, r0 + nrows): a tile that wraps
// from one head into the next covers, conservatively, every position.
MHK_DEVICE void tile_query_range(int r0, int nrows, int Lq, int& i_lo, int& i_hi) {
  i_lo = r0 % Lq;
  i_hi = i_lo + nrows - 1;
  if (i_hi >= Lq) {
    i_lo = 0;
    i_hi = Lq - 1;
  }
}

// What a CTA of one split needs of its row block [r0, r0 + nrows) of packed rows: the
// visibility, the keys [kv_begin, kv_end) it walks (split-K cuts the block's own key range
// [first, any) into whole blocks of kBlockN), the keys [kv_all_lo, kv_all) every row sees (no
// per-element mask inside), and whether a left window masks too.
struct RowBlockKeys {
  Visibility vis;
  int kv_begin, kv_end, kv_all_lo, kv_all;
  bool lo_masks;
};
template <int kBlockN, typename Params>
MHK_DEVICE RowBlockKeys row_block_keys(const Params& p, int Lk_b, int r0, int nrows, int split) {
  RowBlockKeys k;
  k.vis = visibility_of(p, Lk_b);
  int i_lo, i_hi, kv_first, kv_any;
  tile_query_range(r0, nrows, p.Lq, i_lo, i_hi);
  tile_key_range<kBlockN>(k.vis, i_lo, i_hi, kv_first, kv_any, k.kv_all_lo, k.kv_all);
  const int per_split = ceil_div(ceil_div(kv_any - kv_first, kBlockN), p.num_splits) * kBlockN;
  k.kv_begin = kv_first + split * per_split;
  k.kv_end = imin(kv_any, k.kv_begin + per_split);
  k.lo_masks = k.vis.left >= 0;
  return k;
}

}  // namespace cuda
}  // namespace mhakern
