// tripod's CPU kernels, registered as torch ops in the namespace TRIPOD_OPS_NS (one library per
// ISA level: tripod_avx2, tripod_avx512, tripod_avx512_bf16; see simd.h and kernels/build.py).
//
// - paged_attention: every query row attends the first `lens[t]` keys of its request, read
//   directly from the KV pool through a slot table (no gather, no dense copy). One kernel for
//   decode rows, verification rows and prefill chunks (with or without a cached prefix):
//   consecutive queries of one request are processed together so that a tile of keys, loaded
//   once, serves all of them (GQA-aware: a tile serves every query head of its KV head).
//   Long contexts are split in fixed 512-key pieces merged by log-sum-exp (flash-decoding), so
//   a row's arithmetic depends on its own length only, never on what else is in the batch.
// - rope_store_kv: rotary embedding of Q and K in place (HF half-split layout) and the write of
//   this step's K and V into their pool slots, in one pass.
// - silu_mul: SiLU(gate) * up for a fused [gate | up] projection.
// - rms_norm: RMSNorm of each row (one pass to sum squares, one to scale), one rounding.
//
// Numerics: everything is computed in float32; bfloat16 inputs are widened exactly and results
// rounded once (round to nearest even). This file is compiled with -ffp-contract=off, so plain
// arithmetic is never fused behind our back; where an FMA is wanted it is written as one. Every
// ISA level computes the same bits (simd.h): bfloat16 dot products follow vdpbf16ps' order on
// the levels without it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

#ifndef TRIPOD_OPS_NS
#error "compile with -DTRIPOD_OPS_NS=<torch op namespace> (kernels/build.py does)"
#endif

