// Paged-decode attention over the block pool, read in place (vLLM's paged_attention_v1 idea, on CPU).
#include "cpu_types.h"
#include "ops.h"

#include <atomic>

// Token position -> (block, offset) in a paged table. Block sizes are powers of two in
// practice (16 by default): shifts and masks then replace two 64-bit divisions per K/V row,
// which otherwise cost more than the attention arithmetic itself on short contexts.
struct BlockPos {
  int64_t bs, mask;
  int shift;
  explicit BlockPos(int64_t b) : bs(b), mask(b - 1), shift(-1) {
    if (b > 0 && (b & (b - 1)) == 0) { shift = 0; while ((int64_t{1} << shift) < b) ++shift; }
  }
  inline int64_t blk(int64_t p) const { return shift >= 0 ? p >> shift : p / bs; }
  inline int64_t off(int64_t p) const { return shift >= 0 ? p & mask : p % bs; }
};

// Gemma 2's attention logit soft-capping (cap * tanh(s / cap)) on a head's L scaled scores,
// before the softmax as transformers' eager_attention_forward; cap <= 0 leaves them as they are.
static inline void soft_cap(float* sc, int64_t L, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < L; ++i) sc[i] = cap * std::tanh(sc[i] * inv);
}

#if LLMSERVE_AVX512BF16
// bf16 decode of one request, all KV heads: K.q with the AVX512-BF16 dot-product instruction
// (bf16 x bf16 products are exact in float32, sums in float32), 16 keys per horizontal-sum
// tree; P.V with up to three query heads' accumulators in registers. Both passes walk the
// context 16 tokens at a time in memory order (a token's row holds every KV head); before
// each chunk, prefetch_next() asks for a chunk a few steps ahead in the task's stream, so the
// scattered blocks arrive from memory while this one is computed. NV = head_dim / 16.
// acc[h][0:16*NV] += sum_j p[h][j] * V_j for GB query heads over cnt rows (V_j = rows[j] + off).
template <int NV, int GB>
static inline void pv_chunk(float* acc, const float* p, int64_t p_stride, const at::BFloat16* const* rows,
                            int64_t off, int64_t cnt) {
  __m512 a[GB][NV];
  for (int h = 0; h < GB; ++h)
    for (int c = 0; c < NV; ++c) a[h][c] = _mm512_loadu_ps(acc + h * NV * 16 + c * 16);
  for (int64_t j = 0; j < cnt; ++j) {
    const at::BFloat16* row = rows[j] + off;
    __m512 w[GB];
    for (int h = 0; h < GB; ++h) w[h] = _mm512_set1_ps(p[h * p_stride + j]);
    for (int c = 0; c < NV; ++c) {
      const __m512 v = load16(row + c * 16);
      for (int h = 0; h < GB; ++h) a[h][c] = _mm512_fmadd_ps(w[h], v, a[h][c]);
    }
  }
  for (int h = 0; h < GB; ++h)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + h * NV * 16 + c * 16, a[h][c]);
}

// P.V on the AVX512-BF16 dot product, two keys per instruction: rows j and j+1 are
// interleaved 16 bits at a time (unpacklo/hi within 128-bit lanes), so each float lane holds
// a (v_j[d], v_j+1[d]) pair, and the pair (p_j, p_j+1) of every head is broadcast; P is
// rounded to bf16 first, as the bf16 SDPA kernels do before their P.V GEMM. acc keeps the
// lane order of the unpack (see unpermute_pairs). pb: GB heads x 16 bf16 probabilities of
// this chunk, zero past cnt.
template <int NV, int GB>
static inline void pv_pairs(float* acc, const uint16_t* pb, const at::BFloat16* const* rows, int64_t off,
                            int64_t cnt) {
  __m512 a[GB][NV];
  for (int h = 0; h < GB; ++h)
    for (int c = 0; c < NV; ++c) a[h][c] = _mm512_loadu_ps(acc + h * NV * 16 + c * 16);
  for (int64_t j = 0; j < cnt; j += 2) {
    const at::BFloat16* r0 = rows[j] + off;
    const at::BFloat16* r1 = (j + 1 < cnt ? rows[j + 1] : rows[j]) + off;
    __m512i pp[GB];
    for (int h = 0; h < GB; ++h) {
      int32_t pair;
      std::memcpy(&pair, pb + h * 16 + j, sizeof(pair));
      pp[h] = _mm512_set1_epi32(pair);
    }
    for (int c2 = 0; c2 < NV / 2; ++c2) {
      const __m512i x = _mm512_loadu_si512(r0 + c2 * 32), y = _mm512_loadu_si512(r1 + c2 * 32);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int h = 0; h < GB; ++h) {
        a[h][2 * c2] = _mm512_dpbf16_ps(a[h][2 * c2], lo, (__m512bh)pp[h]);
        a[h][2 * c2 + 1] = _mm512_dpbf16_ps(a[h][2 * c2 + 1], hi, (__m512bh)pp[h]);
      }
    }
  }
  for (int h = 0; h < GB; ++h)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + h * NV * 16 + c * 16, a[h][c]);
}

