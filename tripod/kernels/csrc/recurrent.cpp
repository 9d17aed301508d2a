// The hybrid mixers' token recurrences on the CPU, registered beside the other ops in the
// namespace TRIPOD_OPS_NS: the causal depthwise conv over a sequence's conv window (+ SiLU), the
// gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) and Mamba2's selective scan (SSD:
// Nemotron-H, Granite 4.0). The torch loops in layers/gated_delta.py and layers/mamba2.py are the
// reference; these are the same math in one call per layer instead of several torch ops per token.
//
// A step's work is an item table [N, 4] int64: per sequence (first flat row, tokens, state slot,
// keep row). Each task owns one sequence (and one head, or one block of channels) and walks its
// tokens in order with the state in a local buffer, stored back to its pool slot once after the
// last token. `keep row` >= 0: the item is traced (speculative verification, memory/state_pool.py
// StateTrace): the state before the item goes to keep[keep_row] and the state after its i-th
// token to keep[keep_row + i], the very values the recurrence carries on (copies, no recompute).
//
// Exactness: every token of a sequence runs the same operations in the same order whatever the
// item's length, the step's other items or the thread that runs the task (one task = one
// sequence's head; tasks share nothing), so a sequence's bits do not depend on how its tokens
// were split into steps nor on its neighbours. Every sum over the key / state dimension is formed
// in one fixed order (index 0 first, then one add per index) on 16-lane vectors across the other
// dimension: element-wise operations only, so every ISA level (simd.h) gives the same bits. This
// file is compiled with -ffp-contract=off: a multiply and an add are two roundings.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <vector>

#include "simd.h"

#ifndef TRIPOD_OPS_NS
#error "compile with -DTRIPOD_OPS_NS=<torch op namespace> (kernels/build.py does)"
#endif

