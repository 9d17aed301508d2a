// 16 float32 lanes ("V16") for tripod's kernels, on AVX-512 (one zmm) or AVX2 + FMA + F16C (two
// ymm), chosen by the flags this translation unit is compiled with (one library per ISA level).
//
// NOTE: every operation here gives the same bits on both ISAs: lane i of an AVX2 V16 is lane i
// of the AVX-512 one, reductions follow one fixed tree written out for both (never the
// compiler's), e^x is one polynomial, and bf16 dot products are summed in the order of
// AVX512-BF16's vdpbf16ps (the odd element of a pair first, then the even one, each a fused
// multiply-add of an exact bf16 x bf16 product). So a kernel written over V16 computes the same
// numbers whichever library runs it; only the speed differs (tests compare the levels bit for
// bit). The one documented difference: vdpbf16ps flushes denormal inputs and outputs to zero,
// which the other levels do not (no weight, activation or score of a served model is denormal).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "tripod's kernels need at least AVX2, FMA and F16C (compile with -mavx2 -mfma -mf16c)"
#endif

namespace tripod_simd {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define TRIPOD_AVX512 1
#endif

#if defined(TRIPOD_AVX512) && defined(__AVX512BF16__)
constexpr bool kNativeBf16 = true;  // vdpbf16ps / vcvtneps2bf16 available
#else
constexpr bool kNativeBf16 = false;
#endif

#if defined(TRIPOD_AVX512)
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
constexpr const char* kIsa = "amx_bf16";  // the bf16 linears on AMX tiles (linear.cpp); the rest as avx512_bf16
#elif defined(TRIPOD_AMX_EMU)
constexpr const char* kIsa = "amx_emu";  // amx_bf16's tile code on an emulation of the tile instructions (amx.h)
#else
constexpr const char* kIsa = kNativeBf16 ? "avx512_bf16" : "avx512";
#endif
constexpr int kVectorRegisters = 32;  // zmm0-31: room for 4 rows x 4 column blocks of sums

struct V16 {
  __m512 v;
};

inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 min(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a*b + c
inline V16 fnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a*b
inline V16 round_nearest(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n for integral n (scalef rounds once, like the two exact steps of the AVX2 version).
inline V16 scale_pow2(V16 a, V16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }

inline __mmask16 first_lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }
inline V16 keep_first(V16 a, int n) { return {_mm512_maskz_mov_ps(first_lanes(n), a.v)}; }
inline V16 load_first(const float* p, int n) { return {_mm512_maskz_loadu_ps(first_lanes(n), p)}; }
inline void store_first(float* p, V16 a, int n) { _mm512_mask_storeu_ps(p, first_lanes(n), a.v); }

// bfloat16 bits -> float32 (exact) and float32 -> bfloat16 bits, rounded to nearest even.
inline V16 load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline __m256i to_bf16_bits(V16 a) {
  const __m512i x = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
inline void store_bf16(uint16_t* p, V16 a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(a)); }
inline void store_bf16_first(uint16_t* p, V16 a, int n) { _mm256_mask_storeu_epi16(p, first_lanes(n), to_bf16_bits(a)); }

// 32 consecutive bf16 as 16 pairs: lane i of `even` is element 2i, of `odd` element 2i + 1.
inline void load_bf16_pairs(const uint16_t* p, V16& even, V16& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even.v = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd.v = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000u)));
}

// 16 bytes / int8 / fp16 values -> float32 (exact).
inline V16 load_u8(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline V16 load_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline V16 load_fp16(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
// The low and high nibbles of 16 bytes, as float32.
inline void load_nibbles(const uint8_t* p, V16& low, V16& high) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low.v = _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15)));
  high.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
}

// The fixed reduction tree, lanes (i, i+8), then (i, i+4), then (i, i+2), then (0, 1).
inline float reduce_add(V16 a) {
  const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(a.v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
inline float reduce_max_first(V16 a, int n) { return _mm512_mask_reduce_max_ps(first_lanes(n), a.v); }

// Lane j of the result = the sum of the 16 lanes of v[j], by the tree
// ((s0 + s1) + (s2 + s3)) with s_L = (x[4L] + x[4L+2]) + (x[4L+1] + x[4L+3]).
inline V16 transpose_sum16(const V16 v[16]) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD))};
}