// acc of one head in pv_pairs' lane order -> natural order: in the 32 dims of pair c2, lane
// 4k+t of vector 2*c2 holds dim 8k+t and of vector 2*c2+1 dim 8k+4+t.
template <int NV>
static inline void unpermute_pairs(const float* acc, __m512* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c2 = 0; c2 < NV / 2; ++c2) {
    const __m512 x = _mm512_loadu_ps(acc + 32 * c2), y = _mm512_loadu_ps(acc + 32 * c2 + 16);
    out[2 * c2] = _mm512_permutex2var_ps(x, first, y);
    out[2 * c2 + 1] = _mm512_permutex2var_ps(x, second, y);
  }
}

// Lane j = scale * (q . k_j) for one query head q (bf16 [NV * 16]) and the chunk's 16 keys
// (rows[j] + off): products exact in float32 (AVX512-BF16), each key's 16 lane partials
// summed by hsum16x16. Decode rows and prompt tiles both take their scores from here, so
// a token's scores do not depend on how its step was cut.
template <int NV>
static inline __m512 chunk_scores(const at::BFloat16* q, const at::BFloat16* const* rows, int64_t off, float scale) {
  __m512bh qv[NV / 2];
  for (int c = 0; c < NV / 2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    for (int c = 0; c < NV / 2; ++c)
      acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(rows[j] + off + c * 32));
  }
  return _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale));
}

