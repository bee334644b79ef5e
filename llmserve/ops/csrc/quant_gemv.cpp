// Small-step linear layers on GGUF-packed weights (Q4_0, Q4_1, Q8_0 blocks of 32 kept as
// the file stores them), for steps of few tokens, where a bf16 GEMM is bound by reading
// its weights: a Q4_1 row is 20 bytes per 32 weights instead of 64.
//
// Each weight block is dequantized exactly as gguf.quants does (float32: Q4_0 d*(q-8),
// Q4_1 d*q+m as a product then a sum, Q8_0 d*q, d and m from float16) into registers and
// multiplied with the float32 activations, once per block for up to 4 tokens; the row sum
// is float32. Rows are independent of each other and of the number of tokens (a token's
// result does not change with the batch). Built as its own extension (ops/quant_ops.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QK = 32;
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml type ids

int64_t block_bytes(int64_t qt) {
  switch (qt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
  }
  TORCH_CHECK(false, "quant_linear: unsupported GGML type ", qt, " (Q4_0=2, Q4_1=3, Q8_0=8)");
}

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One block -> weights 0..15 (lo) and 16..31 (hi) as float32.
template <int64_t QT>
inline void dequant(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(h2f(b));
  if constexpr (QT == Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
  } else {
    const uint8_t* qs = b + (QT == Q4_1 ? 4 : 2);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512i ql = _mm512_cvtepu8_epi32(_mm_and_si128(q, mask));
    __m512i qh = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask));
    if constexpr (QT == Q4_0) {
      const __m512i eight = _mm512_set1_epi32(8);
      lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ql, eight)));
      hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(qh, eight)));
    } else {
      const __m512 m = _mm512_set1_ps(h2f(b + 2));
      lo = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(ql)), m);
      hi = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(qh)), m);
    }
  }
}

// out[m, n] for rows n in [n0, n1) and up to 4 tokens starting at x (float32, stride K).
template <int64_t QT, int MT>
void rows_tile(const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t n0, int64_t n1,
               float* out, int64_t N) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 lo, hi;
      dequant<QT>(row + b * (row_bytes / nb), lo, hi);
      for (int t = 0; t < MT; ++t) {
        const float* xb = x + t * K + b * QK;
        acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[t]);
        acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[t]);
      }
    }
    for (int t = 0; t < MT; ++t) out[t * N + n] = _mm512_reduce_add_ps(acc[t]);
  }
}

#if defined(__AVX512BF16__)
// bfloat16 activations: the block's 32 integer codes become exact bfloat16 values (a
// 16-entry table for the nibbles; Q8_0 through float32) and meet x in one bf16 dot
// product (float32 sums of exact products), then the block scale: sum d*q*x = d * sum q*x.
// Q4_1's offset adds m * sum(x of the block), from per-token block sums made once.
template <int64_t QT>
inline __m512i codes_bf16(const uint8_t* b) {
  if constexpr (QT == Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else {
    // bf16 bit patterns of 0..15 (Q4_1) or -8..7 (Q4_0), repeated to fill 32 words.
    alignas(64) static const uint16_t kLut[2][32] = {
        {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130,
         0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
         0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170},
        {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040,
         0x4080, 0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
         0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0}};
    const __m512i lut = _mm512_load_si512(kLut[QT == Q4_0 ? 1 : 0]);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(both), lut);
  }
}

template <int64_t QT, int MT>
void rows_tile_bf16(const uint8_t* w, int64_t row_bytes, const at::BFloat16* x, const float* xsum, int64_t K,
                    int64_t n0, int64_t n1, float* out, int64_t N) {
  const int64_t nb = K / QK, bb = row_bytes / nb;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[MT];
    float off[MT];
    for (int t = 0; t < MT; ++t) { acc[t] = _mm512_setzero_ps(); off[t] = 0.f; }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * bb;
      const __m512bh q = (__m512bh)codes_bf16<QT>(blk);
      const __m512 d = _mm512_set1_ps(h2f(blk));
      for (int t = 0; t < MT; ++t) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * K + b * QK);
        acc[t] = _mm512_fmadd_ps(d, _mm512_dpbf16_ps(_mm512_setzero_ps(), q, xv), acc[t]);
        if constexpr (QT == Q4_1) off[t] += h2f(blk + 2) * xsum[t * nb + b];
      }
    }
    for (int t = 0; t < MT; ++t) out[t * N + n] = _mm512_reduce_add_ps(acc[t]) + off[t];
  }
}

