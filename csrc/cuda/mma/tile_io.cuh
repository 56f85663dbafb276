// Tile movement shared by the forward and backward kernels: global -> shared tiles with
// cp.async, shared-memory operand addresses for ldmatrix, and the coalesced copy-out of a tile
// staged in shared memory.
#pragma once

#include "../common/primitives.cuh"

namespace mhakern {
namespace cuda {

// Shared-memory tiles hold rows of D elements with a pitch of D + 8: the 16-byte pad shifts
// consecutive rows by four banks, so the eight 16-byte rows an ldmatrix phase reads fall in
// distinct banks (with a pitch of D, a power-of-two multiple of 128 bytes, they would all
// collide).
template <int D>
struct TilePitch {
  static_assert(D % 16 == 0, "head dim must be a multiple of 16");
  static constexpr int kPitch = D + 8;
};

// ldmatrix.x4 row addresses (see primitives.cuh). For a 16x16 block at (row 0, col 0) of a
// row-major tile, lane l points at row rowmajor_row(l), column rowmajor_col(l); this serves the
// A operand (non-transposed) and the B operand read with .trans from a [k][n] tile.
MHK_DEVICE int rowmajor_row(int lane) { return lane & 15; }
MHK_DEVICE int rowmajor_col(int lane) { return (lane >> 4) * 8; }
// For the B operand of two n8 tiles read without .trans from a [n][k] tile (16 n x 16 k):
// registers 0, 1 are b0, b1 of n-tile 0, registers 2, 3 those of n-tile 1.
MHK_DEVICE int nk_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }
MHK_DEVICE int nk_col(int lane) { return ((lane >> 3) & 1) * 8; }

// Copies ROWS rows of D elements into a shared tile (pitch D + 8) with 16-byte cp.async.
// row_src(rr) gives row rr's global address, or nullptr for a row to zero-fill (past the end
// of the tensor, or hidden). The caller commits the group.
template <typename Elem, int ROWS, int D, int THREADS, typename RowSrc>
MHK_DEVICE void load_tile_async(Elem* tile, const void* any_valid, RowSrc row_src) {
  constexpr int kPitch = TilePitch<D>::kPitch;
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
  const int tid = thread_index();
  MHK_UNROLL
  for (int it = 0; it < ceil_div(kChunks, THREADS); ++it) {
    const int c = it * THREADS + tid;
    if (kChunks % THREADS == 0 || c < kChunks) {
      const int rr = c / kChunksPerRow;
      const int cc = (c % kChunksPerRow) * 8;
      const Elem* src = row_src(rr);
      // A zero-filling cp.async reads nothing, but it still gets a valid address.
      cp_async_16(tile + rr * kPitch + cc, src ? static_cast<const void*>(src + cc) : any_valid, src != nullptr);
    }
  }
}

// Copies rows [n0, n0 + ROWS) of a matrix whose rows lie `stride` elements apart (D contiguous)
// into a shared tile (pitch D + 8) with 16-byte cp.async; rows at or past `limit` are zero-filled
// and never read. Each thread keeps one 16-byte column chunk and walks down the rows with one
// pointer increment per copy: load_tile_async recomputes every row's address through its
// row_src callback (a 64-bit multiply and a branch per 16 bytes), which took ~28 instructions
// per copy, the bulk of the decode kernel's loop, where nothing else is left to hide them.
// When THREADS is not a multiple of the chunks of a row (D = 96) the last few threads idle.
template <typename Elem, int ROWS, int D, int THREADS>
MHK_DEVICE void load_rows_async(Elem* tile, const Elem* base, int64_t stride, int n0, int limit) {
  constexpr int kPitch = TilePitch<D>::kPitch;
  constexpr int kChunksPerRow = D / 8;
  constexpr int kRowsPerPass = THREADS / kChunksPerRow;
  static_assert(kRowsPerPass >= 1, "a pass covers at least one row");
  constexpr int kPasses = ceil_div(ROWS, kRowsPerPass);
  const int tid = thread_index();
  const int r = tid / kChunksPerRow;
  const int cc = (tid % kChunksPerRow) * 8;
  if (THREADS % kChunksPerRow != 0 && r >= kRowsPerPass) return;
  // Addresses as byte offsets from base: a row past the tensor is never formed as a pointer.
  const char* src0 = reinterpret_cast<const char*>(base + cc);
  int64_t off = (static_cast<int64_t>(n0) + r) * stride * static_cast<int64_t>(sizeof(Elem));
  const int64_t step = static_cast<int64_t>(kRowsPerPass) * stride * static_cast<int64_t>(sizeof(Elem));
  Elem* dst = tile + r * kPitch + cc;
  MHK_UNROLL
  for (int it = 0; it < kPasses; ++it) {
    const int row = r + it * kRowsPerPass;
    if (ROWS % kRowsPerPass == 0 || row < ROWS) {
      const bool valid = n0 + row < limit;
      cp_async_16(dst + it * kRowsPerPass * kPitch, valid ? static_cast<const void*>(src0 + off) : base, valid);
    }
    off += step;
  }
}

// Writes ROWS rows staged in a shared tile (pitch D + 8) to global memory, 16 bytes per store;
// row_dst(rr) gives the destination row or nullptr to skip it. Needs a block_sync() between
// the staging writes and this call.
template <typename Elem, int ROWS, int D, int THREADS, typename RowDst>
MHK_DEVICE void store_tile(const Elem* tile, RowDst row_dst) {
  constexpr int kPitch = TilePitch<D>::kPitch;
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
  const int tid = thread_index();
  MHK_UNROLL
  for (int it = 0; it < ceil_div(kChunks, THREADS); ++it) {
    const int c = it * THREADS + tid;
    if (kChunks % THREADS == 0 || c < kChunks) {
      const int rr = c / kChunksPerRow;
      const int cc = (c % kChunksPerRow) * 8;
      Elem* dst = row_dst(rr);
      if (dst) *reinterpret_cast<uint4*>(dst + cc) = *reinterpret_cast<const uint4*>(tile + rr * kPitch + cc);
    }
  }
}

// Stages a warp's 16 x D fp32 accumulator (mma C layout, 16 rows from row0 of the tile),
// multiplied per row half by mul[0] (rows g) and mul[1] (rows g + 8), into a shared tile in
// the element type.
template <typename Elem, int D>
MHK_DEVICE void stage_accumulator(Elem* tile, int row0, const float (&acc)[D / 8][4], const float (&mul)[2], int lane) {
  constexpr int kPitch = TilePitch<D>::kPitch;
  const int g = lane / 4, t = lane % 4;
  MHK_UNROLL
  for (int dt = 0; dt < D / 8; ++dt) {
    MHK_UNROLL
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t packed = ElemTraits<Elem>::pack2(acc[dt][2 * hh] * mul[hh], acc[dt][2 * hh + 1] * mul[hh]);
      *reinterpret_cast<uint32_t*>(tile + (row0 + g + 8 * hh) * kPitch + dt * 8 + 2 * t) = packed;
    }
  }
}

