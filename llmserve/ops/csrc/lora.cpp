// LoRA deltas of a step that mixes adapters, added into the base output in place (punica's
// SGMV idea, Chen et al. 2023, written for the CPU): for each segment (slot, start, end) of
// rows that share an adapter, t = x[rows] @ A[slot] (the shrink, every slice of a fused
// module at once: A's columns are the slices' ranks side by side), then for each column
// range (c0, c1, slice i) of the output, y[rows, c0:c1] += t[:, i*R:(i+1)*R] @ B[slot, :, c0:c1]
// (the expand). B holds each slice's rows only over its own columns ([S, R, N], no zero
// blocks: a block-diagonal B of q/k/v or gate/up is 2-3x larger).
//
// Weights float32 or bfloat16, activations float32 / bfloat16 / float16, all sums in
// float32; the delta is added into y once per element (y + delta rounded once, as torch's
// in-place add of a float32 delta). Rows are taken up to RB at a time so each weight is
// read once per block of rows: at decode a step is bound by reading the adapters' weights
// (SmolLM2-135M, rank 16, all seven projections: 9.8 MB per adapter in bfloat16).
// Each row's result depends only on its own x and slot (batch invariant).
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t RB = 8;    // rows per block (each weight read from memory once per block)
constexpr int64_t KC = 256;  // shrink: rows of A per chunk (<= 24 KB: stays in L1 for the block's rows)
constexpr int64_t CB = 64;   // expand: output columns per tile (4 vectors: 4 independent FMA chains)

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_f(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }

struct Item {
  int64_t slot, start, end;
};

#if defined(__AVX512F__)
// 16 weights as float32 (masked: lanes past the mask read 0).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __mmask16 mask_of(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// t[w0:w0+16] += sum_k x[k] * a[k, w0:w0+16] over k in [k0, k1), four FMA chains.
template <typename XT, typename WT>
inline void shrink16(float* t, const XT* x, const WT* a, int64_t W, int64_t w0, int64_t k0, int64_t k1) {
  const __mmask16 m = mask_of(W - w0);
  __m512 s0 = _mm512_maskz_loadu_ps(m, t + w0), s1 = _mm512_setzero_ps(), s2 = s1, s3 = s1;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    s0 = _mm512_fmadd_ps(_mm512_set1_ps(to_f(x[k])), load16(a + k * W + w0, m), s0);
    s1 = _mm512_fmadd_ps(_mm512_set1_ps(to_f(x[k + 1])), load16(a + (k + 1) * W + w0, m), s1);
    s2 = _mm512_fmadd_ps(_mm512_set1_ps(to_f(x[k + 2])), load16(a + (k + 2) * W + w0, m), s2);
    s3 = _mm512_fmadd_ps(_mm512_set1_ps(to_f(x[k + 3])), load16(a + (k + 3) * W + w0, m), s3);
  }
  for (; k < k1; ++k) s0 = _mm512_fmadd_ps(_mm512_set1_ps(to_f(x[k])), load16(a + k * W + w0, m), s0);
  _mm512_mask_storeu_ps(t + w0, m, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

// acc[0:64] = t[0:R] @ b[:, 0:nc] (b's rows N apart), nc <= 64.
template <typename WT>
inline void expand_tile(float* acc, const float* t, const WT* b, int64_t R, int64_t N, int64_t nc) {
  const __mmask16 m0 = mask_of(nc), m1 = mask_of(std::max<int64_t>(nc - 16, 0)),
                  m2 = mask_of(std::max<int64_t>(nc - 32, 0)), m3 = mask_of(std::max<int64_t>(nc - 48, 0));
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t j = 0; j < R; ++j) {
    const __m512 tv = _mm512_set1_ps(t[j]);
    const WT* bj = b + j * N;
    a0 = _mm512_fmadd_ps(tv, load16(bj, m0), a0);
    if (m1) a1 = _mm512_fmadd_ps(tv, load16(bj + 16, m1), a1);
    if (m2) a2 = _mm512_fmadd_ps(tv, load16(bj + 32, m2), a2);
    if (m3) a3 = _mm512_fmadd_ps(tv, load16(bj + 48, m3), a3);
  }
  _mm512_storeu_ps(acc, a0);
  _mm512_storeu_ps(acc + 16, a1);
  _mm512_storeu_ps(acc + 32, a2);
  _mm512_storeu_ps(acc + 48, a3);
}
#else
template <typename XT, typename WT>
inline void shrink16(float* t, const XT* x, const WT* a, int64_t W, int64_t w0, int64_t k0, int64_t k1) {
  const int64_t w1 = std::min(W, w0 + 16);
  for (int64_t k = k0; k < k1; ++k)
    for (int64_t w = w0; w < w1; ++w) t[w] += to_f(x[k]) * to_f(a[k * W + w]);
}

