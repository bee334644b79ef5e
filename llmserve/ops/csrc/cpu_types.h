// Shared helpers of the llmserve CPU ops: element loads/stores, rounding to the model
// dtype, fast exp2/exp, horizontal sums, and the dtype dispatch macro.
#pragma once
// ATen's core headers, not <torch/extension.h> (all of libtorch's C++ API): ~25-40 s of
// compiling a file with it, 4-9 s without, on 2 cores; only the bindings need pybind11.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#define LLMSERVE_AVX512 1
#else
#define LLMSERVE_AVX512 0
#endif
// AVX2 + FMA + F16C without AVX-512 (AMD Zen 2/3, Intel client cores): the attention's
// dot products and row updates run 8 lanes wide (dot8 / axpy8 below) instead of scalar.
#if !LLMSERVE_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMSERVE_AVX2 1
#else
#define LLMSERVE_AVX2 0
#endif
// Lanes of the vector dot / axpy paths (0: scalar only); head sizes that are a multiple take them.
#define LLMSERVE_VEC_LANES (LLMSERVE_AVX512 ? 16 : LLMSERVE_AVX2 ? 8 : 0)
#if defined(__AVX512BF16__) && LLMSERVE_AVX512
#define LLMSERVE_AVX512BF16 1
#else
#define LLMSERVE_AVX512BF16 0
#endif

// A float32 model's K/V over a float16 / bfloat16 cache (--kv-cache-dtype): the one mixed
// pairing of activations and cache that reshape_and_cache and paged_decode take.
static inline bool narrow_kv(at::ScalarType act, at::ScalarType cache) {
  return act == at::kFloat && (cache == at::kHalf || cache == at::kBFloat16);
}

static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }
static inline float to_f(at::Half x) { return static_cast<float>(x); }

// Round a float to T's precision and back (what storing an intermediate in T does).
template <typename T> static inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }
template <> inline float rnd<float>(float x) { return x; }

#if LLMSERVE_AVX512
// 16 elements -> 16 floats
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 floats -> 16 elements, rounding to nearest even (as c10's conversions do)
static inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void store16(at::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
static inline void store16(at::BFloat16* p, __m512 x) {
#if LLMSERVE_AVX512BF16
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, x);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<at::BFloat16>(tmp[i]);
#endif
}
template <typename T> static inline __m512 rnd16(__m512 x) {
  alignas(64) T tmp[16];
  store16(tmp, x);
  return load16(tmp);
}
template <> inline __m512 rnd16<float>(__m512 x) { return x; }
#if LLMSERVE_AVX512BF16
template <> inline __m512 rnd16<at::BFloat16>(__m512 x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
#endif

#if LLMSERVE_AVX2
// 8 elements -> 8 floats
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8 floats -> 8 elements, rounding to nearest even as c10's conversions do (NaN -> 0x7FC0 in
// bfloat16): a float32 model's K/V into a narrower cache.
static inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
static inline void store8(at::Half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
static inline void store8(at::BFloat16* p, __m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7fff));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  // packus keeps each 128-bit lane's four values twice; 64-bit elements 0 and 2 are the eight.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
static inline float hsum8(__m256 s) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

// dot(q[0:hd], k[0:hd]) with q already float; vec: hd is a multiple of LLMSERVE_VEC_LANES
template <typename T>
static inline float dot(const float* q, const T* k, int64_t hd, bool vec) {
#if LLMSERVE_AVX512
  if (vec) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), s);
    return _mm512_reduce_add_ps(s);
  }
#elif LLMSERVE_AVX2
  if (vec) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), s);
    return hsum8(s);
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < hd; ++d) s += q[d] * to_f(k[d]);
  return s;
}

// acc[0:hd] += w * v[0:hd]
template <typename T>
static inline void axpy(float* acc, float w, const T* v, int64_t hd, bool vec) {
#if LLMSERVE_AVX512
  if (vec) {
    const __m512 ww = _mm512_set1_ps(w);
    for (int64_t d = 0; d < hd; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(ww, load16(v + d), _mm512_loadu_ps(acc + d)));
    return;
  }
#elif LLMSERVE_AVX2
  if (vec) {
    const __m256 ww = _mm256_set1_ps(w);
    for (int64_t d = 0; d < hd; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(ww, load8(v + d), _mm256_loadu_ps(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < hd; ++d) acc[d] += w * to_f(v[d]);
}

// 2^f for |f| <= 0.5: degree-7 Taylor coefficients, highest first (pow2_512, exp256).
static constexpr float kPow2Poly[8] = {1.5252733804059840e-05f, 1.5403530393381608e-04f, 1.3333558146428443e-03f,
                                       9.6181291076284772e-03f, 5.5504108664821580e-02f, 2.4022650695910071e-01f,
                                       6.9314718055994531e-01f, 1.0f};

#if LLMSERVE_AVX512
// 2^t = 2^n * 2^f with n = round(t), |f| <= 0.5, degree-7 Taylor for 2^f (relative error
// < 1e-7 before rounding). t must be >= -126 or so (no denormal handling).
static inline __m512 pow2_512(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kPow2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kPow2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// e^x = 2^(x log2 e); x is clamped below at -87 (the result is then ~1e-38, not 0).
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  return pow2_512(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)));
}

// Lane j of the result = sum of the 16 lanes of v[j] (a transpose-and-add tree: 45 ops for
// 16 horizontal sums instead of 16 separate reductions).
static inline __m512 hsum16x16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

#if LLMSERVE_AVX2
// e^x, 8 lanes: 2^t = 2^n * 2^f as pow2_512 (the same polynomial), 2^n built in the exponent
// bits, so t is clamped to [-126, 127] (x to [-87, 88]: e^x then ~1e-38 or ~1.7e38, not 0 or inf).
static inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kPow2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kPow2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// sc[0:L] = exp(sc - max), returns the sum
static inline float softmax_numerator(float* sc, int64_t L) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if LLMSERVE_AVX512
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= L; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sc + i));
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; i < L; ++i) m = std::max(m, sc[i]);
  float sum = 0.f;
  i = 0;
#if LLMSERVE_AVX512
  const __m512 mm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= L; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + i), mm));
    _mm512_storeu_ps(sc + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif LLMSERVE_AVX2
  const __m256 mm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= L; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mm));
    _mm256_storeu_ps(sc + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; i < L; ++i) { sc[i] = std::exp(sc[i] - m); sum += sc[i]; }
  return sum;
}



#define LLMSERVE_DISPATCH(dtype, NAME, ...)                                       \
  switch (dtype) {                                                                \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }             \
    case at::kBFloat16: { using scalar_t = at::BFloat16; __VA_ARGS__; break; }   \
    case at::kHalf: { using scalar_t = at::Half; __VA_ARGS__; break; }           \
    default: TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);              \
  }
