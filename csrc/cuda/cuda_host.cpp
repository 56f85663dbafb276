// The CUDA kernels of the dispatcher ops mhakern_C::fwd and mhakern_C::bwd (schemas in
// csrc/bindings.cpp; one schema for every device): see cuda_host.h.
//
// The kernels (csrc/cuda/{mma,sm90}/*.cu) see no torch type: this file checks what keeps them in bounds
// (op_common.h's memory-safety checks, alike on every device, and here what the tensor-core
// kernels need besides; the arguments a user names were checked by the Python operator layer,
// mhakern/checks.py, before the call), fills the
// plain parameter structs through the helpers the emulator also uses (attn_params.h), plans the
// split-K (capabilities.h), allocates the outputs and workspaces through torch's caching
// allocator, and launches on torch's current stream of the tensors' device.
#include "cuda_host.h"

// Light torch headers (not torch/extension.h): tensors, the stream, the device guard and the
// operator registration only.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

#include "../capabilities.h"
#include "../op_common.h"
#include "common/attn_dispatch.h"

namespace mhakern {
namespace cuda {
namespace {

ElemType elem_type_of(const at::Tensor& q) {
  if (q.scalar_type() == at::kHalf) return ElemType::fp16;
  if (q.scalar_type() == at::kBFloat16) return ElemType::bf16;
  TORCH_CHECK_TYPE(false, "q: the cuda kernels take float16 or bfloat16 tensors, got ", q.scalar_type(),
                   " (float32 is served by the triton and reference backends)");
  return ElemType::fp16;
}

std::string head_dim_list() {
  std::string s;
  for (int i = 0; i < caps::kCudaNumHeadDims; ++i) s += (i ? ", " : "") + std::to_string(caps::kCudaHeadDims[i]);
  return s;
}

// ", and for the backward also D" for the head dims with only a backward.
std::string bwd_only_list() {
  std::string s;
  for (int i = 0; i < caps::kCudaNumBwdOnlyHeadDims; ++i)
    s += (i ? ", " : "; for the backward also ") + std::to_string(caps::kCudaBwdOnlyHeadDims[i]);
  return s;
}

// The modes a forward call of a head dim that only the sm90 forward has must not use: those the
// cuda family serves and the sm90 forward does not (capabilities.h kCudaFeatures,
// kSm90FwdFeatures; mask_grad is the backward's), as the feature names the Python layer uses.
std::string modes_off_sm90_fwd() {
  const unsigned off = caps::kCudaFeatures & ~caps::kSm90FwdFeatures & ~static_cast<unsigned>(caps::kMaskGrad);
  std::string s;
  for (int f = 0; f < caps::kNumFeatures; ++f)
    if (off & (1u << f)) s += (s.empty() ? "" : ", ") + std::string(caps::kFeatureNames[f]);
  return s;
}

Operand operand(const at::Tensor& x) {
  Operand o;
  o.ptr = x.data_ptr();
  o.stride.batch = x.stride(0);
  o.stride.head = x.stride(1);
  o.stride.row = x.stride(2);
  return o;
}

// What the tensor-core kernels need of a (B, H, L, D) operand besides op_common.h's checks:
// 16-byte aligned rows (cp.async and the 16-byte stores move 8 elements at a time).
void check_aligned(const at::Tensor& x, const char* name) {
  for (int d = 0; d < 3; ++d)
    TORCH_CHECK_VALUE(x.size(d) <= 1 || x.stride(d) % 8 == 0, name,
                      ": strides of dims 0-2 must be multiples of 8 elements (16 bytes), got strides ", x.strides(),
                      " (pass .contiguous())");
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, name,
                    ": data must be 16-byte aligned (got a view at an odd offset; pass .contiguous())");
}

// Everything forward and backward check alike, all of it what the kernels need to stay in
// bounds (no argument check of the Python layer is repeated here); returns the sizes.
op::Sizes check_common(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       const std::optional<at::Tensor>& key_lengths, const op::ModeArgs& modes, bool backward) {
  // check_qkv first: it names an undefined operand (None from Python) before anything reads its device.
  const op::Sizes s = op::check_qkv(q, k, v, scale, &modes);
  TORCH_CHECK_VALUE(q.is_cuda(), "q: expected a CUDA tensor, got one on ", q.device());
  elem_type_of(q);
  TORCH_CHECK_VALUE(s.Dv == s.D, "v: head dim ", s.Dv, " differs from q's (", s.D,
                    "); the cuda kernels need them equal");
  // A head dim only the sm90 forward has (capabilities.h) passes here for the forward; attn_fwd
  // refuses it once it knows the family (fwd_runs_sm90). The backward also takes the head dims
  // with only the fused mma.sync backward (D 256).
  TORCH_CHECK_VALUE(caps::cuda_head_dim_supported(s.D) || (!backward && caps::sm90_head_dim_supported(s.D)) ||
                        (backward && caps::cuda_bwd_only_head_dim(s.D)),
                    "q: head dim ", s.D, " has no compiled cuda kernel", backward ? " for the backward" : "",
                    " (supported: ", head_dim_list(), backward ? bwd_only_list() : "", ")");
  check_aligned(q, "q");
  check_aligned(k, "k");
  check_aligned(v, "v");
  TORCH_CHECK_VALUE((s.H / s.Hkv) * s.Lq <= caps::kCudaMaxGroupRows, "q: (heads per kv head) x Lq = ",
                    (s.H / s.Hkv) * s.Lq, " exceeds the cuda kernels' limit of ", caps::kCudaMaxGroupRows);
  TORCH_CHECK_VALUE(s.Lk < caps::kCudaMaxKeys, "k: length ", s.Lk, " exceeds the cuda kernels' limit of ",
                    caps::kCudaMaxKeys - 1);
  TORCH_CHECK_VALUE(s.B <= std::numeric_limits<int>::max() && s.H <= std::numeric_limits<int>::max(),
                    "q: batch and heads must fit 32 bits, got shape ", q.sizes());
  op::check_key_lengths_meta(key_lengths, q, s);
  op::check_modes(modes, q, s, caps::kCudaFeatures, "cuda", backward);
  return s;
}

// The key lengths for the kernels (contiguous int32, or nullptr). Their values are checked here
// (one small device-to-host read) except while the stream is being captured into a CUDA graph,
// where a read is impossible; the kernels clamp every length into [0, Lk] in any case, so a bad
// value never makes them read outside k and v.
const int32_t* key_lengths_ptr(const std::optional<at::Tensor>& key_lengths, const op::Sizes& s,
                               cudaStream_t stream, at::Tensor& keep) {
  if (!key_lengths.has_value() || !key_lengths->defined()) return nullptr;
  keep = key_lengths->contiguous();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  TORCH_CHECK(err == cudaSuccess, "key_lengths: cudaStreamIsCapturing failed: ", cudaGetErrorString(err));
  if (capture == cudaStreamCaptureStatusNone && s.B > 0) {
    const at::Tensor host = keep.to(at::kCPU);
    op::check_key_length_values(host.const_data_ptr<int32_t>(), s);
  }
  return keep.const_data_ptr<int32_t>();
}

int num_sms(int device) {
  // Per device, read once (a driver query).
  static std::atomic<int> cache[64] = {};
  if (device >= 0 && device < 64) {
    const int n = cache[device].load(std::memory_order_relaxed);
    if (n > 0) return n;
  }
  int n = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  TORCH_CHECK(err == cudaSuccess, "cudaDeviceGetAttribute(multiProcessorCount) failed: ", cudaGetErrorString(err));
  if (device >= 0 && device < 64) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

// An error left pending by an earlier operation is not this kernel's: report it as what it is,
// before launching, so that the error read after the launch is the launch's own.
void check_no_pending_error(const char* op) {
  const cudaError_t pending = cudaGetLastError();
  TORCH_CHECK(pending == cudaSuccess, op, ": a CUDA error from an earlier operation was still pending (not raised ",
              "by mhakern's kernels): ", cudaGetErrorString(pending));
}

// The keys split-K planning sees for one query tile of block_m packed rows (the kernels split
// each tile's own visible key range, csrc/cuda/common/primitives.cuh tile_key_range): with a window
// bounded on both sides (a left size, and a right size or causal) a row sees at most
// left + right + 1 keys, so the tile's rows (at most min(Lq, block_m) consecutive positions
// when it holds one head's rows; any of the Lq positions when it packs several heads) see at
// most left + right + positions of them, plus a block for the rounding down to a block start.
// Otherwise the whole Lk.
int64_t planned_keys(const op::ModeArgs& m, bool causal, const op::Sizes& s, int64_t block_m, int64_t block_n) {
  if (m.window_left < 0 || (m.window_right < 0 && !causal)) return s.Lk;
  const int64_t right = causal ? 0 : m.window_right;
  const int64_t positions = s.H == s.Hkv ? std::min(s.Lq, block_m) : s.Lq;
  const int64_t span = std::min(m.window_left, s.Lk) + std::min(right, s.Lk) + positions + block_n;
  return std::min(span, s.Lk);
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

// ---- the kernel family of a forward call ----------------------------------------------------
#if defined(MHAKERN_WITH_SM90A)
constexpr bool kSm90Compiled = true;  // the build has the sm_90a pass (mhakern/_build.py)
#else
constexpr bool kSm90Compiled = false;
#endif

// Compute capability (major, minor) of a device, read once per device.
std::pair<int, int> compute_capability(int device) {
  static std::atomic<int> cache[64] = {};  // major * 100 + minor + 1; 0 = not read yet
  if (device >= 0 && device < 64) {
    const int c = cache[device].load(std::memory_order_relaxed);
    if (c > 0) return {(c - 1) / 100, (c - 1) % 100};
  }
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  TORCH_CHECK(err == cudaSuccess, "cudaDeviceGetAttribute(computeCapability) failed: ", cudaGetErrorString(err));
  if (device >= 0 && device < 64) cache[device].store(major * 100 + minor + 1, std::memory_order_relaxed);
  return {major, minor};
}

// Runs the forward on the family choose_fwd_family (common/attn_dispatch.h) picks for the device:
// the sm90 family (wgmma + TMA) where it serves the call on a 9.0 device, else mma.sync (always
// mma.sync when forced through cuda_force_fwd_family / MHAKERN_CUDA_FWD_FAMILY).
bool fwd_runs_sm90(const FwdParams& p, int device) {
  const std::pair<int, int> cc = compute_capability(device);
  return op::forced_fwd_family() == 0 && choose_fwd_family(cc.first, cc.second, kSm90Compiled, p) == FwdFamily::sm90;
}
cudaError_t launch_fwd(ElemType t, const FwdParams& p, int device, cudaStream_t stream) {
  if (fwd_runs_sm90(p, device)) return dispatch_attn_fwd_sm90(t, p.D, p, stream);
  return dispatch_attn_fwd(t, p.D, p, stream);
}

std::tuple<at::Tensor, at::Tensor> attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
                                            const op::ModeArgs& modes) {
  const op::Sizes s = check_common(q, k, v, scale, key_lengths, modes, false);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();

  at::Tensor out = op::empty_like_heads(q, s.D);
  at::Tensor lse = at::empty({s.B, s.H, s.Lq}, q.options().dtype(at::kFloat));
  if (s.B == 0 || s.H == 0 || s.Lq == 0) return {out, lse};
  at::Tensor kl;
  const int32_t* kl_ptr = key_lengths_ptr(key_lengths, s, stream, kl);
  if (s.Lk == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  const CallSizes cs{s.B, s.H, s.Hkv, s.Lq, s.Lk, s.D};
  FwdParams p = make_fwd_params(cs, operand(q), operand(k), operand(v), operand(out), lse.data_ptr<float>(), kl_ptr,
                                static_cast<float>(scale), causal, 1, nullptr, nullptr);
  op::fill_mode_params(p, modes);
  if (modes.paged()) p.page_size = k.size(2);  // k: (num_pages, Hkv, page_size, D)
  // Split-K is planned with the tiles of the family that will run the call (its choice does not
  // depend on the split count).
  const bool sm90 = fwd_runs_sm90(p, q.device().index());
  TORCH_CHECK_VALUE(sm90 || caps::cuda_head_dim_supported(s.D), "q: head dim ", s.D,
                    " is served only by the sm_90a forward (a compute capability ", caps::kSm90CapabilityMajor, ".",
                    caps::kSm90CapabilityMinor, " device, a build with the sm_90a pass, none of the modes ",
                    modes_off_sm90_fwd(), ", K/V without a stride-0 dim, the family not forced to mma_sync); the "
                    "cuda kernels otherwise take ", head_dim_list());
  const caps::FwdPlanTiles t = caps::fwd_plan_tiles(sm90, static_cast<int>(s.D), s.H / s.Hkv * s.Lq,
                                                    needs_modes_kernel(p));
  const int64_t forced = op::cuda_forced_splits().load();
  // Packed sequences run unsplit (attn_fwd_kernel.cuh run_attn_fwd: one CTA per query tile of
  // each sequence; the combine kernel's rows are dense ones).
  const int64_t splits = p.cu_seqlens_q != nullptr ? 1
                         : forced > 0               ? forced
                                                    : caps::plan_fwd_splits(s.B, s.Hkv, s.H / s.Hkv, s.Lq,
                                                            planned_keys(modes, causal, s, t.m, t.n), s.D,
                                                            num_sms(q.device().index()), t);
  at::Tensor o_partial, lse_partial;  // kept alive until the kernels are queued (caching allocator)
  if (splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    o_partial = at::empty({splits, s.B, s.H, s.Lq, s.D}, f32);
    lse_partial = at::empty({splits, s.B, s.H, s.Lq}, f32);
    p.num_splits = static_cast<int>(splits);
    p.o_partial = o_partial.data_ptr<float>();
    p.lse_partial = lse_partial.data_ptr<float>();
  }
  check_no_pending_error("mhakern_C::fwd");
  check_launch(launch_fwd(elem_type_of(q), p, q.device().index(), stream), "mhakern_C::fwd");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attn_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal, const std::optional<at::Tensor>& key_lengths,
    const op::ModeArgs& modes) {
  const op::Sizes s = check_common(q, k, v, scale, key_lengths, modes, true);
  op::check_bwd_operands(dout, q, out, lse, s);
  check_aligned(dout, "dout");
  check_aligned(out, "out");
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();

  at::Tensor dq = op::empty_like_heads(q, s.D);
  at::Tensor dk = op::empty_like_heads(k, s.D);
  at::Tensor dv = op::empty_like_heads(v, s.D);
  at::Tensor dmask = op::alloc_dmask(modes, q, s);
  if (s.B == 0 || s.H == 0 || s.Lq == 0 || s.Lk == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, dmask};
  }
  at::Tensor kl;
  const int32_t* kl_ptr = key_lengths_ptr(key_lengths, s, stream, kl);
  const at::Tensor lse_c = lse.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor delta = at::empty({s.B, s.H, s.Lq}, f32);
  const CallSizes cs{s.B, s.H, s.Hkv, s.Lq, s.Lk, s.D};
  BwdParams p = make_bwd_params(cs, operand(dout), operand(q), operand(k), operand(v), operand(out),
                                lse_c.const_data_ptr<float>(), operand(dq), operand(dk), operand(dv),
                                delta.data_ptr<float>(), kl_ptr, static_cast<float>(scale), causal, 1, nullptr);
  op::fill_mode_params(p, modes);
  if (modes.mask_grad) p.dmask = dmask.data_ptr<float>();  // zeros; the dQ kernel writes the visible entries
  // The family first (it does not depend on the split count), then the dQ splits planned for the
  // dQ tiles of that family.
  const std::pair<int, int> cc = compute_capability(q.device().index());
  const bool on_sm90 =
      op::forced_bwd_family() == 0 && choose_bwd_family(cc.first, cc.second, kSm90Compiled, p) == BwdFamily::sm90;
  // The mma.sync family's backward: the split kernels or the fused one (capabilities.h
  // cuda_bwd_kernel; head dims with only the fused kernel run it). The fused kernel has no
  // split-K (a CTA per key block); its workspace is zeroed here.
  // Packed sequences run the split kernels (the fused kernel has no packed path).
  const bool packed = p.cu_seqlens_q != nullptr;
  p.bwd_kernel = on_sm90 ? caps::kBwdSplit : caps::cuda_bwd_kernel(s.D, op::mma_bwd_kernel().get(), packed);
  const bool fused = p.bwd_kernel != caps::kBwdSplit;
  TORCH_CHECK_VALUE(!(packed && fused), "cu_seqlens_q: the cuda backward of head dim ", s.D,
                    " (the fused kernel only) does not take packed sequences; the split kernels do (head dims ",
                    head_dim_list(), ")");
  at::Tensor dq_accum, dq_counters;  // kept alive until the kernels are queued (caching allocator)
  if (fused) {
    dq_accum = at::zeros({s.B, s.H, s.Lq, s.D}, f32);
    dq_counters = at::zeros({caps::cuda_fused_bwd_counters(s.B, s.Hkv, s.H / s.Hkv * s.Lq, static_cast<int>(s.D))},
                            q.options().dtype(at::kInt));
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq_counters = reinterpret_cast<uint32_t*>(dq_counters.data_ptr<int32_t>());
  }
  const caps::CudaTiles t = caps::cuda_tiles(static_cast<int>(s.D));
  const int64_t dq_m = on_sm90 ? caps::kSm90BwdDqBlockM : t.dq_m;
  const int64_t dq_n = on_sm90 ? caps::sm90_bwd_dq_n(static_cast<int>(s.D)) : t.dq_n;
  // The fused sm90 kernel in place of the split ones when chosen (op_common.h sm90_bwd_kernel;
  // default capabilities.h kSm90BwdFused): no dQ split; its zeroed fp32 workspace holds the dQ
  // sums and the row tiles' semaphores.
  if (on_sm90 && op::sm90_bwd_kernel_for(op::sm90_bwd_kernel().get()) == caps::kSm90BwdKernelFused) {
    at::Tensor ws = at::zeros({caps::sm90_bwd_fused_workspace_floats(s.B, s.Hkv, s.H / s.Hkv, s.Lq, s.D)}, f32);
    check_no_pending_error("mhakern_C::bwd");
    check_launch(dispatch_attn_bwd_sm90_fused(elem_type_of(q), p.D, p, ws.data_ptr<float>(),
                                              caps::kSm90BwdFusedDeterministic, stream),
                 "mhakern_C::bwd");
    return {dq, dk, dv, dmask};
  }
  const int64_t forced = op::cuda_forced_splits().load();
  // Packed sequences run unsplit too (attn_bwd_kernel.cuh run_attn_bwd: a CTA per query tile of
  // each sequence; the dQ reduce kernel's rows are dense ones).
  const int64_t splits = fused || packed ? 1
                         : forced > 0                       ? forced
                                                            : caps::plan_splits(s.B, s.Hkv, s.H / s.Hkv, s.Lq,
                                                                  planned_keys(modes, causal, s, dq_m, dq_n), s.D,
                                                                  num_sms(q.device().index()), dq_m, dq_n);
  at::Tensor dq_partial;  // kept alive until the kernels are queued (caching allocator)
  if (splits > 1) {
    dq_partial = at::empty({splits, s.B, s.H, s.Lq, s.D}, f32);
    p.num_splits = static_cast<int>(splits);
    p.dq_partial = dq_partial.data_ptr<float>();
  }
  check_no_pending_error("mhakern_C::bwd");
  // The sm90 family's dK/dV and dQ kernels (wgmma + TMA) for the plain calls it serves on a 9.0
  // device (choose_bwd_family, common/attn_dispatch.h), else mma.sync (always mma.sync when forced
  // through cuda_force_bwd_family / MHAKERN_CUDA_BWD_FAMILY).
  check_launch(on_sm90 ? dispatch_attn_bwd_sm90(elem_type_of(q), p.D, p, stream)
                       : dispatch_attn_bwd(elem_type_of(q), p.D, p, stream),
               "mhakern_C::bwd");
  return {dq, dk, dv, dmask};
}

}  // namespace
}  // namespace cuda
}  // namespace mhakern

TORCH_LIBRARY_IMPL(mhakern_C, CUDA, m) {
  MHAKERN_IMPL_ATTENTION_OPS(m, &mhakern::cuda::attn_fwd, &mhakern::cuda::attn_bwd);
}