template <typename WT>
inline void expand_tile(float* acc, const float* t, const WT* b, int64_t R, int64_t N, int64_t nc) {
  std::fill(acc, acc + CB, 0.0f);
  for (int64_t j = 0; j < R; ++j)
    for (int64_t c = 0; c < nc; ++c) acc[c] += t[j] * to_f(b[j * N + c]);
}
#endif

// y[c0:c0+nc] += acc[0:nc], rounded once to y's dtype.
template <typename XT>
inline void add_row(XT* y, const float* acc, int64_t nc) {
  for (int64_t c = 0; c < nc; ++c) y[c] = from_f<XT>(to_f(y[c]) + acc[c]);
}

#if defined(__AVX512F__)
template <>
inline void add_row<float>(float* y, const float* acc, int64_t nc) {
  for (int64_t c = 0; c < nc; c += 16) {
    const __mmask16 m = mask_of(nc - c);
    _mm512_mask_storeu_ps(y + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + c), _mm512_loadu_ps(acc + c)));
  }
}
#endif

// Shrink of one block of rows [r0, r1) over A's rows [k0, k1): part [nr, W] (from zero).
template <typename XT, typename WT>
void shrink_part(float* part, const XT* x, const WT* a, int64_t nr, int64_t W, int64_t ldx, int64_t k0, int64_t k1) {
  std::fill(part, part + nr * W, 0.0f);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t w0 = 0; w0 < W; w0 += 16) shrink16<XT, WT>(part + r * W, x + r * ldx, a, W, w0, k0, k1);
}

// Expand of one block of rows through columns [c0, c1) of one slice (offset off in t).
template <typename XT, typename WT>
void expand_cols(XT* y, const float* t, const WT* b, int64_t nr, int64_t W, int64_t R, int64_t N, int64_t ldy,
                 int64_t c0, int64_t c1, int64_t off) {
  alignas(64) float acc[CB];
  for (int64_t cb = c0; cb < c1; cb += CB) {
    const int64_t nc = std::min(CB, c1 - cb);
    for (int64_t r = 0; r < nr; ++r) {  // the tile of b stays in L1 for the block's rows
      expand_tile<WT>(acc, t + r * W + off, b + cb, R, N, nc);
      add_row<XT>(y + r * ldy + cb, acc, nc);
    }
  }
}

constexpr int64_t CG = 4 * CB;  // expand: columns per task

struct Cols {
  int64_t c0, c1, off;
};

// Two phases, each split into tasks over the threads: (block, chunk of A's rows) partial
// shrinks, then (block, group of columns) expands, each summing its block's partials in
// chunk order first. The split is fixed by the shapes, not the threads or the batch, so a
// row's result is the same alone or in any batch. Threads even for one decode row: at
// 1 row a module's adapter weights (~80 KB, cold after the base GEMM streamed the model)
// arrive faster over two cores.
template <typename XT, typename WT>
void run(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
         const std::vector<Item>& items, const torch::Tensor& ranges, int64_t work) {
  const int64_t K = x.size(1), W = a.size(2), R = b.size(1), N = y.size(1), P = ranges.size(0);
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  XT* yp = y.data_ptr<XT>();
  const XT* xp = x.data_ptr<XT>();
  const WT* ap = a.data_ptr<WT>();
  const WT* bp = b.data_ptr<WT>();
  const int32_t* rp = ranges.data_ptr<int32_t>();
  const int64_t n = static_cast<int64_t>(items.size()), nkc = (K + KC - 1) / KC;
  thread_local std::vector<Cols> cols;
  cols.clear();
  for (int64_t p = 0; p < P; ++p)
    for (int64_t c = rp[3 * p]; c < rp[3 * p + 1]; c += CG)
      cols.push_back({c, std::min<int64_t>(rp[3 * p + 1], c + CG), rp[3 * p + 2] * R});
  const int64_t ncol = static_cast<int64_t>(cols.size());
  thread_local std::vector<float> parts;
  if (static_cast<int64_t>(parts.size()) < n * nkc * RB * W) parts.resize(n * nkc * RB * W);
  float* pp = parts.data();
  const Cols* cp = cols.data();
#pragma omp parallel if (work >= (1 << 14))
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n * nkc; ++i) {
      const Item& it = items[i / nkc];
      const int64_t k0 = (i % nkc) * KC;
      shrink_part<XT, WT>(pp + i * RB * W, xp + it.start * ldx, ap + it.slot * K * W, it.end - it.start, W, ldx, k0,
                          std::min(K, k0 + KC));
    }
    thread_local std::vector<float> tv;  // one block's t [RB, W]
    if (static_cast<int64_t>(tv.size()) < RB * W) tv.resize(RB * W);
    float* t = tv.data();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n * ncol; ++i) {
      const Item& it = items[i / ncol];
      const int64_t nr = it.end - it.start;
      const float* part = pp + (i / ncol) * nkc * RB * W;
      std::copy(part, part + nr * W, t);
      for (int64_t c = 1; c < nkc; ++c)
        for (int64_t e = 0; e < nr * W; ++e) t[e] += part[c * RB * W + e];
      const Cols& cc = cp[i % ncol];
      expand_cols<XT, WT>(yp + it.start * ldy, t, bp + it.slot * R * N, nr, W, R, N, ldy, cc.c0, cc.c1, cc.off);
    }
  }
}

}  // namespace

