// Vector helpers the CPU kernels share: 8 fp32 lanes from fp32 or bf16, fixed-order horizontal sums,
// whether the CPU has AVX-512, fp32 vector types of 8 and 16 lanes.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cstdint>

namespace moebench_kernels {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {                 // bf16 -> fp32: the top 16 bits, exact
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

#define MOEBENCH_AVX512 __attribute__((target("avx512f")))   // a function that runs only where cpu_has_avx512()

inline float hsum(__m256 v) {                                  // a fixed tree: lanes (i, i+4), (0,2),(1,3), then 0+1
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 16 lanes folded to 8: lanes i and i + 8 added.
MOEBENCH_AVX512 inline __m256 fold8(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
// 16 lanes: folded to 8, then hsum's tree (a 16-lane accumulator is two 8-lane ones).
MOEBENCH_AVX512 inline float hsum(__m512 v) { return hsum(fold8(v)); }

inline bool cpu_has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;     // the CPU's flag and the OS saving its registers
  }();
  return yes;
}

// fp32 vectors of W lanes, for kernels written once over the width (instantiated in a function of
// the matching instruction set: an always-inline template called from a MOEBENCH_AVX512 function
// compiles to AVX-512).
struct Vec8 {
  static constexpr int64_t W = 8;
  using F = __m256;
  static inline F zero() { return _mm256_setzero_ps(); }
  static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static inline F splat(float v) { return _mm256_set1_ps(v); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline __m256 to8(F v) { return v; }
};

struct Vec16 {
  static constexpr int64_t W = 16;
  using F = __m512;
  MOEBENCH_AVX512 static inline F zero() { return _mm512_setzero_ps(); }
  MOEBENCH_AVX512 static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  MOEBENCH_AVX512 static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  MOEBENCH_AVX512 static inline F splat(float v) { return _mm512_set1_ps(v); }
  MOEBENCH_AVX512 static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  MOEBENCH_AVX512 static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  MOEBENCH_AVX512 static inline __m256 to8(F v) { return fold8(v); }
};

}  // namespace moebench_kernels