template <int NV, typename Prefetch>
static void decode_one_bf16(const at::BFloat16* qrow, int64_t q_s1, const at::BFloat16* kp,
                            const at::BFloat16* vp, const int32_t* table, int64_t start, int64_t len,
                            int64_t bs, int64_t nkv, int64_t g, float scale, float cap, at::BFloat16* orow,
                            std::vector<float>& scores, std::vector<float>& accm, std::vector<uint16_t>& pbuf,
                            Prefetch&& prefetch_next) {
  constexpr int64_t hd = NV * 16;
  const int64_t tok_stride = nkv * hd, blk_stride = bs * nkv * hd;
  const BlockPos bp(bs);
  const int64_t L = len - start;
  const int64_t nh = nkv * g;
  scores.resize(nh * L);
  accm.assign(nh * hd, 0.f);
  auto row_of = [&](const at::BFloat16* base, int64_t p) {
    return base + table[bp.blk(p)] * blk_stride + bp.off(p) * tok_stride;
  };
  const at::BFloat16* rows[16];
  for (int64_t p0 = start; p0 < len; p0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, len - p0);
    for (int64_t j = 0; j < 16; ++j) rows[j] = row_of(kp, p0 + std::min<int64_t>(j, cnt - 1));
    prefetch_next();
    for (int64_t kh = 0; kh < nkv; ++kh) {
      for (int64_t i = 0; i < g; ++i) {
        const int64_t h = kh * g + i;
        _mm512_mask_storeu_ps(scores.data() + h * L + (p0 - start), (__mmask16)((1u << cnt) - 1u),
                              chunk_scores<NV>(qrow + h * q_s1, rows, kh * hd, scale));
      }
    }
  }
  float denom_small[64];
  std::vector<float> denom_big(nh > 64 ? nh : 0);
  float* denom = nh > 64 ? denom_big.data() : denom_small;
  for (int64_t h = 0; h < nh; ++h) {
    soft_cap(scores.data() + h * L, L, cap);
    denom[h] = 1.f / softmax_numerator(scores.data() + h * L, L);
  }
  pbuf.resize(nh * 16 + 2);
  uint16_t* pb = pbuf.data();
  for (int64_t p0 = start; p0 < len; p0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, len - p0);
    for (int64_t j = 0; j < cnt; ++j) rows[j] = row_of(vp, p0 + j);
    prefetch_next();
    const __mmask16 valid = (__mmask16)((1u << cnt) - 1u);
    for (int64_t h = 0; h < nh; ++h)  // this chunk's probabilities in bf16, zero past cnt
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + h * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, scores.data() + h * L + (p0 - start))));
    for (int64_t kh = 0; kh < nkv; ++kh) {
      for (int64_t i0 = 0; i0 < g;) {  // up to three query heads at a time (3*NV accumulators)
        const int64_t nq = std::min<int64_t>(g - i0, NV > 4 ? 2 : 3);
        const int64_t h0 = kh * g + i0;
        float* m = accm.data() + h0 * hd;
        if (nq == 3) pv_pairs<NV, 3>(m, pb + h0 * 16, rows, kh * hd, cnt);
        else if (nq == 2) pv_pairs<NV, 2>(m, pb + h0 * 16, rows, kh * hd, cnt);
        else pv_pairs<NV, 1>(m, pb + h0 * 16, rows, kh * hd, cnt);
        i0 += nq;
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    const __m512 d = _mm512_set1_ps(denom[h]);
    __m512 nat[NV];
    unpermute_pairs<NV>(accm.data() + h * hd, nat);
    for (int c = 0; c < NV; ++c) store16(orow + h * hd + c * 16, _mm512_mul_ps(nat[c], d));
  }
}

// Up to kTile consecutive prompt tokens of one request (query i sees positions 0 ..
// lens[i] - 1, lens consecutive, no window), each with decode_one_bf16's arithmetic, but
// each 16-token chunk of K and V is read once for all of them: one query per token re-read
// its whole context (1.5 MB a layer at 4000 tokens, past L2) from L3 for every token.
// Lanes past a query's count are computed from rows of the longest query's chunk and
// dropped, as decode_one_bf16 drops its clamped ones (hsum16x16's lanes do not mix).
constexpr int64_t kTile = 8;

