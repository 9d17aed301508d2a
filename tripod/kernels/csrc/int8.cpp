// Exact int8 x int8 -> int32 products of W8A8 linears: y[m, n] = sum_k q[m, k] * w[n, k], over the
// int8 codes as the checkpoint stores them ([N, K], row-major: no repacked copy, so the model keeps
// one copy of its codes).
//
// Every path sums integers, so its result is the exact sum whatever the order of the additions:
// the same int32 as torch._int_mm (and as the float64 sum) on every ISA level, at every row count
// (batch-invariant by construction). |q * w| <= 2^14, so the true sum fits int32 for K < 2^17
// (the caller's bound, layers/w8a8.py MAX_EXACT_K); partial sums may wrap modulo 2^32 on the way
// (vpdpbusd and vpaddd wrap, they never saturate), which leaves the final value exact.
//
// Paths:
// - AVX512-VNNI (vpdpbusd: unsigned x signed bytes, four products per int32 lane, no saturation)
//   where the CPU has it: the activations' codes are made unsigned (q + 128, i.e. q ^ 0x80), and
//   128 * sum_k w[n, k] (integers, exact) is subtracted at the end.
// - AVX-512BW / AVX2 otherwise: codes sign-extended to int16 and multiplied by vpmaddwd (pairs of
//   int16 products into int32: |2 * 128 * 128| = 2^15, no saturation). Never vpmaddubsw, whose
//   int16 pair sums saturate.
//
// Threads split the outputs; each (row, output) sum is formed by one thread over the whole K.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace tripod_int8 {
namespace {

constexpr int kNb = 4;  // outputs per register tile

// ---------------------------------------------------------------------------- AVX-512 VNNI
#if defined(__AVX512BW__)
#define TRIPOD_VNNI __attribute__((target("avx512vnni")))

// Lane i of the result = the sum of the 16 lanes of v[i] (integers: any tree is exact).
inline __m512i hsum16(const __m512i* v) {
  __m512i w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(w[2 * i], w[2 * i + 1]), _mm512_unpackhi_epi64(w[2 * i], w[2 * i + 1]));
  const __m512i z01 = _mm512_add_epi32(_mm512_shuffle_i32x4(x[0], x[1], 0x88), _mm512_shuffle_i32x4(x[0], x[1], 0xDD));
  const __m512i z23 = _mm512_add_epi32(_mm512_shuffle_i32x4(x[2], x[3], 0x88), _mm512_shuffle_i32x4(x[2], x[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(z01, z23, 0x88), _mm512_shuffle_i32x4(z01, z23, 0xDD));
}

// Rows [0, MR) of xu (unsigned codes, rows of kp >= K bytes, zero-padded) x outputs [n0, n0 + NB).
template <int MR, int NB>
TRIPOD_VNNI void tile_vnni(const uint8_t* xu, int64_t kp, const int8_t* w, int64_t k, int64_t n0, const int32_t* wsum,
                           int32_t* y, int64_t ldy) {
  __m512i acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_si512();
  const int64_t full = k / 64 * 64;
  for (int64_t i = 0; i < full; i += 64) {
    __m512i xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_si512(xu + m * kp + i);
    for (int j = 0; j < NB; ++j) {
      const __m512i wv = _mm512_loadu_si512(w + (n0 + j) * k + i);
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], xv[m], wv);
    }
  }
  if (full < k) {  // the last partial vector of a row: its bytes past K are not read (masked: zeros)
    const __mmask64 mask = ((__mmask64)1 << (k - full)) - 1;
    __m512i xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_si512(xu + m * kp + full);
    for (int j = 0; j < NB; ++j) {
      const __m512i wv = _mm512_maskz_loadu_epi8(mask, w + (n0 + j) * k + full);
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], xv[m], wv);
    }
  }
  if constexpr (MR == 4 && NB == 4) {  // a full tile: its 16 sums by one transposing tree
    alignas(64) int32_t t[16];
    _mm512_store_si512(t, hsum16(&acc[0][0]));
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NB; ++j) y[m * ldy + n0 + j] = t[4 * m + j] - 128 * wsum[n0 + j];  // (wraps back: exact)
  } else {
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NB; ++j) y[m * ldy + n0 + j] = _mm512_reduce_add_epi32(acc[m][j]) - 128 * wsum[n0 + j];
  }
}