template <int64_t QT>
void run_bf16(const uint8_t* w, int64_t row_bytes, const at::BFloat16* x, int64_t M, int64_t K, int64_t N,
              float* out) {
  const int64_t nb = K / QK;
  std::vector<float> xsum(QT == Q4_1 ? M * nb : 0);
  if (QT == Q4_1)
    for (int64_t i = 0; i < M * nb; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < QK; ++j) s += static_cast<float>(x[i * QK + j]);
      xsum[i] = s;
    }
  const float* xs = xsum.data();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      rows_tile_bf16<QT, 4>(w, row_bytes, x + m * K, xs + m * nb, K, n0, n1, out + m * N, N);
    switch (M - m) {
      case 3: rows_tile_bf16<QT, 3>(w, row_bytes, x + m * K, xs + m * nb, K, n0, n1, out + m * N, N); break;
      case 2: rows_tile_bf16<QT, 2>(w, row_bytes, x + m * K, xs + m * nb, K, n0, n1, out + m * N, N); break;
      case 1: rows_tile_bf16<QT, 1>(w, row_bytes, x + m * K, xs + m * nb, K, n0, n1, out + m * N, N); break;
      default: break;
    }
  });
}
#endif

template <int64_t QT>
void run(const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K, int64_t N, float* out) {
  // Enough rows per task to amortise the thread hand-off, few enough to split N over threads.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows_tile<QT, 4>(w, row_bytes, x + m * K, K, n0, n1, out + m * N, N);
    switch (M - m) {
      case 3: rows_tile<QT, 3>(w, row_bytes, x + m * K, K, n0, n1, out + m * N, N); break;
      case 2: rows_tile<QT, 2>(w, row_bytes, x + m * K, K, n0, n1, out + m * N, N); break;
      case 1: rows_tile<QT, 1>(w, row_bytes, x + m * K, K, n0, n1, out + m * N, N); break;
      default: break;
    }
  });
}

}  // namespace

// out [M, N] = x [M, K] @ dequant(w).T, w: uint8 [N, K / 32 * block_bytes(qtype)].
// x: float32, bfloat16 or float16; out in x's dtype (rounded to nearest even from the
// float32 sums), or float32 with out_float.
at::Tensor quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, bool out_float) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear: x [M, K], w uint8 [N, row_bytes] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * bb, "quant_linear: K=", K, " does not fit w ", w.sizes());
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t rb = w.size(1);
  const bool keep = out_float || x.scalar_type() == at::kFloat;
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    at::Tensor xc = x.contiguous();
    const at::BFloat16* xb = xc.data_ptr<at::BFloat16>();
    switch (qtype) {
      case Q4_0: run_bf16<Q4_0>(wp, rb, xb, M, K, N, op); break;
      case Q4_1: run_bf16<Q4_1>(wp, rb, xb, M, K, N, op); break;
      case Q8_0: run_bf16<Q8_0>(wp, rb, xb, M, K, N, op); break;
    }
    return keep ? out : out.to(x.scalar_type());
  }
#endif
  at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  switch (qtype) {
    case Q4_0: run<Q4_0>(wp, rb, xp, M, K, N, op); break;
    case Q4_1: run<Q4_1>(wp, rb, xp, M, K, N, op); break;
    case Q8_0: run<Q8_0>(wp, rb, xp, M, K, N, op); break;
  }
  return keep ? out : out.to(x.scalar_type());
}

// Exact float32 dequantization of packed rows (for the tests and for rebuilding weights).
at::Tensor quant_dequantize(at::Tensor w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "quant_dequantize: w uint8 [N, row_bytes]");
  const int64_t bb = block_bytes(qtype), N = w.size(0), nb = w.size(1) / bb;
  at::Tensor out = at::empty({N, nb * QK}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * nb, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      __m512 lo, hi;
      const uint8_t* blk = wp + b * bb;
      if (qtype == Q4_0) dequant<Q4_0>(blk, lo, hi);
      else if (qtype == Q4_1) dequant<Q4_1>(blk, lo, hi);
      else dequant<Q8_0>(blk, lo, hi);
      _mm512_storeu_ps(op + b * QK, lo);
      _mm512_storeu_ps(op + b * QK + 16, hi);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "x [M, K] @ dequant(w [N, K/32*bb]).T -> [M, N]", py::arg("x"),
        py::arg("w"), py::arg("qtype"), py::arg("out_float") = false);
  m.def("quant_dequantize", &quant_dequantize, "packed GGUF rows -> float32 [N, K]");
}
