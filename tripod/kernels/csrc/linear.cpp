// Small-batch linear layers over weights packed once for this kernel: y = x @ W.T (+ residual).
//
// Formats (packed by `pack_linear` at load):
// - "bf16":  [N/16][K/2][16 outputs][2] bfloat16: one 64-byte load is 16 outputs x 2 inputs,
//            multiplied with a broadcast pair of activations by one vdpbf16ps (float32 sums).
// - "f32":   [N/16][K][16] float32.
// - "q4_1":  GGUF Q4_1 executed as stored: per 16 outputs x 32 inputs, the 16 scales d and 16
//            minimums m (fp16, as stored) and the 4-bit codes q, two inputs per byte.
// - "q4_0":  GGUF Q4_0 as stored: per 16 outputs x 32 inputs, 16 scales d (fp16) and the 4-bit
//            codes q, two inputs per byte as in "q4_1". w = d*(q - 8) is "q4_1"'s d*q + m with
//            m = -8*d (exact in float32), so it takes Q4_1's sums: d*sum(x*q) - 8*d*sum(x).
//            (Centring the codes instead costs a subtraction per code vector: 15-20 % at one row.)
// - "q8_0":  GGUF Q8_0 as stored: per 16 outputs x 32 inputs, 16 scales d (fp16) and int8 codes.
//            (GGUF Q5_0 is given in this form too: d and q - 16 as int8, exactly its values.)
// - "q4_k":  GGUF Q4_K's sub-blocks of 32: per 16 outputs x 32 inputs, the float32 scale a = d*sc
//            and minimum b = dmin*m of each output (w = a*q - b, the products gguf's
//            dequantization forms) and the 4-bit codes, two inputs per byte as in "q4_1".
// - "q6_k":  GGUF Q6_K: per 16 outputs x 32 inputs, two float32 scales a = d*sc (one per 16
//            inputs) and the codes q - 32 as int8 (w = a*(q - 32)).
// The quantized formats use exactly the dequantized weights w = d*q + m (Q8_0: d*q): per block
// of 32 inputs the kernel sums x*q exactly as floats and adds d*sum + m*sum(x), which is the
// same product with another float32 rounding order (tested against the dequantized reference).
//
// NOTE: every output is summed in the same order whatever the number of rows (each row has its
// own accumulators; rows only share weight loads), so a row's result does not depend on what
// else is in the batch: a request's logits are bit-identical alone, in a batch or verified in a
// draft. Threads split the outputs, never the inputs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "amx.h"
#include "simd.h"

#if defined(TRIPOD_AMX) && !defined(TRIPOD_AMX_EMU)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tripod_linear {
namespace {

using bf16 = at::BFloat16;
using namespace tripod_simd;

constexpr int kQ41Block = 16 * 2 + 16 * 2 + 256;  // d[16], m[16] (fp16), codes 16 x 32 nibbles
constexpr int kQ40Block = 16 * 2 + 256;           // d[16] (fp16), codes 16 x 32 nibbles
constexpr int kQ80Block = 16 * 2 + 512;           // d[16] (fp16), codes 16 x 32 int8
constexpr int kQ4KBlock = 16 * 4 * 2 + 256;       // a[16], b[16] (float32), codes 16 x 32 nibbles
constexpr int kQ6KBlock = 16 * 4 * 2 + 512;       // a0[16], a1[16] (float32), codes 16 x 32 int8

enum class Fmt { kBf16, kF32, kQ40, kQ41, kQ80, kQ4K, kQ6K };

Fmt parse_fmt(const std::string& s) {
  if (s == "bf16") return Fmt::kBf16;
  if (s == "f32") return Fmt::kF32;
  if (s == "q4_0") return Fmt::kQ40;
  if (s == "q4_1") return Fmt::kQ41;
  if (s == "q8_0") return Fmt::kQ80;
  if (s == "q4_k") return Fmt::kQ4K;
  if (s == "q6_k") return Fmt::kQ6K;
  TORCH_CHECK(false, "unknown packed weight format '", s, "' (bf16, f32, q4_0, q4_1, q8_0, q4_k, q6_k)");
}

// The packed tensor pack_linear makes for (format, n, k): what linear_packed checks it is given.
std::vector<int64_t> packed_shape(Fmt fmt, int64_t n, int64_t k) {
  const int64_t nb = (n + 15) / 16;
  switch (fmt) {
    case Fmt::kBf16: return {nb, (k + 1) / 2, 16, 2};
    case Fmt::kF32: return {nb, k, 16};
    case Fmt::kQ40: return {nb, k / 32, kQ40Block};
    case Fmt::kQ41: return {nb, k / 32, kQ41Block};
    case Fmt::kQ80: return {nb, k / 32, kQ80Block};
    case Fmt::kQ4K: return {nb, k / 32, kQ4KBlock};
    case Fmt::kQ6K: return {nb, k / 32, kQ6KBlock};
  }
  return {};
}

inline V16 load16(const float* p) { return load(p); }
inline V16 load16(const bf16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }

// ---------------------------------------------------------------------------- packing
// w: [N, K] float32 / bfloat16 (dense formats) or the GGUF blocks as uint8 [N, K / 32 * block].
at::Tensor pack_linear(const at::Tensor& w, const std::string& format, int64_t n, int64_t k) {
  const Fmt fmt = parse_fmt(format);
  const int64_t nb = (n + 15) / 16;
  TORCH_CHECK(w.is_contiguous() && w.size(0) == n, "pack_linear: w must be contiguous with N rows");
  if (fmt == Fmt::kBf16 || fmt == Fmt::kF32) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == k, "pack_linear: dense w must be [N, K]");
    if (fmt == Fmt::kBf16) {
      TORCH_CHECK(w.scalar_type() == at::kBFloat16, "pack_linear bf16: w must be bfloat16");
      TORCH_CHECK(k % 2 == 0, "pack_linear bf16: K must be even");
      const int64_t kp = (k + 1) / 2;
      at::Tensor out = at::zeros({nb, kp, 16, 2}, w.options());
      const bf16* src = w.data_ptr<bf16>();
      bf16* dst = out.data_ptr<bf16>();
      for (int64_t o = 0; o < n; ++o)
        for (int64_t i = 0; i < k; ++i) dst[(((o / 16) * kp + i / 2) * 16 + o % 16) * 2 + i % 2] = src[o * k + i];
      return out;
    }
    TORCH_CHECK(w.scalar_type() == at::kFloat, "pack_linear f32: w must be float32");
    at::Tensor out = at::zeros({nb, k, 16}, w.options());
    const float* src = w.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for (int64_t o = 0; o < n; ++o)
      for (int64_t i = 0; i < k; ++i) dst[((o / 16) * k + i) * 16 + o % 16] = src[o * k + i];
    return out;
  }
  TORCH_CHECK(k % 32 == 0, "pack_linear: quantized weights need K % 32 == 0");
  TORCH_CHECK(w.scalar_type() == at::kByte, "pack_linear: quantized weights are given as uint8 GGUF blocks");
  const int64_t kb = k / 32;
  // Bytes per 32 inputs of one row as given: Q4_0, Q4_1 and Q8_0 as GGUF stores them; q4_k as
  // [a f32, b f32, 16 bytes of nibbles like Q4_1's]; q6_k as [a0 f32, a1 f32, 32 int8 codes].
  const int64_t in_block = fmt == Fmt::kQ40 ? 18 : fmt == Fmt::kQ41 ? 20 : fmt == Fmt::kQ80 ? 34 : fmt == Fmt::kQ4K ? 24 : 40;
  TORCH_CHECK(w.dim() == 2 && w.size(1) == kb * in_block, "pack_linear: expected ", kb * in_block, " bytes per row");
  const int64_t out_block = packed_shape(fmt, n, k)[2];
  const bool wide = fmt == Fmt::kQ4K || fmt == Fmt::kQ6K;  // float32 scales: 4 bytes each
  at::Tensor out = at::zeros({nb, kb, out_block}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t o = 0; o < n; ++o) {
    const int64_t c = o % 16;
    for (int64_t b = 0; b < kb; ++b) {
      const uint8_t* blk = src + (o * kb + b) * in_block;
      uint8_t* ob = dst + ((o / 16) * kb + b) * out_block;
      if (wide) {
        std::memcpy(ob + 4 * c, blk, 4);            // a (q4_k) / a0 (q6_k)
        std::memcpy(ob + 64 + 4 * c, blk + 4, 4);   // b (q4_k) / a1 (q6_k)
      } else {
        std::memcpy(ob + 2 * c, blk, 2);  // d
      }
      if (fmt == Fmt::kQ6K) {
        for (int i = 0; i < 32; ++i) ob[128 + i * 16 + c] = blk[8 + i];
      } else if (fmt == Fmt::kQ40 || fmt == Fmt::kQ41 || fmt == Fmt::kQ4K) {
        if (fmt == Fmt::kQ41) std::memcpy(ob + 32 + 2 * c, blk + 2, 2);  // m
        const int codes = fmt == Fmt::kQ40 ? 32 : fmt == Fmt::kQ41 ? 64 : 128;
        const uint8_t* qs = blk + (fmt == Fmt::kQ40 ? 2 : fmt == Fmt::kQ41 ? 4 : 8);  // input j: low nibble of qs[j] (j < 16), high of qs[j - 16]
        for (int p = 0; p < 16; ++p) {
          const int i0 = 2 * p, i1 = 2 * p + 1;
          const uint8_t q0 = i0 < 16 ? (qs[i0] & 15) : (qs[i0 - 16] >> 4);
          const uint8_t q1 = i1 < 16 ? (qs[i1] & 15) : (qs[i1 - 16] >> 4);
          ob[codes + p * 16 + c] = (uint8_t)(q0 | (q1 << 4));
        }
      } else {
        for (int i = 0; i < 32; ++i) ob[32 + i * 16 + c] = blk[2 + i];
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------- compute
// Sums for rows [0, MR) and output blocks [nb0, nb0 + NBT): acc[m][j] = 16 outputs.

template <int MR, int NBT>
void tile_bf16(const bf16* x, int64_t ldx, const bf16* w, int64_t kp, int64_t nb0, V16 acc[MR][NBT]) {
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);  // pairs of bf16
#if defined(__AVX512BF16__)
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh wv[NBT];
    for (int j = 0; j < NBT; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(w + ((nb0 + j) * kp + p) * 32);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[m * (ldx / 2) + p]);
      for (int j = 0; j < NBT; ++j) acc[m][j].v = _mm512_dpbf16_ps(acc[m][j].v, xv, wv[j]);
    }
  }
#else
  // vdpbf16ps' sums without it: per pair of inputs the odd one's product first (dot_pair).
  (void)xp;
  for (int64_t p = 0; p < kp; ++p) {
    V16 w0[NBT], w1[NBT];
    for (int j = 0; j < NBT; ++j)
      load_bf16_pairs(reinterpret_cast<const uint16_t*>(w + ((nb0 + j) * kp + p) * 32), w0[j], w1[j]);
    for (int m = 0; m < MR; ++m) {
      const V16 x0 = set1(static_cast<float>(x[m * ldx + 2 * p]));
      const V16 x1 = set1(static_cast<float>(x[m * ldx + 2 * p + 1]));
      for (int j = 0; j < NBT; ++j) acc[m][j] = dot_pair(acc[m][j], x0, x1, w0[j], w1[j]);
    }
  }
#endif
}

