// One Adam step of the memorization trainer's stacked runs (mhakern/memorize/train.py,
// StepEngine) in one sweep over each parameter instead of PyTorch's ten foreach passes, with the
// per-element arithmetic of those passes, so the same bits:
//
//   m  = lerp(m, g, 1 - b1)                 ATen: fma(w, g - m, m); DEFAULT kernels m + w (g - m)
//   v  = v * b2 + (1 - b2) g g              ATen: fma((1 - b2) g, g, v b2); DEFAULT unfused
//   s  = sqrt(v)                            ATen's own sqrt (at::sqrt_out: not correctly rounded
//                                           everywhere, so never our own)
//   p -= (m / (s / sqrt(1 - b2^t) + eps)) * step_size[run]      each operation rounded alone
//
// After the forward and backward the step's optimizer state is out of the caches, and each of
// the ten passes streamed its tensors back in: 1.06-1.10 ms of a 12 ms step at the paper's shape
// on one thread, against 0.75 ms for one sweep in chunks that stay in L2 (docs/results.md,
// section 4). Which variant (fma or not) reproduces ATen's kernels on this host is decided by
// the caller, which checks the bits against the foreach passes before using this
// (mhakern/memorize/optim.py, fused_adam_variant); a host where neither does keeps the passes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MHK_ADAM_X86 1
#endif

namespace mhakern::cpu {
namespace {

// Elements per chunk: the chunk's p, g, m, v and sqrt(v) (320 KiB) stay in L2 between the sweep's
// two halves.
constexpr int64_t kAdamChunk = 16384;

struct AdamConsts {
  float w1, c2, b2, eps, sbc2;
};

// The first half without fused multiply-adds (ATen's DEFAULT kernels). Compiled for the baseline
// x86-64 (or any) target, which has no FMA instruction to contract these into.
void moments_plain(float* m, float* v, const float* g, int64_t n, const AdamConsts& c) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] - m[i];
    const float t = c.w1 * d;
    m[i] = m[i] + t;
    const float vb = v[i] * c.b2;
    const float cg = c.c2 * g[i];
    const float gg = cg * g[i];
    v[i] = vb + gg;
  }
}

void update_plain(float* p, const float* m, const float* s, int64_t n, const AdamConsts& c, float ss) {
  for (int64_t i = 0; i < n; ++i) {
    const float den = s[i] / c.sbc2 + c.eps;
    const float u = (m[i] / den) * ss;
    p[i] = p[i] - u;
  }
}

#ifdef MHK_ADAM_X86
// A value the compiler must round on its own: no multiply is contracted into the subtraction
// that reads it (ATen rounds the product and the difference separately).
__attribute__((target("avx2,fma"))) inline __m256 opaque256(__m256 x) {
  asm("" : "+x"(x));
  return x;
}

// Eight lanes at a time; a tail of fewer than eight runs the same lanes on a padded copy, so every
// element gets the same instructions.
template <typename Body>
__attribute__((target("avx2,fma"))) inline void lanes8(int64_t n, float* const* arrays, int narrays, Body body) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) body(i, arrays);
  if (i < n) {
    alignas(32) float pad[5][8];
    float* tails[5];
    for (int a = 0; a < narrays; ++a) {
      std::fill(pad[a], pad[a] + 8, 1.f);
      std::memcpy(pad[a], arrays[a] + i, (n - i) * sizeof(float));
      tails[a] = pad[a];
    }
    body(0, tails);
    for (int a = 0; a < narrays; ++a) std::memcpy(arrays[a] + i, pad[a], (n - i) * sizeof(float));
  }
}

__attribute__((target("avx2,fma"))) void moments_fma(float* m, float* v, const float* g, int64_t n,
                                                       const AdamConsts& c) {
  const __m256 w1 = _mm256_set1_ps(c.w1), c2 = _mm256_set1_ps(c.c2), b2 = _mm256_set1_ps(c.b2);
  float* arrays[3] = {m, v, const_cast<float*>(g)};
  lanes8(n, arrays, 3, [&](int64_t i, float* const* a) __attribute__((target("avx2,fma"))) {
    __m256 mm = _mm256_loadu_ps(a[0] + i), vv = _mm256_loadu_ps(a[1] + i);
    const __m256 gg = _mm256_loadu_ps(a[2] + i);
    mm = _mm256_fmadd_ps(w1, opaque256(_mm256_sub_ps(gg, mm)), mm);
    const __m256 vb = opaque256(_mm256_mul_ps(vv, b2));
    const __m256 cg = opaque256(_mm256_mul_ps(c2, gg));
    vv = _mm256_fmadd_ps(cg, gg, vb);
    _mm256_storeu_ps(a[0] + i, mm);
    _mm256_storeu_ps(a[1] + i, vv);
  });
}

__attribute__((target("avx2,fma"))) void update_avx2(float* p, const float* m, const float* s, int64_t n,
                                                       const AdamConsts& c, float ss) {
  const __m256 sb = _mm256_set1_ps(c.sbc2), eps = _mm256_set1_ps(c.eps), st = _mm256_set1_ps(ss);
  float* arrays[3] = {p, const_cast<float*>(m), const_cast<float*>(s)};
  lanes8(n, arrays, 3, [&](int64_t i, float* const* a) __attribute__((target("avx2,fma"))) {
    const __m256 den = _mm256_add_ps(opaque256(_mm256_div_ps(_mm256_loadu_ps(a[2] + i), sb)), eps);
    const __m256 u = opaque256(_mm256_mul_ps(_mm256_div_ps(_mm256_loadu_ps(a[1] + i), den), st));
    _mm256_storeu_ps(a[0] + i, _mm256_sub_ps(_mm256_loadu_ps(a[0] + i), u));
  });
}