// Packs two fp32 accumulator tiles (keys/queries 16*kk .. 16*kk+15 of a 16-row strip) into the A
// operand of the next mma: the C layout of m16n8 and the A layout of m16n8k16 line up so that
// no data moves between lanes.
template <typename Elem>
MHK_DEVICE void accum_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = ElemTraits<Elem>::pack2(c0[0], c0[1]);
  a[1] = ElemTraits<Elem>::pack2(c0[2], c0[3]);
  a[2] = ElemTraits<Elem>::pack2(c1[0], c1[1]);
  a[3] = ElemTraits<Elem>::pack2(c1[2], c1[3]);
}

// acc (16 x N, N = 8 * NT) += A (16 x K, rows at a_tile + a_row0, row-major) * B^T where B is an
// [n][k] row-major tile (N rows from b_row0): the "Q K^T" shape.
template <typename Elem, int K, int NT>
MHK_DEVICE void mma_rows_x_rowsT(float (&acc)[NT][4], const Elem* a_tile, int a_row0, const Elem* b_tile, int b_row0, int lane) {
  constexpr int kPitch = TilePitch<K>::kPitch;
  static_assert(NT % 2 == 0, "pairs of n8 tiles");
  MHK_UNROLL
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    ldsm_x4(a, a_tile + (a_row0 + rowmajor_row(lane)) * kPitch + kk * 16 + rowmajor_col(lane));
    MHK_UNROLL
    for (int nt2 = 0; nt2 < NT / 2; ++nt2) {
      uint32_t bf[4];
      ldsm_x4(bf, b_tile + (b_row0 + nt2 * 16 + nk_row(lane)) * kPitch + kk * 16 + nk_col(lane));
      mma_16816<Elem>(acc[2 * nt2], a, bf[0], bf[1]);
      mma_16816<Elem>(acc[2 * nt2 + 1], a, bf[2], bf[3]);
    }
  }
}

