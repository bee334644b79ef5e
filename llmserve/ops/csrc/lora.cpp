// LoRA deltas of a step that mixes adapters, added into the base output in place (punica's
// SGMV idea, Chen et al. 2023, written for the CPU): for each segment (slot, start, end) of
// rows that share an adapter, t = x[rows] @ A[slot] (the shrink, every slice of a fused
// module at once: A's columns are the slices' ranks side by side), then for each column
// range (c0, c1, slice i) of the output, y[rows, c0:c1] += t[:, i*R:(i+1)*R] @ B[slot, :, c0:c1]
// (the expand). B holds each slice's rows only over its own columns ([S, R, N], no zero
// blocks: a block-diagonal B of q/k/v or gate/up is 2-3x larger). R is the slots' size
// (--max-lora-rank); each slot holds its adapter at its own rank r <= R, A as [K, n*r] and B
// as [r, N] at the start of the slot, and only those are read: zero padding up to R was read
// (and multiplied) before, 8x the bytes for a rank-8 adapter in slots sized for 64.
//
// Weights float32 or bfloat16, activations float32 / bfloat16 / float16, all sums in
// float32; the delta is added into y once per element (y + delta rounded once, as torch's
// in-place add of a float32 delta). Rows are taken up to RB at a time so each weight is
// read once per block of rows: at decode a step is bound by reading the adapters' weights
// (SmolLM2-135M, rank 16, all seven projections: 9.8 MB per adapter in bfloat16).
// Each row's result depends only on its own x and slot (batch invariant).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t RB = 8;    // rows per block (each weight read from memory once per block)
// shrink: A's K rows are cut into an even number of equal chunks of at most 256 rows
// (<= 24 KB at W = 48: in L1 for the block's next rows), by K alone. Even: at one decode
// row the two threads each take half of a module's A (SmolLM2's K = 576: 4 x 144; with
// fixed 256-row chunks it was 256 + 256 | 64, one thread doing 8/9 of the shrink).
inline int64_t chunk_rows(int64_t K) {
  const int64_t n = 2 * ((K + 511) / 512);
  return ((K + n - 1) / n + 3) / 4 * 4;
}
constexpr int64_t SV = 4;    // shrink: 16-column vectors of A per pass (4 chains each: 16 accumulators)
constexpr int64_t CB = 128;  // expand: output columns per tile (8 vectors: 8 independent FMA chains)

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_f(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }

struct Item {
  int64_t slot, start, end, r;  // r: the slot's rank (> 0)
};

// The arithmetic, fixed for every row whatever the batch, path or thread count:
//  shrink: per 16-column vector of t and per chunk of A's rows (chunk_rows), four FMA chains over
//          k mod 4 (from zero), summed (c0 + c1) + (c2 + c3); the chunks' sums added in
//          chunk order;
//  expand: per output column, one FMA chain over j = 0..R-1 from zero; y + that rounded
//          once to y's dtype.
// The loops below walk A row by row (one contiguous stream: at one decode row a module's
// adapter is cold, 37-135 KB) and B in tiles of CB columns, with the chains independent
// so that the FMA latency is hidden even for one row.

// Software prefetch into L2, a fixed distance ahead of the loops' reads. A module's adapter
// weights are cold (the base GEMM streamed the model through the caches since the last
// step) and short (37-135 KB a slot at rank 16), too short for the hardware prefetchers to
// ramp up: one decode row's deltas read them at ~14 GB/s (1.1 ms for the 120 calls of a
// SmolLM2 step, 9.8 MB) where one core streams ~40 GB/s. As in attention.cpp's KV stream.
constexpr int64_t PD = 4096;  // bytes ahead (2 KB measured the same, 8-16 KB slower)

inline const char* line_of(const void* p) {
  return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63));
}

// A region read front to back (p: the next line to ask for) and a companion region (q: its
// next line) that the same loop prefetches in proportion: the share of B that this part of
// the shrink pays for, so that B's lines are in flight while A is read rather than only
// once the expand starts (each call's B, 18-98 KB a slot, then waited a full memory
// latency per 128-column tile ahead).
struct Stream {
  const char* p;
  const char* begin;
  const char* end;
  const char* q;
  const char* qbegin;
  const char* qend;
  double ratio;  // companion bytes per region byte (a division per prefetch step cost ~0.7 us a call)
};

inline Stream stream_of(const void* begin, int64_t bytes, const void* comp = nullptr, int64_t comp_bytes = 0) {
  const char* c = static_cast<const char*>(begin);
  const char* d = static_cast<const char*>(comp);
  return {line_of(c), c, c + bytes, comp_bytes > 0 ? line_of(d) : nullptr, d, comp_bytes > 0 ? d + comp_bytes : nullptr,
          bytes > 0 ? static_cast<double>(comp_bytes) / static_cast<double>(bytes) : 0.0};
}

// Ask for every line of s below upto + PD (and below its end), and the companion's lines
// up to the same fraction of it.
inline void prefetch_to(Stream* s, const void* upto) {
  if (s == nullptr) return;
  const char* u = std::min(static_cast<const char*>(upto) + PD, s->end);
  for (; s->p < u; s->p += 64) _mm_prefetch(s->p, _MM_HINT_T1);
  if (s->q == nullptr) return;
  const char* v = std::min(s->qend, s->qbegin + static_cast<int64_t>(static_cast<double>(u - s->begin) * s->ratio));
  for (; s->q < v; s->q += 64) _mm_prefetch(s->q, _MM_HINT_T1);
}

