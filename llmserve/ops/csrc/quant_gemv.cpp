// Small-step linear layers on GGUF-quantized weights (Q4_0, Q4_1, Q8_0 blocks of 32), for
// steps of few tokens, where a bf16 GEMM is bound by reading its weights: a Q4_1 row is
// 20 bytes per 32 weights instead of 64.
//
// Weights are repacked once at load (quant_repack) into one layout for all three types:
// per row, unsigned codes q and per-block float16 (d, m) with w = d * q + m exactly
// (Q4_0: q = nibble, m = -8d; Q4_1: as stored; Q8_0: q = int8 + 128, m = -128d; the
// products and sums are exact in float32, so w equals gguf.quants' value bit for bit).
// Codes are grouped 4 blocks at a time (128 weights) so one 64-byte load feeds a VNNI
// dot product whose 16 int32 lanes are 4 lanes per block: Q4 keeps the file's byte order
// (byte i of a block holds weights i and i + 16 as low and high nibble); Q8 stores a
// group's weights 0..15 of each block, then its weights 16..31.
//
// Two kernels share the layout:
// - int8 (default, llama.cpp's scheme): each 32-value block of a token's activations is
//   quantized to int8 with its own scale (d_x = max|x| / 127, round to nearest), then
//   sum w*x = d * d_x * sum(q * q_x) + m * sum(x), the integer dot on AVX512-VNNI and the
//   block sum of x exact in float32.
// - float32 (exact): each block is dequantized in registers and multiplied with the
//   float32 activations; the row sum is float32.
// Rows are independent of each other and of the number of tokens.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t QK = 32;  // weights per block
constexpr int64_t GB = 4;   // blocks per group
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml type ids

int64_t block_bytes(int64_t qt) {
  switch (qt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
  }
  TORCH_CHECK(false, "quant: unsupported GGML type ", qt, " (Q4_0=2, Q4_1=3, Q8_0=8)");
}

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// One GGUF block -> 32 codes in weight order, d and m (see the layout above).
void split_block(const uint8_t* b, int64_t qt, uint8_t* q, uint16_t* dm) {
  float d = h2f(b), m;
  if (qt == Q8_0) {
    for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(b[2 + i] ^ 0x80);  // int8 + 128
    m = -128.f * d;
  } else {
    const uint8_t* qs = b + (qt == Q4_1 ? 4 : 2);
    for (int i = 0; i < 16; ++i) { q[i] = qs[i] & 0x0F; q[i + 16] = qs[i] >> 4; }
    m = qt == Q4_1 ? h2f(b + 2) : -8.f * d;
  }
  dm[0] = f2h(d);
  dm[1] = f2h(m);
  TORCH_CHECK(std::isfinite(_cvtsh_ss(dm[1])), "quant_repack: block offset overflows float16");
}

// Codes of block j (of r in its group) into the group's bytes.
void place_codes(const uint8_t* q, int bits, int64_t j, int64_t r, uint8_t* group) {
  if (bits == 4) {
    for (int i = 0; i < 16; ++i) group[16 * j + i] = static_cast<uint8_t>(q[i] | (q[i + 16] << 4));
  } else {
    std::memcpy(group + 16 * j, q, 16);
    std::memcpy(group + 16 * r + 16 * j, q + 16, 16);
  }
}

inline __mmask64 group_mask(int64_t r) { return r == GB ? ~0ULL : (1ULL << (16 * r)) - 1; }

// The group's low (weights 0..15 of each block) and high (16..31) codes, 16 bytes a block.
// Full groups take plain loads: masked loads of memory not in cache streamed at half the
// rate here (AMD Zen 4: 6 against 12 GB/s on one core), so only a row's tail group has them.
template <int BITS>
inline void load_codes(const uint8_t* g, int64_t r, __m512i& lo, __m512i& hi) {
  const __mmask64 k = group_mask(r);
  if constexpr (BITS == 4) {
    const __m512i v = r == GB ? _mm512_loadu_si512(g) : _mm512_maskz_loadu_epi8(k, g);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(v, nib);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  } else {
    lo = r == GB ? _mm512_loadu_si512(g) : _mm512_maskz_loadu_epi8(k, g);
    hi = r == GB ? _mm512_loadu_si512(g + 64) : _mm512_maskz_loadu_epi8(k, g + 16 * r);
  }
}

// Per-block d (lanes 4j..4j+3 = block j) and m of a group, from its float16 pairs.
inline void load_scales(const uint16_t* dm, int64_t r, __m512& d, __m512& m) {
  const __m128i h = r == GB ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(dm))
                            : _mm_maskz_loadu_epi16(static_cast<__mmask8>((1U << (2 * r)) - 1), dm);
  const __m256 v = _mm256_cvtph_ps(h);
  const __m512 w = _mm512_castps256_ps512(v);
  d = _mm512_permutexvar_ps(_mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0), w);
  m = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 7, 7, 5, 5, 5, 5, 3, 3, 3, 3, 1, 1, 1, 1), w);
}

