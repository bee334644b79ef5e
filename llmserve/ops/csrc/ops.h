// Declarations of the llmserve CPU ops (bound to Python in bindings.cpp; documented in
// llmserve/ops/cpu_ops.py). All write their outputs in place.
#pragma once
#include <ATen/core/Tensor.h>

void paged_decode(at::Tensor out, at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                  at::Tensor seq_lens, int64_t n, double scale, int64_t window, double softcap);
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor out, at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void silu_and_mul(at::Tensor out, at::Tensor gate_up);
void rotary_embedding(at::Tensor positions, at::Tensor x, at::Tensor cos_cache, at::Tensor sin_cache);
void to_float(at::Tensor out, at::Tensor x);
void sample_inverse_cdf(at::Tensor out, at::Tensor x, at::Tensor k, at::Tensor u);
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows, at::Tensor bm_rows);
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache, at::Tensor slot_mapping);