#if defined(__AVX512F__)
// 16 weights as float32 (masked: lanes past the mask read 0).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __mmask16 mask_of(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// out[r * W + 16*v ...] for NR rows r (x's rows ldx apart) = one chunk's shrink through A's
// columns [w0, w0 + 16*NV) (masked at W), over A's rows [k0, k1). Each A vector is loaded
// and widened once for the NR rows (at 16 decodes over 8 adapters a block has 2 rows).
template <int NV, int NR, typename XT, typename WT>
inline void shrink_vecs(float* out, const XT* x, int64_t ldx, const WT* a, int64_t W, int64_t w0, int64_t k0,
                        int64_t k1, Stream* ps) {
  __mmask16 m[NV];
  __m512 s[NR][4][NV];
  for (int v = 0; v < NV; ++v) m[v] = mask_of(W - w0 - 16 * v);
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 4; ++c)
      for (int v = 0; v < NV; ++v) s[r][c][v] = _mm512_setzero_ps();
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    prefetch_to(ps, a + (k + 4) * W);
    for (int c = 0; c < 4; ++c) {
      const WT* ak = a + (k + c) * W + w0;
      __m512 av[NV];
      for (int v = 0; v < NV; ++v) av[v] = load16(ak + 16 * v, m[v]);
      for (int r = 0; r < NR; ++r) {
        const __m512 xv = _mm512_set1_ps(to_f(x[r * ldx + k + c]));
        for (int v = 0; v < NV; ++v) s[r][c][v] = _mm512_fmadd_ps(xv, av[v], s[r][c][v]);
      }
    }
  }
  for (; k < k1; ++k) {
    __m512 av[NV];
    for (int v = 0; v < NV; ++v) av[v] = load16(a + k * W + w0 + 16 * v, m[v]);
    for (int r = 0; r < NR; ++r) {
      const __m512 xv = _mm512_set1_ps(to_f(x[r * ldx + k]));
      for (int v = 0; v < NV; ++v) s[r][0][v] = _mm512_fmadd_ps(xv, av[v], s[r][0][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v)
      _mm512_mask_storeu_ps(out + r * W + w0 + 16 * v, m[v],
                            _mm512_add_ps(_mm512_add_ps(s[r][0][v], s[r][1][v]), _mm512_add_ps(s[r][2][v], s[r][3][v])));
}

// acc[r * CB ...] for NR rows r (t's rows W apart) = t[r, 0:R] @ b[:, 0:nc] (b's rows N apart),
// nc <= 16*NV; each B vector loaded and widened once for the NR rows.
template <int NV, int NR, typename WT>
inline void expand_vecs(float* acc, const float* t, int64_t W, const WT* b, int64_t R, int64_t N, int64_t nc) {
  __mmask16 m[NV];
  __m512 s[NR][NV];
  for (int v = 0; v < NV; ++v) m[v] = mask_of(nc - 16 * v);
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) s[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < R; ++j) {
    const WT* bj = b + j * N;
    __m512 bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load16(bj + 16 * v, m[v]);
    for (int r = 0; r < NR; ++r) {
      const __m512 tv = _mm512_set1_ps(t[r * W + j]);
      for (int v = 0; v < NV; ++v) s[r][v] = _mm512_fmadd_ps(tv, bv[v], s[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * 16 * NV + 16 * v, s[r][v]);
}

// bfloat16 weights 32 at a time: one 512-bit load, the even columns widened by a shift and
// the odd ones by a mask, each into its own accumulators, put back in column order once at
// the end. Where the loops above spend four vector ops on widening 32 weights (vpmovzxwd and
// a shift per 16), this spends two; the FMAs, their chains and their order per column are
// the same as shrink_vecs' / expand_vecs' (bit-identical results). At 16 decode rows over 8
// adapters (2 rows a block) the kernel ran at ~0.5 FMA a cycle with its weights in cache,
// the widening ops sharing the vector pipes with the FMAs.
inline void widen_eo(__m512i w, __m512* e, __m512* o) {
  *e = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  *o = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline __mmask32 mask32_of(int64_t n) {
  return n >= 32 ? __mmask32(0xFFFFFFFFu) : n <= 0 ? __mmask32(0) : __mmask32((1u << n) - 1);
}

// Columns 0..31 from their even (e) and odd (o) lanes.
inline void store_eo(float* out, __m512 e, __m512 o) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(e, lo, o));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(e, hi, o));
}

// shrink_vecs for bfloat16 A over columns [w0, w0 + 32*NP + 16*NV1): NP whole 32-column
// pairs (w0 + 32*NP <= W), then NV1 (0 or 1) 16-column vector masked at W.
template <int NP, int NV1, int NR, typename XT>
inline void shrink_eo(float* out, const XT* x, int64_t ldx, const c10::BFloat16* a, int64_t W, int64_t w0,
                      int64_t k0, int64_t k1, Stream* ps) {
  constexpr int NA = 2 * NP + NV1;  // accumulators per row and chain
  const __mmask16 m1 = mask_of(W - w0 - 32 * NP);
  __m512 s[NR][4][NA];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 4; ++c)
      for (int v = 0; v < NA; ++v) s[r][c][v] = _mm512_setzero_ps();
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    prefetch_to(ps, a + (k + 4) * W);
    for (int c = 0; c < 4; ++c) {
      const c10::BFloat16* ak = a + (k + c) * W + w0;
      __m512 av[NA];
      for (int p = 0; p < NP; ++p) widen_eo(_mm512_loadu_si512(ak + 32 * p), &av[2 * p], &av[2 * p + 1]);
      if (NV1) av[NA - 1] = load16(ak + 32 * NP, m1);
      for (int r = 0; r < NR; ++r) {
        const __m512 xv = _mm512_set1_ps(to_f(x[r * ldx + k + c]));
        for (int v = 0; v < NA; ++v) s[r][c][v] = _mm512_fmadd_ps(xv, av[v], s[r][c][v]);
      }
    }
  }
  for (; k < k1; ++k) {
    const c10::BFloat16* ak = a + k * W + w0;
    __m512 av[NA];
    for (int p = 0; p < NP; ++p) widen_eo(_mm512_loadu_si512(ak + 32 * p), &av[2 * p], &av[2 * p + 1]);
    if (NV1) av[NA - 1] = load16(ak + 32 * NP, m1);
    for (int r = 0; r < NR; ++r) {
      const __m512 xv = _mm512_set1_ps(to_f(x[r * ldx + k]));
      for (int v = 0; v < NA; ++v) s[r][0][v] = _mm512_fmadd_ps(xv, av[v], s[r][0][v]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    __m512 sum[NA];
    for (int v = 0; v < NA; ++v)
      sum[v] = _mm512_add_ps(_mm512_add_ps(s[r][0][v], s[r][1][v]), _mm512_add_ps(s[r][2][v], s[r][3][v]));
    for (int p = 0; p < NP; ++p) store_eo(out + r * W + w0 + 32 * p, sum[2 * p], sum[2 * p + 1]);
    if (NV1) _mm512_mask_storeu_ps(out + r * W + w0 + 32 * NP, m1, sum[NA - 1]);
  }
}

// expand_vecs for bfloat16 B: nc <= 32*NP columns, NP pairs (masked at nc).
template <int NP, int NR>
inline void expand_eo(float* acc, const float* t, int64_t W, const c10::BFloat16* b, int64_t R, int64_t N,
                      int64_t nc) {
  __mmask32 m[NP];
  __m512 se[NR][NP], so[NR][NP];
  for (int p = 0; p < NP; ++p) m[p] = mask32_of(nc - 32 * p);
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < NP; ++p) se[r][p] = so[r][p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < R; ++j) {
    const c10::BFloat16* bj = b + j * N;
    __m512 be[NP], bo[NP];
    for (int p = 0; p < NP; ++p)
      widen_eo(_mm512_maskz_loadu_epi16(m[p], reinterpret_cast<const void*>(bj + 32 * p)), &be[p], &bo[p]);
    for (int r = 0; r < NR; ++r) {
      const __m512 tv = _mm512_set1_ps(t[r * W + j]);
      for (int p = 0; p < NP; ++p) {
        se[r][p] = _mm512_fmadd_ps(tv, be[p], se[r][p]);
        so[r][p] = _mm512_fmadd_ps(tv, bo[p], so[r][p]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int p = 0; p < NP; ++p) store_eo(acc + r * 32 * NP + 32 * p, se[r][p], so[r][p]);
}
#define LORA_EO 1
#else
template <int NV, int NR, typename XT, typename WT>
inline void shrink_vecs(float* out, const XT* x, int64_t ldx, const WT* a, int64_t W, int64_t w0, int64_t k0,
                        int64_t k1, Stream* ps) {
  prefetch_to(ps, a + k1 * W);
  const int64_t w1 = std::min(W, w0 + 16 * NV);
  for (int r = 0; r < NR; ++r, x += ldx, out += W)
  for (int64_t w = w0; w < w1; ++w) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4)
      for (int c = 0; c < 4; ++c) s[c] = std::fma(to_f(x[k + c]), to_f(a[(k + c) * W + w]), s[c]);
    for (; k < k1; ++k) s[0] = std::fma(to_f(x[k]), to_f(a[k * W + w]), s[0]);
    out[w] = (s[0] + s[1]) + (s[2] + s[3]);
  }
}

template <int NV, int NR, typename WT>
inline void expand_vecs(float* acc, const float* t, int64_t W, const WT* b, int64_t R, int64_t N, int64_t nc) {
  for (int r = 0; r < NR; ++r)
    for (int64_t c = 0; c < nc; ++c) {
      float s = 0.0f;
      for (int64_t j = 0; j < R; ++j) s = std::fma(t[r * W + j], to_f(b[j * N + c]), s);
      acc[r * 16 * NV + c] = s;
    }
}
#endif

// y[0:nc] += acc[0:nc], rounded once to y's dtype.
template <typename XT>
inline void add_row(XT* y, const float* acc, int64_t nc) {
  for (int64_t c = 0; c < nc; ++c) y[c] = from_f<XT>(to_f(y[c]) + acc[c]);
}

#if defined(__AVX512F__)
template <>
inline void add_row<float>(float* y, const float* acc, int64_t nc) {
  for (int64_t c = 0; c < nc; c += 16) {
    const __mmask16 m = mask_of(nc - c);
    _mm512_mask_storeu_ps(y + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + c), _mm512_maskz_loadu_ps(m, acc + c)));
  }
}