template <int NV>
static void prefill_tile_bf16(const at::BFloat16* q0, int64_t q_s0, int64_t q_s1, const at::BFloat16* kp,
                              const at::BFloat16* vp, const int32_t* table, const int32_t* lens, int64_t nq,
                              int64_t bs, int64_t nkv, int64_t g, float scale, float cap, at::BFloat16* o0,
                              int64_t o_s0, std::vector<float>& scores, std::vector<float>& accm,
                              std::vector<uint16_t>& pbuf) {
  constexpr int64_t hd = NV * 16;
  const int64_t tok_stride = nkv * hd, blk_stride = bs * nkv * hd, nh = nkv * g;
  const BlockPos bp(bs);
  int64_t so[kTile + 1] = {0};
  for (int64_t i = 0; i < nq; ++i) so[i + 1] = so[i] + nh * lens[i];
  scores.resize(so[nq]);
  accm.assign(nq * nh * hd, 0.f);
  const int64_t lmax = lens[nq - 1];
  auto row_of = [&](const at::BFloat16* base, int64_t p) {
    return base + table[bp.blk(p)] * blk_stride + bp.off(p) * tok_stride;
  };
  const at::BFloat16* rows[16];
  for (int64_t p0 = 0; p0 < lmax; p0 += 16) {
    const int64_t cmax = std::min<int64_t>(16, lmax - p0);
    for (int64_t j = 0; j < 16; ++j) rows[j] = row_of(kp, p0 + std::min<int64_t>(j, cmax - 1));
    for (int64_t qi = 0; qi < nq; ++qi) {
      const int64_t L = lens[qi];
      if (p0 >= L) continue;
      const int64_t cnt = std::min<int64_t>(16, L - p0);
      const at::BFloat16* qrow = q0 + qi * q_s0;
      for (int64_t kh = 0; kh < nkv; ++kh) {
        for (int64_t i = 0; i < g; ++i) {
          const int64_t h = kh * g + i;
          _mm512_mask_storeu_ps(scores.data() + so[qi] + h * L + p0, (__mmask16)((1u << cnt) - 1u),
                                chunk_scores<NV>(qrow + h * q_s1, rows, kh * hd, scale));
        }
      }
    }
  }
  std::vector<float> denom(nq * nh);
  for (int64_t qi = 0; qi < nq; ++qi)
    for (int64_t h = 0; h < nh; ++h) {
      float* sc = scores.data() + so[qi] + h * lens[qi];
      soft_cap(sc, lens[qi], cap);
      denom[qi * nh + h] = 1.f / softmax_numerator(sc, lens[qi]);
    }
  pbuf.resize(nh * 16 + 2);
  uint16_t* pb = pbuf.data();
  for (int64_t p0 = 0; p0 < lmax; p0 += 16) {
    const int64_t cmax = std::min<int64_t>(16, lmax - p0);
    for (int64_t j = 0; j < cmax; ++j) rows[j] = row_of(vp, p0 + j);
    for (int64_t qi = 0; qi < nq; ++qi) {
      const int64_t L = lens[qi];
      if (p0 >= L) continue;
      const int64_t cnt = std::min<int64_t>(16, L - p0);
      const __mmask16 valid = (__mmask16)((1u << cnt) - 1u);
      for (int64_t h = 0; h < nh; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + h * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, scores.data() + so[qi] + h * L + p0)));
      float* am = accm.data() + qi * nh * hd;
      for (int64_t kh = 0; kh < nkv; ++kh) {
        for (int64_t i0 = 0; i0 < g;) {
          const int64_t nqh = std::min<int64_t>(g - i0, NV > 4 ? 2 : 3);
          const int64_t h0 = kh * g + i0;
          if (nqh == 3) pv_pairs<NV, 3>(am + h0 * hd, pb + h0 * 16, rows, kh * hd, cnt);
          else if (nqh == 2) pv_pairs<NV, 2>(am + h0 * hd, pb + h0 * 16, rows, kh * hd, cnt);
          else pv_pairs<NV, 1>(am + h0 * hd, pb + h0 * 16, rows, kh * hd, cnt);
          i0 += nqh;
        }
      }
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi)
    for (int64_t h = 0; h < nh; ++h) {
      const __m512 d = _mm512_set1_ps(denom[qi * nh + h]);
      __m512 nat[NV];
      unpermute_pairs<NV>(accm.data() + (qi * nh + h) * hd, nat);
      for (int c = 0; c < NV; ++c) store16(o0 + qi * o_s0 + h * hd + c * 16, _mm512_mul_ps(nat[c], d));
    }
}

// How many rows from r (at most kTile, below end) are consecutive tokens of one prompt: the
// same table over their context and lengths one apart (no window).
static int64_t tile_rows(const int32_t* btp, int64_t bt_s0, const int32_t* slp, int64_t r, int64_t end,
                         int64_t bs, int64_t window) {
  if (window > 0) return 1;
  int64_t k = 1;
  while (k < kTile && r + k < end && slp[r + k] == slp[r] + k &&
         std::memcmp(btp + (r + k) * bt_s0, btp + r * bt_s0, sizeof(int32_t) * ((slp[r + k] + bs - 1) / bs)) == 0)
    ++k;
  return k;
}
#endif