struct Packed {
  const uint8_t* codes;
  const uint16_t* dm;
  int64_t nb, row_bytes;
  int64_t groups() const { return (nb + GB - 1) / GB; }
  int64_t group_bytes(int bits) const { return GB * 16 * bits / 4; }
};

// Activations as int8 blocks in the packed groups' order, per token: codes [groups, 128]
// (64 bytes matching the low codes, then 64 matching the high), d_x per lane [groups, 16]
// and sum(x) / 4 per lane [groups, 16] (four lanes a block sum to it exactly); a tail
// group's missing blocks are zeros.
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t G;
  template <typename T>
  QuantX(const T* x, int64_t M, int64_t nb) : G((nb + GB - 1) / GB) {
    float xb[QK];
    q.assign(M * G * 128, 0);
    d.assign(M * G * 16, 0.f);
    s.assign(M * G * 16, 0.f);
    for (int64_t t = 0; t < M; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        for (int i = 0; i < QK; ++i) xb[i] = static_cast<float>(x[(t * nb + b) * QK + i]);
        block(xb, t, b);
      }
  }
  void block(const float* xb, int64_t t, int64_t b) {
    float amax = 0.f, sum = 0.f;
    for (int i = 0; i < QK; ++i) { amax = std::max(amax, std::fabs(xb[i])); sum += xb[i]; }
    const float dx = amax / 127.f;
    const int64_t g = b / GB, j = b % GB, base = (t * G + g) * 128;
    for (int i = 0; i < QK; ++i) {
      // x * 127 / amax, each step rounded once: a value at exactly half a step (x = amax / 2
      // is common in bfloat16) rounds to even, not by the rounding of a reciprocal.
      const int v = amax > 0.f ? static_cast<int>(std::nearbyint(xb[i] * 127.f / amax)) : 0;
      q[base + (i < 16 ? 0 : 64) + 16 * j + (i & 15)] = static_cast<int8_t>(std::clamp(v, -127, 127));
    }
    for (int l = 0; l < 4; ++l) {
      d[(t * G + g) * 16 + 4 * j + l] = dx;
      s[(t * G + g) * 16 + 4 * j + l] = sum * 0.25f;
    }
  }
};

template <int BITS, int MT, typename OutT>
void rows_int8(const Packed& p, const QuantX& xq, int64_t t0, int64_t n0, int64_t n1, OutT* out, int64_t N) {
  const int64_t G = p.groups(), gb = p.group_bytes(BITS);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.codes + n * p.row_bytes;
    const uint16_t* dm = p.dm + n * p.nb * 2;
    __m512 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = std::min(GB, p.nb - g * GB);
      __m512i lo, hi;
      __m512 d, m;
      load_codes<BITS>(row + g * gb, r, lo, hi);
      load_scales(dm + g * GB * 2, r, d, m);
      for (int t = 0; t < MT; ++t) {
        const int64_t xo = (t0 + t) * G + g;
        const int8_t* xi = xq.q.data() + xo * 128;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xi));
        dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(xi + 64));
        const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps(xq.d.data() + xo * 16));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[t]);
        acc[t] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xq.s.data() + xo * 16), acc[t]);
      }
    }
    for (int t = 0; t < MT; ++t) out[(t0 + t) * N + n] = static_cast<OutT>(_mm512_reduce_add_ps(acc[t]));
  }
}

// Block b's dequantized weights 0..15 (lo) and 16..31 (hi), float32, exact.
template <int BITS>
inline void dequant(const Packed& p, const uint8_t* row, const uint16_t* dm, int64_t b, __m512& lo, __m512& hi) {
  const int64_t g = b / GB, j = b % GB, r = std::min(GB, p.nb - g * GB);
  const uint8_t* grp = row + g * p.group_bytes(BITS);
  __m512i ql, qh;
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 16 * j));
    const __m128i nib = _mm_set1_epi8(0x0F);
    ql = _mm512_cvtepu8_epi32(_mm_and_si128(v, nib));
    qh = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), nib));
  } else {
    ql = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 16 * j)));
    qh = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 16 * r + 16 * j)));
  }
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(dm[2 * b])), m = _mm512_set1_ps(_cvtsh_ss(dm[2 * b + 1]));
  lo = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(ql)), m);
  hi = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(qh)), m);
}