namespace tripod_cpu {
namespace {

using bf16 = at::BFloat16;
using namespace tripod_simd;

// vdpbf16ps: bf16 products summed in float32 with no widening pass. Elsewhere the same sums are
// formed by widening and two FMAs per pair (simd.h: dot_pair).
constexpr bool kBf16Dot = kNativeBf16;

constexpr int kTile = 16;         // keys per tile (one zmm of scores)
constexpr int kQueryBlock = 32;   // queries of one request processed together, at most
constexpr int kDotQueryBlock = 16;  // ... by attend_piece's float32 and decode forms
constexpr int kLaneRows = 128;      // query vectors of one attend_lanes block (8 lane groups)
constexpr int kSplit = 512;       // keys per split of a long row (fixed: batch-independent)
constexpr int kMaxHeadDim = 256;
constexpr int kQueryFloats = 4096;  // query vectors × head_dim held by one piece (16 KiB)
constexpr int kTransposeMin = 8;    // query vectors from which a piece transposes its key tiles
#ifndef TRIPOD_LANES_PREFILL
#define TRIPOD_LANES_PREFILL 1
#endif
// bfloat16 blocks of queries run attend_lanes (queries in lanes, the same bits; 0: the old
// transposed-tile path, kept for A/B timing and as the reference of the bit-exactness test).
constexpr bool kLanesPrefill = TRIPOD_LANES_PREFILL;

// Run fn(0..n-1) over the intra-op threads, handing out indices one at a time (pieces differ
// in cost: a prefill block next to decode rows), or inline when asked.
template <typename F>
void run_dynamic(int64_t n, bool inline_only, const F& fn) {
  if (n <= 0) return;
  const int threads = at::get_num_threads();
  if (inline_only || n == 1 || threads == 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, n), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

// ---------------------------------------------------------------------------- vector helpers
inline V16 load16(const float* p) { return load(p); }
inline V16 load16(const bf16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline void store16(float* p, V16 v) { store(p, v); }
inline void store16(bf16* p, V16 v) { store_bf16(reinterpret_cast<uint16_t*>(p), v); }

#if defined(__AVX512BF16__)
inline const bf16* qb_as_bf16(const uint16_t* p) { return reinterpret_cast<const bf16*>(p); }

// After P·V over interleaved key pairs, vector 2c holds dims {0-3, 8-11, 16-19, 24-27} of the
// 32-dim chunk c and vector 2c+1 dims {4-7, 12-15, 20-23, 28-31}: put them back in order.
template <int NV>
inline void unpermute_pairs(float* o) {
  for (int c = 0; c < NV / 2; ++c) {
    const __m512 lo = _mm512_loadu_ps(o + 32 * c), hi = _mm512_loadu_ps(o + 32 * c + 16);
    const __m512 a = _mm512_shuffle_f32x4(lo, hi, 0x44), b = _mm512_shuffle_f32x4(lo, hi, 0xEE);
    _mm512_storeu_ps(o + 32 * c, _mm512_shuffle_f32x4(a, a, 0xD8));
    _mm512_storeu_ps(o + 32 * c + 16, _mm512_shuffle_f32x4(b, b, 0xD8));
  }
}
#endif

// ---------------------------------------------------------------------------- attention
// Scores of one query vector against a tile of 16 keys held transposed (lane j = key j), with
// the bits of the dot-product form above: x[i] is what lane i of key j's partial vector holds
// there (the same multiplies and adds, in the same order), and the 16 partials are summed by
// transpose_sum16's tree, ((s0 + s1) + (s2 + s3)) with s_L = (x[4L] + x[4L+2]) + (x[4L+1] + x[4L+3]),
// as vertical adds. A tile transposed once serves every query vector of a block: no horizontal
// sums, no shuffles per query (the dot form spends as many instructions on transpose_sum16 as on
// the products at head_dim 64).
inline V16 tree_sum16(const V16 x[16]) {
  V16 s[4];
  for (int L = 0; L < 4; ++L) s[L] = add(add(x[4 * L], x[4 * L + 2]), add(x[4 * L + 1], x[4 * L + 3]));
  return add(add(s[0], s[1]), add(s[2], s[3]));
}

// float32: qf = the scaled query; kt = [D][16] keys transposed. Lane i of the dot form:
// q[i] * k[i], then fma(q[16v + i], k[16v + i], .) for v = 1 .. NV-1.
template <int NV>
inline V16 scores_t_f32(const float* qf, const float* kt) {
  V16 x[16];
  for (int i = 0; i < 16; ++i) x[i] = mul(set1(qf[i]), load(kt + 16 * i));
  for (int v = 1; v < NV; ++v)
    for (int i = 0; i < 16; ++i) x[i] = fmadd(set1(qf[16 * v + i]), load(kt + 16 * (16 * v + i)), x[i]);
  return tree_sum16(x);
}

// bfloat16 without vdpbf16ps: qf = the query as [even 16 | odd 16] per 32-dim chunk (split_pairs),
// kt = [D/2 pairs][16] even elements then [D/2][16] odd ones. Lane i of chunk c: pair 16c + i.
template <int NV>
inline V16 scores_t_emulated(const float* qf, const float* kt) {
  static_assert(NV % 2 == 0, "head_dim is a multiple of 32");
  constexpr int P = NV * 8;  // pairs of dims
  V16 x[16];
  for (int i = 0; i < 16; ++i) x[i] = zero();
  for (int c = 0; c < NV / 2; ++c)
    for (int i = 0; i < 16; ++i)
      x[i] = dot_pair(x[i], set1(qf[32 * c + i]), set1(qf[32 * c + 16 + i]), load(kt + 16 * (16 * c + i)),
                      load(kt + 16 * (P + 16 * c + i)));
  return tree_sum16(x);
}

#if defined(__AVX512BF16__)
// vdpbf16ps: q2 = the query's bf16 pairs as 32-bit words, kt = [D/2 pairs][16 keys] of words.
template <int NV>
inline V16 scores_t_bf16(const uint32_t* q2, const uint32_t* kt) {
  __m512 x[16];
  for (int i = 0; i < 16; ++i) x[i] = _mm512_setzero_ps();
  for (int c = 0; c < NV / 2; ++c)
    for (int i = 0; i < 16; ++i)
      x[i] = _mm512_dpbf16_ps(x[i], (__m512bh)_mm512_set1_epi32((int)q2[16 * c + i]),
                              (__m512bh)_mm512_loadu_si512(kt + 16 * (16 * c + i)));
  V16 v[16];
  for (int i = 0; i < 16; ++i) v[i] = {x[i]};
  return tree_sum16(v);
}

// scores_t_bf16 for QN query vectors at once (q2[g]: query g's pairs): each word of the key tile
// is loaded once for all QN queries. Every query's lanes see exactly scores_t_bf16's operations
// (the chains x[i] over the chunks, then tree_sum16's adds in its grouping, s0 + s1 formed before
// s2 + s3 only to free registers), so its scores have the same bits alone or in any group.
template <int NV, int QN>
inline void scores_t_bf16_multi(const uint32_t* const q2[QN], const uint32_t* kt, V16 out[QN]) {
  __m512 s01[QN], s2[QN];
  for (int L = 0; L < 4; ++L) {
    __m512 x[QN][4];
    for (int g = 0; g < QN; ++g)
      for (int ii = 0; ii < 4; ++ii) x[g][ii] = _mm512_setzero_ps();
    for (int c = 0; c < NV / 2; ++c)
      for (int ii = 0; ii < 4; ++ii) {
        const int w = 16 * c + 4 * L + ii;
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + 16 * w);
        for (int g = 0; g < QN; ++g)
          x[g][ii] = _mm512_dpbf16_ps(x[g][ii], (__m512bh)_mm512_set1_epi32((int)q2[g][w]), k);
      }
    for (int g = 0; g < QN; ++g) {
      const __m512 sl = _mm512_add_ps(_mm512_add_ps(x[g][0], x[g][2]), _mm512_add_ps(x[g][1], x[g][3]));
      if (L == 0) s01[g] = sl;
      else if (L == 1) s01[g] = _mm512_add_ps(s01[g], sl);
      else if (L == 2) s2[g] = sl;
      else out[g] = {_mm512_add_ps(s01[g], _mm512_add_ps(s2[g], sl))};
    }
  }
}
#endif

#if defined(TRIPOD_AVX512)
// Words [col, col + 16) of 16 rows -> their transpose: dst[16 * c + j] = rows[j][col + c].
inline void transpose16x16(const uint32_t* const rows[16], int col, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows[j] + col);
  for (int j = 0; j < 8; ++j) {
    t[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  for (int j = 0; j < 4; ++j) {
    r[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
    r[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
    r[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
    r[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
  }
  // r[4j + k]: 128-bit lane L holds column 4L + k of rows 4j..4j+3; a 4x4 transpose of lanes
  // across r[k], r[4 + k], r[8 + k], r[12 + k] gives columns k, 4 + k, 8 + k, 12 + k whole.
  for (int k = 0; k < 4; ++k) {
    const __m512i A = r[k], B = r[4 + k], C = r[8 + k], D = r[12 + k];
    const __m512i ab_lo = _mm512_shuffle_i64x2(A, B, 0x44), ab_hi = _mm512_shuffle_i64x2(A, B, 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i64x2(C, D, 0x44), cd_hi = _mm512_shuffle_i64x2(C, D, 0xEE);
    t[k] = _mm512_shuffle_i64x2(ab_lo, cd_lo, 0x88);
    t[4 + k] = _mm512_shuffle_i64x2(ab_lo, cd_lo, 0xDD);
    t[8 + k] = _mm512_shuffle_i64x2(ab_hi, cd_hi, 0x88);
    t[12 + k] = _mm512_shuffle_i64x2(ab_hi, cd_hi, 0xDD);
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + 16 * j, t[j]);
}
#endif

// The 32-bit words [0, words) of 16 key rows, transposed: dst[16 * w + j] = rows[j][w] (words is a
// multiple of 16: head_dim / 2 bf16 pairs or head_dim floats).
inline void transpose_keys(const uint32_t* const rows[16], int words, uint32_t* dst) {
#if defined(TRIPOD_AVX512)
  for (int c = 0; c < words; c += 16) transpose16x16(rows, c, dst + 16 * c);
#else
  for (int w = 0; w < words; ++w)
    for (int j = 0; j < 16; ++j) dst[16 * w + j] = rows[j][w];
#endif
}

struct Block {
  int32_t t0;    // first query (row of q / out)
  int32_t nq;    // queries in the block (same request, consecutive positions)
  int32_t row;   // the request's row in the slot table
  int32_t len0;  // keys the first query attends; query i attends len0 + i
};

struct Piece {  // one unit of parallel work: a block's keys [k0, k1) for KV heads [g0, g1)
  int32_t block, g0, g1, k0, k1, split;  // split: index among the block's pieces (-1: only one)
};

template <typename T>
struct AttnArgs {
  const T* q;
  int64_t q_stride_t, q_stride_h;  // element strides of q [T, H, D]
  const T* kv;                      // the layer's pool [slots, 2, KVH, D]
  int64_t kv_stride_slot;           // 2 * KVH * D
  const int32_t* table;             // [rows, width]
  int64_t table_stride;
  T* out;                           // [T, H, D] contiguous
  int H, KVH, D;
  float scale;
  // Split rows: partial softmax state per (piece, query, head of the piece), packed: a split
  // piece's (query i, head h) is entry part_base[piece] + i * heads_of_piece + (h - first head).
  float* part_acc;           // [entries, D]
  float* part_ml;            // [entries, 2]
  const int64_t* part_base;  // [pieces] (-1: the piece is not split)
  // The entry of query i of a split piece, head `head` (one of the piece's heads).
  int64_t part_slot(const Piece& pc, int piece_index, int i, int head) const {
    const int group = H / KVH;
    return part_base[piece_index] + (int64_t)i * (pc.g1 - pc.g0) * group + (head - pc.g0 * group);
  }
};

// ---------------------------------------------------------------------------- blocked prefill
// Queries in lanes: a block's query vectors (the GQA heads of its KV head folded in as rows) are
// the 16 lanes of a vector, so a 16 × 16 block of scores S (keys × rows), its softmax step and
// P·V are vertical operations (no horizontal sums, no per-query scalar work except when a row's
// maximum moves). Each key element is loaded once per 16 rows (broadcast, FMA into several
// accumulators). The arithmetic of every row is exactly the dot form's (attend_piece's decode
// path): the same 16-key tiles at the same absolute positions, per score the 16 pair chains over
// the 32-dim chunks then tree_sum16's tree, the same running max, std::exp rescale, the same
// vector exp, P rounded to bf16, P·V over key pairs in order stopping at the row's causal limit
// (masked: a lane past it keeps its bits), and the sum of e^(s - m) kept per key lane of the
// tile and reduced by reduce_add's tree. Products of two bf16 are exact in float32, so
// broadcasting the key instead of the query (or P instead of V) changes no bit.
#if defined(TRIPOD_AVX512)
inline V16 select_lt(V16 a, V16 b, V16 x, V16 y) {  // lanes with a < b: x, else y
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), y.v, x.v)};
}
inline unsigned greater_lanes(V16 a, V16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
#else
inline V16 select_lt(V16 a, V16 b, V16 x, V16 y) {
  return {_mm256_blendv_ps(y.lo, x.lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ)),
          _mm256_blendv_ps(y.hi, x.hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ))};
}
inline unsigned greater_lanes(V16 a, V16 b) {  // bit i: lane i of a > lane i of b
  return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ)) |
         ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)) << 8);
}
#endif
inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int NV>
void attend_lanes(const AttnArgs<bf16>& a, const Block& blk, const Piece& pc, int piece_index) {
  constexpr int D = NV * 16, W = D / 2;  // W: pairs of dims (the 32-bit words vdpbf16ps takes)
  constexpr bool native = kBf16Dot;
  static_assert(NV % 2 == 0, "head_dim is a multiple of 32");
  const int group = a.H / a.KVH;  // one KV head (G == 1): row r = query r / group, head r % group
  const int nqv = blk.nq * group;
  const int LG = (nqv + 15) / 16;
  // Per lane group: Qᵀ [W][16] words (native) or [2W][16] widened halves, Oᵀ [D][16], the tile's
  // per-key-lane sums [16][16], the running max [16], the rows' lengths [16].
  constexpr size_t per_group = (size_t)D * 16 * 2 + 256 + 32;
  thread_local std::vector<float> scratch;
  const size_t need = (size_t)LG * per_group + (size_t)2 * kTile * D + 64;
  if (scratch.size() < need) scratch.resize(need);
  float* tile_k = scratch.data() + (size_t)LG * per_group;  // emulated: [16][D] widened K
  float* tile_v = tile_k + (size_t)kTile * D;                // [16][D] widened V / native [8][D] words
  const V16 vscale = set1(a.scale);
  const float ninf = -std::numeric_limits<float>::infinity();
  const int32_t* slots = a.table + (int64_t)blk.row * a.table_stride;
  auto k_of = [&](int k) { return reinterpret_cast<const uint16_t*>(a.kv + (int64_t)slots[k] * a.kv_stride_slot + (int64_t)pc.g0 * D); };
  const int64_t v_off = (int64_t)a.KVH * D;
  auto head_of = [&](int qv) { return pc.g0 * group + qv % group; };

  for (int lg = 0; lg < LG; ++lg) {
    float* qt = scratch.data() + (size_t)lg * per_group;
    float* ot = qt + D * 16;
    float* ls = ot + D * 16;
    float* mv = ls + 256;
    float* lenf = mv + 16;
    uint32_t* qtw = reinterpret_cast<uint32_t*>(qt);
    for (int r = 0; r < 16; ++r) {
      const int qv = lg * 16 + r;
      mv[r] = ninf;
      lenf[r] = qv < nqv ? (float)(blk.len0 + qv / group) : -1.f;
      const uint16_t* src = nullptr;
      if (qv < nqv)
        src = reinterpret_cast<const uint16_t*>(a.q + (int64_t)(blk.t0 + qv / group) * a.q_stride_t +
                                                (int64_t)head_of(qv) * a.q_stride_h);
      for (int w = 0; w < W; ++w) {
        const uint16_t e = src ? src[2 * w] : 0, o = src ? src[2 * w + 1] : 0;
        if constexpr (native) {
          qtw[w * 16 + r] = (uint32_t)e | ((uint32_t)o << 16);
        } else {
          qt[w * 16 + r] = bf16_bits_to_float(e);
          qt[(W + w) * 16 + r] = bf16_bits_to_float(o);
        }
      }
    }
    for (int i = 0; i < D * 16 + 256; ++i) ot[i] = 0.f;  // Oᵀ and the sums
  }

  const uint16_t* krow[kTile];
  const uint16_t* vrow[kTile];
  for (int k0 = pc.k0; k0 < pc.k1; k0 += kTile) {
    const int n = std::min(kTile, pc.k1 - k0);
    for (int j = 0; j < kTile; ++j) {
      krow[j] = k_of(k0 + (j < n ? j : 0));  // past the end: a valid row, masked
      vrow[j] = krow[j] + v_off;
    }
    for (int j = 0; j < std::min(kTile, pc.k1 - k0 - kTile); ++j) {  // the next tile
      const char* r = reinterpret_cast<const char*>(k_of(k0 + kTile + j));
      for (int off = 0; off < D * 2; off += 64) {
        _mm_prefetch(r + off, _MM_HINT_T0);
        _mm_prefetch(r + v_off * 2 + off, _MM_HINT_T0);
      }
    }
    uint32_t* vw = reinterpret_cast<uint32_t*>(tile_v);  // native: [8 key pairs][D] words
    if constexpr (native) {
#if defined(__AVX512BF16__)
      for (int jp = 0; jp < kTile / 2; ++jp)
        for (int c = 0; c < D; c += 16) {
          const __m512i x0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * jp] + c)));
          const __m512i x1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * jp + 1] + c)));
          _mm512_storeu_si512(vw + jp * D + c, _mm512_or_si512(x0, _mm512_slli_epi32(x1, 16)));
        }
