#include "cpu_types.h"
#include "ops.h"

// kv_cache[0 / 1] flat slot slot_mapping[t] <- key / value [T, num_kv_heads, head_dim] (vLLM's
// reshape_and_cache); negative slots are skipped.
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache: contiguous 5-d");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.sizes() == value.sizes(), "key/value [T, kv_heads, head_dim]");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4), "key/value head shape != cache");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "key/value rows must be contiguous");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(), "dtype != cache dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() >= key.size(0), "slot_mapping: int64 [T]");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  const int64_t nslots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] < nslots, "reshape_and_cache: slot out of range");
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