namespace tripod_recurrent {
namespace {

using bf16 = at::BFloat16;
using namespace tripod_simd;

inline int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

// fn(0..n-1) over the intra-op threads, one index at a time (a prefill item next to decode rows
// costs hundreds of times more); the result of a task never depends on which thread runs it.
template <typename F>
void run_tasks(int64_t n, const F& fn) {
  if (n <= 0) return;
  const int threads = at::get_num_threads();
  if (n == 1 || threads == 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, n), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

struct Item {
  int64_t first, n, slot, keep;
};

std::vector<Item> read_items(const at::Tensor& items, int64_t rows, int64_t slots, int64_t keep_rows) {
  TORCH_CHECK(items.dim() == 2 && items.size(1) == 4 && items.scalar_type() == at::kLong && items.is_contiguous(),
              "items must be [N, 4] int64 (first row, tokens, slot, keep row)");
  const int64_t* p = items.data_ptr<int64_t>();
  std::vector<Item> out(items.size(0));
  for (int64_t i = 0; i < items.size(0); ++i) {
    Item it{p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]};
    TORCH_CHECK(it.first >= 0 && it.n >= 0 && it.first + it.n <= rows, "item rows out of range");
    TORCH_CHECK(it.slot >= 0 && it.slot < slots, "item slot out of range");
    TORCH_CHECK(it.keep < 0 || it.keep + it.n < keep_rows, "item keep rows out of range");
    out[i] = it;
  }
  return out;
}

float* keep_ptr(const std::optional<at::Tensor>& keep, int64_t row_floats, const char* what) {
  if (!keep.has_value()) return nullptr;
  TORCH_CHECK(keep->scalar_type() == at::kFloat && keep->is_contiguous() && keep->numel() % row_floats == 0, what);
  return keep->data_ptr<float>();
}

int64_t keep_rows(const std::optional<at::Tensor>& keep) { return keep.has_value() ? keep->size(0) : 0; }

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }

// ---------------------------------------------------------------------------- causal conv
// out[t, c] = silu(sum_j in[t - K + 1 + j, c] * w[c, j] (+ b[c])): taps summed j = 0 .. K-1 (the
// first a product, then one add per tap), inputs before the item's first row from the window
// [C, K - 1] (oldest first), which then becomes the item's last K - 1 inputs.
constexpr int64_t kConvBlock = 256;  // channels per task (decode rows of one sequence still split)

template <typename T>
void conv_update_impl(const at::Tensor& x, at::Tensor& window, const std::vector<Item>& items, const at::Tensor& weight,
                      const float* bias, float* keep, at::Tensor& out) {
  const int64_t C = x.size(1), K = weight.size(1), H = K - 1;
  const int64_t xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const float* wp = weight.data_ptr<float>();
  float* winp = window.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (C + kConvBlock - 1) / kConvBlock;
  run_tasks(static_cast<int64_t>(items.size()) * blocks, [&](int64_t task) {
    const Item& it = items[task / blocks];
    if (it.n == 0 && it.keep < 0) return;
    const int64_t c0 = (task % blocks) * kConvBlock, cw = std::min(kConvBlock, C - c0), cp = pad16(cw);
    // ring[s % K]: the item's input s (s < K - 1: the window's columns; s = t + K - 1: row t)
    std::vector<float> ring(K * cp, 0.f), wt(K * cp, 0.f), bs(cp, 0.f);
    float* win = winp + it.slot * C * H;
    for (int64_t c = 0; c < cw; ++c) {
      for (int64_t j = 0; j < H; ++j) ring[j * cp + c] = win[(c0 + c) * H + j];
      for (int64_t j = 0; j < K; ++j) wt[j * cp + c] = wp[(c0 + c) * K + j];
      if (bias != nullptr) bs[c] = bias[c0 + c];
    }
    auto keep_window = [&](int64_t r) {  // the window after the item's first r rows: inputs r .. r + K - 2
      float* dst = keep + (it.keep + r) * C * H;
      for (int64_t c = 0; c < cw; ++c)
        for (int64_t j = 0; j < H; ++j) dst[(c0 + c) * H + j] = ring[((r + j) % K) * cp + c];
    };
    if (it.keep >= 0) keep_window(0);
    for (int64_t t = 0; t < it.n; ++t) {
      float* in = ring.data() + ((t + H) % K) * cp;
      const T* row = xp + (it.first + t) * xs + c0;
      for (int64_t c = 0; c < cw; ++c) in[c] = to_float(row[c]);
      float* o = op + (it.first + t) * C + c0;
      for (int64_t c = 0; c < cp; c += 16) {
        V16 acc = mul(load(ring.data() + (t % K) * cp + c), load(wt.data() + c));
        for (int64_t j = 1; j < K; ++j)
          acc = add(acc, mul(load(ring.data() + ((t + j) % K) * cp + c), load(wt.data() + j * cp + c)));
        if (bias != nullptr) acc = add(acc, load(bs.data() + c));
        // silu(a) = a / (1 + e^-a)
        acc = div(acc, add(set1(1.f), tripod_simd::exp(sub(zero(), acc))));
        if (c + 16 <= cw) {
          store(o + c, acc);
        } else {
          store_first(o + c, acc, static_cast<int>(cw - c));
        }
      }
      if (it.keep >= 0) keep_window(t + 1);
    }
    if (it.n > 0)
      for (int64_t c = 0; c < cw; ++c)
        for (int64_t j = 0; j < H; ++j) win[(c0 + c) * H + j] = ring[((it.n + j) % K) * cp + c];
  });
}

at::Tensor conv_update(const at::Tensor& x, at::Tensor window, const at::Tensor& items, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& keep) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "conv_update: x must be [T, C] with unit column stride");
  const int64_t C = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.size(1) >= 2 && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(),
              "conv_update: weight must be [C, K] float32, K >= 2");
  const int64_t K = weight.size(1);
  TORCH_CHECK(window.dim() == 3 && window.size(1) == C && window.size(2) == K - 1 && window.scalar_type() == at::kFloat &&
                  window.is_contiguous(),
              "conv_update: window must be [slots, C, K - 1] float32, contiguous");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == C && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "conv_update: bias must be [C] float32");
    bp = bias->data_ptr<float>();
  }
  float* kp = keep_ptr(keep, C * (K - 1), "conv_update: keep must be [R, C, K - 1] float32, contiguous");
  const auto its = read_items(items, x.size(0), window.size(0), keep_rows(keep));
  at::Tensor out = at::empty({x.size(0), C}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat) {
    conv_update_impl<float>(x, window, its, weight, bp, kp, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "conv_update supports float32 and bfloat16 inputs");
    conv_update_impl<bf16>(x, window, its, weight, bp, kp, out);
  }
  return out;
}