// Rows [0, n) of a step over the threads; cost(r): row r's context in tokens. Up to
// kStaticRows rows (decode steps), contiguous ranges of about equal cost, one a thread (each
// thread's prefetch stream stays one run): a step's requests entered the batch at different
// times, oldest first, so equal row counts gave the first thread the longest contexts (at
// c=32 with 128-token answers, contexts 159..287: ~1.14x the balanced time, the other
// thread waiting). A step of prompt tokens is one query per token over its causal context,
// so a prompt's cost grows with the position: contiguous halves left one of 2 threads ~75%
// of a long prompt's work. Past kStaticRows rows, threads claim kClaim rows at a time from
// the end (the longest contexts first, so the last claims are the cheapest). Each row's
// arithmetic is the same either way.
template <typename C, typename F>
static void run_balanced(int64_t n, const C& cost, const F& body) {
  constexpr int64_t kStaticRows = 64, kClaim = 16, kRowCost = 16;  // kRowCost: a row's own work, in tokens
  if (n <= kStaticRows) {
    const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
    int64_t total = 0;
    for (int64_t r = 0; r < n; ++r) total += cost(r) + kRowCost;
    int64_t bounds[kStaticRows + 1];
    bounds[0] = 0;
    for (int64_t t = 1, r = 0, acc = 0; t <= nt; ++t) {  // range t ends once its share of the total is in
      const int64_t goal = t == nt ? total : total * t / nt;
      while (r < n && acc < goal) acc += cost(r++) + kRowCost;
      bounds[t] = t == nt ? n : r;
    }
    at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        if (bounds[t] < bounds[t + 1]) body(bounds[t], bounds[t + 1]);
    });
    return;
  }
  const int64_t chunks = (n + kClaim - 1) / kClaim;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const int64_t end = n - c * kClaim;
      body(std::max<int64_t>(0, end - kClaim), end);
    }
  });
}

#if LLMSERVE_AVX2
// Rows [from, to) of a task's context, HD elements each from offset off, asked into L2 (the
// AVX-512 path's measurement, prefetch_next: L2 a few chunks ahead best, L1 thrashing). The
// hardware prefetchers alone leave the scattered 16-token blocks' first lines to demand
// misses. 30 layers of 32 rows x 256 tokens (SmolLM2 heads, 2-core AVX2 EPYC, medians of
// 3): a float16 cache 20.2 -> 16.1 ms, float32 unchanged (~25 ms). Taking a KV head's 3
// query heads in one task (each K/V vector widened once for them) measured no better.
constexpr int64_t kPrefetchAhead = 32;

template <typename KV, int64_t HD>
static inline void prefetch_rows(const KV* const* rows, int64_t off, int64_t from, int64_t to) {
  constexpr int64_t lines = (HD * static_cast<int64_t>(sizeof(KV)) + 63) / 64;
  for (int64_t p = from; p < to; ++p) {
    const char* row = reinterpret_cast<const char*>(rows[p] + off);
    for (int64_t l = 0; l < lines; ++l) _mm_prefetch(row + 64 * l, _MM_HINT_T2);
  }
}