template <int MR, int NBT>
void tile_f32(const float* x, int64_t ldx, const float* w, int64_t k, int64_t nb0, V16 acc[MR][NBT]) {
  for (int64_t i = 0; i < k; ++i) {
    V16 wv[NBT];
    for (int j = 0; j < NBT; ++j) wv[j] = load(w + ((nb0 + j) * k + i) * 16);
    for (int m = 0; m < MR; ++m) {
      const V16 xv = set1(x[m * ldx + i]);
      for (int j = 0; j < NBT; ++j) acc[m][j] = fmadd(xv, wv[j], acc[m][j]);
    }
  }
}

// The per-block epilogue shared by every tile of the stored formats: acc += scale * s (+ minimum *
// sum(x)), for input block b (and, Q6_K, its 16 inputs from g0); s = the block's sum of x * q.
template <int MR, int NBT, Fmt fmt>
inline void apply_scales(const uint8_t* const blk[NBT], const float* xsum, int64_t kb, int64_t b, int g0,
                         V16 s[MR][NBT], V16 acc[MR][NBT]) {
  for (int j = 0; j < NBT; ++j) {
    if constexpr (fmt == Fmt::kQ41) {
      const V16 d = load_fp16(blk[j]), mn = load_fp16(blk[j] + 32);
      for (int m = 0; m < MR; ++m) acc[m][j] = fmadd(mn, set1(xsum[m * kb + b]), fmadd(d, s[m][j], acc[m][j]));
    } else if constexpr (fmt == Fmt::kQ4K) {
      const V16 a = load(reinterpret_cast<const float*>(blk[j])), mn = load(reinterpret_cast<const float*>(blk[j] + 64));
      for (int m = 0; m < MR; ++m) acc[m][j] = fnmadd(mn, set1(xsum[m * kb + b]), fmadd(a, s[m][j], acc[m][j]));
    } else if constexpr (fmt == Fmt::kQ40) {
      const V16 d = load_fp16(blk[j]), mn = mul(d, set1(-8.f));
      for (int m = 0; m < MR; ++m) acc[m][j] = fmadd(mn, set1(xsum[m * kb + b]), fmadd(d, s[m][j], acc[m][j]));
    } else if constexpr (fmt == Fmt::kQ80) {
      const V16 d = load_fp16(blk[j]);
      for (int m = 0; m < MR; ++m) acc[m][j] = fmadd(d, s[m][j], acc[m][j]);
    } else {
      const V16 a = load(reinterpret_cast<const float*>(blk[j] + 64 * (g0 / 16)));
      for (int m = 0; m < MR; ++m) acc[m][j] = fmadd(a, s[m][j], acc[m][j]);
    }
  }
}

// 4-bit codes with a scale (and a minimum) per output and 32 inputs. x is float32 here;
// xsum[m * kb + b] = the sum of row m's inputs in block b (for the minimums).
// - Q4_0: fp16 d, w = d*q + m with m = -8*d;
// - Q4_1: fp16 d and m, w = d*q + m;
// - Q4_K: float32 a and b, w = a*q - b.
template <int MR, int NBT, Fmt fmt>
void tile_q4(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, int64_t kb, int64_t nb0,
             V16 acc[MR][NBT]) {
  constexpr bool kF32 = fmt == Fmt::kQ4K;
  constexpr int kBlock = fmt == Fmt::kQ40 ? kQ40Block : kF32 ? kQ4KBlock : kQ41Block;
  constexpr int kCodes = fmt == Fmt::kQ40 ? 32 : kF32 ? 128 : 64;  // where the codes start
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* blk[NBT];
    V16 s[MR][NBT];  // sum over the block of x * q (q exact small integers)
    for (int j = 0; j < NBT; ++j) {
      blk[j] = w + ((nb0 + j) * kb + b) * kBlock;
      // Four blocks ahead in each stream: the codes are dense, the loads must not wait.
      if (b + 4 < kb)
        for (int off = 0; off < kBlock; off += 64) _mm_prefetch(reinterpret_cast<const char*>(blk[j] + 4 * kBlock + off), _MM_HINT_T0);
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NBT; ++j) s[m][j] = zero();
    for (int p = 0; p < 16; ++p) {
      V16 q0[NBT], q1[NBT];
      for (int j = 0; j < NBT; ++j) load_nibbles(blk[j] + kCodes + 16 * p, q0[j], q1[j]);
      for (int m = 0; m < MR; ++m) {
        const float* xr = x + m * ldx + b * 32 + 2 * p;
        const V16 x0 = set1(xr[0]), x1 = set1(xr[1]);
        for (int j = 0; j < NBT; ++j) s[m][j] = fmadd(x1, q1[j], fmadd(x0, q0[j], s[m][j]));
      }
    }
    apply_scales<MR, NBT, fmt>(blk, xsum, kb, b, 0, s, acc);
  }
}

template <int MR, int NBT>
void tile_q8_0(const float* x, int64_t ldx, const uint8_t* w, int64_t kb, int64_t nb0, V16 acc[MR][NBT]) {
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* blk[NBT];
    V16 s[MR][NBT];
    for (int j = 0; j < NBT; ++j) {
      blk[j] = w + ((nb0 + j) * kb + b) * kQ80Block;
      if (b + 4 < kb)
        for (int off = 0; off < kQ80Block; off += 64) _mm_prefetch(reinterpret_cast<const char*>(blk[j] + 4 * kQ80Block + off), _MM_HINT_T0);
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NBT; ++j) s[m][j] = zero();
    for (int i = 0; i < 32; ++i) {
      V16 q[NBT];
      for (int j = 0; j < NBT; ++j) q[j] = load_i8(reinterpret_cast<const int8_t*>(blk[j] + 32 + 16 * i));
      for (int m = 0; m < MR; ++m) {
        const V16 xv = set1(x[m * ldx + b * 32 + i]);
        for (int j = 0; j < NBT; ++j) s[m][j] = fmadd(xv, q[j], s[m][j]);
      }
    }
    apply_scales<MR, NBT, Fmt::kQ80>(blk, nullptr, kb, b, 0, s, acc);
  }
}

