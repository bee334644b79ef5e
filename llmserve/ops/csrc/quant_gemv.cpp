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
// x and out: float32, bfloat16 or float16 (out rounded to nearest even from float32).
at::Tensor quant_linear(at::Tensor x, at::Tensor w, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear: x [M, K], w uint8 [N, row_bytes] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * bb, "quant_linear: K=", K, " does not fit w ", w.sizes());
  at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rb = w.size(1);
  switch (qtype) {
    case Q4_0: run<Q4_0>(wp, rb, xp, M, K, N, op); break;
    case Q4_1: run<Q4_1>(wp, rb, xp, M, K, N, op); break;
    case Q8_0: run<Q8_0>(wp, rb, xp, M, K, N, op); break;
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
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
  m.def("quant_linear", &quant_linear, "x [M, K] @ dequant(w [N, K/32*bb]).T -> [M, N]");
  m.def("quant_dequantize", &quant_dequantize, "packed GGUF rows -> float32 [N, K]");
}
