// A decode step's small ops on the CPU, one call each where eager torch makes several.
//
// Between a decode step's weight reads (rows_linear.cpp) the step normalises, rotates, attends and
// gates a few rows. In torch each of those is 3-8 aten calls of a few microseconds of dispatch, and
// amid a real step -- a gigabyte of weights streaming through the caches -- each runs about three
// times slower than alone (docs/cpu_experts.md has the measurement). Here each is one call:
// - rms_norm: x [..., D] -> RMSNorm with r = 1/sqrt(mean(x^2) + eps) in fp32, then w * T(x r) (the
//   weight multiplies in the model's dtype T: transformers' Llama/Mixtral form) or T(x r (offset + w))
//   (scaled in fp32; no weight: T(x r)). The mean's sum runs in an order of its own, so the output
//   equals torch's ops (engine.layers.rms_norm) up to fp32 rounding.
// - rope: x [B, H, T, h] contiguous, cos and the signed sin [T, r] -> x cos + roll(x, r/2) sin over
//   the first r dims, the rest passed on: torch's ops (engine.layers.apply_rope) bit for bit, each
//   product and the sum rounded to T as torch's three ops round them.
// - decode_attention: q [B, H, 1, h], k [B, K, S, h], v [B, K, S, hv] fp32 -> [B, H, 1, hv]: each
//   key head's G = H/K queries against its keys, each key and value read once for all G; the
//   softmax's exp a vector polynomial of its own (`exp8`); the (sequence, key head) pairs shared
//   over the kernels' threads (pool.h). Equal to engine.layers.decode_attention's three torch ops up
//   to fp32 rounding; those ops themselves (bit for bit) for more than 4 queries a key head over
//   more than 512 keys, where MKL's batched GEMM is faster.
// - rope_attention: a decode step's rope, KV write and decode_attention in one call.
// - silu_mul: gate, up [n, I] (rows contiguous: the halves of one projection's output, say) ->
//   silu(gate) * up (SwiGLU's activation), rounded to T as torch's two ops round it; silu's exp is
//   `exp8`, so equal to torch's up to fp32 rounding.
// - swiglu: a SwiGLU expert on x's rows -- rows_linear.cpp's linear, silu_mul, its linear again -- in
//   one call.
// Each output row depends on its own input row only, computed in a fixed order: the same bits at
// any batch and thread count.
// Does not own: when the engine calls them (engine.kernels.step_ops), building them
// (engine.kernels.cpu), the threads (pool.h).
//
// Dimension legend: B=batch, H/K=query/key heads, G=H/K, S=keys held, h/hv=key/value head dim,
// T=tokens, r=rotated dims, D=hidden, I=expert intermediate, n=rows.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"
#include "pool.h"
#include "vec.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using moebench_kernels::hsum;
using moebench_kernels::load8;
using moebench_kernels::run_chunks;
using moebench_kernels::run_rows;
using moebench_kernels::Vec16;
using moebench_kernels::Vec8;
using moebench_kernels::widen;

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }      // fp32: itself; bf16: round to nearest even

// The two dtypes the element-wise ops take.
inline bool float_or_bf16(at::ScalarType dt) { return dt == at::kFloat || dt == at::kBFloat16; }

// f(T{}) with T the C++ type of dt (float_or_bf16).
template <typename F>
inline void by_dtype(at::ScalarType dt, const F& f) {
  if (dt == at::kFloat) f(float{}); else f(c10::BFloat16{});
}

// exp(x) in 8 lanes: Cephes' expf (x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-7 polynomial,
// times 2^n); SiLU through it is within 3 ulp of float64 (tests/engine/test_decode_ops.py). 0 below
// the normal range, inf above 88.376 (expf is finite up to 88.72: silu's 1 / (1 + exp(-x)) is 0
// there either way); NaN stays NaN.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504019f);
  __m256 c = _mm256_max_ps(lo, _mm256_min_ps(hi, x));          // a NaN x is the second operand: kept
  const __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                                  _mm256_set1_ps(0.5f)));
  c = _mm256_sub_ps(c, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  c = _mm256_sub_ps(c, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float p : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_add_ps(_mm256_mul_ps(y, c), _mm256_set1_ps(p));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(c, c)), c), _mm256_set1_ps(1.0f));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(n));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(88.7228391f), _CMP_GT_OQ));
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }   // the same function, one value