// q6_k: int8 codes, one float32 scale per 16 inputs.
template <int MR, int NBT>
void tile_q6_k(const float* x, int64_t ldx, const uint8_t* w, int64_t kb, int64_t nb0, V16 acc[MR][NBT]) {
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* blk[NBT];
    for (int j = 0; j < NBT; ++j) {
      blk[j] = w + ((nb0 + j) * kb + b) * kQ6KBlock;
      if (b + 4 < kb)
        for (int off = 0; off < kQ6KBlock; off += 64) _mm_prefetch(reinterpret_cast<const char*>(blk[j] + 4 * kQ6KBlock + off), _MM_HINT_T0);
    }
    for (int half = 0; half < 2; ++half) {
      V16 s[MR][NBT];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NBT; ++j) s[m][j] = zero();
      for (int i = 16 * half; i < 16 * half + 16; ++i) {
        V16 q[NBT];
        for (int j = 0; j < NBT; ++j) q[j] = load_i8(reinterpret_cast<const int8_t*>(blk[j] + 128 + 16 * i));
        for (int m = 0; m < MR; ++m) {
          const V16 xv = set1(x[m * ldx + b * 32 + i]);
          for (int j = 0; j < NBT; ++j) s[m][j] = fmadd(xv, q[j], s[m][j]);
        }
      }
      apply_scales<MR, NBT, Fmt::kQ6K>(blk, nullptr, kb, b, 16 * half, s, acc);
    }
  }
}

// ---------------------------------------------------------------------------- bf16 activations
// Stored codes times bfloat16 activations (a bf16 run over stored weights). Every code of every
// stored format is a small integer (|q| <= 128), exact in bf16, so x * q is an exact bf16 x bf16
// product and vdpbf16ps sums a pair of them per lane; the scales and minimums are applied per
// block exactly as in the float32 tiles (d*s + m*sum(x)). Where vdpbf16ps is missing its order
// is followed (dot_pair: the odd input's product first): the same bits on every level.
//
// A pair of inputs (2p, 2p+1) of 16 outputs: `WPair`, and a row's pair of activations: `XPair`.
//
// The tile levels (amx_bf16, amx_emu) sum in TDPBF16PS' order, input 2p's product before 2p + 1's,
// at every row count: their few-row tiles here swap both operands' pairs (Swap), so that
// vdpbf16ps, which adds the odd element first, adds input 2p first. A row's bits are then the same
// whether vdpbf16ps (a few rows) or the tiles (more) computed it (amx_stored_linear).
#if defined(TRIPOD_AMX)
constexpr bool kTileOrder = true;
#else
constexpr bool kTileOrder = false;
#endif
#if defined(__AVX512BF16__)
struct WPair {
  __m512bh v;
};
struct XPair {
  __m512bh v;
};
using XAct = uint16_t;  // the tiles read the bf16 activations as they are
inline XPair x_pair(const XAct* x, int64_t i) {  // inputs i, i + 1 (i even); swapped on the tile levels
  uint32_t bits;
  std::memcpy(&bits, x + i, 4);
  if constexpr (kTileOrder) bits = (bits >> 16) | (bits << 16);
  return {(__m512bh)_mm512_set1_epi32((int)bits)};
}
inline V16 dp(V16 acc, XPair x, WPair w) { return {_mm512_dpbf16_ps(acc.v, x.v, w.v)}; }
// bf16 bits of the integer-valued floats lo (inputs 2p) and hi (2p + 1), as one pair vector:
// their float bits have zero low halves (|q| <= 128), so the bf16 is the high half, exactly.
inline WPair pair_of(__m512 lo, __m512 hi) {
  const __m512i l = _mm512_srli_epi32(_mm512_castps_si512(lo), 16);
  const __m512i h = _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32((int)0xffff0000u));
  return {(__m512bh)_mm512_or_si512(l, h)};
}
// 16 bytes of two 4-bit codes each (input 2p low, 2p + 1 high): a table lookup of bf16(0..15).
// Swap: input 2p + 1 in the pair's even element, 2p in its odd one.
template <bool Swap = false>
inline WPair nibble_pairs(const uint8_t* p) {
  const __m512i table = _mm512_set_epi16(
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // low 16 bits: the low nibble; high 16 bits: the high nibble (b < 256, so (b << 12) & 0xf0000).
  const __m512i idx = Swap ? _mm512_or_si512(_mm512_srli_epi32(b, 4), _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), 16))
                          : _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000f000f), 0xa8);  // (A | B) & C
  return {(__m512bh)_mm512_permutexvar_epi16(idx, table)};
}
// 32 int8 codes: inputs 2p (16 outputs) then 2p + 1.
template <bool Swap = false>
inline WPair i8_pairs(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return Swap ? pair_of(hi, lo) : pair_of(lo, hi);
}
inline void store_pairs(float* out, WPair w) { _mm512_storeu_si512(out, (__m512i)w.v); }
inline WPair load_pairs(const float* in) { return {(__m512bh)_mm512_loadu_si512(in)}; }
constexpr int kPairFloats = 16;  // scratch floats per decoded pair of 16 outputs (bf16 pairs)
#else
struct WPair {
  V16 even, odd;
};
struct XPair {
  V16 even, odd;
};
// The tiles read the bf16 activations widened to float32 once per call (exact): a scalar
// conversion per broadcast would cost more than the products.
using XAct = float;
inline XPair x_pair(const XAct* x, int64_t i) { return {set1(x[i]), set1(x[i + 1])}; }
inline V16 dp(V16 acc, XPair x, WPair w) { return dot_pair(acc, x.even, x.odd, w.even, w.odd); }
template <bool Swap = false>  // (never swapped here: the tile levels have vdpbf16ps)
inline WPair nibble_pairs(const uint8_t* p) {
  WPair w;
  load_nibbles(p, w.even, w.odd);
  return w;
}
template <bool Swap = false>
inline WPair i8_pairs(const int8_t* p) { return {load_i8(p), load_i8(p + 16)}; }
inline void store_pairs(float* out, WPair w) {
  store(out, w.even);
  store(out + 16, w.odd);
}
inline WPair load_pairs(const float* in) { return {load(in), load(in + 16)}; }
constexpr int kPairFloats = 32;
#endif

constexpr int kPairBlock = 16 * kPairFloats;  // scratch floats per decoded block (16 outputs x 32 inputs)

// Where a format's codes start in its block, and how many inputs share one scale.
constexpr int codes_at(Fmt fmt) {
  return fmt == Fmt::kQ41 ? 64 : fmt == Fmt::kQ40 || fmt == Fmt::kQ80 ? 32 : 128;
}
constexpr bool nibbles(Fmt fmt) { return fmt == Fmt::kQ40 || fmt == Fmt::kQ41 || fmt == Fmt::kQ4K; }

// The code pair (2p, 2p + 1) of one packed block (Swap: (2p + 1, 2p), the tile levels' few-row order).
template <Fmt fmt, bool Swap = false>
inline WPair code_pair(const uint8_t* blk, int p) {
  if constexpr (nibbles(fmt)) return nibble_pairs<Swap>(blk + codes_at(fmt) + 16 * p);
  else return i8_pairs<Swap>(reinterpret_cast<const int8_t*>(blk + codes_at(fmt) + 32 * p));
}

// Rows [0, MR) of bf16 activations x (row stride ldx) over every input block, codes read from
// the packed blocks: the direct tile of a bf16 run.
template <int MR, int NBT, Fmt fmt>
void tile_bf_codes(const XAct* x, int64_t ldx, const float* xsum, const uint8_t* w, int64_t kb, int64_t nb0,
                   V16 acc[MR][NBT]) {
  constexpr int block = fmt == Fmt::kQ40 ? kQ40Block : fmt == Fmt::kQ41 ? kQ41Block : fmt == Fmt::kQ80 ? kQ80Block
                        : fmt == Fmt::kQ4K ? kQ4KBlock : kQ6KBlock;
  constexpr int group = fmt == Fmt::kQ6K ? 16 : 32;  // inputs per scale
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* blk[NBT];
    for (int j = 0; j < NBT; ++j) {
      blk[j] = w + ((nb0 + j) * kb + b) * block;
      if (b + 4 < kb)
        for (int off = 0; off < block; off += 64) _mm_prefetch(reinterpret_cast<const char*>(blk[j] + 4 * block + off), _MM_HINT_T0);
    }
    for (int g0 = 0; g0 < 32; g0 += group) {
      V16 s[MR][NBT];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NBT; ++j) s[m][j] = zero();
      for (int p = g0 / 2; p < (g0 + group) / 2; ++p) {
        WPair q[NBT];
        for (int j = 0; j < NBT; ++j) q[j] = code_pair<fmt, kTileOrder>(blk[j], p);
        for (int m = 0; m < MR; ++m) {
          const XPair xv = x_pair(x + m * ldx, b * 32 + 2 * p);
          for (int j = 0; j < NBT; ++j) s[m][j] = dp(s[m][j], xv, q[j]);
        }
      }
      apply_scales<MR, NBT, fmt>(blk, xsum, kb, b, g0, s, acc);
    }
  }
}

