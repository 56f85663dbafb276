// Times one compile-time variant of the sm_90a forward (bf16, D 128) on the GPU, outside torch:
// the variants of csrc/cuda/sm90/attn_fwd_sm90_kernel.cuh (MHK_SM90_FWD_DIAG_STAGES, _COUPLED_KV,
// MHK_SM90_FWD_DIAG_NO_SOFTMAX, MHK_SM90_FWD_DIAG_NO_LOADS, MHK_SM90_FWD_PIN_SOFTMAX) are chosen
// by -D flags, one binary each (benchmarks/device_check.sh builds them on the device, in
// parallel). Their differences split a step of the production kernel into load wait (production
// - NO_LOADS), softmax (production - NO_SOFTMAX), the softmax/P V overlap (PIN 0 - PIN 1) and
// what the separate K and V pipelines gain (COUPLED_KV - production); MHK_SM90_FWD_PERSISTENT=0
// (attn_fwd_sm90_launch.cuh) one CTA per work item, what the persistent grid gains.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I csrc/cuda -DMHK_SM90_FWD_DIAG_BUILD \
//        [-DMHK_SM90_FWD_DIAG_...=1] benchmarks/diag_fwd_sm90.cu -o diag
//   ./diag NAME B H L causal      -> one JSON line: median ms, TFLOP/s, spread, checks
//
// Inputs: random (never zeros), three rotating sets so that no set stays in the 50 MB L2 between
// calls of the same set; 5 warm-up calls, then 20 calls timed one by one with events; the median.
// The production variant's output is checked against a float64 reference on a few rows (the
// driver must time the kernel the extension runs); variants that change the math only report.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sm90/attn_fwd_sm90_launch.cuh"

using Elem = __nv_bfloat16;
constexpr int kD = 128;

static const char* g_name = "?";
#define CK(x)                                                                                          \
  do {                                                                                                 \
    cudaError_t e_ = (x);                                                                              \
    if (e_ != cudaSuccess) {                                                                           \
      std::printf("{\"variant\": \"%s\", \"error\": \"%s at %s:%d\"}\n", g_name, cudaGetErrorString(e_), \
                  __FILE__, __LINE__);                                                                 \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

__global__ void fill_random(Elem* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    x[i] = __float2bfloat16((static_cast<float>(h & 0xffffff) / 16777216.f - 0.5f) * 3.4641f);  // unit variance
  }
}

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s NAME B H L causal\n", argv[0]);
    return 2;
  }
  const char* name = g_name = argv[1];
  const int B = std::atoi(argv[2]), H = std::atoi(argv[3]), L = std::atoi(argv[4]), causal = std::atoi(argv[5]);
  const bool production = !MHK_SM90_FWD_DIAG_STAGES && !MHK_SM90_FWD_DIAG_NO_SOFTMAX && !MHK_SM90_FWD_DIAG_NO_LOADS;
  const size_t n = size_t(B) * H * L * kD;
  constexpr int kSets = 3;
  Elem *q[kSets], *k[kSets], *v[kSets], *o;
  float* lse;
  for (int s = 0; s < kSets; ++s) {
    CK(cudaMalloc(&q[s], n * sizeof(Elem)));
    CK(cudaMalloc(&k[s], n * sizeof(Elem)));
    CK(cudaMalloc(&v[s], n * sizeof(Elem)));
    fill_random<<<1024, 256>>>(q[s], n, 3 * s + 1);
    fill_random<<<1024, 256>>>(k[s], n, 3 * s + 2);
    fill_random<<<1024, 256>>>(v[s], n, 3 * s + 3);
  }
  CK(cudaMalloc(&o, n * sizeof(Elem)));
  CK(cudaMalloc(&lse, size_t(B) * H * L * sizeof(float)));
  CK(cudaDeviceSynchronize());
  using namespace mhakern::cuda;
  const CallSizes cs{B, H, H, L, L, kD};
  const HeadStrides st{int64_t(H) * L * kD, int64_t(L) * kD, kD};
  auto params = [&](int s) {
    return make_fwd_params(cs, Operand{q[s], st}, Operand{k[s], st}, Operand{v[s], st}, Operand{o, st}, lse, nullptr,
                           1.f / std::sqrt(float(kD)), causal != 0, 1, nullptr, nullptr);
  };
  for (int i = 0; i < 5; ++i) CK((sm90::run_attn_fwd_sm90<Elem, kD>(params(i % kSets), nullptr)));
  CK(cudaDeviceSynchronize());
  std::vector<float> ms;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 20; ++i) {
    CK(cudaEventRecord(e0));
    CK((sm90::run_attn_fwd_sm90<Elem, kD>(params(i % kSets), nullptr)));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double flop = 4.0 * B * H * double(L) * L * kD / (causal ? 2.0 : 1.0);
  // Check a few rows of the last call (set 19 % 3 = 1) against a float64 reference.
  double max_err = -1;
  if (production) {
    const int s = 19 % kSets;
    std::vector<Elem> hq(n), hk(n), hv(n), ho(n);
    CK(cudaMemcpy(hq.data(), q[s], n * sizeof(Elem), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hk.data(), k[s], n * sizeof(Elem), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hv.data(), v[s], n * sizeof(Elem), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ho.data(), o, n * sizeof(Elem), cudaMemcpyDeviceToHost));
    max_err = 0;
    const int rows[4] = {0, 1, L / 2 + 3, L - 1};
    for (int r : rows) {
      const size_t base = size_t(H - 1) * L * kD;  // the last head of batch element 0
      std::vector<double> sc(L), acc(kD, 0.0);
      double mx = -INFINITY, sum = 0;
      const int lim = causal ? r + 1 : L;
      for (int j = 0; j < lim; ++j) {
        double d = 0;
        for (int c = 0; c < kD; ++c)
          d += double(__bfloat162float(hq[base + size_t(r) * kD + c])) * __bfloat162float(hk[base + size_t(j) * kD + c]);
        sc[j] = d / std::sqrt(double(kD));
        mx = std::max(mx, sc[j]);
      }
      for (int j = 0; j < lim; ++j) {
        const double w = std::exp(sc[j] - mx);
        sum += w;
        for (int c = 0; c < kD; ++c) acc[c] += w * __bfloat162float(hv[base + size_t(j) * kD + c]);
      }
      for (int c = 0; c < kD; ++c)
        max_err = std::max(max_err, std::fabs(acc[c] / sum - __bfloat162float(ho[base + size_t(r) * kD + c])));
    }
  }
  std::printf("{\"variant\": \"%s\", \"B\": %d, \"H\": %d, \"L\": %d, \"causal\": %d, \"stages\": %d, \"v_stages\": %d, "
              "\"ms\": %.4f, \"min_ms\": %.4f, \"max_ms\": %.4f, \"tflops\": %.1f, \"max_abs_err\": %.3g}\n",
              name, B, H, L, causal, sm90::FwdConfigSm90<kD>::kStagesK, sm90::FwdConfigSm90<kD>::kStagesV, med, ms.front(), ms.back(), flop / med / 1e9,
              max_err);
  return production && !(max_err >= 0 && max_err < 3e-2) ? 1 : 0;
}