template <int BITS, int MT, typename OutT>
void rows_f32(const Packed& p, const float* x, int64_t t0, int64_t n0, int64_t n1, OutT* out, int64_t N) {
  const int64_t K = p.nb * QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.codes + n * p.row_bytes;
    const uint16_t* dm = p.dm + n * p.nb * 2;
    __m512 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
      __m512 lo, hi;
      dequant<BITS>(p, row, dm, b, lo, hi);
      for (int t = 0; t < MT; ++t) {
        const float* xb = x + (t0 + t) * K + b * QK;
        acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[t]);
        acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[t]);
      }
    }
    for (int t = 0; t < MT; ++t) out[(t0 + t) * N + n] = static_cast<OutT>(_mm512_reduce_add_ps(acc[t]));
  }
}

// Tokens 4 at a time (each weight group is loaded once per 4 tokens), rows split over
// threads in tasks of >= 64 rows (enough to amortise the hand-off, few enough to share).
template <typename Tile>
void for_tiles(int64_t M, int64_t N, Tile tile) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t t = 0;
    for (; t + 4 <= M; t += 4) tile(std::integral_constant<int, 4>(), t, n0, n1);
    switch (M - t) {
      case 3: tile(std::integral_constant<int, 3>(), t, n0, n1); break;
      case 2: tile(std::integral_constant<int, 2>(), t, n0, n1); break;
      case 1: tile(std::integral_constant<int, 1>(), t, n0, n1); break;
      default: break;
    }
  });
}

// int8: x in its own dtype (quantized straight from it); float32: x as float32. The sums
// go to out in its dtype (float32 or rounded to nearest even once), no extra tensor.
template <int BITS, typename InT, typename OutT>
void run(const Packed& p, const InT* x, int64_t M, int64_t N, bool int8, OutT* out) {
  if constexpr (!std::is_same_v<InT, float>) {
    TORCH_CHECK(int8, "quant_linear: the float32 kernel takes float32 x");
    const QuantX xq(x, M, p.nb);
    for_tiles(M, N, [&](auto mt, int64_t t0, int64_t n0, int64_t n1) {
      rows_int8<BITS, decltype(mt)::value>(p, xq, t0, n0, n1, out, N);
    });
  } else if (int8) {
    const QuantX xq(x, M, p.nb);
    for_tiles(M, N, [&](auto mt, int64_t t0, int64_t n0, int64_t n1) {
      rows_int8<BITS, decltype(mt)::value>(p, xq, t0, n0, n1, out, N);
    });
  } else {
    for_tiles(M, N, [&](auto mt, int64_t t0, int64_t n0, int64_t n1) {
      rows_f32<BITS, decltype(mt)::value>(p, x, t0, n0, n1, out, N);
    });
  }
}

template <typename InT, typename OutT>
void dispatch_bits(const Packed& p, int64_t bits, const InT* x, int64_t M, int64_t N, bool int8, OutT* out) {
  if (bits == 4) run<4>(p, x, M, N, int8, out);
  else run<8>(p, x, M, N, int8, out);
}

template <typename OutT>
void dispatch_in(const Packed& p, int64_t bits, const at::Tensor& x, bool int8, OutT* out, int64_t N) {
  const int64_t M = x.size(0);
  if (int8 && x.scalar_type() == at::kBFloat16) dispatch_bits(p, bits, x.data_ptr<at::BFloat16>(), M, N, int8, out);
  else if (int8 && x.scalar_type() == at::kHalf) dispatch_bits(p, bits, x.data_ptr<at::Half>(), M, N, int8, out);
  else {
    at::Tensor xf = x.to(at::kFloat).contiguous();
    dispatch_bits(p, bits, xf.data_ptr<float>(), M, N, int8, out);
  }
}

}  // namespace

// GGUF blocks uint8 [N, K/32*block_bytes] -> [codes uint8 [N, K/2 (Q4) or K (Q8)],
// dm float16-as-int16 [N, K/32*2]] (the layout above). Raises for a type or shape mismatch.
std::vector<at::Tensor> quant_repack(at::Tensor w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "quant_repack: w uint8 [N, row_bytes]");
  const int64_t bb = block_bytes(qtype), N = w.size(0);
  TORCH_CHECK(w.size(1) % bb == 0, "quant_repack: row of ", w.size(1), " bytes is not whole blocks of ", bb);
  const int64_t nb = w.size(1) / bb, bits = qtype == Q8_0 ? 8 : 4, cb = nb * 16 * bits / 4;
  at::Tensor codes = at::empty({N, cb}, w.options());
  at::Tensor dm = at::empty({N, nb * 2}, w.options().dtype(at::kShort));
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(dm.data_ptr<int16_t>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    uint8_t q[32];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t g = b / GB, r = std::min(GB, nb - g * GB);
        split_block(src + (n * nb + b) * bb, qtype, q, dp + (n * nb + b) * 2);
        place_codes(q, bits, b % GB, r, cp + n * cb + g * GB * 16 * bits / 4);
      }
  });
  return {codes, dm};
}

