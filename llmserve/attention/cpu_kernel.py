"""C++ CPU kernels for the model's hot path, built on first use with
``torch.utils.cpp_extension.load_inline`` (-O3 -march=native, OpenMP).

- ``paged_decode``: paged-decode attention. The pure-torch decode path copies every
  request's K/V blocks out of the pool with advanced indexing before its matmuls, which
  DESIGN.md measured at 3-4 ms per layer for 64 sequences x 256 context; this kernel reads
  the blocks in place (vLLM's ``paged_attention_v1`` idea, written for CPU). In bfloat16 on
  CPUs with AVX512-BF16 it takes Q.K with the bf16 dot-product instruction and sums 16 keys
  at a time, and keeps the P.V accumulators in registers.
- ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding`` and
  ``reshape_and_cache``: the element-wise parts of a Llama layer in one pass each (vLLM's
  ``csrc/cpu`` ops of the same names), with transformers' rounding to the model dtype
  between its ops, so results equal the torch path in float32 up to summation order. Run as
  separate torch ops they cost ~40 small kernels per layer; at batch 1 the dispatch alone is
  a few ms per step.

The build is cached under ``~/.cache/llmserve/torch_extensions``, one directory per source,
torch version, CPU and Python environment (so checkouts with their own venvs do not rebuild
each other's). If it fails (no compiler, no ninja), ``get_cpu_ops``
returns None and the model and ``PagedAttention`` use their pure-torch paths, which the
tests compare with the kernels. ``LLMSERVE_CPU_OPS=0`` turns the kernels off.
Prebuild with ``python -c "from llmserve.attention.cpu_kernel import main; main()"`` (``make`` does).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#define LLMSERVE_AVX512 1
#else
#define LLMSERVE_AVX512 0
#endif
#if defined(__AVX512BF16__) && LLMSERVE_AVX512
#define LLMSERVE_AVX512BF16 1
#else
#define LLMSERVE_AVX512BF16 0
#endif

static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }
static inline float to_f(at::Half x) { return static_cast<float>(x); }

// Round a float to T's precision and back (what storing an intermediate in T does).
template <typename T> static inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }
template <> inline float rnd<float>(float x) { return x; }

#if LLMSERVE_AVX512
// 16 elements -> 16 floats
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 floats -> 16 elements, rounding to nearest even (as c10's conversions do)
static inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void store16(at::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
static inline void store16(at::BFloat16* p, __m512 x) {
#if LLMSERVE_AVX512BF16
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, x);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<at::BFloat16>(tmp[i]);
#endif
}
template <typename T> static inline __m512 rnd16(__m512 x) {
  alignas(64) T tmp[16];
  store16(tmp, x);
  return load16(tmp);
}
template <> inline __m512 rnd16<float>(__m512 x) { return x; }
#if LLMSERVE_AVX512BF16
template <> inline __m512 rnd16<at::BFloat16>(__m512 x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
#endif

// dot(q[0:hd], k[0:hd]) with q already float
template <typename T>
static inline float dot(const float* q, const T* k, int64_t hd, bool vec) {
#if LLMSERVE_AVX512
  if (vec) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), s);
    return _mm512_reduce_add_ps(s);
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < hd; ++d) s += q[d] * to_f(k[d]);
  return s;
}

// acc[0:hd] += w * v[0:hd]
template <typename T>
static inline void axpy(float* acc, float w, const T* v, int64_t hd, bool vec) {
#if LLMSERVE_AVX512
  if (vec) {
    const __m512 ww = _mm512_set1_ps(w);
    for (int64_t d = 0; d < hd; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(ww, load16(v + d), _mm512_loadu_ps(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < hd; ++d) acc[d] += w * to_f(v[d]);
}

#if LLMSERVE_AVX512
// 2^t = 2^n * 2^f with n = round(t), |f| <= 0.5, degree-7 Taylor for 2^f (relative error
// < 1e-7 before rounding). t must be >= -126 or so (no denormal handling).
static inline __m512 pow2_512(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// e^x = 2^(x log2 e); x is clamped below at -87 (the result is then ~1e-38, not 0).
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  return pow2_512(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)));
}

// Lane j of the result = sum of the 16 lanes of v[j] (a transpose-and-add tree: 45 ops for
// 16 horizontal sums instead of 16 separate reductions).
static inline __m512 hsum16x16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

// sc[0:L] = exp(sc - max), returns the sum
static inline float softmax_numerator(float* sc, int64_t L) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if LLMSERVE_AVX512
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= L; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sc + i));
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; i < L; ++i) m = std::max(m, sc[i]);
  float sum = 0.f;
  i = 0;
#if LLMSERVE_AVX512
  const __m512 mm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= L; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + i), mm));
    _mm512_storeu_ps(sc + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < L; ++i) { sc[i] = std::exp(sc[i] - m); sum += sc[i]; }
  return sum;
}

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

template <int NV, typename Prefetch>
static void decode_one_bf16(const at::BFloat16* qrow, int64_t q_s1, const at::BFloat16* kp,
                            const at::BFloat16* vp, const int32_t* table, int64_t start, int64_t len,
                            int64_t bs, int64_t nkv, int64_t g, float scale, at::BFloat16* orow,
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
        __m512bh qv[NV / 2];
        for (int c = 0; c < NV / 2; ++c)
          qv[c] = (__m512bh)_mm512_loadu_si512(qrow + h * q_s1 + c * 32);
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) {
          acc[j] = _mm512_setzero_ps();
          for (int c = 0; c < NV / 2; ++c)
            acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(rows[j] + kh * hd + c * 32));
        }
        const __m512 s = _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores.data() + h * L + (p0 - start), (__mmask16)((1u << cnt) - 1u), s);
      }
    }
  }
  float denom_small[64];
  std::vector<float> denom_big(nh > 64 ? nh : 0);
  float* denom = nh > 64 ? denom_big.data() : denom_small;
  for (int64_t h = 0; h < nh; ++h) denom[h] = 1.f / softmax_numerator(scores.data() + h * L, L);
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
#endif

template <typename scalar_t>
static void decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv,
                        const at::Tensor& bt, const at::Tensor& sl, int64_t n,
                        double scale, int64_t window) {
  const int64_t nh = q.size(1), hd = q.size(2);
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t bs = kv.size(2), nkv = kv.size(3);
  const int64_t g = nh / nkv;
  const int64_t tok_stride = nkv * hd, blk_stride = bs * nkv * hd;
  const BlockPos bp(bs);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = kv.data_ptr<scalar_t>();
  const scalar_t* vp = kp + kv.stride(0);
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t bt_s0 = bt.stride(0);
  const int32_t* slp = sl.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const bool vec = LLMSERVE_AVX512 && hd % 16 == 0;
#if LLMSERVE_AVX512BF16
  if constexpr (std::is_same<scalar_t, at::BFloat16>::value) {
    if (hd == 64 || hd == 128) {
      // One task per request (all its KV heads, so each K/V row is read once).
      at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
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
            const scalar_t* base = ppass == 0 ? kp : vp;
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
          if (hd == 64)
            decode_one_bf16<4>(qp + r * q_s0, q_s1, kp, vp, btp + r * bt_s0, start, len, bs, nkv, g,
                               fscale, orow, scores, accm, pbuf, prefetch_next);
          else
            decode_one_bf16<8>(qp + r * q_s0, q_s1, kp, vp, btp + r * bt_s0, start, len, bs, nkv, g,
                               fscale, orow, scores, accm, pbuf, prefetch_next);
        }
      });
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
        const scalar_t* row = kp + table[bp.blk(p)] * blk_stride + bp.off(p) * tok_stride + kh0 * hd;
        for (int64_t h = 0; h < hq; ++h)
          scores[h * L + (p - start)] = dot(qf.data() + h * hd, row + (h / g) * hd, hd, vec);
      }
      for (int64_t h = 0; h < hq; ++h) denom[h] = 1.f / softmax_numerator(scores.data() + h * L, L);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = start; p < len; ++p) {
        const scalar_t* row = vp + table[bp.blk(p)] * blk_stride + bp.off(p) * tok_stride + kh0 * hd;
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

#define LLMSERVE_DISPATCH(dtype, NAME, ...)                                       \
  switch (dtype) {                                                                \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }             \
    case at::kBFloat16: { using scalar_t = at::BFloat16; __VA_ARGS__; break; }   \
    case at::kHalf: { using scalar_t = at::Half; __VA_ARGS__; break; }           \
    default: TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);              \
  }

void paged_decode(at::Tensor out, at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                  at::Tensor seq_lens, int64_t n, double scale, int64_t window) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache: contiguous 5-d");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [n, heads, head_dim] with unit inner stride");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out: contiguous, q's shape");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and kv_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(1) % kv_cache.size(3) == 0, "head shapes");
  TORCH_CHECK(n <= q.size(0) && n <= block_tables.size(0) && n <= seq_lens.size(0), "n too large");
  LLMSERVE_DISPATCH(q.scalar_type(), "paged_decode",
                    decode_impl<scalar_t>(out, q, kv_cache, block_tables, seq_lens, n, scale, window));
}

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
"""


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    import platform
    return platform.processor()