// ---- RMSNorm

template <typename T>
float inv_rms(const T* x, int64_t D, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    const __m256 v0 = load8(x + i), v1 = load8(x + i + 8);
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
  }
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; i < D; ++i) s += widen(x[i]) * widen(x[i]);
  return 1.0f / std::sqrt(s / static_cast<float>(D) + eps);
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t j0, int64_t j1, int64_t D, float eps, float offset,
                   bool scale_fp32) {
  for (int64_t j = j0; j < j1; ++j) {
    const T* xj = x + j * D;
    T* yj = y + j * D;
    const float r = inv_rms(xj, D, eps);
    for (int64_t i = 0; i < D; ++i) {
      const float a = widen(xj[i]) * r;
      if (!scale_fp32)
        yj[i] = round_to<T>(widen(w[i]) * widen(round_to<T>(a)));     // w * T(x r): the product in T
      else
        yj[i] = round_to<T>(w ? a * (offset + widen(w[i])) : a);      // T(x r (offset + w))
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& w, double eps, double offset,
                    bool scale_fp32) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && float_or_bf16(dt) && x.dim() >= 1,
              "rms_norm: x must be float32 or bfloat16 on the CPU, got ", dt, " on ", x.device());
  const bool has_w = w.has_value() && w->defined();
  const int64_t D = x.size(-1);
  TORCH_CHECK(has_w || scale_fp32, "rms_norm: the weight multiplies in the model's dtype only when there is one");
  if (has_w)
    TORCH_CHECK(w->scalar_type() == dt && w->dim() == 1 && w->size(0) == D && w->is_contiguous() &&
                w->device().is_cpu(), "rms_norm: the weight must be [", D, "] contiguous on the CPU in x's dtype ", dt,
                ", got ", w->scalar_type(), " ", w->sizes());
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = D ? x.numel() / D : 0;
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  by_dtype(dt, [&](auto t) {
    using T = decltype(t);
    run_rows([&](int64_t j0, int64_t j1) {
      rms_norm_rows(xc.data_ptr<T>(), has_w ? w->data_ptr<T>() : nullptr, out.data_ptr<T>(), j0, j1, D, e, off,
                    scale_fp32);
    }, n, D);
  });
  return out;
}

// ---- Rotary embedding

template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* y, int64_t rows, int64_t tokens, int64_t h, int64_t r) {
  const int64_t half = r / 2;
  for (int64_t row = 0; row < rows; ++row, x += h, y += h) {
    const int64_t t = row % tokens;
    const T* c = cos + t * r;
    const T* s = sin + t * r;
    for (int64_t i = 0; i < r; ++i) {
      const T a = round_to<T>(widen(x[i]) * widen(c[i]));
      const T b = round_to<T>(widen(x[i < half ? i + half : i - half]) * widen(s[i]));
      y[i] = round_to<T>(widen(a) + widen(b));
    }
    for (int64_t i = r; i < h; ++i) y[i] = x[i];
  }
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && float_or_bf16(dt) && x.dim() == 4 && x.is_contiguous(),
              "rope: x must be a contiguous float32 or bfloat16 [B, H, T, h] on the CPU, got ", dt, " ", x.sizes());
  const int64_t T = x.size(2), h = x.size(3);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == dt && t->dim() == 2 && t->size(0) == T && t->size(1) <= h && t->size(1) % 2 == 0 &&
                t->is_contiguous() && t->device().is_cpu() && t->sizes() == cos.sizes(),
                "rope: cos and sin must be contiguous [T, r] in x's dtype, T = ", T, ", even r <= ", h, ", got ",
                cos.sizes(), " and ", sin.sizes());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = T ? x.numel() / h : 0;
  by_dtype(dt, [&](auto t) {
    using E = decltype(t);
    rope_rows(x.data_ptr<E>(), cos.data_ptr<E>(), sin.data_ptr<E>(), out.data_ptr<E>(), rows, T, h, cos.size(1));
  });
  return out;
}