// ---------------------------------------------------------------------------- gated delta rule
// Per token, value head h (key head h / (HV / HK)), state S [DK, DV], as layers/gated_delta.py:
//   S = S * decay;  kv = kᵀS;  S = S + k ⊗ ((v - kv) * beta);  o = qᵀS
// both sums over DK in order d = 0 .. DK-1, 16 value channels per vector. decay [T, HV] (one per
// head: Gated DeltaNet) or [T, HV, DK] (one per key channel, row d of S scaled by decay[d]: KDA).
at::Tensor gated_delta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& decay,
                       const at::Tensor& beta, at::Tensor state, const at::Tensor& items,
                       const std::optional<at::Tensor>& keep) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &decay, &beta, &state})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "gated_delta: float32 contiguous inputs");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gated_delta: q, k [T, HK, DK], v [T, HV, DV]");
  const int64_t T = q.size(0), HK = q.size(1), DK = q.size(2), HV = v.size(1), DV = v.size(2);
  TORCH_CHECK(HV % HK == 0, "gated_delta: value heads must be a multiple of key heads");
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == T && beta.size(1) == HV, "gated_delta: beta [T, HV]");
  const bool per_channel = decay.dim() == 3;
  TORCH_CHECK(decay.size(0) == T && decay.size(1) == HV && (decay.dim() == 2 || (per_channel && decay.size(2) == DK)),
              "gated_delta: decay [T, HV] or [T, HV, DK]");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == HV && state.size(2) == DK && state.size(3) == DV,
              "gated_delta: state must be [slots, HV, DK, DV]");
  float* kp = keep_ptr(keep, HV * DK * DV, "gated_delta: keep must be [R, HV, DK, DV] float32, contiguous");
  const auto its = read_items(items, T, state.size(0), keep_rows(keep));
  at::Tensor out = at::empty({T, HV, DV}, v.options());
  const float *qp = q.data_ptr<float>(), *kk = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rep = HV / HK, DP = pad16(DV);
  run_tasks(static_cast<int64_t>(its.size()) * HV, [&](int64_t task) {
    const Item& it = its[task / HV];
    const int64_t h = task % HV, kh = h / rep;
    float* S0 = sp + (it.slot * HV + h) * DK * DV;
    std::vector<float> buf(DK * DP + DP, 0.f);
    float *S = buf.data(), *u = S + DK * DP;  // S[d * DP + c]; u: (v - kᵀS) * beta
    for (int64_t d = 0; d < DK; ++d) std::memcpy(S + d * DP, S0 + d * DV, DV * sizeof(float));
    auto keep_state = [&](int64_t r) {
      float* dst = kp + ((it.keep + r) * HV + h) * DK * DV;
      for (int64_t d = 0; d < DK; ++d) std::memcpy(dst + d * DV, S + d * DP, DV * sizeof(float));
    };
    if (it.keep >= 0) keep_state(0);
    for (int64_t i = 0; i < it.n; ++i) {
      const int64_t r = it.first + i;
      const float* kr = kk + (r * HK + kh) * DK;
      const float* qr = qp + (r * HK + kh) * DK;
      const float* vr = vp + (r * HV + h) * DV;
      const float* gr = per_channel ? gp + (r * HV + h) * DK : gp + r * HV + h;
      const V16 b = set1(bp[r * HV + h]);
      for (int64_t c = 0; c < DP; c += 16) {  // decay, then kv = kᵀS
        V16 acc = zero();
        for (int64_t d = 0; d < DK; ++d) {
          const V16 s = mul(load(S + d * DP + c), set1(gr[per_channel ? d : 0]));
          store(S + d * DP + c, s);
          const V16 p = mul(s, set1(kr[d]));
          acc = d == 0 ? p : add(acc, p);
        }
        const int lanes = static_cast<int>(std::min<int64_t>(16, DV - c));
        store(u + c, mul(sub(load_first(vr + c, lanes), acc), b));  // (padding lanes: 0 - 0)
      }
      for (int64_t c = 0; c < DP; c += 16) {  // S += k ⊗ u, then o = qᵀS
        const V16 uc = load(u + c);
        V16 acc = zero();
        for (int64_t d = 0; d < DK; ++d) {
          const V16 s = add(load(S + d * DP + c), mul(set1(kr[d]), uc));
          store(S + d * DP + c, s);
          const V16 p = mul(s, set1(qr[d]));
          acc = d == 0 ? p : add(acc, p);
        }
        store_first(op + (r * HV + h) * DV + c, acc, static_cast<int>(std::min<int64_t>(16, DV - c)));
      }
      if (it.keep >= 0) keep_state(i + 1);
    }
    for (int64_t d = 0; d < DK; ++d) std::memcpy(S0 + d * DV, S + d * DP, DV * sizeof(float));
  });
  return out;
}