// bfloat16: c10's round to nearest even (NaN -> 0x7FC0), 16 lanes at a time (the scalar
// conversion cost ~1 ns a column: 0.15 ms a decode step over 5,184 columns x 30 layers).
template <>
inline void add_row<c10::BFloat16>(c10::BFloat16* y, const float* acc, int64_t nc) {
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), qnan = _mm512_set1_epi32(0x7FC0);
  for (int64_t c = 0; c < nc; c += 16) {
    const __mmask16 m = mask_of(nc - c);
    const __m512 v = _mm512_add_ps(load16(y + c, m), _mm512_maskz_loadu_ps(m, acc + c));
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan);
    _mm256_mask_storeu_epi16(reinterpret_cast<void*>(y + c), m, _mm512_cvtepi32_epi16(r));
  }
}
#endif

// out[0:n] = x[0:n] as float32.
inline void widen_row(float* out, const float* x, int64_t n) { std::memcpy(out, x, n * sizeof(float)); }
template <typename XT>
inline void widen_row(float* out, const XT* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    if constexpr (std::is_same<XT, c10::BFloat16>::value)
      _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    else
      _mm512_storeu_ps(out + i, _mm512_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) out[i] = to_f(x[i]);
}

// One chunk [k0, k1) of the shrink of a block of nr rows: part [nr, W]. The first row's
// first pass prefetches A's rows [k0, k1) ahead of itself (the rest hit L1/L2).
// NR rows of one pass over A's columns [w0, W): 16*SV columns at a time, then the rest.
template <int NR, typename XT, typename WT>
void shrink_rows(float* out, const XT* x, int64_t ldx, const WT* a, int64_t W, int64_t k0, int64_t k1, Stream* ps) {
#if defined(LORA_EO)
  if constexpr (std::is_same<WT, c10::BFloat16>::value) {  // the same passes, 32-column pairs
    int64_t w0 = 0;
    for (; w0 + 64 <= W; w0 += 64, ps = nullptr)
      for (int r = 0; r < NR; ++r) shrink_eo<2, 0, 1, XT>(out + r * W, x + r * ldx, ldx, a, W, w0, k0, k1, r ? nullptr : ps);
    const int64_t left = W - w0;  // the last < 64 columns
    if (left > 48) {
      shrink_eo<1, 0, NR, XT>(out, x, ldx, a, W, w0, k0, k1, ps);
      shrink_vecs<2, NR, XT, WT>(out, x, ldx, a, W, w0 + 32, k0, k1, nullptr);
    } else if (left > 32) {
      shrink_eo<1, 1, NR, XT>(out, x, ldx, a, W, w0, k0, k1, ps);
    } else if (left == 32) {
      shrink_eo<1, 0, NR, XT>(out, x, ldx, a, W, w0, k0, k1, ps);
    } else if (left > 16) {
      shrink_vecs<2, NR, XT, WT>(out, x, ldx, a, W, w0, k0, k1, ps);
    } else if (left > 0) {
      shrink_vecs<1, NR, XT, WT>(out, x, ldx, a, W, w0, k0, k1, ps);
    }
    return;
  }
#endif
  int64_t w0 = 0;
  for (; w0 + 16 * SV <= W; w0 += 16 * SV, ps = nullptr)
    for (int r = 0; r < NR; ++r) shrink_vecs<SV, 1, XT, WT>(out + r * W, x + r * ldx, ldx, a, W, w0, k0, k1, r ? nullptr : ps);
  const int64_t left = W - w0;  // the last < 16*SV columns
  if (left > 32) shrink_vecs<3, NR, XT, WT>(out, x, ldx, a, W, w0, k0, k1, ps);
  else if (left > 16) shrink_vecs<2, NR, XT, WT>(out, x, ldx, a, W, w0, k0, k1, ps);
  else if (left > 0) shrink_vecs<1, NR, XT, WT>(out, x, ldx, a, W, w0, k0, k1, ps);
}

