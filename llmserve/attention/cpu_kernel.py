"""C++ paged-decode attention kernel for CPUs, built on first use with
``torch.utils.cpp_extension.load_inline`` (-O3 -march=native, OpenMP).

Why: the pure-torch decode path copies every request's K/V blocks out of the pool with
advanced indexing before its matmuls, which DESIGN.md measured at 3-4 ms per layer for 64
sequences x 256 context; this kernel reads the blocks in place (vLLM's
``paged_attention_v1`` idea, written for CPU): one OpenMP task per (request, KV head)
computes the scores of the head's query group against every context token, a float32
softmax, and the weighted sum of V.

The build is cached under ``~/.cache/llmserve/torch_extensions`` (rebuilt when the source
or torch version changes). If it fails (no compiler, no ninja), ``get_decode_kernel``
returns None and ``PagedAttention`` uses ``decode_attention_torch``; tests compare the two.
Prebuild with ``python -m llmserve.attention.cpu_kernel``.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Callable, Optional

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

static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }
static inline float to_f(at::Half x) { return static_cast<float>(x); }

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
// e^x for x <= 0 (softmax inputs): 2^(x log2 e) = 2^n * 2^f, |f| <= 0.5, degree-7 Taylor for
// 2^f (relative error < 1e-7 before rounding).
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
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
#endif

// sc[0:L] = exp(sc - max), returns the sum
static inline float softmax_numerator(float* sc, int64_t L) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < L; ++i) m = std::max(m, sc[i]);
  float sum = 0.f;
  int64_t i = 0;
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

template <typename scalar_t>
static void decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv,
                        const at::Tensor& bt, const at::Tensor& sl, int64_t n,
                        double scale, int64_t window) {
  const int64_t nh = q.size(1), hd = q.size(2);
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t bs = kv.size(2), nkv = kv.size(3);
  const int64_t g = nh / nkv;
  const int64_t tok_stride = nkv * hd, blk_stride = bs * nkv * hd;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = kv.data_ptr<scalar_t>();
  const scalar_t* vp = kp + kv.stride(0);
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t bt_s0 = bt.stride(0);
  const int32_t* slp = sl.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const bool vec = LLMSERVE_AVX512 && hd % 16 == 0;
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
        const scalar_t* row = kp + table[p / bs] * blk_stride + (p % bs) * tok_stride + kh0 * hd;
        for (int64_t h = 0; h < hq; ++h)
          scores[h * L + (p - start)] = dot(qf.data() + h * hd, row + (h / g) * hd, hd, vec);
      }
      for (int64_t h = 0; h < hq; ++h) denom[h] = 1.f / softmax_numerator(scores.data() + h * L, L);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = start; p < len; ++p) {
        const scalar_t* row = vp + table[p / bs] * blk_stride + (p % bs) * tok_stride + kh0 * hd;
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
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_impl<float>(out, q, kv_cache, block_tables, seq_lens, n, scale, window); break;
    case at::kBFloat16:
      decode_impl<at::BFloat16>(out, q, kv_cache, block_tables, seq_lens, n, scale, window); break;
    case at::kHalf:
      decode_impl<at::Half>(out, q, kv_cache, block_tables, seq_lens, n, scale, window); break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
}
"""


def _build_dir() -> str:
    root = os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "torch_extensions")
    digest = hashlib.sha256((_CPP_SOURCE + torch.__version__).encode()).hexdigest()[:12]
    path = os.path.join(root, f"paged_decode_{digest}")
    os.makedirs(path, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def get_decode_kernel() -> Optional[Callable]:
    """The compiled ``paged_decode(out, q, kv_cache, block_tables, seq_lens, n, scale,
    window)`` op, or None when it cannot be built here (logged once).

    out/q: ``[N, num_heads, head_dim]`` (model dtype); kv_cache: one layer's
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; block_tables ``[>=n, M]`` and
    seq_lens ``[>=n]`` int32; n: decode requests; window: sliding window (0 = none).
    The first build takes ~30-60 s on 2 cores; later processes load the cached .so.
    """
    try:
        from torch.utils.cpp_extension import load_inline
        module = load_inline(
            name="llmserve_paged_decode",
            cpp_sources=[_CPP_SOURCE],
            functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=_build_dir(),
            verbose=False,
        )
    except Exception as e:  # no compiler / ninja / headers: the torch path still works
        logger.warning("paged-attention CPU kernel unavailable (%s: %s); using the torch path",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    return module.paged_decode


if __name__ == "__main__":
    import time
    t0 = time.time()
    op = get_decode_kernel()
    print(f"paged_decode kernel: {'built' if op is not None else 'UNAVAILABLE'} "
          f"in {time.time() - t0:.1f}s ({_build_dir()})")