// ---- Decode attention

constexpr int64_t KEY_BLOCK = 64;      // keys (values) whose rows stay in L1 while each query of the group reads them
// More than QUERY_TILE queries a key head over more keys than this: torch's batched GEMM (MKL, 16
// lanes on an AVX-512 host) computes the scores faster than the tiles below, whose horizontal sums
// then dominate (benchmarks/bench_decode_attention.py), so decode_attention runs torch's ops.
constexpr int64_t GEMM_FROM_KEYS = 512;
constexpr int QUERY_TILE = 4;          // queries a tile computes at once (8 accumulators: x 2+ keys, x 2 value vectors)
#define ALWAYS_INLINE __attribute__((always_inline)) inline    // compiled in its caller's instruction set

// Lane r: the sum of a[r]'s lanes as ((0+1)+(2+3))+((4+5)+(6+7)), for 8 vectors at once (a lane
// depends on its own vector only: a tile that fills fewer passes zeros).
inline __m256 reduce8(const __m256* a) {
  // a0-a3's (01)+(23) in the low half, their (45)+(67) in the high half; a4-a7's the same
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// s[g * S + j] = dot(q_g, k_j) * scale for NQ queries (q [NQ, h]) and NK keys from j (NQ x NK <= 8),
// in V::W lanes (h a multiple of W): one chain per score in input order, folded to 8 lanes
// (Vec16::to8), reduce8's tree, the scale -- the same operations for each score in any tile, so
// the same bits whatever NQ and NK are (each width its own bits).
template <typename V, int NQ, int NK>
ALWAYS_INLINE void scores_tile(const float* q, int64_t h, const float* k, int64_t ks, int64_t j, float scale,
                               float* s, int64_t S) {
  static_assert(NQ * NK <= 8, "a tile has 8 accumulators at most");
  typename V::F a[NQ * NK];
  for (int c = 0; c < NQ * NK; ++c) a[c] = V::zero();
  for (int64_t i = 0; i < h; i += V::W) {
    typename V::F x[NK];
    for (int t = 0; t < NK; ++t) x[t] = V::load(k + (j + t) * ks + i);
    for (int g = 0; g < NQ; ++g) {
      const typename V::F qg = V::load(q + g * h + i);
      for (int t = 0; t < NK; ++t) a[g * NK + t] = V::fma(qg, x[t], a[g * NK + t]);
    }
  }
  __m256 a8[8];
  for (int c = 0; c < 8; ++c) a8[c] = c < NQ * NK ? V::to8(a[c]) : _mm256_setzero_ps();
  alignas(32) float d[8];
  _mm256_store_ps(d, reduce8(a8));
  for (int g = 0; g < NQ; ++g)
    for (int t = 0; t < NK; ++t) s[g * S + j + t] = d[g * NK + t] * scale;
}

// A block's keys [j0, j1) against NQ queries: tiles of 8 / NQ keys, then one at a time.
template <typename V, int NQ>
ALWAYS_INLINE void scores_block(const float* q, int64_t h, const float* k, int64_t ks, int64_t j0, int64_t j1,
                                float scale, float* s, int64_t S) {
  constexpr int NK = NQ == 1 ? 8 : NQ == 2 ? 4 : 2;
  int64_t j = j0;
  for (; j + NK <= j1; j += NK) scores_tile<V, NQ, NK>(q, h, k, ks, j, scale, s, S);
  for (; j < j1; ++j) scores_tile<V, NQ, 1>(q, h, k, ks, j, scale, s, S);
}

// out[g] += sum over keys j0..j1 of p[g * S + j] v_j for NQ queries, in V::W lanes (hv a multiple of
// W): each output lane one fma chain over the keys in order (kept in `out` between blocks).
template <typename V, int NQ>
ALWAYS_INLINE void values_block(const float* p, int64_t S, const float* v, int64_t vs, int64_t j0, int64_t j1,
                                int64_t hv, float* out) {
  int64_t i = 0;
  for (; i + 2 * V::W <= hv; i += 2 * V::W) {
    typename V::F a[NQ][2];
    for (int g = 0; g < NQ; ++g) {
      a[g][0] = V::load(out + g * hv + i);
      a[g][1] = V::load(out + g * hv + i + V::W);
    }
    for (int64_t j = j0; j < j1; ++j) {
      const typename V::F v0 = V::load(v + j * vs + i), v1 = V::load(v + j * vs + i + V::W);
      for (int g = 0; g < NQ; ++g) {
        const typename V::F pg = V::splat(p[g * S + j]);
        a[g][0] = V::fma(pg, v0, a[g][0]);
        a[g][1] = V::fma(pg, v1, a[g][1]);
      }
    }
    for (int g = 0; g < NQ; ++g) {
      V::store(out + g * hv + i, a[g][0]);
      V::store(out + g * hv + i + V::W, a[g][1]);
    }
  }
  for (; i < hv; i += V::W)
    for (int g = 0; g < NQ; ++g) {
      typename V::F o = V::load(out + g * hv + i);
      for (int64_t j = j0; j < j1; ++j) o = V::fma(V::splat(p[g * S + j]), V::load(v + j * vs + i), o);
      V::store(out + g * hv + i, o);
    }
}

// The softmax of each of G rows of S scores, in place (the exp a vector polynomial: exp8).
inline void softmax_rows(float* s, int64_t G, int64_t S) {
  for (int64_t g = 0; g < G; ++g, s += S) {
    float m = s[0];
    for (int64_t j = 1; j < S; ++j) m = s[j] > m ? s[j] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 z = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= S; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
      _mm256_storeu_ps(s + j, e);
      z = _mm256_add_ps(z, e);
    }
    float zs = hsum(z);
    for (; j < S; ++j) zs += (s[j] = exp1(s[j] - m));
    const float inv = 1.0f / zs;
    for (j = 0; j < S; ++j) s[j] *= inv;
  }
}