template <typename XT, typename WT>
void shrink_part(float* part, const XT* x, const WT* a, int64_t nr, int64_t W, int64_t ldx, int64_t k0, int64_t k1,
                 const WT* b, int64_t b_elems, int64_t K) {
  if constexpr (!std::is_same<XT, float>::value) {
    // x's chunk widened once (the same float values): the loops then broadcast each x
    // from memory, where a bfloat16 or float16 x took three or four more ops per row and k
    // (as many as widening the weights).
    thread_local std::vector<float> xf;
    if (static_cast<int64_t>(xf.size()) < RB * K) xf.resize(RB * K);
    for (int64_t r = 0; r < nr; ++r) widen_row(xf.data() + r * K + k0, x + r * ldx + k0, k1 - k0);
    shrink_part<float, WT>(part, xf.data(), a, nr, W, K, k0, k1, b, b_elems, K);
    return;
  }
  const int64_t q0 = b_elems * k0 / K, q1 = b_elems * k1 / K;  // this chunk's share of B
  Stream st = stream_of(a + k0 * W, (k1 - k0) * W * static_cast<int64_t>(sizeof(WT)), b + q0,
                        (q1 - q0) * static_cast<int64_t>(sizeof(WT)));
  Stream* ps = &st;
  int64_t r = 0;
  if (W < 16 * SV)  // two rows per pass (A's vectors widened once for both)
    for (; r + 2 <= nr; r += 2, ps = nullptr) shrink_rows<2, XT, WT>(part + r * W, x + r * ldx, ldx, a, W, k0, k1, ps);
  for (; r < nr; ++r, ps = nullptr) shrink_rows<1, XT, WT>(part + r * W, x + r * ldx, ldx, a, W, k0, k1, ps);
}

// Expand of one block of rows through columns [c0, c1) of one slice (offset off in t).
template <typename XT, typename WT>
void expand_cols(XT* y, const float* t, const WT* b, int64_t nr, int64_t W, int64_t R, int64_t N, int64_t ldy,
                 int64_t c0, int64_t c1, int64_t off) {
  alignas(64) float acc[2 * CB];
  const int64_t ahead = (PD / static_cast<int64_t>(sizeof(WT) * R) + CB - 1) / CB * CB;  // columns ahead
  for (int64_t c = c0; c < std::min(c1, c0 + ahead); c += 64 / static_cast<int64_t>(sizeof(WT)))
    for (int64_t j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(b + j * N + c), _MM_HINT_T1);
  for (int64_t cb = c0; cb < c1; cb += CB) {
    const int64_t nc = std::min(CB, c1 - cb);
    for (int64_t c = cb + ahead; c < std::min(c1, cb + ahead + CB); c += 64 / static_cast<int64_t>(sizeof(WT)))  // the tile `ahead` columns on
      for (int64_t j = 0; j < R; ++j) _mm_prefetch(reinterpret_cast<const char*>(b + j * N + c), _MM_HINT_T1);
    int64_t r = 0;
    for (; r + 2 <= nr; r += 2) {  // two rows per pass over the tile of b
#if defined(LORA_EO)
      if constexpr (std::is_same<WT, c10::BFloat16>::value) expand_eo<CB / 32, 2>(acc, t + r * W + off, W, b + cb, R, N, nc);
      else
#endif
      expand_vecs<CB / 16, 2, WT>(acc, t + r * W + off, W, b + cb, R, N, nc);
      add_row<XT>(y + r * ldy + cb, acc, nc);
      add_row<XT>(y + (r + 1) * ldy + cb, acc + CB, nc);
    }
    for (; r < nr; ++r) {
#if defined(LORA_EO)
      if constexpr (std::is_same<WT, c10::BFloat16>::value) expand_eo<CB / 32, 1>(acc, t + r * W + off, W, b + cb, R, N, nc);
      else
#endif
      expand_vecs<CB / 16, 1, WT>(acc, t + r * W + off, W, b + cb, R, N, nc);
      add_row<XT>(y + r * ldy + cb, acc, nc);
    }
  }
}

constexpr int64_t CG = CB;  // expand: columns per task (small: the tasks balance over the threads)

struct Cols {
  int64_t c0, c1, off;
};

// Work (rows x weights) from which a call is split over the threads (see run_serial).
constexpr int64_t kParMinWork = int64_t(1) << 17;

// One block's t [nr, W] = x[rows] @ a: the chunks' partial shrinks summed in chunk order
// (the same operations, in the same order, as the threaded path below: a row's result
// does not depend on which path ran it).
template <typename XT, typename WT>
void shrink_block(float* t, float* tmp, const XT* x, const WT* a, int64_t nr, int64_t K, int64_t W, int64_t ldx,
                  const WT* b, int64_t b_elems) {
  const int64_t kc = chunk_rows(K);
  shrink_part<XT, WT>(t, x, a, nr, W, ldx, 0, std::min(K, kc), b, b_elems, K);
  for (int64_t k0 = kc; k0 < K; k0 += kc) {
    shrink_part<XT, WT>(tmp, x, a, nr, W, ldx, k0, std::min(K, k0 + kc), b, b_elems, K);
    for (int64_t e = 0; e < nr * W; ++e) t[e] += tmp[e];
  }
}

// The call's shapes: x [T, K], y [T, N]; a slot's A is K x (n * r) and its B r x N at its
// rank r (Item::r) at the start of the slot's storage, which is sized for the largest rank
// R (A: K * W elements a slot, W = n * R; B: R * N).
struct Dims {
  int64_t K, W, R, N, n, P, ldx, ldy;
};

// One block (rows sharing a slot), start to end: its shrink into t, then every column range.
// Reads only the slot's own rank: A's K x n*r (contiguous) and B's first r rows.
template <typename XT, typename WT>
inline void run_item(const Item& it, float* t, XT* yp, const XT* xp, const WT* ap, const WT* bp, const int32_t* rp,
                     const Dims& d) {
  const int64_t nr = it.end - it.start, r = it.r, w = d.n * r;
  const WT* b = bp + it.slot * d.R * d.N;
  shrink_block<XT, WT>(t, t + RB * w, xp + it.start * d.ldx, ap + it.slot * d.K * d.W, nr, d.K, w, d.ldx, b, r * d.N);
  for (int64_t p = 0; p < d.P; ++p)
    expand_cols<XT, WT>(yp + it.start * d.ldy, t, b, nr, w, r, d.N, d.ldy, rp[3 * p], rp[3 * p + 1], rp[3 * p + 2] * r);
}