// out [M, N] = x [M, K] @ W.T for W repacked by quant_repack (bits 4 or 8); x float32,
// bfloat16 or float16; int8: quantize x per block (else the exact float32 kernel); out in
// x's dtype (float32 sums rounded once) or float32 with out_float.
at::Tensor quant_linear(at::Tensor x, at::Tensor codes, at::Tensor dm, int64_t bits, bool int8, bool out_float) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && dm.dim() == 2 && codes.scalar_type() == at::kByte &&
                  dm.scalar_type() == at::kShort && codes.is_contiguous() && dm.is_contiguous(),
              "quant_linear: x [M, K], codes uint8 [N, *], dm int16 [N, K/16] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = dm.size(1) / 2;
  TORCH_CHECK(dm.size(0) == N && K == nb * QK && codes.size(1) == nb * 16 * bits / 4, "quant_linear: x ", x.sizes(),
              " does not fit codes ", codes.sizes(), " and dm ", dm.sizes());
  at::Tensor xc = x.contiguous();
  const auto out_type = out_float ? at::kFloat : x.scalar_type();
  TORCH_CHECK(out_type == at::kFloat || out_type == at::kBFloat16 || out_type == at::kHalf,
              "quant_linear: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_type));
  const Packed p{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>()), nb,
                 codes.size(1)};
  if (out_type == at::kFloat) dispatch_in(p, bits, xc, int8, out.data_ptr<float>(), N);
  else if (out_type == at::kBFloat16) dispatch_in(p, bits, xc, int8, out.data_ptr<at::BFloat16>(), N);
  else dispatch_in(p, bits, xc, int8, out.data_ptr<at::Half>(), N);
  return out;
}

// Rows ids [T] (int64) of a repacked weight, dequantized exactly: float32 [T, K] (an
// embedding lookup from the tied LM head's blocks). Raises for an id out of range.
at::Tensor quant_rows(at::Tensor codes, at::Tensor dm, int64_t bits, at::Tensor ids) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_rows: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(codes.is_contiguous() && dm.is_contiguous() && ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "quant_rows: contiguous codes and dm, ids int64 [T]");
  const int64_t N = codes.size(0), nb = dm.size(1) / 2, T = ids.size(0);
  at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "quant_rows: id ", ip[t], " out of range [0, ", N, ")");
  at::Tensor out = at::empty({T, nb * QK}, codes.options().dtype(at::kFloat));
  const Packed p{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>()), nb,
                 codes.size(1)};
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* row = p.codes + ip[t] * p.row_bytes;
      const uint16_t* d = p.dm + ip[t] * nb * 2;
      for (int64_t b = 0; b < nb; ++b) {
        __m512 lo, hi;
        if (bits == 4) dequant<4>(p, row, d, b, lo, hi);
        else dequant<8>(p, row, d, b, lo, hi);
        _mm512_storeu_ps(op + t * nb * QK + b * QK, lo);
        _mm512_storeu_ps(op + t * nb * QK + b * QK + 16, hi);
      }
    }
  });
  return out;
}

// Exact float32 dequantization of GGUF rows, as gguf.quants (for the tests and probes).
at::Tensor quant_dequantize(at::Tensor w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "quant_dequantize: w uint8 [N, row_bytes]");
  const int64_t bb = block_bytes(qtype), N = w.size(0), nb = w.size(1) / bb;
  at::Tensor out = at::empty({N, nb * QK}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * nb, 1024, [&](int64_t b0, int64_t b1) {
    uint8_t q[32];
    uint16_t dm[2];
    for (int64_t b = b0; b < b1; ++b) {
      split_block(wp + b * bb, qtype, q, dm);
      const float d = _cvtsh_ss(dm[0]), m = _cvtsh_ss(dm[1]);
      for (int i = 0; i < QK; ++i) op[b * QK + i] = d * static_cast<float>(q[i]) + m;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_repack", &quant_repack, "GGUF rows -> [codes, dm] (see quant_gemv.cpp)", py::arg("w"), py::arg("qtype"));
  m.def("quant_linear", &quant_linear, "x [M, K] @ W.T from repacked codes/dm -> [M, N]", py::arg("x"),
        py::arg("codes"), py::arg("dm"), py::arg("bits"), py::arg("int8") = true, py::arg("out_float") = false);
  m.def("quant_rows", &quant_rows, "rows ids of a repacked weight -> float32 [T, K]", py::arg("codes"),
        py::arg("dm"), py::arg("bits"), py::arg("ids"));
  m.def("quant_dequantize", &quant_dequantize, "GGUF rows -> float32 [N, K], exact");
}
