#include "cpu_types.h"
#include "ops.h"

// ---- sampling ----

#if LLMSERVE_AVX512
// 2^t for t <= 0 (pow2_512), exactly 0 below -125 (so masked -inf logits
// can never be drawn).
static inline __m512 exp2_nonpos(__m512 t) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(~tiny, pow2_512(_mm512_max_ps(t, _mm512_set1_ps(-125.0f))));
}
#endif

static inline float exp2_scalar(float t) { return t < -125.0f ? 0.0f : std::exp2(t); }

// out[r] <- a token drawn with probability proportional to 2^((x[r, i] - max) * k[r])
// (k = log2(e) / temperature, i.e. softmax(x / T)) by the inverse CDF at u[r] in [0, 1):
// one pass over the row keeps each 64-wide chunk's max and its sum relative to that max;
// the chunk is picked on the rescaled cumulative chunk sums, then the token inside it.
// -inf logits get weight 0. Rows run in parallel; each row's result depends only on that
// row (same token alone or in any batch).
void sample_inverse_cdf(at::Tensor out, at::Tensor x, at::Tensor k, at::Tensor u) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: float32 [n, V] contiguous");
  const int64_t n = x.size(0), V = x.size(1);
  TORCH_CHECK(k.scalar_type() == at::kFloat && k.is_contiguous() && k.numel() == n, "k: float32 [n]");
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.is_contiguous() && u.numel() == n, "u: float32 [n]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == n, "out: int64 [n]");
  TORCH_CHECK(V > 0, "empty vocabulary");
  constexpr int64_t CH = 64;
  const int64_t nch = (V + CH - 1) / CH;
  const float* xp = x.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    std::vector<float> cmax(nch), csum(nch);
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xp + r * V;
      const float kr = kp[r];
      float rowmax = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < nch; ++c) {
        const int64_t lo = c * CH, hi = std::min<int64_t>(V, lo + CH);
        float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
#if LLMSERVE_AVX512
        if (hi - lo == CH) {
          const __m512 a = _mm512_loadu_ps(xr + lo), bb = _mm512_loadu_ps(xr + lo + 16);
          const __m512 cc = _mm512_loadu_ps(xr + lo + 32), d = _mm512_loadu_ps(xr + lo + 48);
          m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, bb), _mm512_max_ps(cc, d)));
          if (m != -std::numeric_limits<float>::infinity()) {
            const __m512 mm = _mm512_set1_ps(m), kk = _mm512_set1_ps(kr);
            __m512 acc = exp2_nonpos(_mm512_mul_ps(_mm512_sub_ps(a, mm), kk));
            acc = _mm512_add_ps(acc, exp2_nonpos(_mm512_mul_ps(_mm512_sub_ps(bb, mm), kk)));
            acc = _mm512_add_ps(acc, exp2_nonpos(_mm512_mul_ps(_mm512_sub_ps(cc, mm), kk)));
            acc = _mm512_add_ps(acc, exp2_nonpos(_mm512_mul_ps(_mm512_sub_ps(d, mm), kk)));
            sum = _mm512_reduce_add_ps(acc);
          }
        } else
#endif
        {
          for (int64_t i = lo; i < hi; ++i) m = std::max(m, xr[i]);
          if (m != -std::numeric_limits<float>::infinity())
            for (int64_t i = lo; i < hi; ++i) sum += exp2_scalar((xr[i] - m) * kr);
        }
        cmax[c] = m;
        csum[c] = sum;
        rowmax = std::max(rowmax, m);
      }
      // Chunk weights relative to the row max, cumulated.
      double total = 0.0;
      int64_t last = 0;
      for (int64_t c = 0; c < nch; ++c) {
        const float w = cmax[c] == -std::numeric_limits<float>::infinity()
                            ? 0.f : csum[c] * exp2_scalar((cmax[c] - rowmax) * kr);
        csum[c] = w;
        if (w > 0.f) last = c;
        total += w;
      }
      const double target = static_cast<double>(up[r]) * total;
      double before = 0.0;
      int64_t c = 0;
      for (; c < last; ++c) {
        if (before + csum[c] > target) break;
        before += csum[c];
      }
      // Inside chunk c: weights relative to the chunk max, target rescaled to match.
      const int64_t lo = c * CH, hi = std::min<int64_t>(V, lo + CH);
      const float scale = exp2_scalar((cmax[c] - rowmax) * kr);
      const double t_in = scale > 0.f ? (target - before) / scale : 0.0;
      double cum = 0.0;
      int64_t pick = -1, last_pos = lo;
      for (int64_t i = lo; i < hi; ++i) {
        const float w = xr[i] == -std::numeric_limits<float>::infinity() ? 0.f : exp2_scalar((xr[i] - cmax[c]) * kr);
        if (w > 0.f) last_pos = i;
        cum += w;
        if (pick < 0 && w > 0.f && cum > t_in) pick = i;
      }
      op[r] = pick < 0 ? last_pos : pick;
    }
  });
}

// ---- grammar bitmask ----

// One logits row: every token t < V whose bit (t % 32 of word t / 32) is clear gets the
// value `neg` (the -inf bit pattern of the row's dtype, stored as a raw integer so the
// all-forbidden and partial words compile to plain vector stores).
template <typename Raw>
static void mask_row(Raw* row, const int32_t* words, int64_t V, Raw neg) {
  const int64_t W = (V + 31) / 32;
  for (int64_t w = 0; w < W; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xffffffffu) continue;
    Raw* p = row + w * 32;
    const int64_t n = std::min<int64_t>(32, V - w * 32);
    for (int64_t b = 0; b < n; ++b) p[b] = ((word >> b) & 1u) ? p[b] : neg;
  }
}

// logits[rows[i], t] <- -inf for the tokens t < min(V, 32 * W) that bitmask[bm_rows[i]]
// forbids (xgrammar's layout: int32 [R, W], bit set = allowed). Other rows and columns are
// untouched. Replaces xgrammar's CPU kernel, which tests bits one at a time (4.8 ms for 32
// rows of SmolLM2's 49152 tokens, ~10% of a 32-stream decode step; this: ~0.2 ms).
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows, at::Tensor bm_rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits: [N, V] with unit column stride");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask: int32 [R, W] contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && bm_rows.scalar_type() == at::kLong && rows.is_contiguous() &&
              bm_rows.is_contiguous() && rows.numel() == bm_rows.numel(), "rows, bm_rows: int64 [K]");
  const int64_t N = logits.size(0), R = bitmask.size(0), W = bitmask.size(1), K = rows.numel();
  const int64_t V = std::min<int64_t>(logits.size(1), 32 * W), stride = logits.stride(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* bp = bm_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < K; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < N && bp[i] >= 0 && bp[i] < R, "row index out of range");
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "logits: float32, bfloat16 or float16");
  void* base = logits.data_ptr();
  at::parallel_for(0, K, 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int32_t* wr = words + bp[i] * W;
      if (dtype == at::kFloat)
        mask_row(static_cast<uint32_t*>(base) + rp[i] * stride, wr, V, uint32_t{0xff800000u});
      else
        mask_row(static_cast<uint16_t*>(base) + rp[i] * stride, wr, V,
                 static_cast<uint16_t>(dtype == at::kBFloat16 ? 0xff80u : 0xfc00u));
    }
  });
}