#endif
    } else {
      for (int j = 0; j < kTile; ++j)
        for (int v = 0; v < NV; ++v) {
          store(tile_k + j * D + 16 * v, load_bf16(krow[j] + 16 * v));
          store(tile_v + j * D + 16 * v, load_bf16(vrow[j] + 16 * v));
        }
    }
    for (int lg = 0; lg < LG; ++lg) {
      float* qt = scratch.data() + (size_t)lg * per_group;
      float* ot = qt + D * 16;
      float* ls = ot + D * 16;
      float* mv = ls + 256;
      const float* lenf = mv + 16;
      const int last = std::min(nqv, lg * 16 + 16) - 1;  // the group's longest row
      if (blk.len0 + last / group - k0 <= 0) continue;   // the tile is in every row's future
      const V16 validf = min(set1((float)n), sub(load(lenf), set1((float)k0)));
      // S: the 16 keys' scores, each a vector over the rows.
      V16 S[kTile];
      if constexpr (native) {
#if defined(__AVX512BF16__)
        const uint32_t* qtw = reinterpret_cast<const uint32_t*>(qt);
        constexpr int KJ = 4;
        for (int j0 = 0; j0 < kTile; j0 += KJ) {
          const uint32_t* kw[KJ];
          for (int u = 0; u < KJ; ++u) kw[u] = reinterpret_cast<const uint32_t*>(krow[j0 + u]);
          __m512 s01[KJ], s2[KJ];
          for (int L = 0; L < 4; ++L) {
            __m512 x[KJ][4];
            for (int u = 0; u < KJ; ++u)
              for (int ii = 0; ii < 4; ++ii) x[u][ii] = _mm512_setzero_ps();
            for (int c = 0; c < NV / 2; ++c)
              for (int ii = 0; ii < 4; ++ii) {
                const int w = 16 * c + 4 * L + ii;
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qtw + 16 * w);
                for (int u = 0; u < KJ; ++u)
                  x[u][ii] = _mm512_dpbf16_ps(x[u][ii], qv, (__m512bh)_mm512_set1_epi32((int)kw[u][w]));
              }
            for (int u = 0; u < KJ; ++u) {
              const __m512 sl = _mm512_add_ps(_mm512_add_ps(x[u][0], x[u][2]), _mm512_add_ps(x[u][1], x[u][3]));
              if (L == 0) s01[u] = sl;
              else if (L == 1) s01[u] = _mm512_add_ps(s01[u], sl);
              else if (L == 2) s2[u] = sl;
              else S[j0 + u] = {_mm512_add_ps(s01[u], _mm512_add_ps(s2[u], sl))};
            }
          }
        }
#endif
      } else {
        for (int j = 0; j < kTile; ++j) {
          const float* kf = tile_k + j * D;
          V16 s01, s2;
          for (int L = 0; L < 4; ++L) {
            V16 x[4];
            for (int ii = 0; ii < 4; ++ii) x[ii] = zero();
            for (int c = 0; c < NV / 2; ++c)
              for (int ii = 0; ii < 4; ++ii) {
                const int w = 16 * c + 4 * L + ii;
                x[ii] = dot_pair(x[ii], load(qt + 16 * w), load(qt + 16 * (W + w)), set1(kf[2 * w]), set1(kf[2 * w + 1]));
              }
            const V16 sl = add(add(x[0], x[2]), add(x[1], x[3]));
            if (L == 0) s01 = sl;
            else if (L == 1) s01 = add(s01, sl);
            else if (L == 2) s2 = sl;
            else S[j] = add(s01, add(s2, sl));
          }
        }
      }
      // The softmax step: the running max of each row over its valid keys of the tile.
      V16 tmax = set1(ninf);
      for (int j = 0; j < kTile; ++j) {
        S[j] = mul(S[j], vscale);
        tmax = max(tmax, select_lt(set1((float)j), validf, S[j], set1(ninf)));
      }
      unsigned moved = greater_lanes(tmax, load(mv));  // rows whose maximum moves up
      if (moved) {
        alignas(64) float tm[16], alpha[16];
        store(tm, tmax);
        store(alpha, set1(1.f));  // x * 1 is x: the rows whose maximum stays keep their bits
        for (; moved; moved &= moved - 1) {
          const int r = __builtin_ctz(moved);
          alpha[r] = std::exp(mv[r] - tm[r]);
          mv[r] = tm[r];
        }
        const V16 al = load(alpha);
        for (int d = 0; d < D; ++d) store(ot + 16 * d, mul(load(ot + 16 * d), al));
        for (int j = 0; j < kTile; ++j) store(ls + 16 * j, mul(load(ls + 16 * j), al));
      }
      const V16 m = load(mv);
      V16 E[kTile];
      for (int j = 0; j < kTile; ++j) {
        E[j] = select_lt(set1((float)j), validf, tripod_simd::exp(sub(S[j], m)), zero());
        store(ls + 16 * j, add(load(ls + 16 * j), E[j]));
      }
      // P·V: Oᵀ[d] (a vector over rows) += P[key pair] · V[key pair][d], pairs in order; a row
      // stops at its causal limit (pair jp counts while 2·jp < valid).
      if constexpr (native) {
#if defined(__AVX512BF16__)
        __m512i pw[kTile / 2];
        __mmask16 pm[kTile / 2];
        for (int jp = 0; jp < kTile / 2; ++jp) {
          const __m512i e0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(E[2 * jp].v));
          const __m512i e1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(E[2 * jp + 1].v));
          pw[jp] = _mm512_or_si512(e0, _mm512_slli_epi32(e1, 16));
          pm[jp] = _mm512_cmp_ps_mask(_mm512_set1_ps((float)(2 * jp)), validf.v, _CMP_LT_OQ);
        }
        for (int d0 = 0; d0 < D; d0 += 16) {
          __m512 acc[16];
          for (int t = 0; t < 16; ++t) acc[t] = _mm512_loadu_ps(ot + 16 * (d0 + t));
          for (int jp = 0; jp < kTile / 2; ++jp) {
            if (!pm[jp]) break;  // masks shrink with jp: no row reaches this pair
            const uint32_t* vj = vw + jp * D + d0;
            for (int t = 0; t < 16; ++t)
              acc[t] = _mm512_mask_dpbf16_ps(acc[t], pm[jp], (__m512bh)pw[jp], (__m512bh)_mm512_set1_epi32((int)vj[t]));
          }
          for (int t = 0; t < 16; ++t) _mm512_storeu_ps(ot + 16 * (d0 + t), acc[t]);
        }