// Lane j = the sum of a[j]'s 8 lanes (a hadd tree: 9 ops for 8 sums instead of 8 x 6).
static inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// float32 rows on AVX2 (dtype auto on a CPU without bfloat16), head_dim NV * 8: per request
// and query head, the scores of 8 keys at a time (8 dot products in registers, one hsum8x8)
// and the P.V sum in NV registers over the request's rows, instead of the generic path's
// per-key horizontal sum and per-key load/store of the output row (perf of a 32-row decode
// on the AVX2 EPYC: decode_impl 12% of the samples, the largest after the packed linears).
// Each token's arithmetic is the same whatever the step holds. KV: the cache's element type
// (float, or float16 / bfloat16 under float32 activations: half the bytes read, each element
// widened exactly to float32 as it is loaded).
template <int NV, typename KV>
static void decode_f32_avx2(float* op, const float* qp, int64_t q_s0, int64_t q_s1, const KV* kp,
                            const KV* vp, const int32_t* btp, int64_t bt_s0, const int32_t* slp, int64_t n,
                            int64_t nh, int64_t g, int64_t tok_stride, int64_t blk_stride, const BlockPos& bp,
                            float scale, int64_t window, float cap) {
  constexpr int64_t hd = NV * 8;
  const int64_t voff = vp - kp;
  // One task per (request, query head), so a batch of one request still uses every thread
  // (one task per request left the second core idle at batch 1); each task's arithmetic is
  // the same however the tasks are split, so a row's output does not depend on the step.
  auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const KV*> rows;
    int64_t rows_of = -1;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / nh, h = w % nh;
      const int64_t len = slp[r];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t L = len - start;
      float* ohead = op + (r * nh + h) * hd;
      if (L <= 0) {
        std::fill(ohead, ohead + hd, 0.f);
        continue;
      }
      if (rows_of != r) {
        rows.resize(L);
        const int32_t* table = btp + r * bt_s0;
        for (int64_t p = start; p < len; ++p) rows[p - start] = kp + table[bp.blk(p)] * blk_stride + bp.off(p) * tok_stride;
        rows_of = r;
      }
      scores.resize(L);
      const int64_t ko = (h / g) * hd;
      __m256 qv[NV];
      const __m256 sv = _mm256_set1_ps(scale);
      for (int c = 0; c < NV; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(qp + r * q_s0 + h * q_s1 + c * 8), sv);
      float* sc = scores.data();
      // The first query head of a KV head fetches its rows; the group's others find them
      // in cache. Software prefetch kPrefetchAhead tokens ahead (into L2, see prefetch_rows).
      const bool lead = h % g == 0;
      if (lead) prefetch_rows<KV, hd>(rows.data(), ko, 0, std::min<int64_t>(L, kPrefetchAhead));
      int64_t i = 0;
      for (; i + 8 <= L; i += 8) {
        if (lead) prefetch_rows<KV, hd>(rows.data(), ko, i + kPrefetchAhead, std::min<int64_t>(L, i + kPrefetchAhead + 8));
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int c = 0; c < NV; ++c)
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv[c], load8(rows[i + j] + ko + c * 8), a[j]);
        _mm256_storeu_ps(sc + i, hsum8x8(a));
      }
      for (; i < L; ++i) {
        __m256 a = _mm256_setzero_ps();
        for (int c = 0; c < NV; ++c) a = _mm256_fmadd_ps(qv[c], load8(rows[i] + ko + c * 8), a);
        sc[i] = hsum8(a);
      }
      if (lead) prefetch_rows<KV, hd>(rows.data(), voff + ko, 0, std::min<int64_t>(L, kPrefetchAhead));
      soft_cap(sc, L, cap);
      const __m256 inv = _mm256_set1_ps(1.f / softmax_numerator(sc, L));
      __m256 acc[NV];
      for (int c = 0; c < NV; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t k = 0; k < L; ++k) {
        if (lead && (k & 7) == 0)
          prefetch_rows<KV, hd>(rows.data(), voff + ko, k + kPrefetchAhead, std::min<int64_t>(L, k + kPrefetchAhead + 8));
        const __m256 wk = _mm256_set1_ps(sc[k]);
        const KV* v = rows[k] + voff + ko;
        for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(wk, load8(v + c * 8), acc[c]);
      }
      for (int c = 0; c < NV; ++c) _mm256_storeu_ps(ohead + c * 8, _mm256_mul_ps(acc[c], inv));
    }
  };
  run_balanced(n * nh, [&](int64_t w) {
    const int64_t len = slp[w / nh];
    return window > 0 ? std::min<int64_t>(len, window) : len;
  }, body);
}
#endif