// ---------------------------------------------------------------------------- decoded tiles
// With more rows than one register tile, a column tile's codes are decoded once into float32
// (exact small integers) in a per-thread scratch and every tile of rows reads them from there:
// the decoding is paid once per tile of outputs, not once per tile of rows. The sums are the
// direct tiles' (the same codes, the same fmadd order per input, the same per-block epilogue), so
// a row's bits do not depend on which path ran it (tested: alone = batched on every format).

constexpr int kDecodedBlock = 32 * 16;  // floats per 16 outputs x 32 inputs

// Bytes per packed 16 outputs x 32 inputs of a quantized format.
constexpr int block_bytes(Fmt fmt) {
  return fmt == Fmt::kQ40 ? kQ40Block : fmt == Fmt::kQ41 ? kQ41Block : fmt == Fmt::kQ80 ? kQ80Block : fmt == Fmt::kQ4K ? kQ4KBlock : kQ6KBlock;
}

// Codes of output blocks [nb0, nb0 + cols) x input blocks [b0, b0 + nq) as float32:
// q[(j * nq + b - b0) * 512 + i * 16 + c].
void decode_codes(Fmt fmt, const uint8_t* w, int64_t kb, int64_t nb0, int64_t cols, int64_t b0, int64_t nq, float* q) {
  const int block = block_bytes(fmt);
  const int codes = fmt == Fmt::kQ41 ? 64 : fmt == Fmt::kQ40 || fmt == Fmt::kQ80 ? 32 : 128;
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t b = b0; b < b0 + nq; ++b) {
      const uint8_t* blk = w + ((nb0 + j) * kb + b) * block + codes;
      float* out = q + (j * nq + b - b0) * kDecodedBlock;
      if (fmt == Fmt::kQ40 || fmt == Fmt::kQ41 || fmt == Fmt::kQ4K) {
        for (int p = 0; p < 16; ++p) {
          V16 lo, hi;
          load_nibbles(blk + 16 * p, lo, hi);
          store(out + (2 * p) * 16, lo);
          store(out + (2 * p + 1) * 16, hi);
        }
      } else {
        for (int i = 0; i < 32; ++i) store(out + i * 16, load_i8(reinterpret_cast<const int8_t*>(blk + 16 * i)));
      }
    }
}

// The direct tiles' sums over input blocks [b0, b0 + nq) from decoded codes q (decode_codes').
template <int MR, int NBT, Fmt fmt>
void tile_decoded(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, const float* q, int64_t kb,
                  int64_t b0, int64_t nq, int64_t nb0, int64_t j0, V16 acc[MR][NBT]) {
  constexpr int block = block_bytes(fmt);
  constexpr int group = fmt == Fmt::kQ6K ? 16 : 32;  // inputs per scale
  for (int64_t b = b0; b < b0 + nq; ++b) {
    for (int g0 = 0; g0 < 32; g0 += group) {
      V16 s[MR][NBT];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NBT; ++j) s[m][j] = zero();
      for (int i = g0; i < g0 + group; ++i) {
        V16 qv[NBT];
        for (int j = 0; j < NBT; ++j) qv[j] = load(q + ((j0 + j) * nq + b - b0) * kDecodedBlock + i * 16);
        for (int m = 0; m < MR; ++m) {
          const V16 xv = set1(x[m * ldx + b * 32 + i]);
          for (int j = 0; j < NBT; ++j) s[m][j] = fmadd(xv, qv[j], s[m][j]);
        }
      }
      const uint8_t* blk[NBT];
      for (int j = 0; j < NBT; ++j) blk[j] = w + ((nb0 + j0 + j) * kb + b) * block;
      apply_scales<MR, NBT, fmt>(blk, xsum, kb, b, g0, s, acc);
    }
  }
}

// The bf16 run's decoded tiles: codes of output blocks [nb0, nb0 + cols) x input blocks
// [b0, b0 + nq) as code pairs, pair p of block (j, b) at q + (j * nq + b - b0) * kPairBlock + p * kPairFloats.
void decode_pairs(Fmt fmt, const uint8_t* w, int64_t kb, int64_t nb0, int64_t cols, int64_t b0, int64_t nq, float* q) {
  const int block = block_bytes(fmt);
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t b = b0; b < b0 + nq; ++b) {
      const uint8_t* blk = w + ((nb0 + j) * kb + b) * block;
      float* out = q + (j * nq + b - b0) * kPairBlock;
      for (int p = 0; p < 16; ++p) {
        switch (fmt) {
          case Fmt::kQ40: store_pairs(out + p * kPairFloats, code_pair<Fmt::kQ40>(blk, p)); break;
          case Fmt::kQ41: store_pairs(out + p * kPairFloats, code_pair<Fmt::kQ41>(blk, p)); break;
          case Fmt::kQ4K: store_pairs(out + p * kPairFloats, code_pair<Fmt::kQ4K>(blk, p)); break;
          case Fmt::kQ80: store_pairs(out + p * kPairFloats, code_pair<Fmt::kQ80>(blk, p)); break;
          default: store_pairs(out + p * kPairFloats, code_pair<Fmt::kQ6K>(blk, p)); break;
        }
      }
    }
}

// The per-block epilogue with the running sums in memory (sums + row * ld + j * 16): a bf16 run's
// decoded tiles keep only the block partials in registers, so that MR x NBT of them (16 on
// AVX-512) are in flight: fewer would wait on vdpbf16ps' latency.
template <int MR, int NBT, Fmt fmt>
inline void apply_scales_mem(const uint8_t* const blk[NBT], const float* xsum, int64_t kb, int64_t b, int g0,
                             V16 s[MR][NBT], float* sums, int64_t ld) {
  V16 acc[MR][NBT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NBT; ++j) acc[m][j] = load(sums + m * ld + j * 16);
  apply_scales<MR, NBT, fmt>(blk, xsum, kb, b, g0, s, acc);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NBT; ++j) store(sums + m * ld + j * 16, acc[m][j]);
}

// tile_bf_codes' sums over input blocks [b0, b0 + nq) from decoded code pairs (decode_pairs'),
// added to the running sums of rows [0, MR) x blocks [j0, j0 + NBT) in `sums` (row stride ld).
template <int MR, int NBT, Fmt fmt>
void tile_decoded_bf(const XAct* x, int64_t ldx, const float* xsum, const uint8_t* w, const float* q, int64_t kb,
                     int64_t b0, int64_t nq, int64_t nb0, int64_t j0, float* sums, int64_t ld) {
  constexpr int block = block_bytes(fmt);
  constexpr int group = fmt == Fmt::kQ6K ? 16 : 32;
  for (int64_t b = b0; b < b0 + nq; ++b) {
    const uint8_t* blk[NBT];
    for (int j = 0; j < NBT; ++j) blk[j] = w + ((nb0 + j0 + j) * kb + b) * block;
    for (int g0 = 0; g0 < 32; g0 += group) {
      V16 s[MR][NBT];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NBT; ++j) s[m][j] = zero();
#if defined(__AVX512BF16__)
      // The block's 16 activation pairs of each row in one register, each pair broadcast from
      // there (a shuffle) instead of from memory: the loads are what bounds this loop.
      __m512i xr[MR];
      for (int m = 0; m < MR; ++m) xr[m] = _mm512_loadu_si512(x + m * ldx + b * 32);
      __m512i idx = _mm512_set1_epi32(g0 / 2);
      const __m512i one = _mm512_set1_epi32(1);
      for (int p = g0 / 2; p < (g0 + group) / 2; ++p) {
        WPair qv[NBT];
        for (int j = 0; j < NBT; ++j) qv[j] = load_pairs(q + ((j0 + j) * nq + b - b0) * kPairBlock + p * kPairFloats);
        for (int m = 0; m < MR; ++m) {
          const XPair xv = {(__m512bh)_mm512_permutexvar_epi32(idx, xr[m])};
          for (int j = 0; j < NBT; ++j) s[m][j] = dp(s[m][j], xv, qv[j]);
        }
        idx = _mm512_add_epi32(idx, one);
      }
#else
      for (int p = g0 / 2; p < (g0 + group) / 2; ++p) {
        WPair qv[NBT];
        for (int j = 0; j < NBT; ++j) qv[j] = load_pairs(q + ((j0 + j) * nq + b - b0) * kPairBlock + p * kPairFloats);
        for (int m = 0; m < MR; ++m) {
          const XPair xv = x_pair(x + m * ldx, b * 32 + 2 * p);
          for (int j = 0; j < NBT; ++j) s[m][j] = dp(s[m][j], xv, qv[j]);
        }
      }
#endif
      apply_scales_mem<MR, NBT, fmt>(blk, xsum, kb, b, g0, s, sums + j0 * 16, ld);
    }
  }
}