// One key head's attention: its G queries q [G, h], S keys (row stride ks) and values (row stride
// vs), the scores' scratch s [G, S] and the output out [G, hv].
struct Group {
  const float* q; const float* k; int64_t ks; const float* v; int64_t vs;
  int64_t S, G, h, hv; float scale; float* s; float* out;
};

// NQ queries from g0 over the keys [j0, j1): their scores, or their weighted values.
template <typename V, int NQ>
ALWAYS_INLINE void tile(bool scores, const Group& a, int64_t j0, int64_t j1, int64_t g0) {
  if (scores)
    scores_block<V, NQ>(a.q + g0 * a.h, a.h, a.k, a.ks, j0, j1, a.scale, a.s + g0 * a.S, a.S);
  else
    values_block<V, NQ>(a.s + g0 * a.S, a.S, a.v, a.vs, j0, j1, a.hv, a.out + g0 * a.hv);
}

// Every key block of KEY_BLOCK keys (read from memory once for all G queries) by tiles of up to
// QUERY_TILE queries: the scores, or the weighted values.
template <typename V>
ALWAYS_INLINE void blocks(bool scores, const Group& a) {
  for (int64_t j0 = 0; j0 < a.S; j0 += KEY_BLOCK) {
    const int64_t j1 = std::min(a.S, j0 + KEY_BLOCK);
    for (int64_t g0 = 0; g0 < a.G; g0 += QUERY_TILE) {
      switch (std::min<int64_t>(QUERY_TILE, a.G - g0)) {
        case 4: tile<V, 4>(scores, a, j0, j1, g0); break;
        case 3: tile<V, 3>(scores, a, j0, j1, g0); break;
        case 2: tile<V, 2>(scores, a, j0, j1, g0); break;
        default: tile<V, 1>(scores, a, j0, j1, g0); break;
      }
    }
  }
}