// scalar_t: q and out; cache_t: the KV cache (scalar_t, or float16 / bfloat16 under float32).
template <typename scalar_t, typename cache_t>
static void decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv,
                        const at::Tensor& bt, const at::Tensor& sl, int64_t n,
                        double scale, int64_t window, double softcap) {
  const float cap = static_cast<float>(softcap);
  const int64_t nh = q.size(1), hd = q.size(2);
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t bs = kv.size(2), nkv = kv.size(3);
  const int64_t g = nh / nkv;
  const int64_t tok_stride = nkv * hd, blk_stride = bs * nkv * hd;
  const BlockPos bp(bs);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = static_cast<const cache_t*>(kv.data_ptr());
  const cache_t* vp = kp + kv.stride(0);
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t bt_s0 = bt.stride(0);
  const int32_t* slp = sl.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const bool vec = LLMSERVE_VEC_LANES > 0 && hd % LLMSERVE_VEC_LANES == 0;
#if LLMSERVE_AVX512BF16
  if constexpr (std::is_same<scalar_t, at::BFloat16>::value && std::is_same<cache_t, at::BFloat16>::value) {
    if (hd == 64 || hd == 128) {
      // One task per request (all its KV heads, so each K/V row is read once).
      auto body = [&](int64_t begin, int64_t end) {
        std::vector<float> scores, accm;
        std::vector<uint16_t> pbuf;
        // Prefetch cursor over this thread's stream of 16-token chunks: request by request,
        // K chunks then V chunks. It runs kAhead chunks ahead of the computation, into L2.
        // Measured (SmolLM2 shapes, 256-512 requests x 192 tokens, 2 threads): into L2 at 4-8
        // chunks ahead streams at ~28 GB/s, against ~15 GB/s with the hardware prefetchers
        // alone; into L1 (T0) a few chunks ahead thrashes L1 and is slower still.
        constexpr int kAhead = 6;
        const int64_t row_lines = (tok_stride * 2 + 63) / 64;
        int64_t pr = begin, ppass = 0, pc = 0;
        auto prefetch_next = [&]() {
          while (pr < end) {
            const int64_t plen = slp[pr];
            const int64_t pstart = window > 0 ? std::max<int64_t>(0, plen - window) : 0;
            const int64_t p0 = pstart + 16 * pc;
            if (p0 >= plen) {  // past this pass of request pr
              pc = 0;
              if (++ppass == 2) { ppass = 0; ++pr; }
              continue;
            }
            const int32_t* tab = btp + pr * bt_s0;
            const cache_t* base = ppass == 0 ? kp : vp;
            const int64_t pend = std::min<int64_t>(p0 + 16, plen);
            for (int64_t p = p0; p < pend; ++p) {
              const char* row = reinterpret_cast<const char*>(base + tab[bp.blk(p)] * blk_stride + bp.off(p) * tok_stride);
              for (int64_t l = 0; l < row_lines; ++l) _mm_prefetch(row + 64 * l, _MM_HINT_T2);
            }
            ++pc;
            return;
          }
        };
        for (int i = 0; i < kAhead; ++i) prefetch_next();
        for (int64_t r = begin; r < end; ++r) {
          const int64_t len = slp[r];
          const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
          scalar_t* orow = op + r * nh * hd;
          if (len - start <= 0) {
            for (int64_t d = 0; d < nh * hd; ++d) orow[d] = static_cast<scalar_t>(0.f);
            continue;
          }
          const int64_t k = tile_rows(btp, bt_s0, slp, r, end, bs, window);
          if (k > 1) {  // a prompt's tokens: K/V chunks read once for k queries
            if (hd == 64)
              prefill_tile_bf16<4>(qp + r * q_s0, q_s0, q_s1, kp, vp, btp + r * bt_s0, slp + r, k, bs, nkv, g,
                                   fscale, cap, orow, nh * hd, scores, accm, pbuf);
            else
              prefill_tile_bf16<8>(qp + r * q_s0, q_s0, q_s1, kp, vp, btp + r * bt_s0, slp + r, k, bs, nkv, g,
                                   fscale, cap, orow, nh * hd, scores, accm, pbuf);
            r += k - 1;
            pr = r + 1, ppass = 0, pc = 0;  // the prefetch cursor skips the tile's rows
            continue;
          }
          if (hd == 64)
            decode_one_bf16<4>(qp + r * q_s0, q_s1, kp, vp, btp + r * bt_s0, start, len, bs, nkv, g,
                               fscale, cap, orow, scores, accm, pbuf, prefetch_next);
          else
            decode_one_bf16<8>(qp + r * q_s0, q_s1, kp, vp, btp + r * bt_s0, start, len, bs, nkv, g,
                               fscale, cap, orow, scores, accm, pbuf, prefetch_next);
        }
      };
      run_balanced(n, [&](int64_t r) {
        return window > 0 ? std::min<int64_t>(slp[r], window) : static_cast<int64_t>(slp[r]);
      }, body);
      return;
    }
  }
#endif
#if LLMSERVE_AVX2
  if constexpr (std::is_same<scalar_t, float>::value) {
    if (hd == 64 || hd == 128) {
      auto run = hd == 64 ? decode_f32_avx2<8, cache_t> : decode_f32_avx2<16, cache_t>;
      run(op, qp, q_s0, q_s1, kp, vp, btp, bt_s0, slp, n, nh, g, tok_stride, blk_stride, bp, fscale, window, cap);
      return;
    }
  }
#endif
  // Many requests: one task per request, walking each token's K/V row of all heads in
  // memory order. Few requests: one task per (request, kv head) to use every thread.
  const int64_t heads_per_task = n >= 4 * at::get_num_threads() ? nkv : 1;
  const int64_t tasks_per_req = nkv / heads_per_task;

  at::parallel_for(0, n * tasks_per_req, 1, [&](int64_t begin, int64_t end) {
    const int64_t hq = heads_per_task * g;  // query heads per task
    std::vector<float> qf(hq * hd), acc(hq * hd), denom(hq), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / tasks_per_req, kh0 = (w % tasks_per_req) * heads_per_task;
      const int64_t h0 = kh0 * g;  // first query head
      const int64_t len = slp[r];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t L = len - start;
      if (L <= 0) {
        for (int64_t h = 0; h < hq; ++h) {
          scalar_t* o = op + (r * nh + h0 + h) * hd;
          for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<scalar_t>(0.f);
        }
        continue;
      }
      scores.resize(hq * L);
      for (int64_t h = 0; h < hq; ++h) {
        const scalar_t* qs = qp + r * q_s0 + (h0 + h) * q_s1;
        for (int64_t d = 0; d < hd; ++d) qf[h * hd + d] = to_f(qs[d]) * fscale;
      }
      const int32_t* table = btp + r * bt_s0;
      for (int64_t p = start; p < len; ++p) {
        const cache_t* row = kp + table[bp.blk(p)] * blk_stride + bp.off(p) * tok_stride + kh0 * hd;
        for (int64_t h = 0; h < hq; ++h)
          scores[h * L + (p - start)] = dot(qf.data() + h * hd, row + (h / g) * hd, hd, vec);
      }
      for (int64_t h = 0; h < hq; ++h) {
        soft_cap(scores.data() + h * L, L, cap);
        denom[h] = 1.f / softmax_numerator(scores.data() + h * L, L);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = start; p < len; ++p) {
        const cache_t* row = vp + table[bp.blk(p)] * blk_stride + bp.off(p) * tok_stride + kh0 * hd;
        for (int64_t h = 0; h < hq; ++h)
          axpy(acc.data() + h * hd, scores[h * L + (p - start)], row + (h / g) * hd, hd, vec);
      }
      for (int64_t h = 0; h < hq; ++h) {
        scalar_t* o = op + (r * nh + h0 + h) * hd;
        const float* a = acc.data() + h * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<scalar_t>(a[d] * denom[h]);
      }
    }
  });
}


void paged_decode(at::Tensor out, at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                  at::Tensor seq_lens, int64_t n, double scale, int64_t window, double softcap) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache: contiguous 5-d");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [n, heads, head_dim] with unit inner stride");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out: contiguous, q's shape");
  const auto ct = kv_cache.scalar_type();
  const bool narrow_cache = narrow_kv(q.scalar_type(), ct);
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && (ct == q.scalar_type() || narrow_cache),
              "q and out share a dtype, and kv_cache has it or is float16/bfloat16 under float32 q");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(1) % kv_cache.size(3) == 0, "head shapes");
  TORCH_CHECK(n <= q.size(0) && n <= block_tables.size(0) && n <= seq_lens.size(0), "n too large");
  if (narrow_cache && ct == at::kHalf)
    return decode_impl<float, at::Half>(out, q, kv_cache, block_tables, seq_lens, n, scale, window, softcap);
  if (narrow_cache)
    return decode_impl<float, at::BFloat16>(out, q, kv_cache, block_tables, seq_lens, n, scale, window, softcap);
  LLMSERVE_DISPATCH(q.scalar_type(), "paged_decode",
                    decode_impl<scalar_t, scalar_t>(out, q, kv_cache, block_tables, seq_lens, n, scale, window, softcap));
}
