#include "cpu_types.h"
#include "ops.h"

// ---- fused element-wise ops of the Llama layer (vLLM's csrc/cpu ops, numerics of transformers) ----

// Rows of a 2-d [R, H] or 3-d [A, B, H] tensor with a unit last stride.
struct Rows {
  int64_t n, inner, s0, s1;
  explicit Rows(const at::Tensor& t) {
    TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1, "need a 2-d or 3-d tensor with unit last stride");
    if (t.dim() == 2) { n = t.size(0); inner = 1; s0 = t.stride(0); s1 = 0; }
    else { n = t.size(0) * t.size(1); inner = t.size(1); s0 = t.stride(0); s1 = t.stride(1); }
  }
  int64_t off(int64_t r) const { return inner == 1 ? r * s0 : (r / inner) * s0 + (r % inner) * s1; }
};

template <typename T>
static void rms_norm_row(T* out, const T* x, const T* w, int64_t H, float eps) {
  float ss = 0.f;
  int64_t d = 0;
#if LLMSERVE_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= H; d += 16) { const __m512 v = load16(x + d); acc = _mm512_fmadd_ps(v, v, acc); }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; d < H; ++d) { const float v = to_f(x[d]); ss += v * v; }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  d = 0;
#if LLMSERVE_AVX512
  const __m512 vi = _mm512_set1_ps(inv);
  for (; d + 16 <= H; d += 16)
    store16(out + d, _mm512_mul_ps(load16(w + d), rnd16<T>(_mm512_mul_ps(load16(x + d), vi))));
#endif
  for (; d < H; ++d) out[d] = static_cast<T>(to_f(w[d]) * rnd<T>(to_f(x[d]) * inv));
}

// out = weight * dtype(x * rsqrt(mean(x^2) + eps)) in float32, per row (transformers' LlamaRMSNorm).
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: out/x/weight shapes or dtypes differ");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(-1), "rms_norm: weight [hidden]");
  const Rows rx(x), ro(out);
  const int64_t H = x.size(-1);
  LLMSERVE_DISPATCH(x.scalar_type(), "rms_norm", {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rx.n, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_norm_row(op + ro.off(r), xp + rx.off(r), wp, H, static_cast<float>(eps));
    });
  });
}

// residual = dtype(x + residual) (in place), then out = rms_norm(residual) (vLLM's fused_add_rms_norm).
void fused_add_rms_norm(at::Tensor out, at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && out.is_contiguous(),
              "fused_add_rms_norm: contiguous 2-d tensors");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.sizes() == out.sizes() && weight.numel() == x.size(1),
              "fused_add_rms_norm: shapes differ");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type() &&
              weight.scalar_type() == x.scalar_type(), "fused_add_rms_norm: dtypes differ");
  const int64_t R = x.size(0), H = x.size(1);
  LLMSERVE_DISPATCH(x.scalar_type(), "fused_add_rms_norm", {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, R, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* res = rp + r * H;
        const scalar_t* xr = xp + r * H;
        int64_t d = 0;
#if LLMSERVE_AVX512
        for (; d + 16 <= H; d += 16) store16(res + d, _mm512_add_ps(load16(xr + d), load16(res + d)));
#endif
        for (; d < H; ++d) res[d] = static_cast<scalar_t>(to_f(xr[d]) + to_f(res[d]));
        rms_norm_row(op + r * H, res, wp, H, static_cast<float>(eps));
      }
    });
  });
}

// out = dtype(silu(gate)) * up for gate_up = [gate | up] ([T, 2I] -> [T, I]); transformers
// computes act_fn(gate_proj(x)) * up_proj(x), each op rounding to the model dtype.
void silu_and_mul(at::Tensor out, at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && out.is_contiguous() &&
              out.size(0) == gate_up.size(0) && 2 * out.size(1) == gate_up.size(1) &&
              out.scalar_type() == gate_up.scalar_type(), "silu_and_mul: out [T, I], gate_up [T, 2I]");
  const int64_t T = gate_up.size(0), I = out.size(1), s0 = gate_up.stride(0);
  LLMSERVE_DISPATCH(out.scalar_type(), "silu_and_mul", {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* g = gp + t * s0;
        const scalar_t* u = g + I;
        scalar_t* o = op + t * I;
        int64_t d = 0;
#if LLMSERVE_AVX512
        const __m512 one = _mm512_set1_ps(1.f);
        for (; d + 16 <= I; d += 16) {
          const __m512 x = load16(g + d);
          const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
          store16(o + d, _mm512_mul_ps(rnd16<scalar_t>(s), load16(u + d)));
        }
#elif LLMSERVE_AVX2
        if constexpr (std::is_same<scalar_t, float>::value) {  // float32 activations (dtype auto here)
          // (casts: the macro's scalar_t is no template parameter, so the branch must compile for all)
          const float* gf = reinterpret_cast<const float*>(g);
          const float* uf = reinterpret_cast<const float*>(u);
          float* of = reinterpret_cast<float*>(o);
          const __m256 one = _mm256_set1_ps(1.f);
          for (; d + 8 <= I; d += 8) {
            const __m256 x = _mm256_loadu_ps(gf + d);
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            _mm256_storeu_ps(of + d, _mm256_mul_ps(s, _mm256_loadu_ps(uf + d)));
          }
        }
#endif
        for (; d < I; ++d) {
          const float x = to_f(g[d]);
          o[d] = static_cast<scalar_t>(rnd<scalar_t>(x / (1.f + std::exp(-x))) * to_f(u[d]));
        }
      }
    });
  });
}