// One key head's G queries q [G, h] over its S keys (row stride ks) and values (row stride vs) ->
// out [G, hv], in V::W lanes (h and hv multiples of W); p: scratch for the G x S scores.
template <typename V>
ALWAYS_INLINE void attend_group(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t S,
                                int64_t G, int64_t h, int64_t hv, float scale, float* out, std::vector<float>& p) {
  p.resize(G * S);
  const Group a{q, k, ks, v, vs, S, G, h, hv, scale, p.data(), out};
  blocks<V>(true, a);
  softmax_rows(a.s, G, S);
  std::fill(out, out + G * hv, 0.0f);
  blocks<V>(false, a);
}

void attend_group8(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t S, int64_t G,
                   int64_t h, int64_t hv, float scale, float* out, std::vector<float>& p) {
  attend_group<Vec8>(q, k, ks, v, vs, S, G, h, hv, scale, out, p);
}

MOEBENCH_AVX512 void attend_group16(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t S,
                                    int64_t G, int64_t h, int64_t hv, float scale, float* out, std::vector<float>& p) {
  attend_group<Vec16>(q, k, ks, v, vs, S, G, h, hv, scale, out, p);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->dim() == 4 && t->stride(3) == 1,
                "decode_attention: q, k and v must be float32 [B, heads, tokens, head dim] on the CPU with each "
                "head's row contiguous, got ", t->scalar_type(), " ", t->sizes(), " strides ", t->strides());
  const int64_t B = q.size(0), H = q.size(1), h = q.size(3), K = k.size(1), S = k.size(2), hv = v.size(3);
  TORCH_CHECK(q.size(2) == 1 && K > 0 && H % K == 0 && k.size(0) == B && v.size(0) == B && v.size(1) == K &&
              v.size(2) == S && k.size(3) == h && S > 0 && h % 8 == 0 && hv % 8 == 0,
              "decode_attention: q [B, H, 1, h], k [B, K, S, h], v [B, K, S, hv] with K dividing H, S > 0, h and hv "
              "multiples of 8, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t G = H / K;
  if (G > QUERY_TILE && S > GEMM_FROM_KEYS) {                        // torch's three ops, as ATen calls
    at::Tensor scores = at::matmul(q.reshape({B, K, G, h}), k.transpose(-1, -2)).mul_(scale);   // [B, K, G, S]
    return at::matmul(at::softmax(scores, -1), v).reshape({B, H, 1, hv});
  }
  at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({B, H, 1, hv}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto ks = k.strides(), vs = v.strides();
  const float sc = static_cast<float>(scale);
  const bool wide = moebench_kernels::cpu_has_avx512() && h % 16 == 0 && hv % 16 == 0;   // 16 lanes where they fit
  run_chunks([&](int64_t i0, int64_t i1) {
    std::vector<float> p;
    for (int64_t i = i0; i < i1; ++i) {                               // i = b * K + key head
      const int64_t b = i / K, kh = i % K;
      (wide ? attend_group16 : attend_group8)(qp + (b * H + kh * G) * h, kp + b * ks[0] + kh * ks[1], ks[2],
                                              vp + b * vs[0] + kh * vs[1], vs[2], S, G, h, hv, sc,
                                              op + (b * H + kh * G) * hv, p);
    }
  }, B * K, B * K * S * (h + hv), 1);
  return out;
}

// rope, the KV write and decode_attention in one call: q [B, H, 1, h] and k [B, K, 1, h] rotated by
// cos / the signed sin [1, r] (rope), the rotated k and v [B, K, 1, hv] written at position `start`
// of the cache buffers k_buf [B, K, capacity, h] / v_buf [B, K, capacity, hv], q attending to
// positions 0..start -> [B, H, 1, hv]. All fp32, q/k/v contiguous, each buffer row contiguous.
at::Tensor rope_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                          const at::Tensor& sin, at::Tensor k_buf, at::Tensor v_buf, int64_t start, double scale) {
  TORCH_CHECK(k_buf.dim() == 4 && v_buf.dim() == 4 && start >= 0 && start < k_buf.size(2) &&
              start < v_buf.size(2) && k.dim() == 4 && v.dim() == 4 && k.size(2) == 1 && v.size(2) == 1 &&
              k.sizes().slice(0, 2) == k_buf.sizes().slice(0, 2) && k.size(3) == k_buf.size(3) &&
              v.sizes().slice(0, 2) == v_buf.sizes().slice(0, 2) && v.size(3) == v_buf.size(3),
              "rope_attention: k/v [B, K, 1, h] written at position ", start, " of buffers [B, K, capacity, h], got ",
              k.sizes(), ", ", v.sizes(), " and ", k_buf.sizes(), ", ", v_buf.sizes());
  const at::Tensor kr = rope(k, cos, sin), vc = v.contiguous();
  k_buf.select(2, start).copy_(kr.select(2, 0));
  v_buf.select(2, start).copy_(vc.select(2, 0));
  return decode_attention(rope(q, cos, sin), k_buf.narrow(2, 0, start + 1), v_buf.narrow(2, 0, start + 1), scale);
}

