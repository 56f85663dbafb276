// The Python module mhakern._C: the cpu kernels' entry points and, in builds with CUDA
// (setup.py defines MHAKERN_WITH_CUDA), the CUDA ones registered by csrc/cuda_host.cpp.
#include <torch/extension.h>

#include "cpu/attention_cpu.h"

#ifdef MHAKERN_WITH_CUDA
#include "cuda_host.h"
#endif

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "mhakern._C: fused exact attention kernels (multi-core CPU; CUDA when built with it). "
      "Tensors are (B, H, L, D) with unit stride on the last dim; see mhakern.attention for the semantics.";

  m.def("cpu_attn_fwd", &mhakern::cpu::attn_fwd,
        "cpu_attn_fwd(q, k, v, scale, causal, key_lengths=None, out=None) -> (out, lse)\n\n"
        "q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) on the CPU, one dtype among float32, bfloat16 and "
        "float16, H a multiple of Hkv, D and Dv at most 256. causal is bottom-right aligned per batch element; "
        "key_lengths (int32, (B,), values in [0, Lk]) hides keys at positions >= key_lengths[b]. Returns out "
        "(B, H, Lq, Dv) in q's dtype (written into `out` when given) and lse float32 (B, H, Lq), natural log, "
        "-inf (and out 0) for rows that see no key.",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("causal"),
        py::arg("key_lengths") = py::none(), py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>());

  m.def("cpu_attn_bwd", &mhakern::cpu::attn_bwd,
        "cpu_attn_bwd(dout, q, k, v, out, lse, scale, causal, key_lengths=None, dq=None, dk=None, dv=None) "
        "-> (dq, dk, dv)\n\n"
        "Gradients of cpu_attn_fwd, recomputing the probabilities from lse (delta = rowsum(dout * out)). dk and dv "
        "are summed over the query heads sharing a KV head; rows that see no key get zero gradient.",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"),
        py::arg("causal"), py::arg("key_lengths") = py::none(), py::arg("dq") = py::none(),
        py::arg("dk") = py::none(), py::arg("dv") = py::none(), py::call_guard<py::gil_scoped_release>());

  // SCAFFOLDING (cpu-modes): every mode, until mhakern_C::fwd/bwd are registered.
  m.def("cpu_attn_fwd_modes", &mhakern::cpu::attn_fwd_modes, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("scale"), py::arg("causal"), py::arg("key_lengths"), py::arg("attn_mask"), py::arg("dropout_p"),
        py::arg("seed"), py::arg("top_left"), py::arg("window_left"), py::arg("window_right"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cpu_attn_bwd_modes", &mhakern::cpu::attn_bwd_modes, py::arg("dout"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("scale"), py::arg("causal"), py::arg("key_lengths"),
        py::arg("attn_mask"), py::arg("dropout_p"), py::arg("seed"), py::arg("top_left"), py::arg("window_left"),
        py::arg("window_right"), py::arg("mask_grad"), py::call_guard<py::gil_scoped_release>());

  m.def("cpu_kernel_isa", &mhakern::cpu::kernel_isa,
        "The instruction-set variant of the cpu kernels in use: 'AVX512', 'AVX2' or 'DEFAULT' (chosen once, from "
        "ATen's CPU capability -- ATEN_CPU_CAPABILITY -- and the CPU's own flags).");

  m.def("cpu_parallel_threads_probe", &mhakern::cpu::parallel_threads_probe,
        "Runs `tasks` empty tasks through at::parallel_for and returns how many threads ran them.",
        py::arg("tasks"), py::call_guard<py::gil_scoped_release>());

  m.attr("cpu_max_head_dim") = mhakern::cpu::kMaxHeadDim;
#ifdef MHAKERN_WITH_CUDA
  m.attr("with_cuda") = true;
  mhakern::cuda::register_ops(m);
#else
  m.attr("with_cuda") = false;
#endif
}