bool has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
#endif

void check_list(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ref, const char* name,
                bool contiguous = true) {
  TORCH_CHECK(xs.size() == ref.size(), "adam_step_: ", name, " has ", xs.size(), " tensors, params ", ref.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& x = xs[i];
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && (x.is_contiguous() || !contiguous),
                "adam_step_: ", name, "[", i, "] must be a ", contiguous ? "contiguous " : "", "float32 CPU tensor");
    TORCH_CHECK(x.sizes() == ref[i].sizes(), "adam_step_: ", name, "[", i, "] has shape ", x.sizes(),
                ", params[", i, "] ", ref[i].sizes());
  }
}

// params, exp_avg, exp_avg_sq: updated in place. step_size: (R,) or (R, 1) float32, the step
// size lr / (1 - b1^t) of each run, whose index is every tensor's first dim. sqrt_bc2: one
// float32, sqrt(1 - b2^t). fma: which of ATen's kernels to reproduce (see the file's comment).
void adam_step(at::TensorList params_l, at::TensorList grads_l, at::TensorList m_l, at::TensorList v_l,
               const at::Tensor& step_size, const at::Tensor& sqrt_bc2, double lerp_weight, double sq_weight,
               double beta2, double eps, bool fma) {
  const std::vector<at::Tensor> params = params_l.vec(), grads = grads_l.vec(), ms = m_l.vec(), vs = v_l.vec();
  check_list(params, params, "params");
  check_list(grads, params, "grads", false);
  check_list(ms, params, "exp_avg");
  check_list(vs, params, "exp_avg_sq");
  TORCH_CHECK(step_size.device().is_cpu() && step_size.scalar_type() == at::kFloat && step_size.dim() >= 1 &&
                  step_size.dim() <= 2 && step_size.numel() == step_size.size(0),
              "adam_step_: step_size must be a float32 CPU tensor of shape (R,) or (R, 1)");
  TORCH_CHECK(sqrt_bc2.device().is_cpu() && sqrt_bc2.scalar_type() == at::kFloat && sqrt_bc2.numel() == 1,
              "adam_step_: sqrt_bc2 must be one float32 CPU value");
  TORCH_CHECK(lerp_weight >= 0 && lerp_weight < 0.5, "adam_step_: lerp_weight (1 - beta1) must be in [0, 0.5): got ",
              lerp_weight);
#ifdef MHK_ADAM_X86
  TORCH_CHECK(!fma || has_avx2_fma(), "adam_step_: fma=True needs a CPU with AVX2 and FMA");
  const bool vec = has_avx2_fma();
#else
  TORCH_CHECK(!fma, "adam_step_: fma=True is implemented for x86-64 only");
  const bool vec = false;
#endif
  const int64_t R = step_size.size(0);
  const at::Tensor ss_c = step_size.contiguous();
  const float* ss = ss_c.data_ptr<float>();
  // The scalars as ATen converts them: each double to float once.
  const AdamConsts c{static_cast<float>(lerp_weight), static_cast<float>(sq_weight), static_cast<float>(beta2),
                     static_cast<float>(eps), sqrt_bc2.item<float>()};
  for (size_t t = 0; t < params.size(); ++t) {
    const at::Tensor& p = params[t];
    const int64_t n = p.numel();
    if (n == 0) continue;
    TORCH_CHECK(p.dim() >= 1 && p.size(0) == R, "adam_step_: params[", t, "] must have the runs (", R,
                ") as its first dim, has shape ", p.sizes());
    const int64_t per_run = n / R;
    float* pp = p.data_ptr<float>();
    float* mp = ms[t].data_ptr<float>();
    float* vp = vs[t].data_ptr<float>();
    const at::Tensor g = grads[t].contiguous();  // autograd's gradient may come strided
    const float* gp = g.data_ptr<float>();
    // Chunks never straddle two runs: a chunk has one step size.
    const int64_t per_run_chunks = (per_run + kAdamChunk - 1) / kAdamChunk;
    at::parallel_for(0, R * per_run_chunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<float> sq(static_cast<size_t>(std::min(kAdamChunk, per_run)));
      for (int64_t ch = c0; ch < c1; ++ch) {
        const int64_t r = ch / per_run_chunks;
        const int64_t i0 = r * per_run + (ch % per_run_chunks) * kAdamChunk;
        const int64_t len = std::min(kAdamChunk, (r + 1) * per_run - i0);
#ifdef MHK_ADAM_X86
        if (fma)
          moments_fma(mp + i0, vp + i0, gp + i0, len, c);
        else
#endif
          moments_plain(mp + i0, vp + i0, gp + i0, len, c);
        at::Tensor vin = at::from_blob(vp + i0, {len}, at::kFloat);
        at::Tensor sout = at::from_blob(sq.data(), {len}, at::kFloat);
        at::sqrt_out(sout, vin);
#ifdef MHK_ADAM_X86
        if (vec)
          update_avx2(pp + i0, mp + i0, sq.data(), len, c, ss[r]);
        else
#endif
          update_plain(pp + i0, mp + i0, sq.data(), len, c, ss[r]);
      }
    });
  }
}

}  // namespace
}  // namespace mhakern::cpu

TORCH_LIBRARY_FRAGMENT(mhakern_C, m) {
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avg, Tensor(c!)[] exp_avg_sq, "
      "Tensor step_size, Tensor sqrt_bc2, float lerp_weight, float sq_weight, float beta2, float eps, bool fma) -> ()",
      &mhakern::cpu::adam_step);
}
