#include "cpu_types.h"
#include "ops.h"

// dst[0:n] = src[0:n] rounded to nearest even in T (float16 or bfloat16), as torch's .to()
// rounds (a NaN stays a NaN): a float32 model's K/V written into a narrower cache
// (CacheConfig.cache_dtype). Vectorised because it runs for every token of every layer:
// ~11k values a token for SmolLM2, ~0.4 M a 32-row decode step.
template <typename T>
static void narrow_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if LLMSERVE_AVX512
  for (; i + 16 <= n; i += 16) store16(dst + i, _mm512_loadu_ps(src + i));
#elif LLMSERVE_AVX2
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Token t's K and V rows (row elements each) into the cache rows kc / vc, converting from
// float32 when the cache is narrower (S -> T); the same dtype is a plain copy.
template <typename T, typename S>
static inline void write_rows(T* kc, T* vc, const S* k, const S* v, int64_t row) {
  if constexpr (std::is_same<T, S>::value) {
    std::memcpy(kc, k, row * sizeof(T));
    std::memcpy(vc, v, row * sizeof(T));
  } else {
    narrow_row(kc, k, row);
    narrow_row(vc, v, row);
  }
}

template <typename T, typename S>
static void cache_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const int64_t* sp) {
  const int64_t T_ = key.size(0), row = key.size(1) * key.size(2);
  T* kc = static_cast<T*>(kv_cache.data_ptr());
  T* vc = kc + kv_cache.stride(0);
  const S* kp = static_cast<const S*>(key.data_ptr());
  const S* vp = static_cast<const S*>(value.data_ptr());
  for (int64_t t = 0; t < T_; ++t) {
    if (sp[t] < 0) continue;
    write_rows<T, S>(kc + sp[t] * row, vc + sp[t] * row, kp + t * key.stride(0), vp + t * value.stride(0), row);
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
  const bool narrowing = key.scalar_type() == at::kFloat && (kt == at::kHalf || kt == at::kBFloat16);
  TORCH_CHECK(key.scalar_type() == kt || narrowing, "key/value dtype ", key.scalar_type(), " into a ", kt,
              " cache: the same dtype, or float32 into float16/bfloat16");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() >= key.size(0), "slot_mapping: int64 [T]");
  const int64_t nslots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t) TORCH_CHECK(sp[t] < nslots, "reshape_and_cache: slot out of range");
  if (narrowing && kt == at::kHalf) return cache_impl<at::Half, float>(key, value, kv_cache, sp);
  if (narrowing) return cache_impl<at::BFloat16, float>(key, value, kv_cache, sp);
  LLMSERVE_DISPATCH(kt, "reshape_and_cache", cache_impl<scalar_t, scalar_t>(key, value, kv_cache, sp));
}
