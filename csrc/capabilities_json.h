// The capability table of capabilities.h as JSON, written once for its two readers:
//   - tools/generate_caps.py compiles a few lines around capabilities_json(nullptr) (no torch
//     needed) and writes the table into mhakern/_caps.py, which Python reads (import mhakern
//     needs no mhakern._C);
//   - csrc/bindings.cpp returns capabilities_json(&build) from torch.ops.mhakern_C.capabilities():
//     the same table plus what this build compiled and what runs now (BuildFacts).
// Nothing here states a fact of its own: every value is a constant or function of capabilities.h.
// Standard library only (the generator compiles it with a plain C++17 compiler).
#pragma once

#include <sstream>
#include <string>

#include "capabilities.h"

namespace mhakern {
namespace caps {

// What capabilities.h cannot know: which families this build compiled and which sm90 backward
// the run-time setting selects (op_common.h sm90_bwd_kernel). csrc/bindings.cpp fills it.
struct BuildFacts {
  bool cuda_compiled;              // MHAKERN_WITH_CUDA
  bool sm90_compiled;              // MHAKERN_WITH_SM90A (the sm_90a pass was in the arch list)
  Sm90BwdKernel sm90_bwd_kernel;   // the sm90 backward that runs now
};

namespace json_detail {

inline const char* boolean(bool b) { return b ? "true" : "false"; }

template <class T>
void numbers(std::ostringstream& js, const T* items, int n) {
  js << "[";
  for (int i = 0; i < n; ++i) js << (i ? ", " : "") << items[i];
  js << "]";
}

inline void strings(std::ostringstream& js, const char* const* items, int n) {
  js << "[";
  for (int i = 0; i < n; ++i) js << (i ? ", " : "") << '"' << items[i] << '"';
  js << "]";
}

}  // namespace json_detail

// The names of the features in `mask` (Feature bits), in kFeatureNames order, as a JSON list.
inline void write_features(std::ostringstream& js, unsigned mask) {
  js << "[";
  bool first = true;
  for (int f = 0; f < kNumFeatures; ++f) {
    if (!(mask & (1u << f))) continue;
    js << (first ? "" : ", ") << '"' << kFeatureNames[f] << '"';
    first = false;
  }
  js << "]";
}

// {"cpu": {...}, "cuda": {...}}: what each kernel family serves. build == nullptr: the table
// alone (what mhakern/_caps.py holds); else the table with build's facts at their keys
// (cpu.compiled, cuda.compiled, cuda.sm90.compiled, cuda.sm90.bwd_kernel,
// cuda.sm90.bwd_deterministic).
inline std::string capabilities_json(const BuildFacts* build) {
  using json_detail::boolean;
  using json_detail::numbers;
  using json_detail::strings;
  std::ostringstream js;
  // ---- cpu ----
  js << "{\"cpu\": {";
  if (build) js << "\"compiled\": true, ";
  js << "\"dtypes\": ";
  strings(js, kCpuDtypeNames, kCpuNumDtypes);
  js << ", \"max_head_dim\": " << kCpuMaxHeadDim << ", \"features\": ";
  write_features(js, kCpuFeatures);
  // ---- cuda: mma.sync ----
  js << "}, \"cuda\": {";
  if (build) js << "\"compiled\": " << boolean(build->cuda_compiled) << ", ";
  js << "\"dtypes\": ";
  strings(js, kCudaDtypeNames, kCudaNumDtypes);
  js << ", \"head_dims\": ";
  numbers(js, kCudaHeadDims, kCudaNumHeadDims);
  js << ", \"equal_head_dims\": " << boolean(kCudaEqualHeadDims) << ", \"min_capability\": [" << kCudaMinCapabilityMajor
     << ", " << kCudaMinCapabilityMinor << "], \"max_group_rows\": " << kCudaMaxGroupRows
     << ", \"max_keys\": " << kCudaMaxKeys << ", \"tiles\": {";
  for (int i = 0; i < kCudaNumHeadDims; ++i) {
    const CudaTiles t = cuda_tiles(kCudaHeadDims[i]);
    js << (i ? ", " : "") << '"' << kCudaHeadDims[i] << "\": {\"fwd\": [" << t.fwd_m << ", " << t.fwd_n
       << "], \"dq\": [" << t.dq_m << ", " << t.dq_n << "], \"dkv\": [" << t.dkv_m << ", " << t.dkv_n
       << "], \"fwd_modes\": [" << t.fwd_m << ", " << t.fwd_modes_n << "]}";
  }
  // The mma.sync family's backward (CudaBwdKernel): which kernel runs by default, the kernels
  // (deterministic, products per tile), the head dims with a backward (bwd_only_head_dims: only
  // the fused kernel, no forward on this family) and the fused tiles per head dim: [keys per
  // CTA, packed query rows per step, warps per 16-key strip].
  js << "}, \"bwd\": {\"default\": \"" << kCudaBwdKernelNames[kCudaMmaBwdDefault] << "\", \"kernels\": {";
  for (int i = 0; i < kCudaNumBwdKernels; ++i)
    js << (i ? ", " : "") << '"' << kCudaBwdKernelNames[i] << "\": {\"deterministic\": "
       << boolean(kCudaBwdKernelDeterministic[i]) << ", \"products_per_tile\": " << kCudaBwdKernelProducts[i] << "}";
  js << "}, \"head_dims\": [";
  {
    int n = 0;
    for (int i = 0; i < kCudaNumHeadDims; ++i) js << (n++ ? ", " : "") << kCudaHeadDims[i];
    for (int i = 0; i < kCudaNumBwdOnlyHeadDims; ++i) js << (n++ ? ", " : "") << kCudaBwdOnlyHeadDims[i];
  }
  js << "], \"bwd_only_head_dims\": ";
  numbers(js, kCudaBwdOnlyHeadDims, kCudaNumBwdOnlyHeadDims);
  js << ", \"fused_tiles\": {";
  {
    int n = 0;
    auto tile = [&](int d) {
      const CudaFusedBwdTiles t = cuda_fused_bwd_tiles(d);
      js << (n++ ? ", " : "") << '"' << d << "\": [" << t.n << ", " << t.m << ", " << t.d_split << "]";
    };
    for (int i = 0; i < kCudaNumHeadDims; ++i) tile(kCudaHeadDims[i]);
    for (int i = 0; i < kCudaNumBwdOnlyHeadDims; ++i) tile(kCudaBwdOnlyHeadDims[i]);
  }
  js << "}";
  // ---- cuda: the sm_90a family ----
  // Its passes, the modes each serves beyond key_lengths and bottom-right causal (fwd_features:
  // packed sequences), the backward's head dims and tiles (plain calls; bwd_dq_tile per head
  // dim: packed query rows, keys per stage).
  js << "}, \"sm90\": {";
  if (build) js << "\"compiled\": " << boolean(build->sm90_compiled) << ", ";
  js << "\"passes\": ";
  strings(js, kSm90PassNames, kSm90NumPasses);
  js << ", \"fwd_features\": ";
  write_features(js, kSm90FwdFeatures);
  js << ", \"bwd_features\": ";
  write_features(js, kSm90BwdFeatures);
  js << ", \"bwd_default\": " << boolean(kSm90BwdByDefault) << ", \"bwd_head_dims\": ";
  numbers(js, kSm90BwdHeadDims, kSm90BwdNumHeadDims);
  js << ", \"bwd_dkv_tile\": [" << kSm90BwdDkvBlockN << ", " << kSm90BwdDkvBlockM << "], \"bwd_dq_tile\": {";
  for (int i = 0; i < kSm90BwdNumHeadDims; ++i)
    js << (i ? ", " : "") << '"' << kSm90BwdHeadDims[i] << "\": [" << kSm90BwdDqBlockM << ", "
       << sm90_bwd_dq_n(kSm90BwdHeadDims[i]) << "]";
  // The sm90 backward kernels (Sm90BwdKernel): the default, each one's determinism; with build
  // facts also the one that runs now (bwd_kernel) and its determinism (bwd_deterministic).
  js << "}, \"bwd_stages\": " << kSm90BwdStages << ", ";
  if (build)
    js << "\"bwd_kernel\": \"" << kSm90BwdKernelNames[build->sm90_bwd_kernel] << "\", \"bwd_deterministic\": "
       << boolean(kSm90BwdKernelDeterministic[build->sm90_bwd_kernel]) << ", ";
  js << "\"bwd_kernel_default\": \"" << kSm90BwdKernelNames[kSm90BwdKernelDefault] << "\", \"bwd_kernels\": {";
  for (int i = 0; i < kSm90NumBwdKernels; ++i)
    js << (i ? ", " : "") << '"' << kSm90BwdKernelNames[i] << "\": {\"deterministic\": "
       << boolean(kSm90BwdKernelDeterministic[i]) << "}";
  js << "}, \"bwd_fused\": {\"deterministic\": " << boolean(kSm90BwdFusedDeterministic) << ", \"features\": ";
  write_features(js, kSm90BwdFusedFeatures);
  js << ", \"stages\": " << kSm90BwdFusedStages << ", \"tiles\": {";
  for (int i = 0; i < kSm90BwdNumHeadDims; ++i)
    js << (i ? ", " : "") << '"' << kSm90BwdHeadDims[i] << "\": [" << kSm90BwdFusedBlockN << ", "
       << sm90_bwd_fused_m(kSm90BwdHeadDims[i]) << "]";
  js << "}}, \"head_dims\": ";
  numbers(js, kSm90HeadDims, kSm90NumHeadDims);
  js << ", \"capability\": [" << kSm90CapabilityMajor << ", " << kSm90CapabilityMinor << "], \"fwd_tile\": ["
     << kSm90FwdBlockM << ", " << kSm90FwdBlockN << "], \"stages\": " << kSm90FwdStages << ", \"fwd_tiles\": {";
  // Per head dim: [packed query rows, keys per stage, stages] (fwd_tile / stages: D 64 and 128).
  for (int i = 0; i < kSm90NumHeadDims; ++i) {
    const Sm90FwdTiles t = sm90_fwd_tiles(kSm90HeadDims[i]);
    js << (i ? ", " : "") << '"' << kSm90HeadDims[i] << "\": [" << t.m << ", " << t.n << ", " << t.stages << "]";
  }
  // Head dims whose forward only this family has (on 9.0); their backward, if any, is the
  // mma.sync family's (cuda.bwd.bwd_only_head_dims).
  js << "}, \"fwd_only_head_dims\": [";
  for (int i = 0, n = 0; i < kSm90NumHeadDims; ++i)
    if (!cuda_head_dim_supported(kSm90HeadDims[i])) js << (n++ ? ", " : "") << kSm90HeadDims[i];
  js << "]";
  // The decode configuration of the mma.sync forward (cuda_decode_tiles): per head dim [packed
  // query rows, keys per tile, stages]; served when group * Lq <= max_rows and the call needs no
  // modes kernel (use_cuda_decode_fwd).
  js << "}, \"decode\": {\"max_rows\": " << kCudaDecodeMaxRows << ", \"warps\": " << kCudaDecodeWarps << ", \"tiles\": {";
  for (int i = 0; i < kCudaNumHeadDims; ++i) {
    const CudaDecodeTiles t = cuda_decode_tiles(kCudaHeadDims[i]);
    js << (i ? ", " : "") << '"' << kCudaHeadDims[i] << "\": [" << t.m << ", " << t.n << ", " << t.stages << "]";
  }
  // Split-K's limits (split_limit), shared by the CUDA planners and the Triton launcher's.
  js << "}}, \"split\": {\"min_blocks_per_split\": " << kMinBlocksPerSplit << ", \"max_splits\": " << kMaxSplits
     << ", \"max_workspace_bytes\": " << kMaxSplitWorkspaceBytes << "}, \"features\": ";
  write_features(js, kCudaFeatures);
  js << "}}";
  return js.str();
}

}  // namespace caps
}  // namespace mhakern
