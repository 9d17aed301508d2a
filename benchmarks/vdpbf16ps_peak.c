// The throughput ceiling of one core's vdpbf16ps (16 independent accumulators; the second operand
// broadcast from memory, as the prefill attention kernel's inner loops do, or in a register), and of
// a float32 FMA with a broadcast operand, for comparison. CPU time of the process.
//
//   gcc -O2 -mavx512f -mavx512bf16 -mavx512vl benchmarks/vdpbf16ps_peak.c -o /tmp/peak && /tmp/peak
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static double cpu_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long n = 50000000;
  uint32_t w[64];
  for (int i = 0; i < 64; i++) w[i] = 0x3f803f80u + i;
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f813f81);
  __m512 acc[16];
  float sink = 0;
  for (int mode = 0; mode < 3; mode++) {
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    double t = cpu_seconds();
    for (long k = 0; k < n; k++) {
      for (int i = 0; i < 16; i++) {
        if (mode == 0) acc[i] = _mm512_dpbf16_ps(acc[i], a, (__m512bh)_mm512_set1_epi32((int)w[i + (k & 7)]));
        else if (mode == 1) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        else acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(1.0001f), _mm512_set1_ps(((float*)w)[i + (k & 7)]), acc[i]);
      }
      __asm__ volatile("" ::: "memory");
    }
    t = cpu_seconds() - t;
    for (int i = 0; i < 16; i++) sink += _mm512_reduce_add_ps(acc[i]);
    const char* name[] = {"vdpbf16ps, broadcast word", "vdpbf16ps, registers", "vfmadd231ps, broadcast"};
    printf("%-28s %.3f ns per instruction\n", name[mode], t / (n * 16.0) * 1e9);
  }
  return sink == 42.f;
}