// The whole call on the calling thread, block by block: no OpenMP region. Below
// kParMinWork (one or two decode rows of SmolLM2's modules, 18-67k weights a row) a fork and
// two barriers cost more than the threads save: at one row, end to end, +20.7% TPOT over the
// base model serial against +25.8% threaded (same run, 2 cores).
template <typename XT, typename WT>
void run_serial(XT* yp, const XT* xp, const WT* ap, const WT* bp, const std::vector<Item>& items, const int32_t* rp,
                const Dims& d) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < 2 * RB * d.W) buf.resize(2 * RB * d.W);
  for (const Item& it : items) run_item<XT, WT>(it, buf.data(), yp, xp, ap, bp, rp, d);
}

// Whole blocks per thread, one parallel region and no barrier between the shrink and the
// expand: with at least two blocks a thread (16 decode rows over 8 adapters: 8 blocks of 2
// rows) the two-phase split below paid a barrier and the partial sums for no balance it
// needed. Blocks go to threads longest first, each to the least loaded (ties: the lower
// thread), then each thread runs its blocks in order. Every block runs run_item, as
// run_serial: a row's bits do not depend on the path.
template <typename XT, typename WT>
void run_blocks(XT* yp, const XT* xp, const WT* ap, const WT* bp, const std::vector<Item>& items, const int32_t* rp,
                const Dims& d, int nt) {
  const int64_t n = static_cast<int64_t>(items.size());
  thread_local std::vector<int64_t> order;
  thread_local std::vector<int> owner;
  order.resize(n);
  owner.resize(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t u, int64_t v) {
    return (items[u].end - items[u].start) * items[u].r > (items[v].end - items[v].start) * items[v].r;
  });
  std::vector<int64_t> load(nt, 0);
  for (int64_t i : order) {
    const int t = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = t;
    load[t] += (items[i].end - items[i].start) * items[i].r;
  }
  const int* op = owner.data();
#pragma omp parallel num_threads(nt)
  {
    const int me = omp_get_thread_num(), got = omp_get_num_threads();  // got < nt: the runtime gave fewer
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < 2 * RB * d.W) buf.resize(2 * RB * d.W);
    for (int64_t i = 0; i < n; ++i)
      if (op[i] % got == me) run_item<XT, WT>(items[i], buf.data(), yp, xp, ap, bp, rp, d);
  }
}

// Two phases, each split into tasks over the threads: (block, chunk of A's rows) partial
// shrinks, then (block, group of columns) expands, each summing its block's partials in
// chunk order first. The split is fixed by the shapes, not the threads or the batch, so a
// row's result is the same alone or in any batch, and equal to run_serial's.
template <typename XT, typename WT>
void run(XT* yp, const XT* xp, const WT* ap, const WT* bp, const std::vector<Item>& items, const int32_t* rp,
         const Dims& d, int64_t work) {
  const int64_t K = d.K, W = d.W, N = d.N, P = d.P, ldx = d.ldx, ldy = d.ldy;
  const int nt = omp_get_max_threads();
  if (work < kParMinWork || nt == 1) {
    run_serial<XT, WT>(yp, xp, ap, bp, items, rp, d);
    return;
  }
  if (static_cast<int64_t>(items.size()) >= 2 * nt) {
    run_blocks<XT, WT>(yp, xp, ap, bp, items, rp, d, nt);
    return;
  }
  const int64_t kc = chunk_rows(K);
  const int64_t n = static_cast<int64_t>(items.size()), nkc = (K + kc - 1) / kc;
  thread_local std::vector<Cols> cols;  // slice offsets in t are slice * r: scaled per block below
  cols.clear();
  for (int64_t p = 0; p < P; ++p)
    for (int64_t c = rp[3 * p]; c < rp[3 * p + 1]; c += CG)
      cols.push_back({c, std::min<int64_t>(rp[3 * p + 1], c + CG), rp[3 * p + 2]});
  const int64_t ncol = static_cast<int64_t>(cols.size());
  thread_local std::vector<float> parts;
  if (static_cast<int64_t>(parts.size()) < n * nkc * RB * W) parts.resize(n * nkc * RB * W);
  float* pp = parts.data();
  const Cols* cp = cols.data();
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n * nkc; ++i) {
      const Item& it = items[i / nkc];
      const int64_t k0 = (i % nkc) * kc;
      shrink_part<XT, WT>(pp + i * RB * W, xp + it.start * ldx, ap + it.slot * K * W, it.end - it.start, d.n * it.r,
                          ldx, k0, std::min(K, k0 + kc), bp + it.slot * d.R * N, it.r * N, K);
    }
    thread_local std::vector<float> tv;  // one block's t [RB, W]
    if (static_cast<int64_t>(tv.size()) < RB * W) tv.resize(RB * W);
    float* t = tv.data();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n * ncol; ++i) {
      const Item& it = items[i / ncol];
      const int64_t nr = it.end - it.start, w = d.n * it.r;
      const float* part = pp + (i / ncol) * nkc * RB * W;
      std::copy(part, part + nr * w, t);
      for (int64_t c = 1; c < nkc; ++c)
        for (int64_t e = 0; e < nr * w; ++e) t[e] += part[c * RB * W + e];
      const Cols& cc = cp[i % ncol];
      expand_cols<XT, WT>(yp + it.start * ldy, t, bp + it.slot * d.R * N, nr, w, it.r, N, ldy, cc.c0, cc.c1,
                          cc.off * it.r);
    }
  }
}