#endif
      } else {
        V16 P[kTile];
        for (int j = 0; j < kTile; ++j) P[j] = round_to_bf16(E[j]);
        constexpr int DB = kVectorRegisters >= 32 ? 16 : 4;
        for (int d0 = 0; d0 < D; d0 += DB) {
          V16 acc[DB];
          for (int t = 0; t < DB; ++t) acc[t] = load(ot + 16 * (d0 + t));
          for (int jp = 0; jp < kTile / 2; ++jp) {
            const V16 lim = set1((float)(2 * jp));
            const float* v0 = tile_v + (2 * jp) * D + d0;
            const float* v1 = v0 + D;
            for (int t = 0; t < DB; ++t)
              acc[t] = select_lt(lim, validf, fmadd(P[2 * jp], set1(v0[t]), fmadd(P[2 * jp + 1], set1(v1[t]), acc[t])), acc[t]);
          }
          for (int t = 0; t < DB; ++t) store(ot + 16 * (d0 + t), acc[t]);
        }
      }
    }
  }

  for (int lg = 0; lg < LG; ++lg) {
    const float* qt = scratch.data() + (size_t)lg * per_group;
    const float* ot = qt + D * 16;
    const float* ls = ot + D * 16;
    const float* mv = ls + 256;
    for (int r = 0; r < 16 && lg * 16 + r < nqv; ++r) {
      const int qv = lg * 16 + r, i = qv / group, head = head_of(qv);
      alignas(64) float o[D], lsum[16];
      for (int d = 0; d < D; ++d) o[d] = ot[16 * d + r];
      for (int j = 0; j < 16; ++j) lsum[j] = ls[16 * j + r];
      const bool any = blk.len0 + i > pc.k0;  // this query saw at least one key of the piece
      const float l = any ? reduce_add(load(lsum)) : 0.f;
      if (pc.split < 0) {
        const V16 inv = set1(l > 0.f ? 1.f / l : 0.f);
        bf16* dst = a.out + ((int64_t)(blk.t0 + i) * a.H + head) * D;
        for (int v = 0; v < NV; ++v) store16(dst + 16 * v, mul(load(o + 16 * v), inv));
      } else {
        const int64_t slot = a.part_slot(pc, piece_index, i, head);
        float* pa = a.part_acc + slot * D;
        for (int v = 0; v < NV; ++v) store(pa + 16 * v, load(o + 16 * v));
        a.part_ml[slot * 2] = any ? mv[r] : -std::numeric_limits<float>::infinity();
        a.part_ml[slot * 2 + 1] = l;
      }
    }
  }
}