// The register tile: rows x 16-output blocks of sums. AVX-512 has 32 vector registers and a V16
// takes one; AVX2 has 16 and a V16 takes two. (The tile shape never changes what is summed.)
constexpr int kRows = 4;                                // rows per register tile
constexpr int kCols = kVectorRegisters >= 32 ? 4 : 2;  // 16-output blocks per register tile

struct Problem {
  Fmt fmt;
  int64_t m, n, k, nb;
  const void* x;       // activations as given (bf16 or f32), [M, K] with row stride ldx
  int64_t ldx;
  const float* xf;     // float32 activations (quantized/f32 formats on bf16 input), ld = k
  const float* xsum;   // [M, K/32] block sums (q4_0, q4_1, q4_k)
  const XAct* xb;      // bf16 activations over stored codes (a bf16 run; XAct: as given or widened), row stride ldx; else null
  const void* w;
  const void* residual;  // [M, N] or null
  int64_t ldr;
  void* y;             // [M, N]
  bool bf16_io;
};

template <int MR, int NBT>
void finish_tile(const Problem& p, int64_t m0, int64_t nb0, V16 acc[MR][NBT]);

// A bf16 run's direct tile over stored codes (its own function: sharing run_tile's body makes the
// compiler spill the other formats' accumulators).
template <int MR, int NBT>
__attribute__((noinline)) void run_tile_bf(const Problem& p, int64_t m0, int64_t nb0) {
  V16 acc[MR][NBT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NBT; ++j) acc[m][j] = zero();
  const XAct* x = p.xb + m0 * p.ldx;
  const float* xs = p.xsum ? p.xsum + m0 * (p.k / 32) : nullptr;
  const uint8_t* w = static_cast<const uint8_t*>(p.w);
  const int64_t kb = p.k / 32;
  switch (p.fmt) {
    case Fmt::kQ40: tile_bf_codes<MR, NBT, Fmt::kQ40>(x, p.ldx, xs, w, kb, nb0, acc); break;
    case Fmt::kQ41: tile_bf_codes<MR, NBT, Fmt::kQ41>(x, p.ldx, xs, w, kb, nb0, acc); break;
    case Fmt::kQ80: tile_bf_codes<MR, NBT, Fmt::kQ80>(x, p.ldx, xs, w, kb, nb0, acc); break;
    case Fmt::kQ4K: tile_bf_codes<MR, NBT, Fmt::kQ4K>(x, p.ldx, xs, w, kb, nb0, acc); break;
    default: tile_bf_codes<MR, NBT, Fmt::kQ6K>(x, p.ldx, xs, w, kb, nb0, acc); break;
  }
  finish_tile<MR, NBT>(p, m0, nb0, acc);
}

template <int MR, int NBT>
void run_tile(const Problem& p, int64_t m0, int64_t nb0) {
  V16 acc[MR][NBT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NBT; ++j) acc[m][j] = zero();
  switch (p.fmt) {
    case Fmt::kBf16:
      tile_bf16<MR, NBT>(static_cast<const bf16*>(p.x) + m0 * p.ldx, p.ldx, static_cast<const bf16*>(p.w), (p.k + 1) / 2, nb0, acc);
      break;
    case Fmt::kF32:
      tile_f32<MR, NBT>(p.xf + m0 * p.k, p.k, static_cast<const float*>(p.w), p.k, nb0, acc);
      break;
    case Fmt::kQ40:
      tile_q4<MR, NBT, Fmt::kQ40>(p.xf + m0 * p.k, p.k, p.xsum + m0 * (p.k / 32), static_cast<const uint8_t*>(p.w), p.k / 32, nb0, acc);
      break;
    case Fmt::kQ41:
      tile_q4<MR, NBT, Fmt::kQ41>(p.xf + m0 * p.k, p.k, p.xsum + m0 * (p.k / 32), static_cast<const uint8_t*>(p.w), p.k / 32, nb0, acc);
      break;
    case Fmt::kQ80:
      tile_q8_0<MR, NBT>(p.xf + m0 * p.k, p.k, static_cast<const uint8_t*>(p.w), p.k / 32, nb0, acc);
      break;
    case Fmt::kQ4K:
      tile_q4<MR, NBT, Fmt::kQ4K>(p.xf + m0 * p.k, p.k, p.xsum + m0 * (p.k / 32), static_cast<const uint8_t*>(p.w), p.k / 32, nb0, acc);
      break;
    case Fmt::kQ6K:
      tile_q6_k<MR, NBT>(p.xf + m0 * p.k, p.k, static_cast<const uint8_t*>(p.w), p.k / 32, nb0, acc);
      break;
  }
  finish_tile<MR, NBT>(p, m0, nb0, acc);
}

// Rows [m0, m0 + MR) x blocks [nb0 + j0, + NBT) over the input blocks [b0, b0 + nq) decoded in q.
// The sums so far live in sums ([row][kCols * 16] floats, exact copies of the registers) between
// chunks of inputs; after the last chunk they go out.
template <int MR, int NBT>
__attribute__((noinline)) void run_decoded_tile(const Problem& p, int64_t m0, int64_t nb0, int64_t j0, int64_t b0, int64_t nq, const float* q,
                      float* sums) {
  constexpr int ld = kCols * 16;
  V16 acc[MR][NBT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NBT; ++j) acc[m][j] = b0 == 0 ? zero() : load(sums + (m0 + m) * ld + (j0 + j) * 16);
  const int64_t kb = p.k / 32;
  const float* xs = p.xsum ? p.xsum + m0 * kb : nullptr;
  const uint8_t* w = static_cast<const uint8_t*>(p.w);
  const float* x = p.xf + m0 * p.k;
  switch (p.fmt) {
    case Fmt::kQ40: tile_decoded<MR, NBT, Fmt::kQ40>(x, p.k, xs, w, q, kb, b0, nq, nb0, j0, acc); break;
    case Fmt::kQ41: tile_decoded<MR, NBT, Fmt::kQ41>(x, p.k, xs, w, q, kb, b0, nq, nb0, j0, acc); break;
    case Fmt::kQ80: tile_decoded<MR, NBT, Fmt::kQ80>(x, p.k, xs, w, q, kb, b0, nq, nb0, j0, acc); break;
    case Fmt::kQ4K: tile_decoded<MR, NBT, Fmt::kQ4K>(x, p.k, xs, w, q, kb, b0, nq, nb0, j0, acc); break;
    default: tile_decoded<MR, NBT, Fmt::kQ6K>(x, p.k, xs, w, q, kb, b0, nq, nb0, j0, acc); break;
  }
  if (b0 + nq < kb) {
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NBT; ++j) store(sums + (m0 + m) * ld + (j0 + j) * 16, acc[m][j]);
    return;
  }
  finish_tile<MR, NBT>(p, m0, nb0 + j0, acc);
}

// A bf16 run's decoded tile: rows [m0, m0 + MR) x blocks [nb0 + j0, + NBT) over input blocks
// [b0, b0 + nq); the running sums live in `sums` ([row][kCols * 16]) from the first chunk to the
// last, which writes them out.
template <int MR, int NBT>
__attribute__((noinline)) void run_decoded_tile_bf(const Problem& p, int64_t m0, int64_t nb0, int64_t j0, int64_t b0,
                                                   int64_t nq, const float* q, float* sums) {
  constexpr int64_t ld = kCols * 16;
  float* rows = sums + m0 * ld;
  if (b0 == 0)
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NBT; ++j) store(rows + m * ld + (j0 + j) * 16, zero());
  const int64_t kb = p.k / 32;
  const float* xs = p.xsum ? p.xsum + m0 * kb : nullptr;
  const uint8_t* w = static_cast<const uint8_t*>(p.w);
  const XAct* xb = p.xb + m0 * p.ldx;
  switch (p.fmt) {
    case Fmt::kQ40: tile_decoded_bf<MR, NBT, Fmt::kQ40>(xb, p.ldx, xs, w, q, kb, b0, nq, nb0, j0, rows, ld); break;
    case Fmt::kQ41: tile_decoded_bf<MR, NBT, Fmt::kQ41>(xb, p.ldx, xs, w, q, kb, b0, nq, nb0, j0, rows, ld); break;
    case Fmt::kQ80: tile_decoded_bf<MR, NBT, Fmt::kQ80>(xb, p.ldx, xs, w, q, kb, b0, nq, nb0, j0, rows, ld); break;
    case Fmt::kQ4K: tile_decoded_bf<MR, NBT, Fmt::kQ4K>(xb, p.ldx, xs, w, q, kb, b0, nq, nb0, j0, rows, ld); break;
    default: tile_decoded_bf<MR, NBT, Fmt::kQ6K>(xb, p.ldx, xs, w, q, kb, b0, nq, nb0, j0, rows, ld); break;
  }
  if (b0 + nq < kb) return;
  V16 acc[MR][NBT];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NBT; ++j) acc[m][j] = load(rows + m * ld + (j0 + j) * 16);
  finish_tile<MR, NBT>(p, m0, nb0 + j0, acc);
}