// y [T, N] += per segment (slot, start, end) of segs (int32 [G, 3]): x[start:end] @ a[slot] then
// per range (c0, c1, slice) of ranges (int32 [P, 3]) the expand through b[slot, :, c0:c1].
// x [T, K] and y in one dtype (float32 / bfloat16 / float16); a [S, K, W], b [S, R, N]
// float32 or bfloat16, W = slices * R, contiguous; x and y contiguous along rows (any row stride).
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor segs,
              torch::Tensor ranges) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3, "lora_add: y, x 2-D; a, b 3-D");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(),
              "lora_add: a and b must be contiguous, the rows of x and y too");
  TORCH_CHECK(x.size(0) == y.size(0) && x.size(1) == a.size(1) && b.size(2) == y.size(1) && a.size(0) == b.size(0),
              "lora_add: shapes do not match: y ", y.sizes(), " x ", x.sizes(), " a ", a.sizes(), " b ", b.sizes());
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == b.scalar_type(),
              "lora_add: x and y, a and b must share a dtype");
  TORCH_CHECK(a.size(2) % b.size(1) == 0, "lora_add: a's width must be a multiple of b's rank");
  TORCH_CHECK(segs.scalar_type() == at::kInt && ranges.scalar_type() == at::kInt && segs.is_contiguous() &&
                  ranges.is_contiguous() && segs.dim() == 2 && segs.size(1) == 3 && ranges.dim() == 2 &&
                  ranges.size(1) == 3,
              "lora_add: segs and ranges must be contiguous int32 [*, 3]");
  const int64_t T = y.size(0), S = a.size(0), N = y.size(1), slices = a.size(2) / b.size(1);
  const int32_t* rp = ranges.data_ptr<int32_t>();
  for (int64_t p = 0; p < ranges.size(0); ++p)
    TORCH_CHECK(rp[3 * p] >= 0 && rp[3 * p] <= rp[3 * p + 1] && rp[3 * p + 1] <= N && rp[3 * p + 2] >= 0 &&
                    rp[3 * p + 2] < slices,
                "lora_add: range ", p, " out of bounds");
  thread_local std::vector<Item> items;  // reused: no allocation per call
  items.clear();
  const int32_t* sp = segs.data_ptr<int32_t>();
  int64_t rows = 0;
  for (int64_t g = 0; g < segs.size(0); ++g) {
    const int64_t slot = sp[3 * g], s = sp[3 * g + 1], e = sp[3 * g + 2];
    TORCH_CHECK(slot >= 0 && slot < S && s >= 0 && s <= e && e <= T, "lora_add: segment ", g, " out of bounds");
    for (int64_t r = s; r < e; r += RB) items.push_back({slot, r, std::min(e, r + RB)});
    rows += e - s;
  }
  const int64_t work = rows * (a.size(1) * a.size(2) + b.size(1) * N);
  const bool wbf = a.scalar_type() == at::kBFloat16;
  TORCH_CHECK(wbf || a.scalar_type() == at::kFloat, "lora_add: weights must be float32 or bfloat16");
  switch (x.scalar_type()) {
    case at::kFloat:
      wbf ? run<float, c10::BFloat16>(y, x, a, b, items, ranges, work) : run<float, float>(y, x, a, b, items, ranges, work);
      break;
    case at::kBFloat16:
      wbf ? run<c10::BFloat16, c10::BFloat16>(y, x, a, b, items, ranges, work)
          : run<c10::BFloat16, float>(y, x, a, b, items, ranges, work);
      break;
    case at::kHalf:
      wbf ? run<c10::Half, c10::BFloat16>(y, x, a, b, items, ranges, work) : run<c10::Half, float>(y, x, a, b, items, ranges, work);
      break;
    default:
      TORCH_CHECK(false, "lora_add: x must be float32, bfloat16 or float16");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops: an adapter-loading thread runs meanwhile.
  m.def("lora_add", &lora_add, "y += LoRA deltas per segment (see lora.cpp)", py::arg("y"), py::arg("x"),
        py::arg("a"), py::arg("b"), py::arg("segs"), py::arg("ranges"), py::call_guard<py::gil_scoped_release>());
}