// One piece: queries of `blk` × the query heads of KV heads [g0, g1), keys [k0, k1) (at most
// kSplit). NV = D / 16 is a compile-time constant so a query vector and its output stay in
// registers. A decode row takes every KV head in one piece (each key's K|V row is read whole,
// once); a block of several queries takes one KV head (the tile serves all of them).
//
// One pass over the keys, tile by tile (online softmax): each query vector's 16 scores, then
// e^(s - max) against V. The running max only moves up, and then rescales what was summed;
// after the first tiles it rarely does. K and V of a tile are read together, so the memory
// stream never pauses (the pool is far larger than the caches: K and V come from DRAM).
// NOTE: the arithmetic of one query vector depends only on its own keys, never on the other
// queries of its block or the heads beside it: a token's attention is bit-identical whether it
// is decoded alone, verified in a draft or prefilled in a chunk (jump-forward and the prefix
// cache rely on it).
template <typename T, int NV>
void attend_piece(const AttnArgs<T>& a, const Block& blk, const Piece& pc, int piece_index) {
  constexpr int D = NV * 16;
  constexpr bool is_bf16 = std::is_same_v<T, bf16>;
  constexpr bool bf16_dot = is_bf16 && kBf16Dot;  // native vdpbf16ps for q·k and P·V
  // bfloat16 without vdpbf16ps: the same sums from widened tiles. K is split into the even and
  // odd elements of each pair of dims (vdpbf16ps' pairs), V widened; P rounded to bf16.
  constexpr bool emulate = is_bf16 && !kBf16Dot;
  const int group = a.H / a.KVH, G = pc.g1 - pc.g0;
  const int per_query = G * group;  // query vectors of one query in this piece
  const int nqv = blk.nq * per_query;
  // NOTE: nqv * D <= kQueryFloats in every piece that gets here (paged_attention_impl cuts float32
  // blocks so; a bf16 block of more than 7 query vectors on one KV head goes to attend_lanes).
  thread_local std::vector<float> scratch;
  const size_t tile = (size_t)G * kTile * D;
  // A block of queries on one KV head (a prefill chunk, a draft's verification): each tile of
  // keys transposed once for all its query vectors, scores by the transposed form and P·V by
  // groups of queries (the same bits as the dot form, see tree_sum16). Decode rows keep the dot
  // form (a transpose per tile would not pay for one query).
  const bool transposed = nqv >= kTransposeMin && G == 1;
  if constexpr (is_bf16) {
    if (transposed && kLanesPrefill) return attend_lanes<NV>(a, blk, pc, piece_index);
  }
  const size_t need = (size_t)kQueryFloats * 2 + (size_t)nqv * 32 + (emulate ? 2 * tile : bf16_dot ? tile : 0) +
                      (transposed ? tile : 0) + 16;
  if (scratch.size() < need) scratch.resize(need);
  float* qf = scratch.data();                 // [nqv, D] query vectors (float32 / emulated paths)
  float* acc = qf + kQueryFloats;              // [nqv, D] output accumulators
  float* lv = acc + kQueryFloats;              // [nqv, 16] sums of e^(s - m), as vectors
  float* kf = lv + (size_t)nqv * 16;           // emulate: [G, 16, D] K tile as pair halves
  float* vf = kf + (emulate ? tile : 0);       // emulate: [G, 16, D] widened V tile
  // bf16_dot: [G, 8 key pairs, NV vectors] of interleaved bf16 (in the space vf would take).
  uint16_t* vp = reinterpret_cast<uint16_t*>(kf);
  // transposed: [G][D words][16 keys] (bf16: D/2 pairs; emulated: D/2 even words then D/2 odd).
  float* kt = vf + (emulate ? tile : 0) + (bf16_dot ? tile : 0);
  // dot form: [nqv, 16] each query vector's P of the tile (float32, bf16-rounded floats, or 8
  // words of bf16 pairs), after the transposed tile when there is one.
  float* pbuf = kt + (transposed ? tile : 0);
  float m[kQueryFloats / 16];                  // running max of each query vector
  int np[kQueryFloats / 16];                   // dot form: P·V steps of the tile (keys or key pairs)
  alignas(64) uint16_t qb[bf16_dot ? kQueryFloats : 1];  // query vectors as bf16 bits (dot path)
  const V16 vscale = set1(a.scale);
  // A bf16 vector of D dims as vdpbf16ps sees it: NV/2 chunks of 32 dims, each [even 16 | odd 16]
  // (element 2i and 2i + 1 of the chunk in lane i), then the last 16 dims widened when NV is odd.
  auto split_pairs = [](const T* src, float* dst) {
    if constexpr (is_bf16) {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
      for (int c = 0; c < NV / 2; ++c) {
        V16 e, o;
        load_bf16_pairs(s + 32 * c, e, o);
        store(dst + 32 * c, e);
        store(dst + 32 * c + 16, o);
      }
      if constexpr (NV % 2 == 1) store(dst + 32 * (NV / 2), load_bf16(s + 32 * (NV / 2)));
    }
  };
  // Query vector qv = (i * G + gl) * group + h: query i, KV head g0 + gl, its head h.
  auto head_of = [&](int qv) { return (pc.g0 + (qv / group) % G) * group + qv % group; };
  for (int qv = 0; qv < nqv; ++qv) {
    const int i = qv / per_query;
    const T* src = a.q + (int64_t)(blk.t0 + i) * a.q_stride_t + (int64_t)head_of(qv) * a.q_stride_h;
    if constexpr (bf16_dot) {
      std::memcpy(qb + qv * D, src, D * sizeof(T));
    } else if constexpr (emulate) {
      split_pairs(src, qf + qv * D);  // unscaled, as vdpbf16ps takes it: the scale comes after
    } else {
      for (int v = 0; v < NV; ++v) store(qf + qv * D + 16 * v, mul(load16(src + 16 * v), vscale));
    }
    for (int v = 0; v < NV; ++v) store(acc + qv * D + 16 * v, zero());
    store(lv + qv * 16, zero());
    m[qv] = -std::numeric_limits<float>::infinity();
  }

  const int32_t* slots = a.table + (int64_t)blk.row * a.table_stride;
  const int64_t span = (int64_t)G * D * sizeof(T);  // bytes of K (or V) of this piece's heads
  auto k_of = [&](int k, int gl) { return a.kv + (int64_t)slots[k] * a.kv_stride_slot + (int64_t)(pc.g0 + gl) * D; };
  const T* krow[8][kTile];  // [G][16] (G <= 8)
  const T* vrow[8][kTile];
  for (int k0 = pc.k0; k0 < pc.k1; k0 += kTile) {
    const int n = std::min(kTile, pc.k1 - k0);
    // The next tile's rows, prefetched a few at a time while this tile is computed (below):
    // a burst of a whole tile's lines would overflow the core's outstanding-miss slots.
    const int next_n = std::max(0, std::min(kTile, pc.k1 - k0 - kTile));
    const char* next_rows[kTile];
    for (int j = 0; j < next_n; ++j) next_rows[j] = reinterpret_cast<const char*>(k_of(k0 + kTile + j, 0));
    int next_done = 0;
    auto prefetch_some = [&](int upto) {  // rows [next_done, upto) of the next tile
      for (; next_done < std::min(upto, next_n); ++next_done) {
        const char* r = next_rows[next_done];
        for (int64_t off = 0; off < span; off += 64) {
          _mm_prefetch(r + off, _MM_HINT_T0);
          _mm_prefetch(r + (int64_t)a.KVH * D * sizeof(T) + off, _MM_HINT_T0);
        }
      }
    };
    const T* base[kTile];  // each key's row at KV head g0 (past the end: any valid row, masked)
    for (int j = 0; j < kTile; ++j) base[j] = k_of(k0 + (j < n ? j : 0), 0);
    for (int gl = 0; gl < G; ++gl)
      for (int j = 0; j < kTile; ++j) {
        const T* kr = base[j] + (int64_t)gl * D;
        const T* vr = kr + (int64_t)a.KVH * D;
        krow[gl][j] = kr;
        vrow[gl][j] = vr;
        if constexpr (emulate) {
          split_pairs(kr, kf + (gl * kTile + j) * D);
          for (int v = 0; v < NV; ++v) store(vf + (gl * kTile + j) * D + 16 * v, load16(vr + 16 * v));
        }
#if defined(__AVX512BF16__)
        if constexpr (bf16_dot) {
          if (j % 2 == 1) {  // interleave keys j-1 and j: each 32-dim chunk -> two vectors
            const T* v0 = base[j - 1] + (int64_t)gl * D + (int64_t)a.KVH * D;
            uint16_t* dst = vp + ((size_t)(gl * (kTile / 2) + j / 2) * NV) * 32;
            for (int c = 0; c < NV / 2; ++c) {
              const __m512i x0 = _mm512_loadu_si512(v0 + 32 * c), x1 = _mm512_loadu_si512(vr + 32 * c);
              _mm512_storeu_si512(dst + 64 * c, _mm512_unpacklo_epi16(x0, x1));
              _mm512_storeu_si512(dst + 64 * c + 32, _mm512_unpackhi_epi16(x0, x1));
            }
          }
        }
#endif
      }
    if (transposed)
      for (int gl = 0; gl < G; ++gl) {
        const uint32_t* rows[kTile];
        for (int j = 0; j < kTile; ++j) rows[j] = reinterpret_cast<const uint32_t*>(krow[gl][j]);
        uint32_t* dst = reinterpret_cast<uint32_t*>(kt + (size_t)gl * kTile * D);
        if constexpr (is_bf16) {
          transpose_keys(rows, D / 2, dst);
          if constexpr (emulate) {  // words -> [even pairs halves | odd], widened in place
            for (int w = D / 2 * kTile - 1; w >= 0; --w) {
              const uint32_t x = dst[w];
              dst[w] = x << 16;
              dst[D / 2 * kTile + w] = x & 0xffff0000u;
            }
          }
        } else {
          transpose_keys(rows, D, dst);
        }
      }
    if (transposed) {
      // Query vectors in groups of QG: each computes its scores and softmax step on its own
      // (exactly the dot form's operations, see tree_sum16), then the group's P·V runs together,
      // each V vector loaded once for the group and QG independent accumulator chains in flight
      // (one query's chain alone waits on the latency of every multiply-add).
      constexpr int QG = std::max(1, std::min(8, 16 / NV));
      for (int q0 = 0; q0 < nqv; q0 += QG) {
        const int ng = std::min(QG, nqv - q0);
        prefetch_some((q0 + ng) * kTile / nqv + 1);
        V16 r[QG][NV];
        int np[QG];                       // keys (bf16: key pairs) of the tile this query sums
        alignas(64) float pe[QG][kTile];  // P (float32 / emulated paths)
        alignas(64) uint32_t pp[QG][kTile / 2];  // P as bf16, two keys per word (dot path)
        int most = 0;
        V16 sg[QG];  // bf16_dot: the group's scores, QS query vectors at a time
        if constexpr (bf16_dot) {
#if defined(__AVX512BF16__)
          constexpr int QS = 4;
          const uint32_t* kt2 = reinterpret_cast<const uint32_t*>(kt);
          int g = 0;
          for (; g + QS <= ng; g += QS) {
            const uint32_t* q2[QS];
            for (int u = 0; u < QS; ++u) q2[u] = reinterpret_cast<const uint32_t*>(qb + (q0 + g + u) * D);
            scores_t_bf16_multi<NV, QS>(q2, kt2, sg + g);
          }
          for (; g < ng; ++g) sg[g] = scores_t_bf16<NV>(reinterpret_cast<const uint32_t*>(qb + (q0 + g) * D), kt2);
#endif
        }
        for (int g = 0; g < ng; ++g) {
          const int qv = q0 + g;
          const int valid = std::min(n, blk.len0 + qv / per_query - k0);  // causal limit of this query
          np[g] = 0;
          if (valid <= 0) continue;  // the whole tile is in this query's future
          V16 s;
          if constexpr (bf16_dot) {
            s = sg[g];
          } else if constexpr (emulate) {
            s = scores_t_emulated<NV>(qf + qv * D, kt);
          } else {
            s = scores_t_f32<NV>(qf + qv * D, kt);
          }
          if constexpr (is_bf16) s = mul(s, vscale);
          const float tmax = reduce_max_first(s, valid);
          float* o = acc + qv * D;
          for (int v = 0; v < NV; ++v) r[g][v] = load(o + 16 * v);
          V16 l = load(lv + qv * 16);
          if (tmax > m[qv]) {  // a new maximum: rescale what was summed so far (0 at the start)
            const V16 alpha = set1(std::exp(m[qv] - tmax));
            for (int v = 0; v < NV; ++v) r[g][v] = mul(r[g][v], alpha);
            l = mul(l, alpha);
            m[qv] = tmax;
          }
          const V16 e = keep_first(tripod_simd::exp(sub(s, set1(m[qv]))), valid);
          store(lv + qv * 16, add(l, e));
          if constexpr (bf16_dot) {
#if defined(__AVX512BF16__)
            _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), (__m256i)_mm512_cvtneps_pbh(e.v));
#endif
            np[g] = (valid + 1) / 2;
          } else if constexpr (emulate) {
            store(pe[g], round_to_bf16(e));
            np[g] = (valid + 1) / 2;
          } else {
            store(pe[g], e);
            np[g] = valid;
          }
          most = std::max(most, np[g]);
        }
        // NOTE: each query adds exactly its own terms in the dot form's order (key pairs in
        // order; the odd key's product first), stopping at its own causal limit.
        for (int jp = 0; jp < most; ++jp) {
          if constexpr (bf16_dot) {
#if defined(__AVX512BF16__)
            __m512bh vv[NV];
            for (int v = 0; v < NV; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(vp + ((size_t)jp * NV + v) * 32);
            for (int g = 0; g < ng; ++g) {
              if (jp >= np[g]) continue;
              const __m512bh pj = (__m512bh)_mm512_set1_epi32((int)pp[g][jp]);
              for (int v = 0; v < NV; ++v) r[g][v].v = _mm512_dpbf16_ps(r[g][v].v, pj, vv[v]);
            }
#endif
          } else if constexpr (emulate) {
            const float* v1 = vf + (2 * jp + 1) * D;
            const float* v0 = vf + (2 * jp) * D;
            for (int g = 0; g < ng; ++g) {
              if (jp >= np[g]) continue;
              const V16 p1 = set1(pe[g][2 * jp + 1]), p0 = set1(pe[g][2 * jp]);
              for (int v = 0; v < NV; ++v) r[g][v] = fmadd(p0, load(v0 + 16 * v), fmadd(p1, load(v1 + 16 * v), r[g][v]));
            }
          } else {
            const float* vj = reinterpret_cast<const float*>(vrow[0][jp]);
            V16 vv[NV];
            for (int v = 0; v < NV; ++v) vv[v] = load(vj + 16 * v);
            for (int g = 0; g < ng; ++g) {
              if (jp >= np[g]) continue;
              const V16 pj = set1(pe[g][jp]);
              for (int v = 0; v < NV; ++v) r[g][v] = fmadd(pj, vv[v], r[g][v]);
            }
          }
        }
        for (int g = 0; g < ng; ++g)
          if (np[g] > 0)
            for (int v = 0; v < NV; ++v) store(acc + (q0 + g) * D + 16 * v, r[g][v]);
      }
      continue;
    }
    for (int qv = 0; qv < nqv; ++qv) {
      prefetch_some((qv + 1) * kTile / nqv + 1);
      const int valid = std::min(n, blk.len0 + qv / per_query - k0);  // causal limit of this query
      np[qv] = 0;
      if (valid <= 0) continue;  // the whole tile is in this query's future
      const int gl = (qv / group) % G;
      V16 parts[kTile];
      if constexpr (bf16_dot) {
#if defined(__AVX512BF16__)
        __m512bh q2[NV / 2 + 1];
        for (int v = 0; v < NV / 2; ++v) q2[v] = (__m512bh)_mm512_load_si512(qb + qv * D + 32 * v);
#pragma GCC unroll 16
        for (int j = 0; j < kTile; ++j) {
          __m512 t = _mm512_setzero_ps();
          for (int v = 0; v < NV / 2; ++v) t = _mm512_dpbf16_ps(t, q2[v], (__m512bh)_mm512_loadu_si512(krow[gl][j] + 32 * v));
          if constexpr (NV % 2 == 1)  // D = 16 (mod 32): the last 16 dims widened
            t = _mm512_fmadd_ps(load16(qb_as_bf16(qb + qv * D + 32 * (NV / 2))).v, load16(krow[gl][j] + 32 * (NV / 2)).v, t);
          parts[j] = {t};
        }
#endif
      } else if constexpr (emulate) {
        const float* qv_f = qf + qv * D;
#pragma GCC unroll 16
        for (int j = 0; j < kTile; ++j) {
          const float* kj = kf + (gl * kTile + j) * D;
          V16 t = zero();
          for (int c = 0; c < NV / 2; ++c)
            t = dot_pair(t, load(qv_f + 32 * c), load(qv_f + 32 * c + 16), load(kj + 32 * c), load(kj + 32 * c + 16));
          if constexpr (NV % 2 == 1) t = fmadd(load(qv_f + 32 * (NV / 2)), load(kj + 32 * (NV / 2)), t);
          parts[j] = t;
        }
      } else {
        V16 q[NV];
        for (int v = 0; v < NV; ++v) q[v] = load(qf + qv * D + 16 * v);
#pragma GCC unroll 16
        for (int j = 0; j < kTile; ++j) {
          const float* kj = reinterpret_cast<const float*>(krow[gl][j]);
          V16 t = mul(q[0], load(kj));
          for (int v = 1; v < NV; ++v) t = fmadd(q[v], load(kj + 16 * v), t);
          parts[j] = t;
        }
      }
      V16 s = transpose_sum16(parts);
      if constexpr (is_bf16) s = mul(s, vscale);
      const float tmax = reduce_max_first(s, valid);
      float* o = acc + qv * D;
      V16 l = load(lv + qv * 16);
      if (tmax > m[qv]) {  // a new maximum: rescale what was summed so far (0 at the start)
        const V16 alpha = set1(std::exp(m[qv] - tmax));
        for (int v = 0; v < NV; ++v) store(o + 16 * v, mul(load(o + 16 * v), alpha));
        l = mul(l, alpha);
        m[qv] = tmax;
      }
      const V16 e = keep_first(tripod_simd::exp(sub(s, set1(m[qv]))), valid);
      store(lv + qv * 16, add(l, e));
      // P of this query vector, kept for the P·V pass below (bf16: rounded as vdpbf16ps takes it).
      if constexpr (bf16_dot) {
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbuf + (size_t)qv * 16), (__m256i)_mm512_cvtneps_pbh(e.v));
#endif
        np[qv] = (valid + 1) / 2;
      } else if constexpr (emulate) {
        store(pbuf + (size_t)qv * 16, round_to_bf16(e));
        np[qv] = (valid + 1) / 2;
      } else {
        store(pbuf + (size_t)qv * 16, e);
        np[qv] = valid;
      }
    }
    // P·V for QG query vectors at a time: QG × NV independent accumulator chains in flight (one
    // query vector's chain alone waits on the latency of every multiply-add). Each query vector
    // still adds exactly its own terms in the same order (keys, or bf16 key pairs with the odd
    // key's product first, in order up to its causal limit): the bits of the one-at-a-time form.
    constexpr int QG = std::max(1, std::min(8, 16 / NV));
    for (int q0 = 0; q0 < nqv; q0 += QG) {
      const int ng = std::min(QG, nqv - q0);
      V16 r[QG][NV];
      int most = 0;
      for (int g = 0; g < ng; ++g) {
        most = std::max(most, np[q0 + g]);
        if (np[q0 + g] > 0)
          for (int v = 0; v < NV; ++v) r[g][v] = load(acc + (q0 + g) * D + 16 * v);
      }
      for (int jp = 0; jp < most; ++jp)
        for (int g = 0; g < ng; ++g) {
          const int qv = q0 + g;
          if (jp >= np[qv]) continue;
          const int gl = (qv / group) % G;
          if constexpr (bf16_dot) {
#if defined(__AVX512BF16__)
            const uint32_t* ppw = reinterpret_cast<const uint32_t*>(pbuf + (size_t)qv * 16);
            const __m512bh pj = (__m512bh)_mm512_set1_epi32((int)ppw[jp]);
            const uint16_t* vpg = vp + (size_t)gl * (kTile / 2) * NV * 32;
            for (int v = 0; v < NV; ++v)
              r[g][v].v = _mm512_dpbf16_ps(r[g][v].v, pj, (__m512bh)_mm512_loadu_si512(vpg + ((size_t)jp * NV + v) * 32));
#endif
          } else if constexpr (emulate) {
            const float* pq = pbuf + (size_t)qv * 16;
            const V16 p1 = set1(pq[2 * jp + 1]), p0 = set1(pq[2 * jp]);
            const float* vg = vf + (size_t)gl * kTile * D;
            const float* v1 = vg + (2 * jp + 1) * D;
            const float* v0 = vg + (2 * jp) * D;
            for (int v = 0; v < NV; ++v) r[g][v] = fmadd(p0, load(v0 + 16 * v), fmadd(p1, load(v1 + 16 * v), r[g][v]));
          } else {
            const V16 pj = set1(pbuf[(size_t)qv * 16 + jp]);
            const float* vj = reinterpret_cast<const float*>(vrow[gl][jp]);
            for (int v = 0; v < NV; ++v) r[g][v] = fmadd(pj, load(vj + 16 * v), r[g][v]);
          }
        }
      for (int g = 0; g < ng; ++g)
        if (np[q0 + g] > 0)
          for (int v = 0; v < NV; ++v) store(acc + (q0 + g) * D + 16 * v, r[g][v]);
    }
  }

  for (int qv = 0; qv < nqv; ++qv) {
    const int i = qv / per_query, head = head_of(qv);
    float* o = acc + qv * D;
#if defined(__AVX512BF16__)
    if constexpr (bf16_dot) unpermute_pairs<NV>(o);
#endif
    const bool any = blk.len0 + i > pc.k0;  // this query saw at least one key of the piece
    const float l = any ? reduce_add(load(lv + qv * 16)) : 0.f;
    if (pc.split < 0) {
      const V16 inv = set1(l > 0.f ? 1.f / l : 0.f);
      T* dst = a.out + ((int64_t)(blk.t0 + i) * a.H + head) * D;
      for (int v = 0; v < NV; ++v) store16(dst + 16 * v, mul(load(o + 16 * v), inv));
    } else {
      const int64_t slot = a.part_slot(pc, piece_index, i, head);
      float* pa = a.part_acc + slot * D;
      for (int v = 0; v < NV; ++v) store(pa + 16 * v, load(o + 16 * v));
      a.part_ml[slot * 2] = any ? m[qv] : -std::numeric_limits<float>::infinity();
      a.part_ml[slot * 2 + 1] = l;
    }
  }
}

