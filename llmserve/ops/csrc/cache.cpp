#include "cpu_types.h"
#include "ops.h"

// dst[0:n] = src[0:n] rounded to nearest even in T (float16 or bfloat16), as torch's .to()
// rounds (a NaN stays a NaN): a float32 model's K/V written into a narrower cache
// (CacheConfig.cache_dtype). Vectorised because it runs for every token of every layer:
// ~11k values a token for SmolLM2, ~0.4 M a 32-row decode step.
#if LLMSERVE_AVX512
// torch's float32 -> bfloat16 on the bits (round to nearest even, NaN -> 0x7FC0), not
// store16's VCVTNEPS2BF16: that instruction treats denormal inputs as zero, so on AVX512-BF16
// CPUs a K/V value of 1e-40 was cached as 0 where torch keeps the bfloat16 denormal (a CI
// rehearsal on Zen 4 caught it; the AVX2 path, store8, was already exact).
static inline void narrow16(at::BFloat16* p, __m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
static inline void narrow16(at::Half* p, __m512 x) { store16(p, x); }
#endif

template <typename T>
static void narrow_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if LLMSERVE_AVX512
  for (; i + 16 <= n; i += 16) narrow16(dst + i, _mm512_loadu_ps(src + i));
#elif LLMSERVE_AVX2
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// float32 K/V rows into a float16 / bfloat16 cache (T) at their slots (negative: skipped).
template <typename T>
static void narrow_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const int64_t* sp) {
  const int64_t row = key.size(1) * key.size(2);
  T* kc = static_cast<T*>(kv_cache.data_ptr());
  T* vc = kc + kv_cache.stride(0);
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  for (int64_t t = 0; t < key.size(0); ++t) {
    if (sp[t] < 0) continue;
    narrow_row(kc + sp[t] * row, kp + t * key.stride(0), row);
    narrow_row(vc + sp[t] * row, vp + t * value.stride(0), row);
  }
}

// kv_cache[0 / 1] flat slot slot_mapping[t] <- key / value [T, num_kv_heads, head_dim] (vLLM's
// reshape_and_cache); negative slots are skipped. key/value are in the cache's dtype, or
// float32 into a float16 / bfloat16 cache (rounded to nearest even).
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache: contiguous 5-d");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.sizes() == value.sizes(), "key/value [T, kv_heads, head_dim]");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4), "key/value head shape != cache");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "key/value rows must be contiguous");
  const auto kt = kv_cache.scalar_type();
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value dtypes differ");
  const bool narrowing = narrow_kv(key.scalar_type(), kt);
  TORCH_CHECK(key.scalar_type() == kt || narrowing, "key/value dtype ", key.scalar_type(), " into a ", kt,
              " cache: the same dtype, or float32 into float16/bfloat16");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() >= key.size(0), "slot_mapping: int64 [T]");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  const int64_t nslots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] < nslots, "reshape_and_cache: slot out of range");
  if (narrowing) {
    if (kt == at::kHalf) narrow_rows<at::Half>(key, value, kv_cache, sp);
    else narrow_rows<at::BFloat16>(key, value, kv_cache, sp);
    return;
  }
  const int64_t bytes = row * key.element_size();
  char* kc = static_cast<char*>(kv_cache.data_ptr());
  char* vc = kc + kv_cache.stride(0) * kv_cache.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < T; ++t) {
    if (sp[t] < 0) continue;
    std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
    std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
  }
}