// Signed int16 codes (rows of kp >= K, zero-padded) x int8 weights widened in registers.
template <int MR, int NB>
void tile_avx512(const int16_t* x16, int64_t kp, const int8_t* w, int64_t k, int64_t n0, int32_t* y, int64_t ldy) {
  __m512i acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_si512();
  const int64_t full = k / 32 * 32;
  for (int64_t i = 0; i < k; i += 32) {
    const __mmask32 mask = i < full ? ~(__mmask32)0 : (((__mmask32)1 << (k - i)) - 1);
    __m512i xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_si512(x16 + m * kp + i);
    for (int j = 0; j < NB; ++j) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + (n0 + j) * k + i));
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_add_epi32(acc[m][j], _mm512_madd_epi16(xv[m], wv));
    }
  }
  if constexpr (MR == 4 && NB == 4) {
    alignas(64) int32_t t[16];
    _mm512_store_si512(t, hsum16(&acc[0][0]));
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NB; ++j) y[m * ldy + n0 + j] = t[4 * m + j];
  } else {
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NB; ++j) y[m * ldy + n0 + j] = _mm512_reduce_add_epi32(acc[m][j]);
  }
}
constexpr int kStep16 = 32;  // int16 lanes per vector
#else
// ---------------------------------------------------------------------------- AVX2
inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

template <int MR, int NB>
void tile_avx2(const int16_t* x16, int64_t kp, const int8_t* w, int64_t k, int64_t n0, int32_t* y, int64_t ldy) {
  __m256i acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_si256();
  const int64_t full = k / 16 * 16;
  for (int64_t i = 0; i < full; i += 16) {
    __m256i xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + m * kp + i));
    for (int j = 0; j < NB; ++j) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + j) * k + i)));
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm256_add_epi32(acc[m][j], _mm256_madd_epi16(xv[m], wv));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) {
      int32_t s = hsum8(acc[m][j]);
      for (int64_t i = full; i < k; ++i) s += (int32_t)x16[m * kp + i] * (int32_t)w[(n0 + j) * k + i];  // the tail
      y[m * ldy + n0 + j] = s;
    }
}
constexpr int kStep16 = 16;
#endif