template <typename T>
void attend_piece_any(const AttnArgs<T>& a, const Block& blk, const Piece& pc, int piece_index) {
  switch (a.D / 16) {
    case 2: return attend_piece<T, 2>(a, blk, pc, piece_index);
    case 4: return attend_piece<T, 4>(a, blk, pc, piece_index);
    case 6: return attend_piece<T, 6>(a, blk, pc, piece_index);
    case 8: return attend_piece<T, 8>(a, blk, pc, piece_index);
    case 16: return attend_piece<T, 16>(a, blk, pc, piece_index);
    default: TORCH_CHECK(false, "paged_attention: head_dim must be 32, 64, 96, 128 or 256");
  }
}

struct Merge { int32_t block, g0, g1, first, count; };

// Combine the pieces of a split block (log-sum-exp), in piece order: fixed, batch-independent.
template <typename T>
void merge_block(const AttnArgs<T>& a, const Block& blk, const Merge& mg) {
  const int D = a.D, nv = D / 16, group = a.H / a.KVH;
  const Piece mpc{mg.block, mg.g0, mg.g1, 0, 0, 0};  // the heads every piece of the merge covers
  for (int i = 0; i < blk.nq; ++i)
    for (int head = mg.g0 * group; head < mg.g1 * group; ++head) {
      float m = -std::numeric_limits<float>::infinity();
      for (int s = 0; s < mg.count; ++s) {
        const int64_t slot = a.part_slot(mpc, mg.first + s, i, head);
        m = std::max(m, a.part_ml[slot * 2]);
      }
      V16 o[kMaxHeadDim / 16];
      for (int v = 0; v < nv; ++v) o[v] = zero();
      float l = 0.f;
      for (int s = 0; s < mg.count; ++s) {
        const int64_t slot = a.part_slot(mpc, mg.first + s, i, head);
        const float ms = a.part_ml[slot * 2], ls = a.part_ml[slot * 2 + 1];
        if (ls == 0.f) continue;  // a piece wholly in this query's future
        const float w = std::exp(ms - m);
        l += ls * w;
        const V16 vw = set1(w);
        for (int v = 0; v < nv; ++v) o[v] = fmadd(load(a.part_acc + slot * D + 16 * v), vw, o[v]);
      }
      const V16 inv = set1(l > 0.f ? 1.f / l : 0.f);
      T* dst = a.out + ((int64_t)(blk.t0 + i) * a.H + head) * D;
      for (int v = 0; v < nv; ++v) store16(dst + 16 * v, mul(o[v], inv));
    }
}