// ---- SwiGLU's activation

template <typename T>
void silu_mul_rows(const T* gate, int64_t gs, const T* up, int64_t us, T* y, int64_t j0, int64_t j1, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t j = j0; j < j1; ++j) {
    const T* g = gate + j * gs;
    const T* u = up + j * us;
    T* o = y + j * I;
    int64_t i = 0;
    if constexpr (std::is_same_v<T, float>) {
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 a = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
      }
    }
    for (; i < I; ++i) {                                               // silu(g) = g / (1 + exp(-g)), rounded to T
      const float gi = widen(g[i]);
      o[i] = round_to<T>(widen(round_to<T>(gi / (1.0f + exp1(-gi)))) * widen(u[i]));
    }
  }
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  const auto dt = gate.scalar_type();
  TORCH_CHECK(gate.device().is_cpu() && float_or_bf16(dt) && gate.dim() == 2 &&
              gate.stride(1) == 1, "silu_mul: gate must be float32 or bfloat16 [n, I] on the CPU with rows "
              "contiguous, got ", dt, " ", gate.sizes(), " strides ", gate.strides());
  TORCH_CHECK(up.scalar_type() == dt && up.device().is_cpu() && up.sizes() == gate.sizes() && up.stride(1) == 1,
              "silu_mul: up must be gate's dtype and shape ", gate.sizes(), " with rows contiguous, got ",
              up.scalar_type(), " ", up.sizes(), " strides ", up.strides());
  const int64_t n = gate.size(0), I = gate.size(1);
  at::Tensor out = at::empty({n, I}, gate.options());
  by_dtype(dt, [&](auto t) {
    using T = decltype(t);
    run_rows([&](int64_t j0, int64_t j1) {
      silu_mul_rows(gate.data_ptr<T>(), gate.stride(0), up.data_ptr<T>(), up.stride(0), out.data_ptr<T>(), j0, j1, I);
    }, n, 2 * I);
  });
  return out;
}

// ---- A SwiGLU expert

// silu(x gate^T) * (x up^T) @ down^T for x [n, D], gate_up [2I, D] (gate's rows, then up's), down [D, I]:
// small_linear, silu_mul, small_linear -- the ops engine.layers.expert_ffn makes with the kernel's
// linear, bit for bit, in one call (a decode step returns to Python between them otherwise).
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, int64_t max_rows,
                  bool widen_bf16) {
  TORCH_CHECK(gate_up.dim() == 2 && down.dim() == 2 && gate_up.size(0) == 2 * down.size(1),
              "swiglu: gate_up [2I, D] and down [D, I], got ", gate_up.sizes(), " and ", down.sizes());
  const int64_t I = down.size(1);
  at::Tensor gu = moebench_kernels::small_linear(x, gate_up, max_rows, widen_bf16);         // [n, 2I]
  return moebench_kernels::small_linear(silu_mul(gu.narrow(1, 0, I), gu.narrow(1, I, I)), down, max_rows, widen_bf16);
}

