// C entry points of the emulator's own runtime (cuda_emu.h): which schedule the next launches
// use, and which global memory the kernels may read. Built into every emulator library by
// tests/test_cuda_host.py next to emu_entry.cpp (the kernels' entry points).
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cuda_emu.h"

extern "C" {

// random = 0: the fixed schedule (fibers in thread order, switching only where they must wait).
// random = 1: the seeded random schedule (see cuda_emu.h). Persists until changed; the per-call
// mhk_emu_configure leaves it alone.
void mhk_emu_schedule(int random, unsigned long long seed) { mhk_emu::set_schedule(random, seed); }

// The order in which the next launches start their blocks (order 0: block-index order, 1:
// reversed, 2: a permutation drawn from seed) and how many are resident at once (resident > 0;
// 0: the schedule's own number). Persists until changed (mhk_emu_schedule leaves it alone).
void mhk_emu_dispatch(int order, int resident, unsigned long long seed) {
  mhk_emu::Dispatch& d = mhk_emu::state().dispatch;
  d.order = static_cast<mhk_emu::Dispatch::Order>(order < 0 || order > 2 ? 0 : order);
  d.resident = resident < 0 ? 0 : resident;
  d.seed = seed;
}

// The deliberate defect the kernels compiled for emulation inject from now on (0: none; see
// cuda_emu.h State::defect). Returns the previous one.
int mhk_emu_set_defect(int defect) {
  const int prev = mhk_emu::state().defect;
  mhk_emu::state().defect = defect;
  return prev;
}

// The knobs the seed chose (probabilities in units of 2^-32), for a failure report.
void mhk_emu_schedule_knobs(unsigned int* out) {
  const mhk_emu::Schedule& c = mhk_emu::state().sched;
  out[0] = c.p_preempt;
  out[1] = c.p_land_now;
  out[2] = c.p_land_step;
}

// The byte ranges [begin[i], end[i]) that cp.async may read from; n = 0 lifts the check. A copy
// from anywhere else is an error (and is not performed), so a kernel that would read past a
// tensor is caught before it touches the memory.
void mhk_emu_guard_reads(int n, const unsigned long long* begin, const unsigned long long* end) {
  auto& r = mhk_emu::state().readable;
  std::vector<std::pair<uintptr_t, uintptr_t>> in;
  for (int i = 0; i < n; ++i)
    if (end[i] > begin[i]) in.emplace_back(static_cast<uintptr_t>(begin[i]), static_cast<uintptr_t>(end[i]));
  std::sort(in.begin(), in.end());
  r.clear();
  for (const auto& x : in) {
    if (!r.empty() && x.first <= r.back().second)
      r.back().second = std::max(r.back().second, x.second);
    else
      r.push_back(x);
  }
}

}  // extern "C"