// The step's blocks of rows (Item) from segs (int32 [G, 3] of (slot, start, end)), checked
// against T rows and S slots; kp: the slots' ranks (nullptr: all R; each read is checked to
// lie in 0..R); rank-0 slots are left out. Returns the work (rows x weights read).
int64_t items_of(const at::Tensor& segs, int64_t T, int64_t S, int64_t R, const int32_t* kp, int64_t K,
                 int64_t slices, int64_t N, std::vector<Item>& items) {
  TORCH_CHECK(segs.scalar_type() == at::kInt && segs.is_contiguous() && segs.dim() == 2 && segs.size(1) == 3,
              "lora_add: segs must be a contiguous int32 [*, 3]");
  items.clear();
  const int32_t* sp = segs.data_ptr<int32_t>();
  int64_t work = 0;
  for (int64_t g = 0; g < segs.size(0); ++g) {
    const int64_t slot = sp[3 * g], s = sp[3 * g + 1], e = sp[3 * g + 2];
    TORCH_CHECK(slot >= 0 && slot < S && s >= 0 && s <= e && e <= T, "lora_add: segment ", g, " out of bounds");
    const int64_t r = kp ? kp[slot] : R;
    TORCH_CHECK(r >= 0 && r <= R, "lora_add: ranks[", slot, "] = ", r, " is outside 0..", R);
    if (r == 0) continue;  // the adapter does not target this module
    for (int64_t i = s; i < e; i += RB) items.push_back({slot, i, std::min(e, i + RB), r});
    work += (e - s) * r * (K * slices + N);
  }
  return work;
}

// run<XT, WT> for y's dtype (x's, checked by the callers) and the weights' (wbf: bfloat16,
// else float32).
void run_typed(at::Tensor& y, const at::Tensor& x, const void* ap, const void* bp, bool wbf,
               const std::vector<Item>& items, const int32_t* rp, const Dims& d, int64_t work) {
  using BF = c10::BFloat16;
  const auto* af = static_cast<const float*>(ap);
  const auto* bf = static_cast<const float*>(bp);
  const auto* ah = static_cast<const BF*>(ap);
  const auto* bh = static_cast<const BF*>(bp);
  switch (x.scalar_type()) {
    case at::kFloat:
      wbf ? run<float, BF>(y.data_ptr<float>(), x.data_ptr<float>(), ah, bh, items, rp, d, work)
          : run<float, float>(y.data_ptr<float>(), x.data_ptr<float>(), af, bf, items, rp, d, work);
      break;
    case at::kBFloat16:
      wbf ? run<BF, BF>(y.data_ptr<BF>(), x.data_ptr<BF>(), ah, bh, items, rp, d, work)
          : run<BF, float>(y.data_ptr<BF>(), x.data_ptr<BF>(), af, bf, items, rp, d, work);
      break;
    case at::kHalf:
      wbf ? run<c10::Half, BF>(y.data_ptr<c10::Half>(), x.data_ptr<c10::Half>(), ah, bh, items, rp, d, work)
          : run<c10::Half, float>(y.data_ptr<c10::Half>(), x.data_ptr<c10::Half>(), af, bf, items, rp, d, work);
      break;
    default:
      TORCH_CHECK(false, "lora_add: x must be float32, bfloat16 or float16");
  }
}

// Weights a [S, K, W] and b [S, R, N] (float32 or bfloat16, one dtype, contiguous, W a
// multiple of R) and ranges (int32 [P, 3] within N columns and W / R slices) as the kernel
// takes them; the ranks tensor, when given, int32 [S] contiguous.
void check_weights(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ranges,
                   const at::Tensor* ranks) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0),
              "lora_add: a [S, K, W] and b [S, R, N] must be contiguous with one S, got a ", a.sizes(), " b ",
              b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kFloat),
              "lora_add: a and b must share a dtype, float32 or bfloat16");
  TORCH_CHECK(b.size(1) > 0 && a.size(2) % b.size(1) == 0, "lora_add: a's width must be a multiple of b's rank");
  TORCH_CHECK(ranges.scalar_type() == at::kInt && ranges.is_contiguous() && ranges.dim() == 2 && ranges.size(1) == 3,
              "lora_add: ranges must be a contiguous int32 [*, 3]");
  const int64_t N = b.size(2), slices = a.size(2) / b.size(1);
  const int32_t* rp = ranges.data_ptr<int32_t>();
  for (int64_t p = 0; p < ranges.size(0); ++p)
    TORCH_CHECK(rp[3 * p] >= 0 && rp[3 * p] <= rp[3 * p + 1] && rp[3 * p + 1] <= N && rp[3 * p + 2] >= 0 &&
                    rp[3 * p + 2] < slices,
                "lora_add: range ", p, " out of bounds");
  if (ranks != nullptr)
    TORCH_CHECK(ranks->scalar_type() == at::kInt && ranks->is_contiguous() && ranks->dim() == 1 &&
                    ranks->size(0) == a.size(0),
                "lora_add: ranks must be a contiguous int32 [", a.size(0), "] (one per slot), got ", ranks->sizes());
}

// y [T, N] and x [T, K] for weights of K inputs and N outputs: one dtype, rows contiguous.
void check_xy(const at::Tensor& y, const at::Tensor& x, int64_t K, int64_t N) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.stride(1) == 1 && x.stride(1) == 1 && x.size(0) == y.size(0) &&
                  x.size(1) == K && y.size(1) == N,
              "lora_add: shapes do not match: y [T, ", N, "] and x [T, ", K,
              "] with contiguous rows expected, got y ", y.sizes(), " x ", x.sizes());
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_add: x and y must share a dtype");
}

}  // namespace

// y [T, N] += per segment (slot, start, end) of segs (int32 [G, 3]): x[start:end] @ A of the
// slot, then per range (c0, c1, slice) of ranges (int32 [P, 3]) the expand through B's columns
// c0:c1. x [T, K] and y in one dtype (float32 / bfloat16 / float16); a [S, K, W], b [S, R, N]
// float32 or bfloat16, W = slices * R, contiguous; x and y contiguous along rows (any row stride).
// ranks (int32 [S], or None: every slot at R): slot s's rank r_s in 0..R; its A is the first
// K * slices * r_s elements of a[s] read as [K, slices * r_s] (slice i in columns i*r_s..),
// its B the first r_s rows of b[s]; the rest of the slot is never read (an adapter of rank 8
// in slots sized for 64 reads 1/8 of them), and rank 0 skips the slot's rows (no delta).
void lora_add(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor segs,
              at::Tensor ranges, c10::optional<at::Tensor> ranks) {
  check_weights(a, b, ranges, ranks.has_value() ? &*ranks : nullptr);
  check_xy(y, x, a.size(1), b.size(2));
  const int64_t R = b.size(1), slices = a.size(2) / R;
  const int32_t* kp = ranks.has_value() ? ranks->data_ptr<int32_t>() : nullptr;
  if (kp != nullptr)
    for (int64_t s = 0; s < a.size(0); ++s)
      TORCH_CHECK(kp[s] >= 0 && kp[s] <= R, "lora_add: ranks[", s, "] = ", kp[s], " is outside 0..", R);
  thread_local std::vector<Item> items;  // reused: no allocation per call
  const int64_t work = items_of(segs, y.size(0), a.size(0), R, kp, a.size(1), slices, b.size(2), items);
  const Dims d{a.size(1), a.size(2), R, b.size(2), slices, ranges.size(0), x.stride(0), y.stride(0)};
  run_typed(y, x, a.data_ptr(), b.data_ptr(), a.scalar_type() == at::kBFloat16, items, ranges.data_ptr<int32_t>(), d,
            work);
}