// float32 -> the float32 value of its bf16 rounding (nearest even), with vcvtneps2bf16's flush
// of denormal inputs to zero.
inline V16 round_to_bf16(V16 a) {
  const __mmask16 normal = _mm512_cmp_ps_mask(_mm512_abs_ps(a.v), _mm512_set1_ps(1.17549435e-38f), _CMP_GE_OQ);
  const __m512i x = _mm512_castps_si512(_mm512_maskz_mov_ps(normal, a.v));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
  return {_mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)))};
}

#else  // AVX2 + FMA + F16C: lanes 0-7 in lo, 8-15 in hi.
constexpr const char* kIsa = "avx2";
constexpr int kVectorRegisters = 16;  // ymm0-15: a V16 takes two

struct V16 {
  __m256 lo, hi;
};

inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 min(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 fnmadd(V16 a, V16 b, V16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 round_nearest(V16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 pow2_half(__m256i n) {  // 2^n for n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
// a * 2^n for integral n in [-252, 254]: two exact power-of-two steps (the second rounds once
// if the result is subnormal), which is what AVX-512's scalef computes.
inline __m256 scale_pow2_8(__m256 a, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(a, pow2_half(h)), pow2_half(_mm256_sub_epi32(ni, h)));
}
inline V16 scale_pow2(V16 a, V16 n) { return {scale_pow2_8(a.lo, n.lo), scale_pow2_8(a.hi, n.hi)}; }

inline __m256i lane_mask(int n, int first) {  // lanes first..first+7 below n
  const __m256i idx = _mm256_setr_epi32(first, first + 1, first + 2, first + 3, first + 4, first + 5, first + 6, first + 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}
inline V16 keep_first(V16 a, int n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(lane_mask(n, 0))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(lane_mask(n, 8)))};
}
inline V16 load_first(const float* p, int n) { return {_mm256_maskload_ps(p, lane_mask(n, 0)), _mm256_maskload_ps(p + 8, lane_mask(n, 8))}; }
inline void store_first(float* p, V16 a, int n) {
  _mm256_maskstore_ps(p, lane_mask(n, 0), a.lo);
  _mm256_maskstore_ps(p + 8, lane_mask(n, 8), a.hi);
}

inline __m256 widen_bf16_8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V16 load_bf16(const uint16_t* p) { return {widen_bf16_8(p), widen_bf16_8(p + 8)}; }
inline __m256i round_bf16_8(__m256 v) {  // the bf16 bits in the low half of each 32-bit lane
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
}
inline __m256i to_bf16_bits(V16 a) {
  // packus works within 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> put the quarters in order.
  const __m256i packed = _mm256_packus_epi32(round_bf16_8(a.lo), round_bf16_8(a.hi));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}
inline void store_bf16(uint16_t* p, V16 a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(a)); }
inline void store_bf16_first(uint16_t* p, V16 a, int n) {
  alignas(32) uint16_t tmp[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), to_bf16_bits(a));
  std::memcpy(p, tmp, sizeof(uint16_t) * (n < 16 ? n : 16));
}

inline void load_bf16_pairs(const uint16_t* p, V16& even, V16& odd) {
  const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(r0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(r1, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(r0, hi_mask)), _mm256_castsi256_ps(_mm256_and_si256(r1, hi_mask))};
}

inline V16 load_u8(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 load_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 load_fp16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline void load_nibbles(const uint8_t* p, V16& low, V16& high) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i c0 = _mm256_cvtepu8_epi32(b), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  const __m256i m = _mm256_set1_epi32(15);
  low = {_mm256_cvtepi32_ps(_mm256_and_si256(c0, m)), _mm256_cvtepi32_ps(_mm256_and_si256(c1, m))};
  high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4))};
}