// out += T(swiglu(...) * gate) (gate [n, 1], out [n, D], all in x's dtype): a routed expert's weighted
// output added in place, rounded as torch's `out.add_(y * gate)` rounds it.
void swiglu_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                 const at::Tensor& gate, int64_t max_rows, bool widen_bf16) {
  at::Tensor y = swiglu(x, gate_up, down, max_rows, widen_bf16);
  TORCH_CHECK(out.sizes() == y.sizes() && out.is_contiguous() && out.scalar_type() == y.scalar_type() &&
              gate.scalar_type() == y.scalar_type() && gate.dim() == 2 && gate.size(0) == y.size(0) &&
              gate.size(1) == 1, "swiglu_add_: out ", y.sizes(), " contiguous and gate [n, 1] in x's dtype, got ",
              out.sizes(), " ", out.scalar_type(), " and ", gate.sizes(), " ", gate.scalar_type());
  const int64_t n = y.size(0), D = y.size(1);
  by_dtype(y.scalar_type(), [&](auto t) {
    using T = decltype(t);
    T* o = out.data_ptr<T>();
    const T* yv = y.data_ptr<T>();
    for (int64_t j = 0; j < n; ++j) {
      const float g = widen(gate.data_ptr<T>()[j * gate.stride(0)]);
      for (int64_t i = 0; i < D; ++i)
        o[j * D + i] = round_to<T>(widen(o[j * D + i]) + widen(round_to<T>(widen(yv[j * D + i]) * g)));
    }
  });
}

// ---- The softmax top-k router

// (ids int64 [N, k], weights fp32 [N, k]) of h [N, D] against the router w [E, D]: the logits by
// small_linear (in h's dtype), softmax over them in fp32 (exp8), the k largest in descending order
// (ties: the lower expert id first), divided by their sum when `norm`. engine.layers.route's ops up
// to fp32 rounding.
std::tuple<at::Tensor, at::Tensor> softmax_topk(const at::Tensor& h, const at::Tensor& w, int64_t k, bool norm,
                                                int64_t max_rows, bool widen_bf16) {
  at::Tensor logits = moebench_kernels::small_linear(h, w, max_rows, widen_bf16).to(at::kFloat).contiguous();
  const int64_t N = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "softmax_topk: k must be in [1, ", E, "], got ", k);
  at::Tensor ids = at::empty({N, k}, h.options().dtype(at::kLong));
  at::Tensor wts = at::empty({N, k}, h.options().dtype(at::kFloat));
  std::vector<float> p(E);
  for (int64_t j = 0; j < N; ++j) {
    const float* l = logits.data_ptr<float>() + j * E;
    float m = l[0];
    for (int64_t e = 1; e < E; ++e) m = l[e] > m ? l[e] : m;
    float z = 0.0f;
    for (int64_t e = 0; e < E; ++e) z += (p[e] = exp1(l[e] - m));
    for (int64_t e = 0; e < E; ++e) p[e] /= z;
    int64_t* id = ids.data_ptr<int64_t>() + j * k;
    float* wt = wts.data_ptr<float>() + j * k;
    float sum = 0.0f;
    const auto ahead = [&](int64_t a, int64_t b) {                     // a ranks before b: NaN first (as topk),
      return b < 0 || (!std::isnan(p[b]) && (std::isnan(p[a]) || p[a] > p[b]));   // then larger, then lower id
    };
    for (int64_t t = 0; t < k; ++t) {                                  // the best not yet taken
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (std::find(id, id + t, e) == id + t && ahead(e, best)) best = e;
      id[t] = best;
      sum += (wt[t] = p[best]);
    }
    if (norm)
      for (int64_t t = 0; t < k; ++t) wt[t] /= sum;
  }
  return {ids, wts};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moebench_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? w, float eps, float offset, bool scale_fp32) -> Tensor", &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &decode_attention);
  m.def("rope_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_buf, Tensor(b!) v_buf, "
        "int start, float scale) -> Tensor", &rope_attention);
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor", &silu_mul);
  m.def("swiglu(Tensor x, Tensor gate_up, Tensor down, int max_rows, bool widen_bf16) -> Tensor", &swiglu);
  m.def("swiglu_add_(Tensor(a!) out, Tensor x, Tensor gate_up, Tensor down, Tensor gate, int max_rows, "
        "bool widen_bf16) -> ()", &swiglu_add_);
  m.def("softmax_topk(Tensor h, Tensor w, int k, bool norm, int max_rows, bool widen_bf16) -> (Tensor, Tensor)",
        &softmax_topk);
}