// One wrapped linear's adapter stacks, bound once (llmserve.lora.layers): add(y, x, segs) is
// lora_add(y, x, a, b, segs, ranges, ranks) with the same arithmetic. Why: at one decode row
// of SmolLM2-135M (120 calls a step) lora_add's seven tensor arguments, their checks and the
// GIL's release cost ~3.3 us a call, 0.40 ms of a ~4.9 ms step (+8.5%; the same calls with
// no rows to add), the base GEMM having pushed the tensors' metadata out of the caches. A
// no-op pybind function taking 7 tensors cost +0.24 ms a step with the GIL released, +0.10
// ms without; taking 2, nothing measurable. So this keeps the weights' pointers, shapes and
// ranges, reads the ranks through a pointer to the caller's tensor (written in place when a
// slot changes), and keeps the GIL unless the call is split over threads (large steps: an
// adapter-loading thread runs meanwhile). Tensors are held, so the pointers stay valid.
// quant_gemv.cpp's LinearHook (the same C ABI, version 2): begin on the calling thread with
// the GEMM's input, then pre/post run by each thread of the base GEMM around its share of the
// output columns.
struct LinearHook {
  int64_t abi;
  void (*pre)(void* ctx, int64_t c0, int64_t c1, int64_t n);
  void (*post)(void* ctx, int64_t c0, int64_t c1, void* out, int64_t ldo);
  void* ctx;
  int64_t rows, n, k;
  void (*begin)(void* ctx, const void* x, int64_t ldx, int64_t xtype);
};
constexpr int64_t kLinearHookAbi = 2;
constexpr int64_t kHookF32 = 0, kHookBF16 = 1, kHookF16 = 2;

class LoRAModule {
 public:
  LoRAModule(at::Tensor a, at::Tensor b, at::Tensor ranges, at::Tensor ranks)
      : a_(a), b_(b), ranges_(ranges), ranks_(ranks) {
    check_weights(a, b, ranges, &ranks);
    ap_ = a.data_ptr();
    bp_ = b.data_ptr();
    rp_ = ranges.data_ptr<int32_t>();
    kp_ = ranks.data_ptr<int32_t>();
    wbf_ = a.scalar_type() == at::kBFloat16;
    S_ = a.size(0);
    d_ = Dims{a.size(1), a.size(2), b.size(1), b.size(2), a.size(2) / b.size(1), ranges.size(0), 0, 0};
  }

  void add(at::Tensor y, at::Tensor x, at::Tensor segs) {
    check_xy(y, x, d_.K, d_.N);
    thread_local std::vector<Item> items;
    const int64_t work = items_of(segs, y.size(0), S_, d_.R, kp_, d_.K, d_.n, d_.N, items);
    Dims d = d_;
    d.ldx = x.stride(0);
    d.ldy = y.stride(0);
    c10::optional<py::gil_scoped_release> nogil;
    if (work >= kParMinWork) nogil.emplace();
    run_typed(y, x, ap_, bp_, wbf_, items, rp_, d, work);
  }

  // The deltas of this step's base GEMMs (quant_gemv.cpp's quant_linear(..., hook=)) run
  // inside their threads: arms the hook at hook_address() for a step of `rows` rows and segs
  // as add()'s, until the next arm(); each GEMM passes its x (begin_fn). The arithmetic, and
  // so every bit of y, is add()'s: the shrink's (block, chunk) tasks are the threaded path's,
  // summed in chunk order, and each output column is one FMA chain added once. What differs
  // is who runs them: each GEMM thread takes its share of the shrink tasks before its
  // columns (pre), then any task no thread has taken, waits for the others' to finish, and
  // expands into its own columns only (post), so the adapter is read by both cores while
  // the base model's weights stream, with no parallel region of its own.
  // Why (SmolLM2-135M Q4_1, rank 16 on all seven projections, one decode row): add() ran
  // after the GEMM on one thread (a fork cost more than it saved) and read the 9.8 MB of
  // adapter a step at ~14 GB/s from one core. Armed once a step for all modules (arm_all),
  // not made per call from x and segs: that pybind call of two tensors cost ~1.5 us a
  // module cold, 0.15-0.22 ms of a ~5 ms step (the call alone, its hook unused; 4 runs).
  void arm(const at::Tensor& segs, int64_t rows) {
    hook_.abi = 0;  // refused by the GEMM until armed
    items_of(segs, rows, S_, d_.R, kp_, d_.K, d_.n, d_.N, fitems_);
    fd_ = d_;
    kc_ = chunk_rows(d_.K);
    nkc_ = (d_.K + kc_ - 1) / kc_;
    ntask_ = static_cast<int64_t>(fitems_.size()) * nkc_;
    if (static_cast<int64_t>(parts_.size()) < ntask_ * RB * d_.W) parts_.resize(ntask_ * RB * d_.W);
    if (ntask_ > nclaimed_) {
      claimed_.reset(new std::atomic<int32_t>[ntask_]);
      nclaimed_ = ntask_;
    }
    hook_.ctx = this;
    hook_.rows = rows;
    hook_.n = d_.N;
    hook_.k = d_.K;
    hook_.begin = &begin_fn;
    hook_.abi = kLinearHookAbi;
  }

  // The address of this module's LinearHook (fixed for its lifetime; refused by the GEMM
  // until arm()).
  int64_t hook_address() const { return reinterpret_cast<int64_t>(&hook_); }

 private:
  template <typename WT>
  void set_fns(bool bf, bool half) {
    using BF = c10::BFloat16;
    if (bf) { hook_.pre = &pre_fn<BF, WT>; hook_.post = &post_fn<BF, WT>; }
    else if (half) { hook_.pre = &pre_fn<c10::Half, WT>; hook_.post = &post_fn<c10::Half, WT>; }
    else { hook_.pre = &pre_fn<float, WT>; hook_.post = &post_fn<float, WT>; }
  }