// In-place GPT-NeoX ("rotate half") rotary embedding of x [T, heads, head_dim] at positions
// [T] (int64), from float32 cos/sin tables [P, head_dim / 2]. As transformers in the model
// dtype: cos/sin rounded to it, out = x * cos + rotate_half(x) * sin with each product and the
// sum rounded.
void rotary_embedding(at::Tensor positions, at::Tensor x, at::Tensor cos_cache, at::Tensor sin_cache) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_embedding: x [T, heads, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "rotary_embedding: positions int64 [T]");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
              cos_cache.is_contiguous() && sin_cache.is_contiguous() && 2 * cos_cache.size(1) == x.size(2),
              "rotary_embedding: float32 cos/sin [P, head_dim/2]");
  const int64_t T = x.size(0), H = x.size(1), half = x.size(2) / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1), P = cos_cache.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < P, "rotary_embedding: position out of range");
  const float* cp = cos_cache.data_ptr<float>();
  const float* sp = sin_cache.data_ptr<float>();
  LLMSERVE_DISPATCH(x.scalar_type(), "rotary_embedding", {
    scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      std::vector<float> cr(half), sr(half);
      for (int64_t t = b; t < e; ++t) {
        const float* c = cp + pp[t] * half;
        const float* s = sp + pp[t] * half;
        for (int64_t d = 0; d < half; ++d) { cr[d] = rnd<scalar_t>(c[d]); sr[d] = rnd<scalar_t>(s[d]); }
        for (int64_t h = 0; h < H; ++h) {
          scalar_t* x1 = xp + t * s0 + h * s1;
          scalar_t* x2 = x1 + half;
          int64_t d = 0;
#if LLMSERVE_AVX512
          for (; d + 16 <= half; d += 16) {
            const __m512 a = load16(x1 + d), bb = load16(x2 + d);
            const __m512 cc = _mm512_loadu_ps(cr.data() + d), ss = _mm512_loadu_ps(sr.data() + d);
            const __m512 o1 = _mm512_sub_ps(rnd16<scalar_t>(_mm512_mul_ps(a, cc)), rnd16<scalar_t>(_mm512_mul_ps(bb, ss)));
            const __m512 o2 = _mm512_add_ps(rnd16<scalar_t>(_mm512_mul_ps(bb, cc)), rnd16<scalar_t>(_mm512_mul_ps(a, ss)));
            store16(x1 + d, o1);
            store16(x2 + d, o2);
          }
#endif
          for (; d < half; ++d) {
            const float a = to_f(x1[d]), bb = to_f(x2[d]);
            const float o1 = rnd<scalar_t>(a * cr[d]) - rnd<scalar_t>(bb * sr[d]);
            const float o2 = rnd<scalar_t>(bb * cr[d]) + rnd<scalar_t>(a * sr[d]);
            x1[d] = static_cast<scalar_t>(o1);
            x2[d] = static_cast<scalar_t>(o2);
          }
        }
      }
    });
  });
}

// out [R, C] float32 <- x [R, C] (any float dtype, unit last stride); torch's own conversion
// runs at a fraction of memory speed for the [num_seqs, vocab] logits.
void to_float(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && x.dim() == 2 && x.stride(1) == 1 &&
              out.sizes() == x.sizes(), "to_float: out float32 [R, C] contiguous, x [R, C]");
  const int64_t R = x.size(0), C = x.size(1), s0 = x.stride(0);
  float* op = out.data_ptr<float>();
  LLMSERVE_DISPATCH(x.scalar_type(), "to_float", {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* xr = xp + r * s0;
        float* o = op + r * C;
        int64_t d = 0;
#if LLMSERVE_AVX512
        for (; d + 16 <= C; d += 16) _mm512_storeu_ps(o + d, load16(xr + d));
#endif
        for (; d < C; ++d) o[d] = to_f(xr[d]);
      }
    });
  });
}