bool cpu_has_vnni() {
#if defined(__AVX512BW__)
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

// The register tiles: up to 4 rows x kNb outputs (x 64 bytes: 16 + 4 zmm; on AVX2 2 rows: 8 + 2 ymm).
#if defined(__AVX512BW__)
constexpr int kRows = 4;
#else
constexpr int kRows = 2;
#endif

template <int MR>
void run_rows(bool vnni, const void* xp, int64_t kp, const int8_t* w, int64_t k, int64_t n0, int64_t nb,
              const int32_t* wsum, int32_t* y, int64_t ldy) {
#if defined(__AVX512BW__)
  if (vnni) {
    const uint8_t* xu = static_cast<const uint8_t*>(xp);
    switch (nb) {
      case 1: tile_vnni<MR, 1>(xu, kp, w, k, n0, wsum, y, ldy); break;
      case 2: tile_vnni<MR, 2>(xu, kp, w, k, n0, wsum, y, ldy); break;
      case 3: tile_vnni<MR, 3>(xu, kp, w, k, n0, wsum, y, ldy); break;
      default: tile_vnni<MR, kNb>(xu, kp, w, k, n0, wsum, y, ldy); break;
    }
    return;
  }
#define TRIPOD_TILE16 tile_avx512
#else
  (void)vnni;
  (void)wsum;
#define TRIPOD_TILE16 tile_avx2
#endif
  const int16_t* x16 = static_cast<const int16_t*>(xp);
  switch (nb) {
    case 1: TRIPOD_TILE16<MR, 1>(x16, kp, w, k, n0, y, ldy); break;
    case 2: TRIPOD_TILE16<MR, 2>(x16, kp, w, k, n0, y, ldy); break;
    case 3: TRIPOD_TILE16<MR, 3>(x16, kp, w, k, n0, y, ldy); break;
    default: TRIPOD_TILE16<MR, kNb>(x16, kp, w, k, n0, y, ldy); break;
  }
#undef TRIPOD_TILE16
}

// q: int8 [M, K] (activation codes), w: int8 [N, K] (weight codes, as stored), wsum: int32 [N]
// (sum_k w[n, k]; used by the VNNI path, computed here when not given). vnni=false: the AVX-512BW
// path even where VNNI is present (tests). Returns int32 [M, N].
at::Tensor int8_linear(const at::Tensor& q, const at::Tensor& w, const c10::optional<at::Tensor>& wsum_opt, bool vnni) {
  TORCH_CHECK(q.dim() == 2 && w.dim() == 2 && q.size(1) == w.size(1), "int8_linear: q [M, K] and w [N, K] must share K");
  TORCH_CHECK(q.scalar_type() == at::kChar && w.scalar_type() == at::kChar, "int8_linear: q and w must be int8");
  TORCH_CHECK(w.is_contiguous(), "int8_linear: w must be contiguous");
  const int64_t m = q.size(0), n = w.size(0), k = w.size(1);
  TORCH_CHECK(k < (int64_t(1) << 17), "int8_linear: K must be below 2^17 (the int32 sum is exact there)");
  at::Tensor y = at::empty({m, n}, q.options().dtype(at::kInt));
  if (m == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  const bool use_vnni = vnni && cpu_has_vnni();
  at::Tensor wsum;
  if (use_vnni) {
    if (wsum_opt.has_value()) {
      wsum = *wsum_opt;
      TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.dim() == 1 && wsum.size(0) == n && wsum.is_contiguous(),
                  "int8_linear: wsum must be int32 [N], contiguous");
    } else {
      wsum = w.sum({1}, false, at::kInt);  // integers: exact in any order
    }
  }
  // The activations, once per call: unsigned bytes (VNNI) or int16, rows padded with zeros to a
  // whole number of vectors (the weights' tail is never read past K).
  const int64_t step = use_vnni ? 64 : kStep16;
  const int64_t kp = (k + step - 1) / step * step;
  at::Tensor xbuf = at::zeros({m, kp}, q.options().dtype(use_vnni ? at::kByte : at::kShort));
  const at::Tensor qc = q.contiguous();
  const int8_t* qs = qc.data_ptr<int8_t>();
  if (use_vnni) {
    uint8_t* xu = xbuf.data_ptr<uint8_t>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) xu[r * kp + i] = (uint8_t)qs[r * k + i] ^ 0x80;  // q + 128
  } else {
    int16_t* x16 = xbuf.data_ptr<int16_t>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) x16[r * kp + i] = qs[r * k + i];
  }
  const size_t elem = use_vnni ? 1 : 2;
  const uint8_t* xb = static_cast<const uint8_t*>(xbuf.data_ptr());
  const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* ws = use_vnni ? wsum.data_ptr<int32_t>() : nullptr;
  int32_t* yp = y.data_ptr<int32_t>();
  const int64_t tiles = (n + kNb - 1) / kNb;
  // Output tiles of kNb rows of w; a thread takes whole tiles (at least 16 KiB of weights each).
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, kNb * k));
  at::parallel_for(0, tiles, m * n * k < (1 << 18) ? tiles : grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kNb, nb = std::min<int64_t>(kNb, n - n0);
      for (int64_t m0 = 0; m0 < m; m0 += kRows) {
        const void* xr = xb + m0 * kp * elem;
        int32_t* yr = yp + m0 * n;
        switch (std::min<int64_t>(kRows, m - m0)) {
          case 1: run_rows<1>(use_vnni, xr, kp, wp, k, n0, nb, ws, yr, n); break;
#if defined(__AVX512BW__)
          case 2: run_rows<2>(use_vnni, xr, kp, wp, k, n0, nb, ws, yr, n); break;
          case 3: run_rows<3>(use_vnni, xr, kp, wp, k, n0, nb, ws, yr, n); break;
#endif
          default: run_rows<kRows>(use_vnni, xr, kp, wp, k, n0, nb, ws, yr, n); break;
        }
      }
    }
  });
  return y;
}

