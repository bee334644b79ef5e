// 16-lane vectors for the packed-weight kernels (quant_gemv.cpp): 16 float32 lanes (vf), 16
// int32 lanes or 64 bytes (vi), one AVX-512 register each, or two AVX2 registers on CPUs
// without AVX-512 (AMD Zen 2/3, Intel's client cores), so one kernel source serves both. The
// AVX2 side has no VNNI: its integer dot products are VPMADDUBSW (u8 x s8 pairs into int16,
// saturating) then VPMADDWD against ones (int16 pairs into int32), llama.cpp's AVX2 scheme;
// quant_gemv.cpp keeps every int16 sum below 2^15 (see dot_group) so they stay exact.
#pragma once
#include <immintrin.h>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLMS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLMS_AVX512 0
#else
#error "the packed-weight kernels need AVX512-VNNI or AVX2 + FMA + F16C"
#endif

namespace simd16 {

#if LLMS_AVX512
using vf = __m512;
using vi = __m512i;
inline vf zero_f() { return _mm512_setzero_ps(); }
inline vf set1_f(float a) { return _mm512_set1_ps(a); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline vf abs_f(vf a) { return _mm512_abs_ps(a); }
inline vf max_f(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float hmax(vf a) { return _mm512_reduce_max_ps(a); }
inline vf load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, vf a) { _mm512_storeu_ps(p, a); }
// 16 float16 / bfloat16 values (raw 16-bit words) -> float32.
inline vf load_h(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
inline vf load_bf(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}
inline vf load_i8(const int8_t* p) {  // 16 int8 -> float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf to_f(vi a) { return _mm512_cvtepi32_ps(a); }
inline vi to_i_round(vf a) { return _mm512_cvtps_epi32(a); }  // nearest even (the default MXCSR)
inline vi zero_i() { return _mm512_setzero_si512(); }
inline vi set1_i32(int32_t a) { return _mm512_set1_epi32(a); }
inline vi set1_i8(int8_t a) { return _mm512_set1_epi8(a); }
inline vi load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vi add_i32(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi min_i32(vi a, vi b) { return _mm512_min_epi32(a, b); }
inline vi max_i32(vi a, vi b) { return _mm512_max_epi32(a, b); }
inline int32_t hsum_i32(vi a) { return _mm512_reduce_add_epi32(a); }
inline void store_i32_as_i8(int8_t* p, vi a) {  // a's lanes within int8 range
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a));
}
inline vi and_i(vi a, vi b) { return _mm512_and_si512(a, b); }
// Bytes' high nibbles moved down (one GF2P8AFFINEQB where the CPU has GFNI: out bit i = in
// bit i + 4; Cascade Lake has AVX512-VNNI without it: a shift and a mask).
inline vi hi_nibbles(vi b) {
#if defined(__GFNI__)
  return _mm512_gf2p8affine_epi64_epi8(b, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
  return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F));
#endif
}
// v | (h shifted left by s (right by -s) & 0x10 in each byte): one ternary-logic op, 0xF8 = A | (B & C).
template <int S>
inline vi or_bit4(vi v, vi h) {
  const vi sh = S > 0 ? _mm512_slli_epi16(h, S > 0 ? S : 0) : S < 0 ? _mm512_srli_epi16(h, S < 0 ? -S : 0) : h;
  return _mm512_ternarylogic_epi32(v, sh, _mm512_set1_epi8(0x10), 0xF8);
}
// acc + per int32 lane the sum of 4 products u8 (a) x s8 (b), exact (VPDPBUSD).
inline vi dpbusd(vi acc, vi a, vi b) { return _mm512_dpbusd_epi32(acc, a, b); }
#else
struct vf { __m256 lo, hi; };
struct vi { __m256i lo, hi; };
inline vf zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1_f(float a) { const __m256 v = _mm256_set1_ps(a); return {v, v}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf div(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf fnmadd(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf abs_f(vf a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline vf max_f(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float hmax(vf a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_shuffle_ps(r, r, 1));
  return _mm_cvtss_f32(r);
}
inline vf load_f(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store_f(float* p, vf a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline vf load_h(const void* p) {
  const __m128i* q = static_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
inline vf load_bf(const void* p) {
  const __m128i* q = static_cast<const __m128i*>(p);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16))};
}
inline vf load_i8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
inline vf to_f(vi a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline vi to_i_round(vf a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline vi zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi set1_i32(int32_t a) { const __m256i v = _mm256_set1_epi32(a); return {v, v}; }
inline vi set1_i8(int8_t a) { const __m256i v = _mm256_set1_epi8(a); return {v, v}; }
inline vi load_i(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline vi add_i32(vi a, vi b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline vi min_i32(vi a, vi b) { return {_mm256_min_epi32(a.lo, b.lo), _mm256_min_epi32(a.hi, b.hi)}; }
inline vi max_i32(vi a, vi b) { return {_mm256_max_epi32(a.lo, b.lo), _mm256_max_epi32(a.hi, b.hi)}; }
inline int32_t hsum_i32(vi a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i r = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1));
  return _mm_cvtsi128_si32(r);
}
inline void store_i32_as_i8(int8_t* p, vi a) {  // a's lanes within int8 range: packs saturate nothing
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);  // 16 int16 in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
inline vi and_i(vi a, vi b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline vi hi_nibbles(vi b) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), m)};
}
template <int S>
inline __m256i shift16(__m256i h) {
  if constexpr (S > 0) return _mm256_slli_epi16(h, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(h, -S);
  else return h;
}
template <int S>
inline vi or_bit4(vi v, vi h) {
  const __m256i b4 = _mm256_set1_epi8(0x10);
  return {_mm256_or_si256(v.lo, _mm256_and_si256(shift16<S>(h.lo), b4)),
          _mm256_or_si256(v.hi, _mm256_and_si256(shift16<S>(h.hi), b4))};
}
// The AVX2 dot-product pieces (quant_gemv.cpp's dot_group): u8 x s8 pairs into int16
// (saturating beyond +-2^15: the callers' codes keep each sum below), int16 sums, and int16
// pairs into int32 lanes.
inline vi maddubs(vi a, vi b) { return {_mm256_maddubs_epi16(a.lo, b.lo), _mm256_maddubs_epi16(a.hi, b.hi)}; }
inline vi add_i16(vi a, vi b) { return {_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)}; }
inline vi madd_ones(vi a) {
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(a.lo, one), _mm256_madd_epi16(a.hi, one)};
}
// Signed x signed bytes: |a| as unsigned and b with a's signs (VPSIGNB), so that
// maddubs(abs_i8(a), sign_i8(b, a)) = the pairs of a * b (|a| <= 128, |b| <= 127: < 2^15).
inline vi abs_i8(vi a) { return {_mm256_abs_epi8(a.lo), _mm256_abs_epi8(a.hi)}; }
inline vi sign_i8(vi b, vi a) { return {_mm256_sign_epi8(b.lo, a.lo), _mm256_sign_epi8(b.hi, a.hi)}; }
inline vi xor_i(vi a, vi b) { return {_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)}; }
#endif

}  // namespace simd16