inline float reduce_add(V16 a) {
  const __m256 t3 = _mm256_add_ps(a.lo, a.hi);
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
inline float reduce_max_first(V16 a, int n) {
  alignas(32) float t[16];
  store(t, a);
  float m = t[0];
  for (int i = 1; i < n && i < 16; ++i) m = t[i] > m ? t[i] : m;
  return m;
}

inline V16 transpose_sum16(const V16 v[16]) {
  // The same unpack steps within each 128-bit quarter as the AVX-512 version; then the quarter
  // sums (L0 + L1, L2 + L3) across the two halves.
  __m256 wl[8], wh[8], xl[4], xh[4];
  for (int i = 0; i < 8; ++i) {
    wl[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i].lo, v[2 * i + 1].lo), _mm256_unpackhi_ps(v[2 * i].lo, v[2 * i + 1].lo));
    wh[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i].hi, v[2 * i + 1].hi), _mm256_unpackhi_ps(v[2 * i].hi, v[2 * i + 1].hi));
  }
  auto pd_sum = [](__m256 a, __m256 b) {
    const __m256d x = _mm256_castps_pd(a), y = _mm256_castps_pd(b);
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  };
  for (int i = 0; i < 4; ++i) {
    xl[i] = pd_sum(wl[2 * i], wl[2 * i + 1]);
    xh[i] = pd_sum(wh[2 * i], wh[2 * i + 1]);
  }
  // x[i] = {lo: quarters L0 L1, hi: L2 L3}; quarter sums: [L0 + L1, L2 + L3].
  auto pair_sums = [](__m256 lo, __m256 hi) {
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
  };
  // pair_sums(pair_sums(x0), pair_sums(x1)) = [x0's (L0+L1)+(L2+L3), x1's]: lanes 0-7 of the result.
  const __m256 z01 = pair_sums(pair_sums(xl[0], xh[0]), pair_sums(xl[1], xh[1]));
  const __m256 z23 = pair_sums(pair_sums(xl[2], xh[2]), pair_sums(xl[3], xh[3]));
  return {z01, z23};
}
inline __m256 round_to_bf16_8(__m256 v) {
  const __m256 absv = _mm256_andnot_ps(_mm256_set1_ps(-0.f), v);
  const __m256 keep = _mm256_cmp_ps(absv, _mm256_set1_ps(1.17549435e-38f), _CMP_GE_OQ);
  const __m256i x = _mm256_castps_si256(_mm256_and_ps(v, keep));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}
inline V16 round_to_bf16(V16 a) { return {round_to_bf16_8(a.lo), round_to_bf16_8(a.hi)}; }
#endif

// e^x, Cephes' single-precision polynomial (about 1 ulp); x <= -87 gives ~0. One definition for
// every ISA (the same operations, the same bits).
inline V16 exp(V16 x) {
  x = max(min(x, set1(88.3762626647949f)), set1(-87.3365447504f));
  const V16 fx = round_nearest(mul(x, set1(1.44269504088896341f)));
  x = fnmadd(fx, set1(0.693359375f), x);
  x = fnmadd(fx, set1(-2.12194440e-4f), x);
  V16 y = set1(1.9875691500e-4f);
  y = fmadd(y, x, set1(1.3981999507e-3f));
  y = fmadd(y, x, set1(8.3334519073e-3f));
  y = fmadd(y, x, set1(4.1665795894e-2f));
  y = fmadd(y, x, set1(1.6666665459e-1f));
  y = fmadd(y, x, set1(5.0000001201e-1f));
  y = fmadd(y, mul(x, x), add(x, set1(1.0f)));
  return scale_pow2(y, fx);
}

// acc + a . b over one pair of bf16 per lane, in vdpbf16ps' order: the odd elements' product
// first, then the even ones' (each product of two bf16 is exact in float32).
inline V16 dot_pair(V16 acc, V16 a_even, V16 a_odd, V16 b_even, V16 b_odd) {
  return fmadd(a_even, b_even, fmadd(a_odd, b_odd, acc));
}

}  // namespace tripod_simd