  // Shrink task i: block i / nkc_'s partial over A's rows of chunk i % nkc_ (as run()).
  // A GEMM's start, on its calling thread: its x (rows ldx apart), the functions for its
  // dtype, and no shrink task taken yet.
  static void begin_fn(void* ctx, const void* x, int64_t ldx, int64_t xtype) {
    auto* self = static_cast<LoRAModule*>(ctx);
    self->x_ = x;
    self->fd_.ldx = ldx;
    for (int64_t i = 0; i < self->ntask_; ++i) self->claimed_[i].store(0, std::memory_order_relaxed);
    self->done_.store(0, std::memory_order_release);
    using BF = c10::BFloat16;
    if (self->wbf_) self->set_fns<BF>(xtype == kHookBF16, xtype == kHookF16);
    else self->set_fns<float>(xtype == kHookBF16, xtype == kHookF16);
  }

  template <typename XT, typename WT>
  void task(int64_t i) {
    const Item& it = fitems_[i / nkc_];
    const int64_t k0 = (i % nkc_) * kc_;
    shrink_part<XT, WT>(parts_.data() + i * RB * fd_.W, static_cast<const XT*>(x_) + it.start * fd_.ldx,
                        static_cast<const WT*>(ap_) + it.slot * fd_.K * fd_.W, it.end - it.start, fd_.n * it.r,
                        fd_.ldx, k0, std::min(fd_.K, k0 + kc_), static_cast<const WT*>(bp_), 0, fd_.K);
    done_.fetch_add(1, std::memory_order_release);
  }

  // Runs the shrink tasks [i0, i1) that no thread has claimed yet (a contiguous range: each
  // thread's A stays one stream, where tasks handed out one at a time interleaved the two
  // threads' chunks of each adapter's A).
  template <typename XT, typename WT>
  void take(int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      if (claimed_[i].exchange(1, std::memory_order_relaxed) == 0) task<XT, WT>(i);
  }

  // Before a thread's columns [c0, c1) of n: its share of the shrink tasks. Nothing more:
  // asking its A and B columns into L2 here, for after the GEMM, cost more than it saved
  // (one decode row, 120 modules: +0.21 ms a step for the prefetches alone, +0.55 against
  // +0.50 ms with them).
  template <typename XT, typename WT>
  static void pre_fn(void* ctx, int64_t c0, int64_t c1, int64_t n) {
    auto* self = static_cast<LoRAModule*>(ctx);
    self->take<XT, WT>(self->ntask_ * c0 / n, self->ntask_ * c1 / n);
  }

  // After a thread's columns: the tasks left, the wait for the others' (each one claimed is
  // running on a thread that waits for nothing), then each block's t (its chunks summed in
  // order, as run()) expanded into columns [c0, c1) of every range.
  template <typename XT, typename WT>
  static void post_fn(void* ctx, int64_t c0, int64_t c1, void* out, int64_t ldo) {
    auto* self = static_cast<LoRAModule*>(ctx);
    self->take<XT, WT>(0, self->ntask_);
    for (int spins = 0; self->done_.load(std::memory_order_acquire) < self->ntask_; ++spins) {
      if (spins < 4096) _mm_pause();
      else sched_yield();  // the other thread lost its core: let it run
    }
    const Dims& d = self->fd_;
    alignas(64) float t[RB * 64 * 3];
    thread_local std::vector<float> big;
    float* tp = t;
    if (RB * d.W > static_cast<int64_t>(sizeof(t) / sizeof(float))) {
      if (static_cast<int64_t>(big.size()) < RB * d.W) big.resize(RB * d.W);
      tp = big.data();
    }
    const int32_t* rp = self->rp_;
    for (size_t ii = 0; ii < self->fitems_.size(); ++ii) {
      const Item& it = self->fitems_[ii];
      const int64_t nr = it.end - it.start, w = d.n * it.r;
      const float* part = self->parts_.data() + ii * self->nkc_ * RB * d.W;
      std::copy(part, part + nr * w, tp);
      for (int64_t c = 1; c < self->nkc_; ++c)
        for (int64_t e = 0; e < nr * w; ++e) tp[e] += part[c * RB * d.W + e];
      const WT* b = static_cast<const WT*>(self->bp_) + it.slot * d.R * d.N;
      XT* y = static_cast<XT*>(out) + it.start * ldo;
      for (int64_t p = 0; p < d.P; ++p) {
        const int64_t lo = std::max<int64_t>(c0, rp[3 * p]), hi = std::min<int64_t>(c1, rp[3 * p + 1]);
        if (lo < hi) expand_cols<XT, WT>(y, tp, b, nr, w, it.r, d.N, ldo, lo, hi, rp[3 * p + 2] * it.r);
      }
    }
  }

  const void* x_ = nullptr;  // the running GEMM's input (begin_fn)
  std::vector<Item> fitems_;
  std::vector<float> parts_;  // [ntask_, RB, W] partial shrinks
  Dims fd_{};
  int64_t kc_ = 0, nkc_ = 0, ntask_ = 0;
  std::unique_ptr<std::atomic<int32_t>[]> claimed_;  // [ntask_]: 1 once a thread took task i
  int64_t nclaimed_ = 0;
  std::atomic<int64_t> done_{0};
  LinearHook hook_{};

  at::Tensor a_, b_, ranges_, ranks_;
  const void* ap_;
  const void* bp_;
  const int32_t* rp_;
  const int32_t* kp_;
  bool wbf_;
  int64_t S_;
  Dims d_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops: an adapter-loading thread runs meanwhile.
  m.def("lora_add", &lora_add, "y += LoRA deltas per segment (see lora.cpp)", py::arg("y"), py::arg("x"),
        py::arg("a"), py::arg("b"), py::arg("segs"), py::arg("ranges"), py::arg("ranks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  py::class_<LoRAModule>(m, "LoRAModule", "A linear's adapter stacks bound once: add(y, x, segs) (see lora.cpp)")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(), py::arg("a"), py::arg("b"),
           py::arg("ranges"), py::arg("ranks"))
      .def("add", &LoRAModule::add, py::arg("y"), py::arg("x"), py::arg("segs"))
      .def("arm", &LoRAModule::arm, py::arg("segs"), py::arg("rows"))
      .def("hook_address", &LoRAModule::hook_address);
  m.def(
      "arm_all",
      [](const py::list& modules, const at::Tensor& segs, int64_t rows) {
        for (const auto& mod : modules) mod.cast<LoRAModule&>().arm(segs, rows);
      },
      "LoRAModule.arm(segs, rows) of each module in the list (one call a step)", py::arg("modules"),
      py::arg("segs"), py::arg("rows"));
}