// acc -> y (+ residual) for rows [m0, m0 + MR) and output blocks [nb0, nb0 + NBT).
template <int MR, int NBT>
void finish_tile(const Problem& p, int64_t m0, int64_t nb0, V16 acc[MR][NBT]) {
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NBT; ++j) {
      const int64_t col = (nb0 + j) * 16;
      const int live = (int)std::min<int64_t>(16, p.n - col);  // the last block may be partial
      V16 v = acc[m][j];
      const int64_t row = m0 + m;
      if (p.bf16_io) {
        uint16_t* y = reinterpret_cast<uint16_t*>(static_cast<bf16*>(p.y) + row * p.n + col);
        if (p.residual) {
          const bf16* r = static_cast<const bf16*>(p.residual) + row * p.ldr + col;
          if (live == 16) {
            v = add(v, load16(r));
          } else {
            alignas(64) uint16_t tmp[16] = {};
            std::memcpy(tmp, r, sizeof(uint16_t) * live);
            v = add(v, load_bf16(tmp));
          }
        }
        if (live == 16) store_bf16(y, v);
        else store_bf16_first(y, v, live);
      } else {
        float* y = static_cast<float*>(p.y) + row * p.n + col;
        if (p.residual) v = add(v, load_first(static_cast<const float*>(p.residual) + row * p.ldr + col, live));
        if (live == 16) store(y, v);
        else store_first(y, v, live);
      }
    }
}

template <int NBT>
void run_rows(const Problem& p, int64_t m0, int64_t mr, int64_t nb0) {
  if (p.xb != nullptr) {
    switch (mr) {
      case 1: return run_tile_bf<1, NBT>(p, m0, nb0);
      case 2: return run_tile_bf<2, NBT>(p, m0, nb0);
      case 3: return run_tile_bf<3, NBT>(p, m0, nb0);
      default: return run_tile_bf<4, NBT>(p, m0, nb0);
    }
  }
  switch (mr) {
    case 1: return run_tile<1, NBT>(p, m0, nb0);
    case 2: return run_tile<2, NBT>(p, m0, nb0);
    case 3: return run_tile<3, NBT>(p, m0, nb0);
    default: return run_tile<4, NBT>(p, m0, nb0);
  }
}

// A tile of `cols` 16-output blocks (<= kCols). The quantized formats keep per-block partial sums
// beside the accumulators: with more than two rows they go two blocks at a time (registers).
// The tile shape never changes what is summed, or in which order.
void run_block_tile(const Problem& p, int64_t m0, int64_t mr, int64_t nb0, int64_t cols) {
  const bool quant = p.fmt != Fmt::kBf16 && p.fmt != Fmt::kF32;
  if (quant && mr > 2 && cols > 2) {
    run_rows<2>(p, m0, mr, nb0);
    if (cols == 3) run_rows<1>(p, m0, mr, nb0 + 2);
    else run_rows<2>(p, m0, mr, nb0 + 2);
    return;
  }
  switch (cols) {
    case 1: run_rows<1>(p, m0, mr, nb0); break;
    case 2: run_rows<2>(p, m0, mr, nb0); break;
    case 3: run_rows<3>(p, m0, mr, nb0); break;
    default: run_rows<4>(p, m0, mr, nb0); break;
  }
}


#if defined(TRIPOD_AMX)
// ---------------------------------------------------------------------------- AMX-BF16 (levels amx_bf16, amx_emu)
// The bf16 linears on tiles: C[rows x 16 outputs] += A[rows x 16 pairs] . B[16 pairs x 16 outputs]
// by TDPBF16PS, whose B tile is exactly 16 pairs of the "bf16" packing ([N/16][K/2][16][2]: 64
// bytes per pair). Per output it adds, pair after pair in input order, the even product then the
// odd one (each exact bf16 x bf16 product rounded once into the float32 sum; denormals flushed):
// one order fixed by the row, whatever the batch. (vdpbf16ps adds the odd one first: this level's
// bits are its own, not the other levels'.) The last pairs of K are zero-padded to a whole tile
// (+0 products), the same for every batch. The tile instructions are amx.h's macros: the hardware's
// on amx_bf16, their emulation on amx_emu (the same code, so every CPU with AVX512-BF16 runs it).
//
// NOTE: Linux grants AMX tile state only to a process that asks (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction dies with SIGILL. Asked once, when
// the library loads; refused, linear_packed runs the avx512_bf16 code and amx_status() says why.

using tripod_amx::TileConfig;

const char* amx_refusal() {
#if defined(TRIPOD_AMX_EMU)
  return nullptr;  // emulated tiles: nothing to ask for
#else
  static const char* why = [] {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0
               ? (const char*)nullptr
               : "Linux refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)";
  }();
  return why;
#endif
}

// Rows [m0, m0 + mr) (mr <= 16) x output blocks [nb0, nb0 + cols) (cols <= 2): C in tiles 0-1, A in
// tile 2, B in tiles 3-4.
void amx_bf16_tile(const Problem& p, int64_t m0, int64_t mr, int64_t nb0, int64_t cols) {
  const int64_t kp = p.k / 2;
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) {
    cfg.rows[t] = (uint8_t)mr;
    cfg.colsb[t] = 64;
  }
  cfg.rows[3] = cfg.rows[4] = 16;
  cfg.colsb[3] = cfg.colsb[4] = 64;
  TRIPOD_TILE_LOADCONFIG(&cfg);
  TRIPOD_TILE_ZERO(0);
  TRIPOD_TILE_ZERO(1);
  const bf16* x = static_cast<const bf16*>(p.x) + m0 * p.ldx;
  const bf16* w = static_cast<const bf16*>(p.w);
  alignas(64) bf16 apad[16 * 32];
  alignas(64) bf16 bpad[2][16 * 32];
  for (int64_t p0 = 0; p0 < kp; p0 += 16) {
    const int64_t np = std::min<int64_t>(16, kp - p0);
    if (np == 16) {
      TRIPOD_TILE_LOADD(2, x + 2 * p0, p.ldx * 2);
      TRIPOD_TILE_LOADD(3, w + (nb0 * kp + p0) * 32, 64);
      if (cols > 1) TRIPOD_TILE_LOADD(4, w + ((nb0 + 1) * kp + p0) * 32, 64);
    } else {
      std::memset(apad, 0, sizeof apad);
      std::memset(bpad, 0, sizeof bpad);
      for (int64_t r = 0; r < mr; ++r) std::memcpy(apad + r * 32, x + r * p.ldx + 2 * p0, np * 4);
      for (int64_t j = 0; j < cols; ++j) std::memcpy(bpad[j], w + ((nb0 + j) * kp + p0) * 32, np * 64);
      TRIPOD_TILE_LOADD(2, apad, 64);
      TRIPOD_TILE_LOADD(3, bpad[0], 64);
      if (cols > 1) TRIPOD_TILE_LOADD(4, bpad[1], 64);
    }
    TRIPOD_TILE_DPBF16PS(0, 2, 3);
    if (cols > 1) TRIPOD_TILE_DPBF16PS(1, 2, 4);
  }
  alignas(64) float c[2][16 * 16];
  TRIPOD_TILE_STORED(0, c[0], 64);
  if (cols > 1) TRIPOD_TILE_STORED(1, c[1], 64);
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      V16 acc[1][1] = {{load(c[j] + r * 16)}};
      finish_tile<1, 1>(p, m0 + r, nb0 + j, acc);
    }
}

void amx_bf16_linear(const Problem& p) {
  const int64_t pairs = (p.nb + 1) / 2;  // work items: two 16-output blocks each
  at::parallel_for(0, pairs, p.m * p.n * p.k < (1 << 18) ? pairs : 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < p.m; m0 += 16)
        amx_bf16_tile(p, m0, std::min<int64_t>(16, p.m - m0), 2 * t, std::min<int64_t>(2, p.nb - 2 * t));
    TRIPOD_TILE_RELEASE();
  });
}