// ---------------------------------------------------------------------------- Mamba2 scan
// Per token, head h (group g = h / (H / G)), state [P, N], as layers/mamba2.py:
//   h = h * decay + (dt * B[g]) ⊗ x;  y = h · C[g]   (the sum over N in order m = 0 .. N-1)
// The state is held transposed ([N, P], 16 channels per vector) while the item runs.
at::Tensor ssd_scan(const at::Tensor& x, const at::Tensor& b, const at::Tensor& c, const at::Tensor& dt,
                    const at::Tensor& decay, at::Tensor state, const at::Tensor& items,
                    const std::optional<at::Tensor>& keep) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &b, &c, &dt, &decay, &state})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "ssd_scan: float32 inputs");
  TORCH_CHECK(state.dim() == 4 && state.is_contiguous(), "ssd_scan: state must be [slots, H, P, N], contiguous");
  const int64_t T = x.size(0), H = state.size(1), P = state.size(2), N = state.size(3);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == H * P && x.stride(1) == 1, "ssd_scan: x must be [T, H * P], unit columns");
  TORCH_CHECK(b.dim() == 2 && c.sizes() == b.sizes() && b.size(0) == T && b.size(1) % N == 0 && b.stride(1) == 1 &&
                  c.stride(1) == 1,
              "ssd_scan: B, C must be [T, G * N], unit columns");
  const int64_t G = b.size(1) / N;
  TORCH_CHECK(G > 0 && H % G == 0, "ssd_scan: heads must split into the groups of B and C");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == T && dt.size(1) == H && dt.is_contiguous() && decay.sizes() == dt.sizes() &&
                  decay.is_contiguous(),
              "ssd_scan: dt, decay [T, H], contiguous");
  float* kp = keep_ptr(keep, H * P * N, "ssd_scan: keep must be [R, H, P, N] float32, contiguous");
  const auto its = read_items(items, T, state.size(0), keep_rows(keep));
  at::Tensor out = at::empty({T, H, P}, x.options());
  const float *xp = x.data_ptr<float>(), *bp = b.data_ptr<float>(), *cp = c.data_ptr<float>();
  const float *dtp = dt.data_ptr<float>(), *ap = decay.data_ptr<float>();
  const int64_t xs = x.stride(0), bs = b.stride(0), cs = c.stride(0);
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rep = H / G, PP = pad16(P);
  run_tasks(static_cast<int64_t>(its.size()) * H, [&](int64_t task) {
    const Item& it = its[task / H];
    const int64_t h = task % H, g = h / rep;
    float* S0 = sp + (it.slot * H + h) * P * N;
    std::vector<float> buf(N * PP + PP, 0.f);
    float *S = buf.data(), *xr = S + N * PP;  // S[m * PP + p]
    for (int64_t p = 0; p < P; ++p)
      for (int64_t m = 0; m < N; ++m) S[m * PP + p] = S0[p * N + m];
    auto put_state = [&](float* dst) {
      for (int64_t p = 0; p < P; ++p)
        for (int64_t m = 0; m < N; ++m) dst[p * N + m] = S[m * PP + p];
    };
    if (it.keep >= 0) put_state(kp + ((it.keep) * H + h) * P * N);
    for (int64_t i = 0; i < it.n; ++i) {
      const int64_t r = it.first + i;
      std::memcpy(xr, xp + r * xs + h * P, P * sizeof(float));
      const float* br = bp + r * bs + g * N;
      const float* cr = cp + r * cs + g * N;
      const float dtv = dtp[r * H + h];
      const V16 a = set1(ap[r * H + h]);
      for (int64_t q = 0; q < PP; q += 16) {
        const V16 xv = load(xr + q);
        V16 acc = zero();
        for (int64_t m = 0; m < N; ++m) {
          const V16 s = add(mul(load(S + m * PP + q), a), mul(set1(dtv * br[m]), xv));
          store(S + m * PP + q, s);
          const V16 pr = mul(s, set1(cr[m]));
          acc = m == 0 ? pr : add(acc, pr);
        }
        store_first(op + (r * H + h) * P + q, acc, static_cast<int>(std::min<int64_t>(16, P - q)));
      }
      if (it.keep >= 0) put_state(kp + ((it.keep + i + 1) * H + h) * P * N);
    }
    put_state(S0);
  });
  return out;
}

}  // namespace
}  // namespace tripod_recurrent

// TORCH_LIBRARY_FRAGMENT stringifies its argument: expand TRIPOD_OPS_NS first.
#define TRIPOD_RECURRENT_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TRIPOD_RECURRENT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TRIPOD_RECURRENT_FRAGMENT(TRIPOD_OPS_NS, m) {
  m.def("conv_update(Tensor x, Tensor(a!) window, Tensor items, Tensor weight, Tensor? bias, Tensor(b!)? keep) -> Tensor");
  m.def("gated_delta(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, Tensor(a!) state, Tensor items, "
        "Tensor(b!)? keep) -> Tensor");
  m.def("ssd_scan(Tensor x, Tensor b, Tensor c, Tensor dt, Tensor decay, Tensor(a!) state, Tensor items, "
        "Tensor(b!)? keep) -> Tensor");
}

TRIPOD_RECURRENT_IMPL(TRIPOD_OPS_NS, CPU, m) {
  m.impl("conv_update", &tripod_recurrent::conv_update);
  m.impl("gated_delta", &tripod_recurrent::gated_delta);
  m.impl("ssd_scan", &tripod_recurrent::ssd_scan);
}
