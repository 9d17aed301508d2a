// The AMX tile instructions tripod's kernels use, as macros over either the hardware intrinsics
// (level amx_bf16: compiled with -mamx-tile -mamx-bf16) or an emulation of exactly those
// instructions (level amx_emu: -DTRIPOD_AMX_EMU on the avx512_bf16 flags), so that one kernel
// source runs its tile code paths on every AVX-512 BF16 CPU, AMX or not, and a test on an AMX host
// compares the two bit for bit.
//
// Emulated, following Intel's documentation of each instruction:
// - LDTILECFG (TRIPOD_TILE_LOADCONFIG): palette 1, up to 8 tiles of rows x colsb bytes; every
//   tile is zeroed.
// - TILELOADD / TILESTORED: `rows` rows of `colsb` bytes at base + r * stride; a load zeroes the
//   rest of the tile.
// - TILEZERO.
// - TDPBF16PS c, a, b: for each row m of c and each column n (a float32), for k = 0 .. a.colsb/4-1
//   in order: c[m][n] += a[m].bf16[2k] * b[k].bf16[2n], then c[m][n] += a[m].bf16[2k+1] *
//   b[k].bf16[2n+1]; each accumulation an FMA rounded to nearest even (the product of two bf16 is
//   exact in float32), input denormals read as zero, output denormals flushed to zero, MXCSR not
//   consulted.
// - TILERELEASE.
// The tile state is per thread (thread_local), as the hardware's is.

#pragma once

#include <cstdint>
#include <cstring>

#include "simd.h"

#if defined(TRIPOD_AMX_EMU) || (defined(__AMX_BF16__) && defined(__AMX_TILE__))
#define TRIPOD_AMX 1
#endif

#if defined(TRIPOD_AMX)
#if defined(TRIPOD_AMX_EMU) && !defined(__AVX512BF16__)
#error "the AMX emulation (level amx_emu) is compiled with the avx512_bf16 flags"
#endif

namespace tripod_amx {

// LDTILECFG's 64-byte operand, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if defined(TRIPOD_AMX_EMU)
constexpr bool kEmulated = true;

struct EmuTiles {
  TileConfig cfg;
  alignas(64) uint8_t data[8][16 * 64];  // 8 tiles of at most 16 rows x 64 bytes
};

inline EmuTiles& emu_tiles() {
  static thread_local EmuTiles t;
  return t;
}

inline void emu_loadconfig(const TileConfig* cfg) {
  EmuTiles& t = emu_tiles();
  t.cfg = *cfg;
  std::memset(t.data, 0, sizeof t.data);
}

inline void emu_zero(int tile) { std::memset(emu_tiles().data[tile], 0, sizeof emu_tiles().data[tile]); }

inline void emu_loadd(int tile, const void* base, int64_t stride) {
  EmuTiles& t = emu_tiles();
  std::memset(t.data[tile], 0, sizeof t.data[tile]);
  for (int r = 0; r < t.cfg.rows[tile]; ++r)
    std::memcpy(t.data[tile] + r * 64, static_cast<const uint8_t*>(base) + r * stride, t.cfg.colsb[tile]);
}

inline void emu_stored(int tile, void* base, int64_t stride) {
  const EmuTiles& t = emu_tiles();
  for (int r = 0; r < t.cfg.rows[tile]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[tile] + r * 64, t.cfg.colsb[tile]);
}

// Input denormals as zero: a bf16 whose exponent bits are 0 becomes a signed zero.
inline float emu_bf16(uint16_t h) {
  const uint32_t bits = (h & 0x7f80u) == 0 ? (uint32_t)(h & 0x8000u) << 16 : (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Output denormals flushed to zero (keeping the sign).
inline __m512 emu_flush(__m512 v) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ);
  return _mm512_mask_and_ps(v, tiny, v, _mm512_set1_ps(-0.0f));
}

inline void emu_dpbf16ps(int c, int a, int b) {
  EmuTiles& t = emu_tiles();
  const int rows = t.cfg.rows[c], pairs = t.cfg.colsb[a] / 4;
  const int cols = t.cfg.colsb[c] / 4;  // <= 16 float32 columns
  const __mmask16 live = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1u);
  // Row k of b: 16 columns of (bf16[2n], bf16[2n + 1]), widened and read as zero if denormal.
  alignas(64) float be[16][16], bo[16][16];
  for (int k = 0; k < pairs; ++k) {
    const uint16_t* brow = reinterpret_cast<const uint16_t*>(t.data[b] + k * 64);
    for (int n = 0; n < 16; ++n) {
      be[k][n] = emu_bf16(brow[2 * n]);
      bo[k][n] = emu_bf16(brow[2 * n + 1]);
    }
  }
  for (int m = 0; m < rows; ++m) {
    float* crow = reinterpret_cast<float*>(t.data[c] + m * 64);
    const uint16_t* arow = reinterpret_cast<const uint16_t*>(t.data[a] + m * 64);
    __m512 acc = _mm512_maskz_loadu_ps(live, crow);
    for (int k = 0; k < pairs; ++k) {
      // NOTE: each step one FMA (the bf16 x bf16 product is exact), even element first.
      acc = emu_flush(_mm512_fmadd_ps(_mm512_set1_ps(emu_bf16(arow[2 * k])), _mm512_load_ps(be[k]), acc));
      acc = emu_flush(_mm512_fmadd_ps(_mm512_set1_ps(emu_bf16(arow[2 * k + 1])), _mm512_load_ps(bo[k]), acc));
    }
    _mm512_mask_storeu_ps(crow, live, acc);
    std::memset(t.data[c] + m * 64 + cols * 4, 0, 64 - cols * 4);  // the rest of the row zeroed
  }
  std::memset(t.data[c] + rows * 64, 0, (16 - rows) * 64);  // and the rows below
}

inline void emu_release() {
  EmuTiles& t = emu_tiles();
  t.cfg = TileConfig{};
  std::memset(t.data, 0, sizeof t.data);
}

#define TRIPOD_TILE_LOADCONFIG(cfg) ::tripod_amx::emu_loadconfig(cfg)
#define TRIPOD_TILE_ZERO(t) ::tripod_amx::emu_zero(t)
#define TRIPOD_TILE_LOADD(t, base, stride) ::tripod_amx::emu_loadd(t, base, stride)
#define TRIPOD_TILE_STORED(t, base, stride) ::tripod_amx::emu_stored(t, base, stride)
#define TRIPOD_TILE_DPBF16PS(c, a, b) ::tripod_amx::emu_dpbf16ps(c, a, b)
#define TRIPOD_TILE_RELEASE() ::tripod_amx::emu_release()
#else
constexpr bool kEmulated = false;
#define TRIPOD_TILE_LOADCONFIG(cfg) _tile_loadconfig(cfg)
#define TRIPOD_TILE_ZERO(t) _tile_zero(t)
#define TRIPOD_TILE_LOADD(t, base, stride) _tile_loadd(t, base, stride)
#define TRIPOD_TILE_STORED(t, base, stride) _tile_stored(t, base, stride)
#define TRIPOD_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TRIPOD_TILE_RELEASE() _tile_release()
#endif

}  // namespace tripod_amx
#endif