// ---------------------------------------------------------------------------- stored blocks on tiles
// GGUF blocks executed as stored with bf16 activations, more rows than a register tile: per block
// of 32 inputs (Q6_K: per 16, its scale's group) and 16 outputs, a B tile of the block's codes as
// bf16 (small integers, exact; decode_pairs' layout is TDPBF16PS' B tile: 16 pairs x 16 outputs x
// 2), an A tile of up to 16 rows' activations (read in place), C zeroed, one TDPBF16PS, and the
// block's scale (and minimum) applied in float32 by apply_scales, as the few-row tiles do. Per
// output row: s = the block's x . q in TDPBF16PS' order, acc = the epilogue of (acc, s), blocks in
// input order. That is tile_bf_codes' order on the tile levels (kTileOrder: vdpbf16ps on swapped
// pairs), so a row's bits are the same alone (a few rows: vdpbf16ps) as in a batch (tiles):
// tested through the emulation, and on AMX hosts by the self-test.
//
// Tiles: C in 0-1, A in 2, B in 3-4; the codes of a column tile (two 16-output blocks) are decoded
// once for the whole K (1 KiB per block) and read by every tile of rows.

constexpr int kTileCols = 2;  // 16-output blocks per column tile

// The block epilogue of MR rows of one 16-output block: acc (row stride ld) = apply_scales(acc, c),
// c the C tile as stored (16 floats per row). MR = 16 for a full tile: the scales are loaded once.
template <int MR, Fmt fmt>
inline void tile_epilogue(const uint8_t* blk, const float* xsum, int64_t kb, int64_t b, int g0, const float* c,
                          float* acc, int64_t ld) {
  V16 s[MR][1], a[MR][1];
  for (int m = 0; m < MR; ++m) {
    s[m][0] = load(c + m * 16);
    a[m][0] = load(acc + m * ld);
  }
  const uint8_t* blks[1] = {blk};
  apply_scales<MR, 1, fmt>(blks, xsum, kb, b, g0, s, a);
  for (int m = 0; m < MR; ++m) store(acc + m * ld, a[m][0]);
}

template <Fmt fmt>
void amx_stored_rows(const Problem& p, int64_t m0, int64_t mr, int64_t nb0, int64_t cols, const float* q, float* acc) {
  constexpr int group = fmt == Fmt::kQ6K ? 16 : 32;  // inputs per scale: one TDPBF16PS of group / 2 pairs
  constexpr int block = block_bytes(fmt);
  const int64_t kb = p.k / 32;
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = (uint8_t)mr;
  cfg.colsb[0] = cfg.colsb[1] = 64;
  cfg.colsb[2] = group * 2;  // group bf16 per row
  cfg.rows[3] = cfg.rows[4] = group / 2;
  cfg.colsb[3] = cfg.colsb[4] = 64;
  TRIPOD_TILE_LOADCONFIG(&cfg);
  const uint16_t* x = reinterpret_cast<const uint16_t*>(p.xb) + m0 * p.ldx;
  const uint8_t* w = static_cast<const uint8_t*>(p.w);
  const float* xsum = p.xsum ? p.xsum + m0 * kb : nullptr;
  constexpr int64_t ld = kTileCols * 16;  // acc: [row][kTileCols * 16] float32
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t j = 0; j < cols; ++j) store(acc + r * ld + j * 16, zero());
  alignas(64) float c[kTileCols][16 * 16];
  for (int64_t b = 0; b < kb; ++b) {
    for (int g0 = 0; g0 < 32; g0 += group) {
      TRIPOD_TILE_ZERO(0);
      TRIPOD_TILE_LOADD(2, x + b * 32 + g0, p.ldx * 2);
      TRIPOD_TILE_LOADD(3, q + (0 * kb + b) * kPairBlock + (g0 / 2) * kPairFloats, 64);
      TRIPOD_TILE_DPBF16PS(0, 2, 3);
      TRIPOD_TILE_STORED(0, c[0], 64);
      if (cols > 1) {
        TRIPOD_TILE_ZERO(1);
        TRIPOD_TILE_LOADD(4, q + (1 * kb + b) * kPairBlock + (g0 / 2) * kPairFloats, 64);
        TRIPOD_TILE_DPBF16PS(1, 2, 4);
        TRIPOD_TILE_STORED(1, c[1], 64);
      }
      // NOTE: the same operations per row whether 16 rows share the scales' loads or one runs.
      for (int64_t j = 0; j < cols; ++j) {
        const uint8_t* blk = w + ((nb0 + j) * kb + b) * block;
        if (mr == 16) {
          tile_epilogue<16, fmt>(blk, xsum, kb, b, g0, c[j], acc + j * 16, ld);
        } else {
          for (int64_t r = 0; r < mr; ++r)
            tile_epilogue<1, fmt>(blk, xsum ? xsum + r * kb : nullptr, kb, b, g0, c[j] + r * 16, acc + r * ld + j * 16, ld);
        }
      }
    }
  }
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      V16 a[1][1] = {{load(acc + r * ld + j * 16)}};
      finish_tile<1, 1>(p, m0 + r, nb0 + j, a);
    }
}

void amx_stored_linear(const Problem& p) {
  const int64_t kb = p.k / 32;
  const int64_t ntiles = (p.nb + kTileCols - 1) / kTileCols;
  at::parallel_for(0, ntiles, p.m * p.n * p.k < (1 << 18) ? ntiles : 1, [&](int64_t t0, int64_t t1) {
    std::unique_ptr<float[]> q(new float[(size_t)(kTileCols * kb * kPairBlock)]);
    std::unique_ptr<float[]> acc(new float[(size_t)(16 * kTileCols * 16)]);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb0 = t * kTileCols;
      const int64_t cols = std::min<int64_t>(kTileCols, p.nb - nb0);
      decode_pairs(p.fmt, static_cast<const uint8_t*>(p.w), kb, nb0, cols, 0, kb, q.get());
      for (int64_t m0 = 0; m0 < p.m; m0 += 16) {
        const int64_t mr = std::min<int64_t>(16, p.m - m0);
        switch (p.fmt) {
          case Fmt::kQ40: amx_stored_rows<Fmt::kQ40>(p, m0, mr, nb0, cols, q.get(), acc.get()); break;
          case Fmt::kQ41: amx_stored_rows<Fmt::kQ41>(p, m0, mr, nb0, cols, q.get(), acc.get()); break;
          case Fmt::kQ80: amx_stored_rows<Fmt::kQ80>(p, m0, mr, nb0, cols, q.get(), acc.get()); break;
          case Fmt::kQ4K: amx_stored_rows<Fmt::kQ4K>(p, m0, mr, nb0, cols, q.get(), acc.get()); break;
          default: amx_stored_rows<Fmt::kQ6K>(p, m0, mr, nb0, cols, q.get(), acc.get()); break;
        }
      }
    }
    TRIPOD_TILE_RELEASE();
  });
}
#endif

std::string amx_status() {
#if defined(TRIPOD_AMX_EMU)
  return "amx_emu: tiles emulated (no AMX instruction runs)";
#elif defined(TRIPOD_AMX)
  const char* why = amx_refusal();
  return why ? std::string(why) : std::string("amx_bf16: tiles granted");
#else
  return "this library was not built for AMX (level amx_bf16)";
#endif
}

