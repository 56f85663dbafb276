// The operators of mhakern._C, registered with PyTorch's dispatcher (TORCH_LIBRARY): one schema
// per operation for every device, the per-device kernels registered beside their host code
// (cpu/attention_cpu.cpp: CPU; cuda/cuda_host.cpp: CUDA, in builds with MHAKERN_WITH_CUDA), and the
// meta kernels here, which torch.compile's fake tensors run to learn output shapes. Python calls
// them as torch.ops.mhakern_C.<name>; errors raised in a kernel (TORCH_CHECK) reach Python through
// torch's own operator machinery as ValueError / TypeError / NotImplementedError / RuntimeError.
//
// The Python module itself only exists so that `import mhakern._C` loads this library, which
// registers the operators. It binds no function and is made with the plain CPython API, as
// pytorch/extension-cpp does: no pybind11 in this library at all, so no pybind11 version or
// exception translator of ours can differ from the one torch was built with (one of the
// hypotheses for the TORCH_CHECK crash seen on a GPU machine).
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>

#include "capabilities.h"
#include "capabilities_json.h"
#include "cpu/attention_cpu.h"
#include "generated/modes.h"
#include "op_common.h"

namespace mhakern {
namespace {

#ifdef MHAKERN_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif
#if defined(MHAKERN_WITH_SM90A)
constexpr bool kWithSm90a = true;
#else
constexpr bool kWithSm90a = false;
#endif

// capabilities.h as JSON (capabilities_json.h, the writer mhakern/_caps.py is generated with),
// with what this build compiled and which sm90 backward the run-time setting selects now (a bad
// MHAKERN_CUDA_SM90_BWD reads as the default here and raises at the first backward).
std::string capabilities() {
  const int sm90_req = op::sm90_bwd_kernel().value.load();
  const caps::BuildFacts build{kWithCuda, kWithSm90a, op::sm90_bwd_kernel_for(sm90_req >= 0 ? sm90_req : -1)};
  return caps::capabilities_json(&build);
}

// The split-K planner the CUDA host code runs (capabilities.h), for tests and tools.
// sm90: plan a forward that the sm90 family runs (its tiles, capabilities.h fwd_plan_tiles).
int64_t cuda_plan_splits(int64_t batch, int64_t kv_heads, int64_t group, int64_t q_len, int64_t k_len,
                         int64_t head_dim, int64_t num_sms, bool backward, bool sm90) {
  const std::pair<const char*, int64_t> args[] = {{"batch", batch}, {"kv_heads", kv_heads}, {"group", group},
                                                  {"q_len", q_len}, {"k_len", k_len},       {"num_sms", num_sms}};
  for (const auto& a : args)
    TORCH_CHECK_VALUE(a.second >= 0, "cuda_plan_splits: ", a.first, " must be non-negative, got ", a.second);
  if (sm90) {
    TORCH_CHECK_VALUE(!backward, "cuda_plan_splits: sm90=True plans the forward only (backward must be False)");
    TORCH_CHECK_VALUE(caps::sm90_head_dim_supported(head_dim), "cuda_plan_splits: head_dim ", head_dim,
                      " has no compiled sm90 kernel");
  } else {
    TORCH_CHECK_VALUE(caps::cuda_head_dim_supported(head_dim), "cuda_plan_splits: head_dim ", head_dim,
                      " has no compiled cuda kernel");
  }
  const caps::CudaTiles t = caps::cuda_tiles(static_cast<int>(head_dim));
  // A mma.sync forward of few packed rows runs the decode kernel (a call without attn_mask and
  // dropout: what the planner is asked about here).
  const caps::FwdPlanTiles f = caps::fwd_plan_tiles(sm90, static_cast<int>(head_dim), group * q_len, false);
  if (backward) return caps::plan_splits(batch, kv_heads, group, q_len, k_len, head_dim, num_sms, t.dq_m, t.dq_n);
  return caps::plan_fwd_splits(batch, kv_heads, group, q_len, k_len, head_dim, num_sms, f);
}

// The split-K rule itself (capabilities.h split_rule), for the test that the Triton launcher's
// twin (mhakern/kernels/heuristics.py split_rule) agrees with it (tests/test_split_plan.py).
int64_t plan_key_splits(int64_t programs, int64_t key_blocks, int64_t rows, int64_t dv, int64_t num_sms) {
  const std::pair<const char*, int64_t> args[] = {
      {"programs", programs}, {"key_blocks", key_blocks}, {"rows", rows}, {"dv", dv}, {"num_sms", num_sms}};
  for (const auto& a : args)
    TORCH_CHECK_VALUE(a.second >= 0, "plan_key_splits: ", a.first, " must be non-negative, got ", a.second);
  return caps::split_rule(programs, key_blocks, rows, dv, num_sms);
}

// Sets the CUDA host code's split-K count (0: its planner decides); returns the previous value.
int64_t cuda_force_splits(int64_t num_splits) {
  TORCH_CHECK_VALUE(num_splits >= 0 && num_splits <= op::kMaxForcedSplits,
                    "cuda_force_splits: num_splits must lie in [0, ", op::kMaxForcedSplits, "] (0: planned), got ",
                    num_splits);
  return op::cuda_forced_splits().exchange(num_splits);
}

// Sets which CUDA kernel family serves a pass ("auto": the host's choice; "mma_sync": that family
// always); returns the previous setting. Test and benchmark hooks (op_common.h).
std::string force_family(op::FamilySetting& setting, const char* op_name, const std::string& family) {
  const int i = op::family_index(family);
  TORCH_CHECK_VALUE(i >= 0, op_name, ": family must be ", op::family_choices(), ", got '", family, "'");
  const int prev = setting.value.exchange(i);
  return prev >= 0 ? op::kFamilyNames[prev] : "auto";
}
std::string cuda_force_fwd_family(const std::string& family) {
  return force_family(op::cuda_fwd_family(), "cuda_force_fwd_family", family);
}
std::string cuda_force_bwd_family(const std::string& family) {
  return force_family(op::cuda_bwd_family(), "cuda_force_bwd_family", family);
}
// Sets which backward a family runs (op_common.h KernelSetting: "default" or one of its names);
// returns the previous setting. Test and benchmark hooks.
std::string force_kernel(op::KernelSetting& setting, const char* op_name, const std::string& kernel) {
  const int i = setting.index(kernel);
  TORCH_CHECK_VALUE(i >= -1, op_name, ": kernel must be ", setting.choices(), ", got '", kernel, "'");
  const int prev = setting.value.exchange(i);
  return prev >= 0 ? setting.names[prev] : "default";
}
// The mma.sync family's backward: "default", "split", "fused", "fused_atomic".
std::string cuda_force_mma_bwd_kernel(const std::string& kernel) {
  return force_kernel(op::mma_bwd_kernel(), "cuda_force_mma_bwd_kernel", kernel);
}
// The sm90 family's backward: "default", "split", "fused".
std::string cuda_force_sm90_bwd_kernel(const std::string& kernel) {
  return force_kernel(op::sm90_bwd_kernel(), "cuda_force_sm90_bwd_kernel", kernel);
}

// Meta kernels: the same argument checks as every device (op_common.h), then outputs of the
// right shape, dtype and layout. Which modes a family implements is checked by the real kernel.
constexpr unsigned kAllFeatures = ~0u;

std::tuple<at::Tensor, at::Tensor> fwd_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scale, bool /*causal*/, const std::optional<at::Tensor>& key_lengths,
                                            const op::ModeArgs& modes) {
  const op::Sizes s = op::check_qkv(q, k, v, scale, &modes);
  op::check_key_lengths_meta(key_lengths, q, s);
  op::check_modes(modes, q, s, kAllFeatures, "meta", false);
  return {op::empty_like_heads(q, s.Dv), at::empty({s.B, s.H, s.Lq}, q.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_meta(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool /*causal*/, const std::optional<at::Tensor>& key_lengths,
    const op::ModeArgs& modes) {
  const op::Sizes s = op::check_qkv(q, k, v, scale, &modes);
  op::check_key_lengths_meta(key_lengths, q, s);
  op::check_modes(modes, q, s, kAllFeatures, "meta", true);
  op::check_bwd_operands(dout, q, out, lse, s);
  return {op::empty_like_heads(q, s.D), op::empty_like_heads(k, s.D), op::empty_like_heads(v, s.Dv),
          op::alloc_dmask(modes, q, s)};
}

}  // namespace
}  // namespace mhakern

TORCH_LIBRARY(mhakern_C, m) {
  // docs/contract.md gives the semantics; INTERFACE: one schema for CPU and CUDA, outputs
  // allocated by the op. The modes after key_lengths are the mode table's (mhakern/mode_table.py,
  // through generated/modes.h; op_common.h fwd_op / bwd_op take them in the same order).
  m.def("fwd(Tensor q, Tensor k, Tensor v, float scale, bool causal, Tensor? key_lengths, " MHK_MODE_FWD_SCHEMA
        ") -> (Tensor out, Tensor lse)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, bool causal, "
        "Tensor? key_lengths, " MHK_MODE_BWD_SCHEMA ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dmask)");
  // The same kernels for a call without any mode (op_common.h fwd_plain_op): what every plain
  // call of the Python layer runs (mhakern/modes.py c_fwd / c_bwd).
  m.def("fwd_plain(Tensor q, Tensor k, Tensor v, float scale, bool causal, Tensor? key_lengths) -> "
        "(Tensor out, Tensor lse)");
  m.def("bwd_plain(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, bool causal, "
        "Tensor? key_lengths) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dmask)");
  // Small non-tensor helpers (no dispatch key: one kernel for all).
  m.def("capabilities() -> str", &mhakern::capabilities);
  m.def("cpu_kernel_isa() -> str", &mhakern::cpu::kernel_isa);
  m.def("cpu_parallel_threads_probe(int tasks) -> int", &mhakern::cpu::parallel_threads_probe);
  m.def(
      "cuda_plan_splits(int batch, int kv_heads, int group, int q_len, int k_len, int head_dim, int num_sms, "
      "bool backward=False, bool sm90=False) -> int",
      &mhakern::cuda_plan_splits);
  m.def("plan_key_splits(int programs, int key_blocks, int rows, int dv, int num_sms) -> int",
        &mhakern::plan_key_splits);
  m.def("cuda_force_splits(int num_splits) -> int", &mhakern::cuda_force_splits);
  m.def("cuda_force_fwd_family(str family) -> str", &mhakern::cuda_force_fwd_family);
  m.def("cuda_force_bwd_family(str family) -> str", &mhakern::cuda_force_bwd_family);
  m.def("cuda_force_mma_bwd_kernel(str kernel) -> str", &mhakern::cuda_force_mma_bwd_kernel);
  m.def("cuda_force_sm90_bwd_kernel(str kernel) -> str", &mhakern::cuda_force_sm90_bwd_kernel);
}

TORCH_LIBRARY_IMPL(mhakern_C, Meta, m) {
  MHAKERN_IMPL_ATTENTION_OPS(m, &mhakern::fwd_meta, &mhakern::bwd_meta);
}

#define MHK_CONCAT_(a, b) a##b
#define MHK_PYINIT_(name) MHK_CONCAT_(PyInit_, name)

PyMODINIT_FUNC MHK_PYINIT_(TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT,
      "mhakern._C",
      "mhakern._C: fused exact attention kernels (multi-core CPU; CUDA when built with it), registered as the "
      "dispatcher operators torch.ops.mhakern_C.fwd / bwd (see csrc/bindings.cpp for the schemas and "
      "torch.ops.mhakern_C.capabilities() for what each kernel family serves).",
      -1,
      nullptr,
  };
  return PyModule_Create(&module);
}