template <typename T>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& table,
                          const at::Tensor& rows, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t nt = q.size(0);
  const int H = q.size(1), D = q.size(2), KVH = kv.size(2);
  const int group = H / KVH;
  const int32_t* row_of = rows.data_ptr<int32_t>();
  const int32_t* len_of = lens.data_ptr<int32_t>();
  // Blocks: runs of consecutive queries of one request at consecutive positions.
  // bf16 blocks run attend_lanes (no per-block scratch limit: more rows share each key load).
  const int qb = std::is_same_v<T, bf16> ? std::max(1, std::min(kQueryBlock, kLaneRows / group))
                                         : std::max(1, std::min(kDotQueryBlock, kQueryFloats / (group * D)));
  std::vector<Block> blocks;
  for (int64_t t = 0; t < nt;) {
    Block b{(int32_t)t, 1, row_of[t], len_of[t]};
    while (t + b.nq < nt && b.nq < qb && row_of[t + b.nq] == b.row && len_of[t + b.nq] == b.len0 + b.nq)
      ++b.nq;
    blocks.push_back(b);
    t += b.nq;
  }
  // NOTE: every slot id a query will read is checked against the pool before any is read (a
  // stale or corrupt slot table must raise, never read out of bounds).
  const int64_t nslots = kv.size(0);
  const int32_t* tab = table.data_ptr<int32_t>();
  std::vector<int32_t> checked(table.size(0), 0);  // slots of each row checked so far
  for (const Block& b : blocks) {
    const int32_t keys = b.len0 + b.nq - 1;
    for (int32_t k = checked[b.row]; k < keys; ++k) {
      const int32_t slot = tab[(int64_t)b.row * table.stride(0) + k];
      TORCH_CHECK(slot >= 0 && slot < nslots, "paged_attention: slot id ", slot, " at table[", b.row, ", ", k,
                  "] is outside the pool of ", nslots, " slots");
    }
    checked[b.row] = std::max(checked[b.row], keys);
  }
  // Pieces: a lone query takes all KV heads (as many as fit the scratch), a block of queries one
  // KV head; the keys cut into fixed kSplit-key pieces.
  // With fewer blocks than threads (a lone decode) the heads are split instead, for parallelism;
  // on one thread a decode row keeps every KV head in its pieces (each key's K|V row read whole,
  // in address order; a query vector's arithmetic is the same whichever heads share its piece).
  const int threads = at::get_num_threads();
  const bool few = threads > 1 && (int64_t)blocks.size() < 2 * (int64_t)threads;
  const int heads_at_once = few ? 1 : std::max(1, std::min(std::min(KVH, 8), kQueryFloats / (group * D)));
  std::vector<Piece> pieces;
  std::vector<Merge> merges;
  int64_t work = 0;
  for (int32_t bi = 0; bi < (int32_t)blocks.size(); ++bi) {
    const Block& b = blocks[bi];
    const int32_t keys = b.len0 + b.nq - 1;  // the last query's keys
    const int32_t n = std::max<int32_t>(1, (keys + kSplit - 1) / kSplit);
    work += (int64_t)keys * b.nq;
    const int step = b.nq == 1 ? heads_at_once : 1;
    for (int g0 = 0; g0 < KVH; g0 += step) {
      const int g1 = std::min(KVH, g0 + step);
      if (n > 1) merges.push_back({bi, g0, g1, (int32_t)pieces.size(), n});
      for (int32_t s = 0; s < n; ++s)
        pieces.push_back({bi, g0, g1, s * kSplit, std::min(keys, (s + 1) * kSplit), n > 1 ? s : -1});
    }
  }
  // Split pieces' partial states, packed (a decode row at 32k keys: 64 pieces × its heads; sized
  // per piece rather than for a full block of every head, whose zeroing cost more than the
  // attention). Every entry is written by its piece before the merge reads it: no zeroing, and the
  // buffers are kept per thread between calls (no page faults per step).
  std::vector<int64_t> part_base(pieces.size(), -1);
  int64_t entries = 0;
  for (size_t i = 0; i < pieces.size(); ++i)
    if (pieces[i].split >= 0) {
      part_base[i] = entries;
      entries += (int64_t)blocks[pieces[i].block].nq * (pieces[i].g1 - pieces[i].g0) * group;
    }
  thread_local std::vector<float> part_acc, part_ml;
  if ((int64_t)part_acc.size() < entries * D) part_acc.resize(entries * D);
  if ((int64_t)part_ml.size() < entries * 2) part_ml.resize(entries * 2);
  AttnArgs<T> a{q.data_ptr<T>(), q.stride(0), q.stride(1), kv.data_ptr<T>(), kv.stride(0),
                table.data_ptr<int32_t>(), table.stride(0), out.data_ptr<T>(), H, KVH, D, (float)scale,
                part_acc.data(), part_ml.data(), part_base.data()};
  // Small steps run on the calling thread: waking the pool costs more than it saves.
  const bool small = work * group * KVH < 4096;
  run_dynamic((int64_t)pieces.size(), small, [&](int64_t i) {
    attend_piece_any(a, blocks[pieces[i].block], pieces[i], (int)i);
  });
  run_dynamic((int64_t)merges.size(), small, [&](int64_t i) { merge_block(a, blocks[merges[i].block], merges[i]); });
  // Kept for the next step only while small (a decode row's: KiBs to a few MiB); a long prefill
  // chunk's (hundreds of MiB at 32k keys on wide layers) go back at once, so memory stays flat.
  constexpr size_t kKeepFloats = size_t(8) << 20;  // 32 MiB a buffer
  if (part_acc.capacity() > kKeepFloats) std::vector<float>().swap(part_acc);
  if (part_ml.capacity() > kKeepFloats) std::vector<float>().swap(part_ml);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& table,
                           const at::Tensor& rows, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with unit stride in D");
  TORCH_CHECK(kv.dim() == 4 && kv.size(1) == 2 && kv.is_contiguous(), "kv must be a contiguous [slots, 2, KVH, D]");
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "q and kv must share a dtype");
  TORCH_CHECK(table.scalar_type() == at::kInt && rows.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "table, rows and lens must be int32");
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1, "table must be [rows, width] with unit stride");
  TORCH_CHECK(rows.is_contiguous() && lens.is_contiguous() && rows.numel() == q.size(0) && lens.numel() == q.size(0),
              "rows and lens need one entry per query");
  const int D = q.size(2), H = q.size(1), KVH = kv.size(2);
  TORCH_CHECK(kv.size(3) == D && (D == 32 || D == 64 || D == 96 || D == 128 || D == 256),
              "paged_attention: head_dim must be 32, 64, 96, 128 or 256");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= 8, "query heads per KV head must divide evenly and be at most 8");
  const int32_t* row_of = rows.data_ptr<int32_t>();
  const int32_t* len_of = lens.data_ptr<int32_t>();
  for (int64_t t = 0; t < q.size(0); ++t) {
    TORCH_CHECK(row_of[t] >= 0 && row_of[t] < table.size(0), "paged_attention: query ", t, " names table row ",
                row_of[t], " (the table has ", table.size(0), ")");
    TORCH_CHECK(len_of[t] >= 1 && len_of[t] <= table.size(1), "paged_attention: query ", t, " attends ", len_of[t],
                " keys (1 to the table's width ", table.size(1), ")");
  }
  at::Tensor out = at::empty({q.size(0), H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.size(0) == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    paged_attention_impl<float>(q, kv, table, rows, lens, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention supports float32 and bfloat16");
    paged_attention_impl<bf16>(q, kv, table, rows, lens, scale, out);
  }
  return out;
}

// ---------------------------------------------------------------------------- RoPE + KV write
template <typename T>
void rope_store_kv_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& kv, const at::Tensor& slots, int H, int KVH) {
  const int64_t nt = qkv.size(0);
  const int D = kv.size(3), half = D / 2;
  T* base = qkv.data_ptr<T>();
  const int64_t stride = qkv.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t cstride = cos.stride(0);
  T* pool = kv.data_ptr<T>();
  const int64_t sstride = kv.stride(0);
  at::parallel_for(0, nt, 64, [&](int64_t begin, int64_t end) {
    alignas(64) float x[kMaxHeadDim];
    for (int64_t t = begin; t < end; ++t) {
      T* row = base + t * stride;
      const float* c = cs + pos[t] * cstride;
      const float* s = sn + pos[t] * cstride;
      // out = x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: products rounded,
      // then summed, as the eager float32 path computes it (-ffp-contract=off keeps them apart).
      for (int h = 0; h < H + KVH; ++h) {
        T* v = row + (int64_t)h * D;
        int i = 0;
        if (half % 16 == 0) {
          for (; i < half; i += 16) {
            const V16 x1 = load16(v + i), x2 = load16(v + i + half);
            const V16 a = sub(mul(x1, load16(c + i)), mul(x2, load16(s + i)));
            const V16 b = add(mul(x2, load16(c + i + half)), mul(x1, load16(s + i + half)));
            store16(v + i, a);
            store16(v + i + half, b);
          }
        } else {
          for (int j = 0; j < D; ++j) x[j] = static_cast<float>(v[j]);
          for (; i < half; ++i) {
            const float a = x[i] * c[i] + (-x[i + half]) * s[i];
            const float b = x[i + half] * c[i + half] + x[i] * s[i + half];
            v[i] = static_cast<T>(a);
            v[i + half] = static_cast<T>(b);
          }
        }
      }
      // K then V are adjacent in qkv, and adjacent in a pool slot.
      std::memcpy(pool + slot[t] * sstride, row + (int64_t)H * D, sizeof(T) * 2 * KVH * D);
    }
  });
}