// The decoded path's register tiles: on AVX2 (16 registers) one 16-output block at a time (4 rows
// of sums and of partial sums fill them), on AVX-512 two.
void run_decoded_rows(const Problem& p, int64_t m0, int64_t mr, int64_t nb0, int64_t cols, int64_t b0, int64_t nq,
                      const float* q, float* sums) {
  if (p.xb != nullptr) {  // a bf16 run: 4 rows x kCols blocks of partials (16 zmm on AVX-512)
    constexpr int kStepBf = kVectorRegisters >= 32 ? kCols : 1;
    for (int64_t j0 = 0; j0 < cols; j0 += kStepBf) {
      const int64_t nc = std::min<int64_t>(kStepBf, cols - j0);
#define TRIPOD_DECODED_BF(R)                                                   \
  switch (nc) {                                                                \
    case 1: run_decoded_tile_bf<R, 1>(p, m0, nb0, j0, b0, nq, q, sums); break; \
    case 2: run_decoded_tile_bf<R, 2 <= kStepBf ? 2 : 1>(p, m0, nb0, j0, b0, nq, q, sums); break; \
    case 3: run_decoded_tile_bf<R, 3 <= kStepBf ? 3 : 1>(p, m0, nb0, j0, b0, nq, q, sums); break; \
    default: run_decoded_tile_bf<R, kStepBf>(p, m0, nb0, j0, b0, nq, q, sums); break; \
  }
      switch (mr) {
        case 1: TRIPOD_DECODED_BF(1); break;
        case 2: TRIPOD_DECODED_BF(2); break;
        case 3: TRIPOD_DECODED_BF(3); break;
        default: TRIPOD_DECODED_BF(4); break;
      }
#undef TRIPOD_DECODED_BF
    }
    return;
  }
  constexpr int kStep = kVectorRegisters >= 32 ? 2 : 1;
  for (int64_t j0 = 0; j0 < cols; j0 += kStep) {
    const bool two = kStep == 2 && j0 + 1 < cols;
#define TRIPOD_DECODED(R) two ? run_decoded_tile<R, 2>(p, m0, nb0, j0, b0, nq, q, sums) : run_decoded_tile<R, 1>(p, m0, nb0, j0, b0, nq, q, sums)
    switch (mr) {
      case 1: TRIPOD_DECODED(1); break;
      case 2: TRIPOD_DECODED(2); break;
      case 3: TRIPOD_DECODED(3); break;
      default: TRIPOD_DECODED(4); break;
    }
#undef TRIPOD_DECODED
  }
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& w, const std::string& format, int64_t n, int64_t k,
                         const c10::optional<at::Tensor>& residual) {
  const Fmt fmt = parse_fmt(format);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1, "linear_packed: x must be [M, K] with unit stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_packed: x must be float32 or bfloat16");
  TORCH_CHECK(w.is_contiguous(), "linear_packed: w must be packed by pack_linear");
  TORCH_CHECK(n >= 1 && k >= 1, "linear_packed: n and k must be positive");
  TORCH_CHECK(fmt == Fmt::kBf16 || fmt == Fmt::kF32 || k % 32 == 0, "linear_packed: quantized weights need K % 32 == 0");
  TORCH_CHECK(fmt != Fmt::kBf16 || k % 2 == 0, "linear_packed: bf16 weights need an even K");
  const std::vector<int64_t> want = packed_shape(fmt, n, k);
  TORCH_CHECK(w.sizes() == at::IntArrayRef(want), "linear_packed: w has shape ", w.sizes(), " but ", format, " packing of ",
              n, " x ", k, " makes ", at::IntArrayRef(want));
  TORCH_CHECK(w.scalar_type() == (fmt == Fmt::kBf16 ? at::kBFloat16 : fmt == Fmt::kF32 ? at::kFloat : at::kByte),
              "linear_packed: w's dtype does not match the ", format, " packing");
  if (fmt == Fmt::kBf16)
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.stride(0) % 2 == 0, "linear_packed: bf16 weights need bf16 activations (even row stride)");
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  Problem p{fmt, m, n, k, (n + 15) / 16, x.data_ptr(), x.stride(0), nullptr, nullptr, nullptr, w.data_ptr(), nullptr, 0,
            y.data_ptr(), x.scalar_type() == at::kBFloat16};
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(r.dim() == 2 && r.size(0) == m && r.size(1) == n && r.stride(1) == 1 && r.scalar_type() == x.scalar_type(),
                "linear_packed: residual must be [M, N] like the output");
    p.residual = r.data_ptr();
    p.ldr = r.stride(0);
  }
#if defined(TRIPOD_AMX)
  if (fmt == Fmt::kBf16 && amx_refusal() == nullptr) {
    amx_bf16_linear(p);
    return y;
  }
#endif
  at::Tensor xf, xsum;
  const bool quant = fmt != Fmt::kBf16 && fmt != Fmt::kF32;
  // Stored codes with bf16 activations: exact bf16 x code products (tile_bf_codes); else the
  // quantized and f32 formats take float32 activations.
  const bool bf_act = quant && x.scalar_type() == at::kBFloat16;
  if (bf_act) {
    if constexpr (kNativeBf16) {
      p.xb = reinterpret_cast<const XAct*>(x.data_ptr());
    } else {
      xf = x.to(at::kFloat).contiguous();  // exact; the products are formed in vdpbf16ps' order
      p.xb = reinterpret_cast<const XAct*>(xf.data_ptr<float>());
      p.ldx = k;
    }
  } else if (fmt != Fmt::kBf16) {  // float32 activations, contiguous
    xf = x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
    p.xf = xf.data_ptr<float>();
  }
  if (fmt == Fmt::kQ40 || fmt == Fmt::kQ41 || fmt == Fmt::kQ4K) {  // block sums, for the minimums
    // NOTE: summed here in a fixed order, not by torch's sum (whose order follows the CPU
    // capability ATen dispatches to): the same bits on every machine.
    xsum = at::empty({m, k / 32}, x.options().dtype(at::kFloat));
    float* out = xsum.data_ptr<float>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t b = 0; b < k / 32; ++b) {
        float acc = 0.f;
        if (bf_act && kNativeBf16) {
          const uint16_t* xr = reinterpret_cast<const uint16_t*>(p.xb) + r * p.ldx + b * 32;
          for (int j = 0; j < 32; ++j) {
            const uint32_t bits = (uint32_t)xr[j] << 16;
            float v;
            std::memcpy(&v, &bits, 4);
            acc += v;
          }
        } else {  // float32 activations, or bf16 ones widened (both contiguous)
          const float* xr = (bf_act ? reinterpret_cast<const float*>(p.xb) : p.xf) + (r * k + b * 32);
          for (int j = 0; j < 32; ++j) acc += xr[j];
        }
        out[r * (k / 32) + b] = acc;
      }
    p.xsum = out;
  }
#if defined(TRIPOD_AMX)
  // Stored codes on the tile levels: more rows than a register tile on tiles, fewer on vdpbf16ps
  // in the tiles' order (kTileOrder): the same bits, so the switch is a matter of speed only.
  if (bf_act && m > kRows && amx_refusal() == nullptr) {
    amx_stored_linear(p);
    return y;
  }
#endif
  const int64_t nb = p.nb;
  const int64_t ntiles = (nb + kCols - 1) / kCols;
  // Threads split the outputs (whole tiles of 64): never a row's sum.
  const int64_t work = m * n * k;
  // More rows than one register tile: quantized codes are decoded once per column tile.
  // (Not on the tile levels with bf16 activations: their few-row tiles' order is the tiles' one, the
  // decoded tiles' is vdpbf16ps'; refused tiles, every row count takes the direct tiles.)
  const bool decoded = fmt != Fmt::kBf16 && fmt != Fmt::kF32 && m > kRows && !(kTileOrder && bf_act);
  at::parallel_for(0, ntiles, work < (1 << 18) ? ntiles : 1, [&](int64_t t0, int64_t t1) {
    // The decoded codes of kChunk input blocks (16 KiB per 16-output block: L1 with the
    // activations' rows) and every row's sums between chunks.
    // A bf16 run decodes a column tile's whole K (code pairs: 1 KiB per block, L2) so that each
    // row tile's running sums stay in L1 from the first input to the last.
    const int64_t kChunk = bf_act ? k / 32 : 4;
    // NOTE: not zero-filled (every float is written before it is read): filling them cost more
    // than the decoding at a few rows.
    const size_t scratch_floats = decoded ? (size_t)(kCols * kChunk * (bf_act ? kPairBlock : kDecodedBlock)) : 0;
    std::unique_ptr<float[]> scratch_mem(decoded ? new float[scratch_floats + 16] : nullptr);
    std::unique_ptr<float[]> sums_mem(decoded ? new float[(size_t)(m * kCols * 16)] : nullptr);
    struct {
      float* p;
      float* data() const { return p; }
    } scratch{scratch_mem.get()}, sums{sums_mem.get()};
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb0 = t * kCols;
      const int64_t cols = std::min<int64_t>(kCols, nb - nb0);
      if (decoded) {
        const int64_t kb = k / 32;
        for (int64_t b0 = 0; b0 < kb; b0 += kChunk) {
          const int64_t nq = std::min<int64_t>(kChunk, kb - b0);
          if (bf_act) decode_pairs(fmt, static_cast<const uint8_t*>(p.w), kb, nb0, cols, b0, nq, scratch.data());
          else decode_codes(fmt, static_cast<const uint8_t*>(p.w), kb, nb0, cols, b0, nq, scratch.data());
          for (int64_t m0 = 0; m0 < m; m0 += kRows)
            run_decoded_rows(p, m0, std::min<int64_t>(kRows, m - m0), nb0, cols, b0, nq, scratch.data(), sums.data());
        }
        continue;
      }
      for (int64_t m0 = 0; m0 < m; m0 += kRows) {
        run_block_tile(p, m0, std::min<int64_t>(kRows, m - m0), nb0, cols);
      }
    }
  });
  return y;
}

}  // namespace
}  // namespace tripod_linear

// TORCH_LIBRARY_FRAGMENT stringifies its argument: expand TRIPOD_OPS_NS first.
#define TRIPOD_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TRIPOD_FRAGMENT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TRIPOD_FRAGMENT(TRIPOD_OPS_NS, m) {
  m.def("pack_linear(Tensor w, str format, int n, int k) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor w, str format, int n, int k, Tensor? residual=None) -> Tensor");
  m.def("amx_status() -> str", &tripod_linear::amx_status);
}

TRIPOD_FRAGMENT_IMPL(TRIPOD_OPS_NS, CPU, m) {
  m.impl("pack_linear", &tripod_linear::pack_linear);
  m.impl("linear_packed", &tripod_linear::linear_packed);
}