// acc (16 x D) += P (16 x KP, fp32 accumulator tiles in registers) * B where B is a [k][n]
// row-major tile of KP rows (from b_row0) and D columns: the "P V" shape.
template <typename Elem, int D, int KP>
MHK_DEVICE void mma_regs_x_rows(float (&acc)[D / 8][4], const float (&pr)[KP / 8][4], const Elem* b_tile, int b_row0, int lane) {
  constexpr int kPitch = TilePitch<D>::kPitch;
  MHK_UNROLL
  for (int kk = 0; kk < KP / 16; ++kk) {
    uint32_t a[4];
    accum_to_a<Elem>(a, pr[2 * kk], pr[2 * kk + 1]);
    MHK_UNROLL
    for (int dt2 = 0; dt2 < D / 16; ++dt2) {
      uint32_t bf[4];
      ldsm_x4_trans(bf, b_tile + (b_row0 + kk * 16 + rowmajor_row(lane)) * kPitch + dt2 * 16 + rowmajor_col(lane));
      mma_16816<Elem>(acc[2 * dt2], a, bf[0], bf[1]);
      mma_16816<Elem>(acc[2 * dt2 + 1], a, bf[2], bf[3]);
    }
  }
}

// The same two products for MT 16-row strips at once (rows a_row0 + 16 * mt): each B fragment
// read from shared memory feeds MT mma instead of one, which halves (MT = 2) the shared-memory
// traffic per multiply of the forward's inner loop.
template <typename Elem, int K, int NT, int MT>
MHK_DEVICE void mma_rows_x_rowsT_mt(float (&acc)[MT][NT][4], const Elem* a_tile, int a_row0, const Elem* b_tile, int b_row0,
                                    int lane) {
  constexpr int kPitch = TilePitch<K>::kPitch;
  static_assert(NT % 2 == 0, "pairs of n8 tiles");
  MHK_UNROLL
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[MT][4];
    MHK_UNROLL
    for (int mt = 0; mt < MT; ++mt)
      ldsm_x4(a[mt], a_tile + (a_row0 + 16 * mt + rowmajor_row(lane)) * kPitch + kk * 16 + rowmajor_col(lane));
    MHK_UNROLL
    for (int nt2 = 0; nt2 < NT / 2; ++nt2) {
      uint32_t bf[4];
      ldsm_x4(bf, b_tile + (b_row0 + nt2 * 16 + nk_row(lane)) * kPitch + kk * 16 + nk_col(lane));
      MHK_UNROLL
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<Elem>(acc[mt][2 * nt2], a[mt], bf[0], bf[1]);
        mma_16816<Elem>(acc[mt][2 * nt2 + 1], a[mt], bf[2], bf[3]);
      }
    }
  }
}

template <typename Elem, int D, int KP, int MT>
MHK_DEVICE void mma_regs_x_rows_mt(float (&acc)[MT][D / 8][4], const float (&pr)[MT][KP / 8][4], const Elem* b_tile, int b_row0,
                                   int lane) {
  constexpr int kPitch = TilePitch<D>::kPitch;
  MHK_UNROLL
  for (int kk = 0; kk < KP / 16; ++kk) {
    uint32_t a[MT][4];
    MHK_UNROLL
    for (int mt = 0; mt < MT; ++mt) accum_to_a<Elem>(a[mt], pr[mt][2 * kk], pr[mt][2 * kk + 1]);
    MHK_UNROLL
    for (int dt2 = 0; dt2 < D / 16; ++dt2) {
      uint32_t bf[4];
      ldsm_x4_trans(bf, b_tile + (b_row0 + kk * 16 + rowmajor_row(lane)) * kPitch + dt2 * 16 + rowmajor_col(lane));
      MHK_UNROLL
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<Elem>(acc[mt][2 * dt2], a[mt], bf[0], bf[1]);
        mma_16816<Elem>(acc[mt][2 * dt2 + 1], a[mt], bf[2], bf[3]);
      }
    }
  }
}

}  // namespace cuda
}  // namespace mhakern