def _build_dir() -> str:
    root = os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "torch_extensions")
    # sys.prefix too: the build files hold the venv's absolute include paths, so venvs that
    # shared one directory would keep rebuilding each other's kernels.
    key = _CPP_SOURCE + torch.__version__ + _cpu_signature() + sys.prefix
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = os.path.join(root, f"cpu_ops_{digest}")
    os.makedirs(path, exist_ok=True)
    return path


_FUNCTIONS = ["paged_decode", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
              "reshape_and_cache", "to_float", "sample_inverse_cdf"]


@functools.lru_cache(maxsize=1)
def get_cpu_ops() -> Optional[Any]:
    """The compiled ops module, or None when it cannot be built here (logged once) or
    ``LLMSERVE_CPU_OPS=0``. Ops (all write in place, return None):

    - ``paged_decode(out, q, kv_cache, block_tables, seq_lens, n, scale, window)``: out/q
      ``[N, num_heads, head_dim]`` (model dtype); kv_cache: one layer's ``[2, num_blocks,
      block_size, num_kv_heads, head_dim]``; block_tables ``[>=n, M]`` and seq_lens ``[>=n]``
      int32; n: decode requests; window: sliding window (0 = none).
    - ``rms_norm(out, x, weight, eps)``: x/out ``[R, H]`` or ``[A, B, H]``, weight ``[H]``.
    - ``fused_add_rms_norm(out, x, residual, weight, eps)``: residual <- x + residual, out <-
      rms_norm(residual); contiguous ``[R, H]``.
    - ``silu_and_mul(out [T, I], gate_up [T, 2I])``.
    - ``rotary_embedding(positions [T] int64, x [T, heads, head_dim], cos [P, head_dim/2],
      sin [P, head_dim/2])``: float32 tables, x rotated in place.
    - ``reshape_and_cache(key, value, kv_cache, slot_mapping [T] int64)``.
    - ``to_float(out [R, C] float32, x [R, C])``.
    - ``sample_inverse_cdf(out [n] int64, x [n, V] float32, k [n] float32, u [n] float32)``:
      a token per row drawn from softmax(x * k / log2(e)) (k = log2(e) / temperature) at
      the uniform u, by the inverse CDF over 64-wide chunks; -inf logits are never drawn.
    Each raises RuntimeError on a shape, dtype or range mismatch.
    The first build takes ~1 min on 2 cores; later processes load the cached .so.
    """
    if os.environ.get("LLMSERVE_CPU_OPS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline
        module = load_inline(
            name="llmserve_cpu_ops",
            cpp_sources=[_CPP_SOURCE],
            functions=_FUNCTIONS,
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"],
            build_directory=_build_dir(),
            verbose=False,
        )
    except Exception as e:  # no compiler / ninja / headers: the torch path still works
        logger.warning("CPU kernels unavailable (%s: %s); using the torch path",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    return module


def get_decode_kernel() -> Optional[Callable]:
    """``get_cpu_ops().paged_decode``, or None when the kernels are unavailable."""
    ops = get_cpu_ops()
    return None if ops is None else ops.paged_decode


def cpu_ops_for(t: torch.Tensor) -> Optional[Any]:
    """The ops module when ``t`` is a CPU tensor and the kernels are built, else None."""
    return get_cpu_ops() if t.device.type == "cpu" else None


def main() -> None:
    """Build (or load) the kernels and say where they are (``make`` runs this once)."""
    import time
    t0 = time.time()
    ops = get_cpu_ops()
    print(f"llmserve CPU kernels: {'built' if ops is not None else 'UNAVAILABLE'} "
          f"in {time.time() - t0:.1f}s ({_build_dir()})")


if __name__ == "__main__":
    main()
