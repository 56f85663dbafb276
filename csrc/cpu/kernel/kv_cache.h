// Where the forward finds the key and value rows of a batch element (ModeParams, "KV cache
// addressing"): k / v batch row b (dense), row kv_batch_idx[b] (cache_batch_idx), or, paged, row
// j % page_size of page block_table[b, j / page_size]. A key block that lies in one page (or a
// dense cache) is read in place like any strided rows; one that crosses pages is gathered row by
// row into the block's fp32 scratch tile, which the half-precision path fills anyway.
#pragma once

#include "vec_math.h"

namespace mhakern::cpu {
namespace CPU_CAPABILITY {

// The key / value rows of one (batch element, KV head) pair, as the forward reads them.
template <typename T>
struct KvRows {
  const T* base;          // dense: row 0 of the pair; paged: the head's offset inside page 0
  const int32_t* pages;   // paged: the batch element's block table row, else nullptr
  int64_t page_size, sb, sl;

  KvRows(const AttnParams& p, const View& x, int64_t b, int64_t hkv) : sb(x.sb), sl(x.sl) {
    base = static_cast<const T*>(x.ptr) + hkv * x.sh;
    pages = p.block_table ? p.block_table + b * p.block_table_stride : nullptr;
    page_size = p.page_size;
    if (!pages) base += (p.kv_batch_idx ? p.kv_batch_idx[b] : b) * x.sb;
  }
  // Row j (paged: valid for the rows up to the end of j's page).
  const T* row(int64_t j) const {
    if (!pages) return base + j * sl;
    return base + pages[j / page_size] * sb + (j % page_size) * sl;
  }
  // Rows that follow row j in memory: the rest of its page, or all of a dense cache's.
  int64_t run(int64_t j, int64_t n) const { return pages ? std::min(n, page_size - j % page_size) : n; }
  // Rows j .. j + n - 1 as fp32 rows of `cols` values (in place when they are fp32 and adjacent
  // in memory, else converted or gathered into tmp, n x cols); *ld: their row stride.
  const float* block(int64_t j, int64_t n, int64_t cols, float* tmp, int64_t* ld) const {
    if (run(j, n) == n) return rows_as_float<T>(row(j), n, cols, sl, tmp, ld);
    for (int64_t r = 0; r < n;) {
      const int64_t m = run(j + r, n - r);
      int64_t unused;
      const T* src = row(j + r);
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t i = 0; i < m; ++i) std::copy(src + i * sl, src + i * sl + cols, tmp + (r + i) * cols);
      } else {
        rows_as_float<T>(src, m, cols, sl, tmp + r * cols, &unused);
      }
      r += m;
    }
    *ld = cols;
    return tmp;
  }
};

}  // namespace CPU_CAPABILITY
}  // namespace mhakern::cpu