// W8A8's whole product and scale epilogue: y[m, n] = dtype(acc[m, n] * (sx[m] * scales[n])), acc the
// exact int32 sum (int8_linear), sx float64 [M] (the activations' scales), scales float64 [N] (the
// weights'). The same operations, in the same precision, as layers/w8a8.py's torch epilogue: the
// scale product (of two float32-exact values: exact in float64) and acc times it rounded once in
// float64, then to float32 (round to nearest even) and, for bfloat16, float32 to bfloat16 (nearest
// even): the path torch's float64 -> bfloat16 conversion takes.
at::Tensor int8_linear_scaled(const at::Tensor& q, const at::Tensor& w, const c10::optional<at::Tensor>& wsum,
                              const at::Tensor& sx, const at::Tensor& scales, c10::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int8_linear_scaled: dtype must be float32 or bfloat16");
  const int64_t m = q.size(0), n = w.size(0);
  TORCH_CHECK(sx.scalar_type() == at::kDouble && sx.dim() == 1 && sx.size(0) == m && sx.is_contiguous(),
              "int8_linear_scaled: sx must be float64 [M], contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kDouble && scales.dim() == 1 && scales.size(0) == n && scales.is_contiguous(),
              "int8_linear_scaled: scales must be float64 [N], contiguous");
  const at::Tensor acc = int8_linear(q, w, wsum, true);
  at::Tensor y = at::empty({m, n}, q.options().dtype(dtype));
  const int32_t* a = acc.data_ptr<int32_t>();
  const double* sxp = sx.data_ptr<double>();
  const double* sp = scales.data_ptr<double>();
  if (dtype == at::kFloat) {
    float* out = y.data_ptr<float>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) {
        const double scale = sxp[r] * sp[c];
        out[r * n + c] = static_cast<float>(static_cast<double>(a[r * n + c]) * scale);
      }
  } else {
    at::BFloat16* out = y.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) {
        const double scale = sxp[r] * sp[c];
        out[r * n + c] = at::BFloat16(static_cast<float>(static_cast<double>(a[r * n + c]) * scale));
      }
  }
  return y;
}

// Which path int8_linear takes here: "avx512_vnni", "avx512bw" or "avx2".
std::string int8_path() {
#if defined(__AVX512BW__)
  return cpu_has_vnni() ? "avx512_vnni" : "avx512bw";
#else
  return "avx2";
#endif
}

}  // namespace
}  // namespace tripod_int8

#define TRIPOD_INT8_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TRIPOD_INT8_FRAGMENT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TRIPOD_INT8_FRAGMENT(TRIPOD_OPS_NS, m) {
  m.def("int8_linear(Tensor q, Tensor w, Tensor? wsum=None, bool vnni=True) -> Tensor");
  m.def("int8_linear_scaled(Tensor q, Tensor w, Tensor? wsum, Tensor sx, Tensor scales, ScalarType dtype) -> Tensor");
  m.def("int8_path() -> str", &tripod_int8::int8_path);
}

TRIPOD_INT8_FRAGMENT_IMPL(TRIPOD_OPS_NS, CPU, m) {
  m.impl("int8_linear", &tripod_int8::int8_linear);
  m.impl("int8_linear_scaled", &tripod_int8::int8_linear_scaled);
}