void rope_store_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor kv, const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, (H + 2 KVH) * D], unit stride");
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous() && kv.scalar_type() == qkv.scalar_type(), "kv: contiguous, same dtype as qkv");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos/sin tables must be float32 [positions, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.is_contiguous() &&
              slots.is_contiguous(), "positions and slots must be contiguous int64");
  const int H = num_heads, KVH = num_kv_heads, D = kv.size(3);
  TORCH_CHECK(kv.size(1) == 2 && kv.size(2) == KVH, "rope_store_kv: kv must be [slots, 2, num_kv_heads, D]");
  TORCH_CHECK(qkv.size(1) == (int64_t)(H + 2 * KVH) * D && D % 2 == 0 && D <= kMaxHeadDim, "qkv width mismatch");
  TORCH_CHECK(positions.numel() == qkv.size(0) && slots.numel() == qkv.size(0),
              "rope_store_kv: one position and one slot per row of qkv");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) >= D, "rope_store_kv: cos/sin must be [positions, >= D]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_store_kv: position ", pos[t], " is outside the RoPE table (",
                cos.size(0), " positions)");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < kv.size(0), "rope_store_kv: slot ", slot[t], " is outside the pool of ",
                kv.size(0), " slots");
  }
  if (qkv.scalar_type() == at::kFloat) {
    rope_store_kv_impl<float>(qkv, positions, cos, sin, kv, slots, H, KVH);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "rope_store_kv supports float32 and bfloat16");
    rope_store_kv_impl<bf16>(qkv, positions, cos, sin, kv, slots, H, KVH);
  }
}

// ---------------------------------------------------------------------------- SiLU(gate) * up
template <typename T>
void silu_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t nt = gu.size(0), inter = gu.size(1) / 2;
  const T* src = gu.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t sstride = gu.stride(0);
  at::parallel_for(0, nt, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = src + t * sstride;
      const T* u = g + inter;
      T* o = dst + t * inter;
      int64_t i = 0;
      for (; i + 16 <= inter; i += 16) {
        const V16 x = load16(g + i);
        // silu(x) = x / (1 + e^-x)
        const V16 sg = div(x, add(set1(1.f), tripod_simd::exp(sub(zero(), x))));
        store16(o + i, mul(sg, load16(u + i)));
      }
      for (; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = static_cast<T>(x / (1.f + std::exp(-x)) * static_cast<float>(u[i]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0, "gu must be [T, 2 * I], unit stride");
  at::Tensor out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(gu, out);
  } else {
    TORCH_CHECK(gu.scalar_type() == at::kBFloat16, "silu_mul supports float32 and bfloat16");
    silu_mul_impl<bf16>(gu, out);
  }
  return out;
}

// ---------------------------------------------------------------------------- RMSNorm
// y = x / sqrt(mean(x^2) + eps) * w, in float32, rounded once.
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t nt = x.size(0), h = x.size(1);
  const T* src = x.data_ptr<T>();
  const T* wt = w.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, nt, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* r = src + t * xs;
      T* o = dst + t * h;
      V16 acc = zero();
      int64_t i = 0;
      for (; i + 16 <= h; i += 16) {
        const V16 v = load16(r + i);
        acc = fmadd(v, v, acc);
      }
      float ss = reduce_add(acc);
      for (; i < h; ++i) ss += static_cast<float>(r[i]) * static_cast<float>(r[i]);
      const float inv = 1.f / std::sqrt(ss / (float)h + (float)eps);
      const V16 vi = set1(inv);
      for (i = 0; i + 16 <= h; i += 16) store16(o + i, mul(mul(load16(r + i), vi), load16(wt + i)));
      for (; i < h; ++i) o[i] = static_cast<T>(static_cast<float>(r[i]) * inv * static_cast<float>(wt[i]));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1),
              "rms_norm: x [T, H] with unit stride, w [H]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm: x and w must share a dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x, w, eps, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm supports float32 and bfloat16");
    rms_norm_impl<bf16>(x, w, eps, out);
  }
  return out;
}

}  // namespace
}  // namespace tripod_cpu

// TORCH_LIBRARY stringifies its argument: expand TRIPOD_OPS_NS first.
#define TRIPOD_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define TRIPOD_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TRIPOD_LIBRARY(TRIPOD_OPS_NS, m) {
  m.def("paged_attention(Tensor q, Tensor kv, Tensor table, Tensor rows, Tensor lens, float scale) -> Tensor");
  m.def("rope_store_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) kv, Tensor slots, int num_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
}

TRIPOD_LIBRARY_IMPL(TRIPOD_OPS_NS, CPU, m) {
  m.impl("paged_attention", &tripod_cpu::paged_attention);
  m.impl("rope_store_kv", &tripod_cpu::rope_store_kv);
  m.impl("silu_mul", &tripod_cpu::silu_mul);
  m.impl("rms_norm", &tripod_cpu::rms_norm);
}
