// Linear layers on GGUF-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 blocks of 32, and
// the K-quants Q2_K..Q6_K in their own layout below) with int8
// activations on AVX512-VNNI or AVX2 (simd16.h), llama.cpp's scheme: each 32-value block of a token's
// activations is quantized to int8 with its own scale (d_x = max|x| / 127, round to
// nearest even), then sum w*x = d * d_x * sum(q * q_x) + m * d_x * sum(q_x) per block, the
// integer sums exact in int32: the dot product of the weights with the int8-rounded x, as
// llama.cpp's q4_1 x q8_1 (its y->s). Against the float sum of x (the rule before), the
// offsets m (-8d, -16d, -128d, the block min) no longer scale the rounding error of x:
// SmolLM2 Q4_1's perplexity on benchmarks/data/declaration.txt went from 9.25 to 8.79
// (float32 dense: 8.84).
//
// Weights are repacked once at load (quant_repack) into one layout for all these types,
// w = d * q + m with unsigned codes q and float16 d, m per block (Q4_0: m = -8d; Q4_1:
// as stored; Q5_0: 5-bit q, m = -16d; Q5_1: as stored; Q8_0: q = int8 + 128, m = -128d;
// IQ4_NL: q = its int8 level + 128, m = -128d;
// 5- and 8-bit codes in the 8-bit tiles; all exact: w equals gguf.quants' value):
// rows in groups of 16, and per (group, block) the 16 rows' codes interleaved so that a
// 64-byte vector holds 4 consecutive codes of each of the 16 rows. One VNNI instruction
// then adds 4 products into each row's own int32 lane against 4 activation codes
// broadcast, so a block is 8 such instructions for 16 rows, and the per-block float
// scaling (the costly part of a per-block scheme) is paid once per 16 x 32 weights
// instead of once per 32. Q4: 4 chunks of 64 bytes per (group, block), chunk c holding
// codes 4c..4c+3 in its low nibbles and 4c+16..4c+19 in its high ones; Q8: 8 chunks of
// codes 4j..4j+3. Scales: per (group, block) 16 d then 16 m, float16, for Q4_1 and Q5_1;
// the symmetric types (Q4_0, Q5_0, Q8_0, IQ4_NL) keep only the 16 d, and the kernels take
// m = -2^(bits-1) d (exact in float32, as the stored m was): 2 bytes less per 32 weights,
// which brought the weights of llama-quantize's Q4_K_M of SmolLM2 (mostly Q5_0) from
// 1.114x to 1.050x its file size in memory. Rows past N in the last group are zeros.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "simd16.h"
#include "packed_linear.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

// A per-thread hook into a linear's parallel region (the C ABI shared with lora.cpp's
// LoRAModule, armed once a step by LoRAModule::arm; abi must be kLinearHookAbi). The GEMM
// first calls begin(ctx, x, ldx, xtype) on the calling thread with its input (rows ldx
// elements apart; xtype: kHookF32, kHookBF16 or kHookF16). Then each thread that runs a
// share of the output columns [c0, c1) calls pre(ctx, c0, c1, n) before its share of the
// GEMM and post(ctx, c0, c1, out, ldo) after it, out pointing at the whole output (rows ldo
// elements apart, in x's dtype): the LoRA deltas then run inside the GEMM's threads, each
// adding into its own columns, instead of in a call of their own after it (see lora.cpp).
// A thread's calls may run one after another on one thread (a nested or one-thread
// region): a hook must not wait for another thread's pre unless that thread has started it.
struct LinearHook {
  int64_t abi;
  void (*pre)(void* ctx, int64_t c0, int64_t c1, int64_t n);
  void (*post)(void* ctx, int64_t c0, int64_t c1, void* out, int64_t ldo);
  void* ctx;
  int64_t rows, n, k;  // the x rows, output columns and input columns it was armed for (checked)
  void (*begin)(void* ctx, const void* x, int64_t ldx, int64_t xtype);
};
constexpr int64_t kLinearHookAbi = 2;
constexpr int64_t kHookF32 = 0, kHookBF16 = 1, kHookF16 = 2;

namespace {

using namespace simd16;

constexpr int64_t QK = 32;  // weights per block
constexpr int64_t RG = 16;  // rows per group (one int32 lane each)
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = 20 };  // ggml type ids
// IQ4_NL's 16 non-linear levels (ggml's kvalues_iq4nl).
constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

int64_t block_bytes(int64_t qt) {
  switch (qt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case IQ4_NL: return 18;
  }
  TORCH_CHECK(false, "quant: unsupported GGML type ", qt, " (Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, IQ4_NL=20)");
}

// Code width in the repacked layout: 5-bit codes (Q5_0, Q5_1) take 5-bit tiles, IQ4_NL's
// int8 levels the 8-bit ones.
int qbits(int64_t qt) { return qt == Q4_0 || qt == Q4_1 ? 4 : qt == Q5_0 || qt == Q5_1 ? 5 : 8; }

// float16 scales per (group, block): d and m (Q4_1, Q5_1), or d alone (m = -2^(bits-1) d).
int64_t scale_halfs(int64_t qt) { return qt == Q4_1 || qt == Q5_1 ? 32 : 16; }

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// One GGUF block -> 32 codes in weight order, d and m (see the layout above).
void split_block(const uint8_t* b, int64_t qt, uint8_t* q, uint16_t& d16, uint16_t& m16) {
  float d = h2f(b), m;
  if (qt == Q8_0) {
    for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(b[2 + i] ^ 0x80);  // int8 + 128
    m = -128.f * d;
  } else if (qt == IQ4_NL) {  // d * level: q = level + 128, m = -128d (d * q exact in float32)
    for (int i = 0; i < 16; ++i) {
      q[i] = static_cast<uint8_t>(kIQ4NL[b[2 + i] & 0x0F] + 128);
      q[i + 16] = static_cast<uint8_t>(kIQ4NL[b[2 + i] >> 4] + 128);
    }
    m = -128.f * d;
  } else if (qt == Q5_0 || qt == Q5_1) {
    // d (m) float16, qh: bit i = bit 4 of code i, qs: codes i and i + 16 in one byte.
    const int off = qt == Q5_1 ? 4 : 2;
    uint32_t qh;
    std::memcpy(&qh, b + off, 4);
    const uint8_t* qs = b + off + 4;
    for (int i = 0; i < 16; ++i) {
      q[i] = static_cast<uint8_t>((qs[i] & 0x0F) | (((qh >> i) & 1) << 4));
      q[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
    m = qt == Q5_1 ? h2f(b + 2) : -16.f * d;  // Q5_0: d * (q - 16), exact as d * q - 16 d
  } else {
    const uint8_t* qs = b + (qt == Q4_1 ? 4 : 2);
    for (int i = 0; i < 16; ++i) { q[i] = qs[i] & 0x0F; q[i + 16] = qs[i] >> 4; }
    m = qt == Q4_1 ? h2f(b + 2) : -8.f * d;
  }
  d16 = f2h(d);
  m16 = f2h(m);
  TORCH_CHECK(std::isfinite(_cvtsh_ss(m16)), "quant_repack: block offset overflows float16");
}

// Codes of one (group, block): 256 bytes (4-bit), 320 (5-bit: the 4-bit tile of the low
// nibbles, then 64 bytes whose byte l*4 + i holds in bit j bit 4 of code 4j + i of row l:
// 5.5 bits per weight with Q5_0's float16 d, as in the file, 6 with Q5_1's d and m, where
// 8-bit codes took 9), 512 (8-bit).
int64_t tile_bytes(int bits) { return RG * QK * bits / 8; }

// Code k of lane l in a (group, block) tile.
inline uint8_t tile_code(const uint8_t* tile, int bits, int64_t l, int64_t k) {
  if (bits == 8) return tile[(k / 4) * 64 + l * 4 + k % 4];
  const int64_t c = (k % 16) / 4, shift = k < 16 ? 0 : 4;
  const uint8_t lo = (tile[c * 64 + l * 4 + k % 4] >> shift) & 0x0F;
  if (bits == 4) return lo;
  return static_cast<uint8_t>(lo | (((tile[256 + l * 4 + k % 4] >> (k / 4)) & 1) << 4));
}

inline void set_tile_code(uint8_t* tile, int bits, int64_t l, int64_t k, uint8_t q) {
  if (bits == 8) { tile[(k / 4) * 64 + l * 4 + k % 4] = q; return; }
  uint8_t& byte = tile[((k % 16) / 4) * 64 + l * 4 + k % 4];
  const uint8_t lo = q & 0x0F;
  byte = static_cast<uint8_t>(k < 16 ? (byte & 0xF0) | lo : (byte & 0x0F) | (lo << 4));
  if (bits == 5) {
    uint8_t& hi = tile[256 + l * 4 + k % 4];
    hi = static_cast<uint8_t>((hi & ~(1 << (k / 4))) | (((q >> 4) & 1) << (k / 4)));
  }
}

struct Packed {
  const uint8_t* codes;  // [groups, nb, tile_bytes]
  const uint16_t* dm;    // [groups, nb, dms]: 16 d then 16 m (dms 32), or 16 d (dms 16)
  int64_t nb, n, bits, dms;
  float moff;            // dms 16: m = moff * d
};

// Activations as int8 codes in natural order [M, K], per block d_x [M, nb], per half
// block (16 values, the K-quants' sub-block) sum(q_x) hb [M, nb, 2], and the offsets'
// factors the kernels would otherwise recompute per row group: per block sx = d_x *
// sum(q_x) [M, nb] and per half block sh = d_x * sum(q_x of the half) [M, nb, 2] (the
// same float32 products, so the results are unchanged).
inline vf load16(const float* p) { return load_f(p); }
inline vf load16(const at::BFloat16* p) { return load_bf(p); }
inline vf load16(const at::Half* p) { return load_h(p); }

// A thread's scratch memory for its calls' quantized activations: kept from call to call
// and never cleared, since QuantX writes every value before a kernel reads it. Fresh zeroed
// vectors per call were a serial memset (and page faults for prefill-sized ones) on the
// calling thread while the other threads spun: 4% of the engine thread's perf samples in a
// c=32 chat bench (SmolLM2 Q4_K_M), the largest serial cost of a step after Python.
struct Scratch {
  std::unique_ptr<uint8_t[]> buf;
  size_t cap = 0;
  uint8_t* get(size_t bytes) {
    if (bytes > cap) {
      cap = std::max(bytes, cap + cap / 2);
      buf.reset(new uint8_t[cap]);  // default-initialised: not zeroed
    }
    return buf.get();
  }
};

// The calling thread's Scratch, one for every activation dtype (a static inside QuantX's
// templated constructor would be one per dtype, each as large as its largest call). slot:
// which of kScratchSlots buffers, so the QuantX of a multi-part linear's parts (one per
// code offset) live side by side.
constexpr int kScratchSlots = 4;
inline uint8_t* thread_scratch(size_t bytes, int slot = 0) {
  static thread_local Scratch scratch[kScratchSlots];
  return scratch[slot].get(bytes);
}

// Tokens from which AVX2 runs the 4- / 5-bit and K-quant tiles unpacked (groups_unpacked).
constexpr int64_t kUnpackMinTokens = 32;

struct QuantX {
  int8_t* q;
  uint8_t* qu;  // AVX2, M >= kUnpackMinTokens: q + 128 as unsigned codes [M, K] (groups_unpacked's); else null
  float *d, *sx, *sh;
  int32_t *hb, *zs;
  int32_t z;
  // z: the weight's code offset (w = d * (code - z)): 8, 16 or 128 for the symmetric
  // Q4_0, Q5_0, Q8_0 / IQ4_NL tiles, 32 or 4 for Q6_K / Q3_K, 0 for types with mins. With z,
  // zs holds -z * sum(q_x) per block (symmetric tiles, [M, nb]) or per half block
  // (K-quants, [M, nb, 2]): the kernels start each integer dot product there, so the
  // offset costs no vector op per token (see group_tile).
  // The arrays live in this thread's Scratch, valid until its next QuantX.
  template <typename T>
  QuantX(const T* x, int64_t M, int64_t nb, int32_t z_, bool halves, int slot = 0) : z(z_) {
    const size_t n = static_cast<size_t>(M * nb);
    // q [n * 32] int8, then d, sx [n] and sh [2n] float, hb [2n] and zs [2n] int32: offsets
    // stay multiples of 4 bytes (q's size is a multiple of 32).
    // Only the unpacked kernels read qu: fewer tokens (every decode step below 32) skip it.
    const bool with_qu = !LLMS_AVX512 && M >= kUnpackMinTokens;
    const size_t qu_bytes = with_qu ? n * QK : 0;
    uint8_t* base = thread_scratch(n * QK + n * 4 * sizeof(float) + n * 4 * sizeof(int32_t) + qu_bytes, slot);
    q = reinterpret_cast<int8_t*>(base);
    qu = with_qu ? base + n * QK + n * 4 * sizeof(float) + n * 4 * sizeof(int32_t) : nullptr;
    d = reinterpret_cast<float*>(base + n * QK);
    sx = d + n;
    sh = sx + n;
    hb = reinterpret_cast<int32_t*>(sh + 2 * n);
    zs = hb + 2 * n;
    at::parallel_for(0, M * nb, 256, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        block(x + i * QK, i);
        if (!z) continue;
        if (halves) { zs[2 * i] = -z * hb[2 * i]; zs[2 * i + 1] = -z * hb[2 * i + 1]; }
        else zs[i] = -z * (hb[2 * i] + hb[2 * i + 1]);
      }
    });
  }
  // Vectorised; each value as the scalar rule gave it: amax = max |x|, d_x = amax / 127,
  // q_x = x * 127 / amax (each step rounded once) rounded to nearest even (a value at
  // exactly half a step, as x = amax / 2 often is in bfloat16, rounds to even, not by the
  // rounding of a reciprocal), clamped to [-127, 127] (NaN's INT_MIN to -127, as before).
  template <typename T>
  void block(const T* xs, int64_t i) {
    const vf x0 = load16(xs), x1 = load16(xs + 16);
    const float amax = hmax(max_f(abs_f(x0), abs_f(x1)));
    d[i] = amax / 127.f;
    vi q0 = zero_i(), q1 = q0;
    if (amax > 0.f) {
      const vf s = set1_f(127.f), a = set1_f(amax);
      const vi lo = set1_i32(-127), hi = set1_i32(127);
      q0 = min_i32(max_i32(to_i_round(div(mul(x0, s), a)), lo), hi);
      q1 = min_i32(max_i32(to_i_round(div(mul(x1, s), a)), lo), hi);
    }
    store_i32_as_i8(q + i * QK, q0);
    store_i32_as_i8(q + i * QK + 16, q1);
#if !LLMS_AVX512
    if (qu != nullptr) {
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * QK));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qu + i * QK), _mm256_xor_si256(codes, _mm256_set1_epi8(-128)));
    }
#endif
    hb[2 * i] = hsum_i32(q0);
    hb[2 * i + 1] = hsum_i32(q1);
    sx[i] = d[i] * static_cast<float>(hb[2 * i] + hb[2 * i + 1]);
    sh[2 * i] = d[i] * static_cast<float>(hb[2 * i]);
    sh[2 * i + 1] = d[i] * static_cast<float>(hb[2 * i + 1]);
  }
};

// The (group, block) tile's 8 code vectors: V[j] lane l = codes 4j..4j+3 of row l (Q4:
// chunk c's low nibbles are V[c], its high ones V[c + 4]). S8 (AVX2, the signed 8-bit tiles
// of Q8_0 and IQ4_NL, codes = w + 128): V[j] = |w| and W[j] = w instead, for dot_avx2's
// signed products (maddubs takes u8 x s8 pairs, and 255 x 127 x 2 would saturate int16).
template <int BITS, bool S8 = false>
inline void load_tile(const uint8_t* tile, vi* v, vi* w = nullptr) {
  if constexpr (BITS == 8) {
    for (int j = 0; j < 8; ++j) v[j] = load_i(tile + 64 * j);
#if !LLMS_AVX512
    if constexpr (S8) {
      const vi bias = set1_i8(static_cast<int8_t>(0x80));
      for (int j = 0; j < 8; ++j) { w[j] = xor_i(v[j], bias); v[j] = abs_i8(w[j]); }
    }
#endif
  } else {
    const vi nib = set1_i8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const vi b = load_i(tile + 64 * c);
      v[c] = and_i(b, nib);
      v[c + 4] = hi_nibbles(b);
    }
    // 5-bit: bit j of the high plane's bytes -> bit 4 of V[j] (shift, then on AVX-512 one
    // ternary logic op for the mask and the or). GF2P8AFFINEQB moving each bit measured no
    // faster here on Q5_0 rows.
    if constexpr (BITS == 5) {
      const vi h = load_i(tile + 256);
      v[0] = or_bit4<4>(v[0], h);
      v[1] = or_bit4<3>(v[1], h);
      v[2] = or_bit4<2>(v[2], h);
      v[3] = or_bit4<1>(v[3], h);
      v[4] = or_bit4<0>(v[4], h);
      v[5] = or_bit4<-1>(v[5], h);
      v[6] = or_bit4<-2>(v[6], h);
      v[7] = or_bit4<-3>(v[7], h);
    }
  }
}

#if !LLMS_AVX512
// init + the integer dot products of V[0..N) with x's words xw[0..N) (4 codes each), on
// AVX2. maddubs sums pairs of u8 x s8 into int16, which saturates past 2^15 - 1: with
// codes below 2^c and |q_x| <= 127 a pair is at most 2 (2^c - 1) 127, so G of them are
// summed in int16 before one madd into int32: 8 for 4-bit codes (30,480), 4 for 5-bit
// (31,496), 2 for the K-quants' 8-bit tiles (Q6_K's codes < 64: 32,004). The signed 8-bit
// tiles (S8) take |w| x (x with w's signs), each pair at most 2 x 128 x 127, one madd each.
template <int BITS, int N, bool S8>
inline vi dot_avx2(vi a, const vi* v, const vi* w, const int32_t* xw) {
  if constexpr (S8) {
    for (int j = 0; j < N; ++j) a = add_i32(a, madd_ones(maddubs(v[j], sign_i8(set1_i32(xw[j]), w[j]))));
    return a;
  } else {
    constexpr int G = BITS == 4 ? 8 : BITS == 5 ? 4 : 2;
    for (int j0 = 0; j0 < N; j0 += G) {
      vi s = maddubs(v[j0], set1_i32(xw[j0]));
      for (int j = j0 + 1; j < j0 + G && j < N; ++j) s = add_i16(s, maddubs(v[j], set1_i32(xw[j])));
      a = add_i32(a, madd_ones(s));
    }
    return a;
  }
}
#endif

// Software prefetch, into L1, of the tile kPrefetchAhead blocks ahead and its scales. A
// thread walks its row groups' tiles in memory order ([groups, nb, tile] is one stream,
// group g + 1 right after g), but each group once per 16 or 8 tokens (twice at 32 rows,
// the second pass from L1), which the hardware prefetchers lost: at 8-32 rows the kernels
// ran latency-bound, slower the more bytes a tile has (Q8_0 1.5x Q4_1 at 32 rows, equal at
// 512). Addresses past the weight's end are harmless (a prefetch does not fault). Measured
// (all packed linears of a SmolLM2 step, 2 threads, old and new alternating, medians of
// 5; Q4_1 file / llama-quantize's Q4_K_M): 1 row 1.09x / 1.12x, 4 rows 1.21x / 1.30x, 8
// rows 1.71x / 1.87x, 32 rows 1.36x / 1.41x, 128 rows 1.09x / 1.11x; 2, 4, 8 and 16 blocks
// ahead, or none below 8 rows, were no better. Results unchanged (same arithmetic).
constexpr int64_t kPrefetchAhead = 12;

inline void prefetch_tile(const uint8_t* tile, int64_t tb, const void* scales) {
  const char* t = reinterpret_cast<const char*>(tile);
  for (int64_t l = 0; l < tb; l += 64) _mm_prefetch(t + l, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales), _MM_HINT_T0);
}

template <typename OutT>
inline void store_rows(OutT* out, vf acc, int64_t valid) {
  alignas(64) float tmp[RG];
  store_f(tmp, acc);
  for (int64_t l = 0; l < valid; ++l) out[l] = static_cast<OutT>(tmp[l]);
}

// Rows of group g for tokens t0..t0+MT-1.
// SYM: a symmetric type (d only, w = d * (code - z)): each dot product starts at -z *
// sum(q_x) (QuantX::zs, exact in int32: |dot| < 2^20), so a token's block costs 8 VNNI and
// 3 float ops (convert, d * d_x, FMA) instead of 4 with the offset's own FMA of m = -z * d
// against d_x * sum(q_x). The kernels are bound by those vector ops from 8 rows on (Q5_0
// at 32 rows ~275 GMAC/s on 2 cores, Q4_K with 16 ops a block ~200). One rounding less:
// the sum of w * x over the int8-rounded x is the same number, rounded once per block.
template <int BITS, int MT, bool SYM, typename OutT>
void group_tile_s(const Packed& p, const QuantX& xq, int64_t g, int64_t t0, OutT* out, int64_t N) {
  const int64_t tb = tile_bytes(BITS), K = p.nb * QK;
  const uint8_t* codes = p.codes + g * p.nb * tb;
  const uint16_t* dm = p.dm + g * p.nb * p.dms;
  // AVX2's signed 8-bit tiles (Q8_0, IQ4_NL: always symmetric) hold w = code - 128 itself:
  // their dot products start at 0, not at -128 * sum(q_x).
  constexpr bool S8 = !LLMS_AVX512 && BITS == 8;
  vf acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = zero_f();
  for (int64_t b = 0; b < p.nb; ++b) {
    prefetch_tile(codes + (b + kPrefetchAhead) * tb, tb, dm + (b + kPrefetchAhead) * p.dms);
    vi v[8], w[S8 ? 8 : 1];
    load_tile<BITS, S8>(codes + b * tb, v, w);
    const vf d = load_h(dm + b * p.dms);
    vf m = zero_f();
    if constexpr (!SYM) m = load_h(dm + b * 32 + 16);
    for (int t = 0; t < MT; ++t) {
      const int64_t xi = (t0 + t) * p.nb + b;
      const int32_t* xw = reinterpret_cast<const int32_t*>(xq.q + (t0 + t) * K + b * QK);
      // V[j] holds codes 4j..4j+3 of each row (both types), x's word j the same codes of x;
      // from 8 tokens on, one dependency chain per token (their chains overlap; the add of
      // two chains was one more vector op per token and block).
      const vi a_init = SYM && !S8 ? set1_i32(xq.zs[xi]) : zero_i();
      vi a;
#if LLMS_AVX512
      if (MT < 8) {  // two chains where few tokens overlap theirs
        vi a0 = dpbusd(a_init, v[0], set1_i32(xw[0]));
        vi a1 = dpbusd(zero_i(), v[1], set1_i32(xw[1]));
        for (int j = 2; j < 8; j += 2) {
          a0 = dpbusd(a0, v[j], set1_i32(xw[j]));
          a1 = dpbusd(a1, v[j + 1], set1_i32(xw[j + 1]));
        }
        a = add_i32(a0, a1);
      } else {
        a = dpbusd(a_init, v[0], set1_i32(xw[0]));
        for (int j = 1; j < 8; ++j) a = dpbusd(a, v[j], set1_i32(xw[j]));
      }
#else
      a = dot_avx2<BITS, 8, S8>(a_init, v, w, xw);
#endif
      acc[t] = fmadd(to_f(a), mul(d, set1_f(xq.d[xi])), acc[t]);
      if constexpr (!SYM) acc[t] = fmadd(m, set1_f(xq.sx[xi]), acc[t]);
    }
  }
  const int64_t valid = std::min(RG, p.n - g * RG);
  for (int t = 0; t < MT; ++t) store_rows(out + (t0 + t) * N + g * RG, acc[t], valid);
}


template <int BITS, int MT, typename OutT>
void group_tile(const Packed& p, const QuantX& xq, int64_t g, int64_t t0, OutT* out, int64_t N) {
  if (p.dms == 16) group_tile_s<BITS, MT, true>(p, xq, g, t0, out, N);
  else group_tile_s<BITS, MT, false>(p, xq, g, t0, out, N);
}

#if !LLMS_AVX512
// AVX2, 4- and 5-bit tiles, many tokens: a row group's tiles unpacked once into signed
// codes c = code - 2^(bits-1) (in L1, kUnpackBlocks blocks at a time), then each token
// runs over them with its codes as the unsigned operand, x' = q_x + 128 (QuantX::qu):
// sum(c x') - 128 sum(c) = sum(c q_x), so each block starts at corr = -128 sum(c) per row
// (one vector for all tokens) and the symmetric types need no -z sum(q_x) per token. With
// the weights as maddubs' signed operand they are its memory operand, so no register holds
// a tile and the float accumulators stay in registers; group_tile_s kept 8 code vectors
// (all 16 AVX2 registers) and spilled its 16 tokens' sums. The int16 bounds are the same:
// pairs of |c| <= 2^(bits-1) and x' <= 255 sum to at most 8 x 4,080 (4-bit) or 4 x 8,160
// (5-bit) before the madd. Same integer sums, same float steps: results are bit-identical.
// Measured (Q5_0 576 -> 3072, 30 copies, 2 threads, best of 7, /tmp-style microbenchmark):
// 32 tokens 156.6 -> 169.0 GMAC/s, 256 tokens 156.5 -> 197.6; 16 tokens 153.5 -> 144.0, so
// fewer tokens keep group_tile_s.
constexpr int64_t kUnpackBlocks = 24;  // 24 x 640 bytes = 15 KiB of L1 per thread

struct UnpackedBlock {
  __m256i w[8][2];   // signed codes: w[j][h] = codes 4j..4j+3 of rows 8h..8h+7
  __m256i corr[2];   // -128 * sum(c) per row
  __m256 d[2], m[2];  // the rows' d and m (m unused for the symmetric types)
};

template <int BITS, bool SYM>
inline void unpack_block(const uint8_t* tile, const uint16_t* dm, UnpackedBlock* u) {
  vi v[8];
  load_tile<BITS>(tile, v);
  const __m256i zc = _mm256_set1_epi8(1 << (BITS - 1));
  __m256i s_lo = _mm256_setzero_si256(), s_hi = s_lo;
  for (int j = 0; j < 8; ++j) {
    s_lo = _mm256_add_epi8(s_lo, v[j].lo);  // 8 codes of at most 31 per byte: < 256
    s_hi = _mm256_add_epi8(s_hi, v[j].hi);
    _mm256_store_si256(&u->w[j][0], _mm256_sub_epi8(v[j].lo, zc));
    _mm256_store_si256(&u->w[j][1], _mm256_sub_epi8(v[j].hi, zc));
  }
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  const __m256i off = _mm256_set1_epi32(QK << (BITS - 1));  // sum(c) = sum(code) - 32 zc
  const __m256i c_lo = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(s_lo, ones8), ones16), off);
  const __m256i c_hi = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(s_hi, ones8), ones16), off);
  _mm256_store_si256(&u->corr[0], _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), c_lo), 7));
  _mm256_store_si256(&u->corr[1], _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), c_hi), 7));
  const vf d = load_h(dm);
  u->d[0] = d.lo;
  u->d[1] = d.hi;
  if constexpr (!SYM) {
    const vf m = load_h(dm + 16);
    u->m[0] = m.lo;
    u->m[1] = m.hi;
  }
}

// One token's sums over blocks [b0, b0 + nbc) of the unpacked group into acc (rows 0-7, 8-15).
// Without SYM the dot is sum(code q_x) = sum(c q_x) + 2^(bits-1) sum(q_x), the offset m
// applied to d_x sum(q_x) as group_tile_s does.
template <int BITS, bool SYM>
inline void token_unpacked(const UnpackedBlock* u, int64_t nbc, const QuantX& xq, int64_t K, int64_t nb, int64_t t,
                           int64_t b0, __m256& acc_lo, __m256& acc_hi) {
  constexpr int G = BITS == 4 ? 8 : 4;
  const __m256i ones16 = _mm256_set1_epi16(1);
  const int32_t* xw0 = reinterpret_cast<const int32_t*>(xq.qu + t * K + b0 * QK);
  for (int64_t b = 0; b < nbc; ++b) {
    const int32_t* xw = xw0 + b * (QK / 4);
    const int64_t xi = t * nb + b0 + b;
    __m256i a_lo = u[b].corr[0], a_hi = u[b].corr[1];
    if constexpr (!SYM) {
      const __m256i z = _mm256_set1_epi32((xq.hb[2 * xi] + xq.hb[2 * xi + 1]) * (1 << (BITS - 1)));
      a_lo = _mm256_add_epi32(a_lo, z);
      a_hi = _mm256_add_epi32(a_hi, z);
    }
    for (int j0 = 0; j0 < 8; j0 += G) {
      __m256i xb = _mm256_set1_epi32(xw[j0]);
      __m256i s_lo = _mm256_maddubs_epi16(xb, u[b].w[j0][0]), s_hi = _mm256_maddubs_epi16(xb, u[b].w[j0][1]);
      for (int j = j0 + 1; j < j0 + G; ++j) {
        xb = _mm256_set1_epi32(xw[j]);
        s_lo = _mm256_add_epi16(s_lo, _mm256_maddubs_epi16(xb, u[b].w[j][0]));
        s_hi = _mm256_add_epi16(s_hi, _mm256_maddubs_epi16(xb, u[b].w[j][1]));
      }
      a_lo = _mm256_add_epi32(a_lo, _mm256_madd_epi16(s_lo, ones16));
      a_hi = _mm256_add_epi32(a_hi, _mm256_madd_epi16(s_hi, ones16));
    }
    const __m256 dx = _mm256_set1_ps(xq.d[xi]);
    acc_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a_lo), _mm256_mul_ps(u[b].d[0], dx), acc_lo);
    acc_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a_hi), _mm256_mul_ps(u[b].d[1], dx), acc_hi);
    if constexpr (!SYM) {
      const __m256 sx = _mm256_set1_ps(xq.sx[xi]);
      acc_lo = _mm256_fmadd_ps(u[b].m[0], sx, acc_lo);
      acc_hi = _mm256_fmadd_ps(u[b].m[1], sx, acc_hi);
    }
  }
}

// Tokens [t0, t1) against row groups [g0, g1) of a weight of nb blocks and n rows, the tiles
// unpacked once per group and chunk of at most max_blocks blocks: unpack(g, b0, nbc) fills
// the thread's unpacked blocks, token(t, b0, nbc, lo, hi) adds token t's sums over them to
// its rows 0-7 (lo) and 8-15 (hi). A token's partial sums between chunks wait in this
// thread's float buffer.
template <typename OutT, typename Unpack, typename Token>
void walk_unpacked(int64_t nb, int64_t n, int64_t max_blocks, int64_t t0, int64_t t1, OutT* out, int64_t ldo,
                   int64_t g0, int64_t g1, const Unpack& unpack, const Token& token) {
  const int64_t chunks = (nb + max_blocks - 1) / max_blocks, bc = (nb + chunks - 1) / chunks;
  static thread_local Scratch partials;  // not thread_scratch: the calling thread's QuantX live there
  float* part = chunks > 1 ? reinterpret_cast<float*>(partials.get((t1 - t0) * RG * sizeof(float))) : nullptr;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t valid = std::min(RG, n - g * RG);
    for (int64_t b0 = 0; b0 < nb; b0 += bc) {
      const int64_t nbc = std::min(bc, nb - b0);
      unpack(g, b0, nbc);
      const bool first = b0 == 0, last = b0 + nbc >= nb;
      for (int64_t t = t0; t < t1; ++t) {
        float* pt = part ? part + (t - t0) * RG : nullptr;
        __m256 lo = first ? _mm256_setzero_ps() : _mm256_loadu_ps(pt);
        __m256 hi = first ? _mm256_setzero_ps() : _mm256_loadu_ps(pt + 8);
        token(t, b0, nbc, lo, hi);
        if (!last) {
          _mm256_storeu_ps(pt, lo);
          _mm256_storeu_ps(pt + 8, hi);
        } else {
          store_rows(out + t * ldo + g * RG, vf{lo, hi}, valid);
        }
      }
    }
  }
}

template <int BITS, bool SYM, typename OutT>
void groups_unpacked(const Packed& p, const QuantX& xq, int64_t t0, int64_t t1, OutT* out, int64_t ldo, int64_t g0,
                     int64_t g1) {
  // On the stack (15 KiB), not thread_local: in this shared library a thread_local's
  // address is a __tls_get_addr call, which the compiler re-made for every token (with a
  // vzeroupper and the accumulators spilled around it).
  alignas(64) UnpackedBlock u[kUnpackBlocks];
  const int64_t tb = tile_bytes(BITS), K = p.nb * QK, nb = p.nb;
  walk_unpacked(
      p.nb, p.n, kUnpackBlocks, t0, t1, out, ldo, g0, g1,
      [&](int64_t g, int64_t b0, int64_t nbc) {
        for (int64_t b = 0; b < nbc; ++b)
          unpack_block<BITS, SYM>(p.codes + (g * p.nb + b0 + b) * tb, p.dm + (g * p.nb + b0 + b) * p.dms, &u[b]);
      },
      [&xq, &u, K, nb](int64_t t, int64_t b0, int64_t nbc, __m256& lo, __m256& hi) {
        token_unpacked<BITS, SYM>(u, nbc, xq, K, nb, t, b0, lo, hi);
      });
}

template <int BITS, typename OutT>
void groups_unpacked(const Packed& p, const QuantX& xq, int64_t t0, int64_t t1, OutT* out, int64_t ldo, int64_t g0,
                     int64_t g1) {
  if (p.dms == 16) groups_unpacked<BITS, true>(p, xq, t0, t1, out, ldo, g0, g1);
  else groups_unpacked<BITS, false>(p, xq, t0, t1, out, ldo, g0, g1);
}
#endif

// K-quants (Q2_K..Q6_K, super-blocks of 256 = 8 blocks), repacked by llmserve/ops/kquant.py:
// codes in the tiles above (4-bit for Q2_K, Q3_K, Q4_K; 5-bit Q5_K; 8-bit Q6_K), per
// (group, block) int8 [64] = the 16 rows' scale of each 16-value half (sc0, sc1) then
// their min multipliers (mn0, mn1), per (group, super-block) float16 [32] = 16 d then 16
// dmin. w = (d * sc) * (code - z) - dmin * mn in float32 steps, as gguf.quants (z: the
// type's code offset, 32 for Q6_K, 4 for Q3_K). Per token and half block the integer dot
// is dot(code, q_x) - z * sum(q_x) (llama.cpp's bsums), scaled by d * sc * d_x, less
// dmin * mn * d_x * sum(q_x): the sum of w * x over the int8-rounded x, as llama.cpp's
// ggml_vec_dot_q4_K_q8_K (the mins against the float sum of x left errors ~3x larger on
// random Q4_K rows: the offset d * code is ~2x |w|).
struct KPacked {
  const uint8_t* codes;  // [groups, nb, tile_bytes]
  const int8_t* sc;      // [groups, nb, 64]
  const uint16_t* dd;    // [groups, nb / 8, 32]
  int64_t nb, n, bits, z;
};

inline vf i8x16_ps(const int8_t* p) { return load_i8(p); }

inline vf h16_ps(const uint16_t* p) { return load_h(p); }

// kMins: the type has mins (Q2_K, Q4_K, Q5_K: z = 0); Q3_K and Q6_K have none (their mn
// and dmin are zero, kquant.py) but a code offset z, so their tiles skip the two min terms
// per token and half-block pair (and the scales' two products), and always subtract z. The
// skipped terms were acc - 0 * sh: the results are unchanged.
template <int BITS, int MT, bool kMins, typename OutT>
void group_tile_k(const KPacked& p, const QuantX& xq, int64_t g, int64_t t0, OutT* out, int64_t N) {
  const int64_t tb = tile_bytes(BITS), K = p.nb * QK;
  const uint8_t* codes = p.codes + g * p.nb * tb;
  const int8_t* sc = p.sc + g * p.nb * 64;
  const uint16_t* dd = p.dd + g * (p.nb / 8) * 32;
  vf acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = zero_f();
  vf d = zero_f(), dmin = d;
  for (int64_t b = 0; b < p.nb; ++b) {
    if (b % 8 == 0) {
      d = h16_ps(dd + (b / 8) * 32);
      dmin = h16_ps(dd + (b / 8) * 32 + 16);
    }
    prefetch_tile(codes + (b + kPrefetchAhead) * tb, tb, sc + (b + kPrefetchAhead) * 64);
    vi v[8];
    load_tile<BITS>(codes + b * tb, v);
    const int8_t* s = sc + b * 64;
    const vf d0 = mul(d, i8x16_ps(s)), d1 = mul(d, i8x16_ps(s + 16));
    vf m0 = zero_f(), m1 = m0;
    if constexpr (kMins) {
      m0 = mul(dmin, i8x16_ps(s + 32));
      m1 = mul(dmin, i8x16_ps(s + 48));
    }
    for (int t = 0; t < MT; ++t) {
      const int64_t xi = (t0 + t) * p.nb + b;
      const int32_t* xw = reinterpret_cast<const int32_t*>(xq.q + (t0 + t) * K + b * QK);
      // V[0..3]: codes 0..15 (first half), V[4..7]: codes 16..31.
      // Without mins, each half's dot starts at -z * sum(q_x of the half) (QuantX::zs): the
      // same int32 sums as subtracting after, with no vector op for it.
      vi a0 = kMins ? zero_i() : set1_i32(xq.zs[2 * xi]);
      vi a1 = kMins ? zero_i() : set1_i32(xq.zs[2 * xi + 1]);
#if LLMS_AVX512
      for (int j = 0; j < 4; ++j) {
        a0 = dpbusd(a0, v[j], set1_i32(xw[j]));
        a1 = dpbusd(a1, v[j + 4], set1_i32(xw[j + 4]));
      }
#else
      a0 = dot_avx2<BITS, 4, false>(a0, v, nullptr, xw);
      a1 = dot_avx2<BITS, 4, false>(a1, v + 4, nullptr, xw + 4);
#endif
      const vf dx = set1_f(xq.d[xi]);
      acc[t] = fmadd(to_f(a0), mul(d0, dx), acc[t]);
      acc[t] = fmadd(to_f(a1), mul(d1, dx), acc[t]);
      if constexpr (kMins) {
        acc[t] = fnmadd(m0, set1_f(xq.sh[2 * xi]), acc[t]);
        acc[t] = fnmadd(m1, set1_f(xq.sh[2 * xi + 1]), acc[t]);
      }
    }
  }
  const int64_t valid = std::min(RG, p.n - g * RG);
  for (int t = 0; t < MT; ++t) store_rows(out + (t0 + t) * N + g * RG, acc[t], valid);
}

template <int BITS, int MT, typename OutT>
void group_tile(const KPacked& p, const QuantX& xq, int64_t g, int64_t t0, OutT* out, int64_t N) {
  if (p.z) group_tile_k<BITS, MT, false>(p, xq, g, t0, out, N);
  else group_tile_k<BITS, MT, true>(p, xq, g, t0, out, N);
}

#if !LLMS_AVX512
// The K-quants' tiles unpacked the same way (see groups_unpacked): signed codes c = code -
// ZC per row group and block, with per half block corr = -128 sum(c), and the rows' d * sc
// and dmin * mn as group_tile_k forms them. ZC is the type's own offset z where it has one
// (Q3_K 4, Q6_K 32: sum(c q_x) is then the dot group_tile_k starts at -z sum(q_x)); with
// mins z = 0, and ZC = 0 for the 4-bit tiles (codes <= 15 are already signed bytes) or 16
// for Q5_K's 5-bit ones, whose dot then adds 16 sum(q_x of the half) per token (the int16
// bounds of groups_unpacked need |c| <= 16 there). The float steps are group_tile_k's, in
// its order: results are bit-identical. 16 blocks (14 KiB) at a time.
constexpr int64_t kUnpackBlocksK = 16;

struct UnpackedKBlock {
  __m256i w[8][2];     // signed codes, as UnpackedBlock
  __m256i corr[2][2];  // [half][rows 0-7 / 8-15]: -128 * sum(c) of the half
  __m256 d[2][2], m[2][2];  // [half][rows]: d * sc and dmin * mn (mins only)
};

template <int BITS, bool kMins, int ZC>
inline void unpack_kblock(const uint8_t* tile, const int8_t* s, vf d, vf dmin, UnpackedKBlock* u) {
  vi v[8];
  load_tile<BITS>(tile, v);
  const __m256i zc = _mm256_set1_epi8(static_cast<char>(ZC));
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  const __m256i off = _mm256_set1_epi32(16 * ZC), zero = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    __m256i s_lo = zero, s_hi = zero;
    for (int j = 4 * h; j < 4 * h + 4; ++j) {
      s_lo = _mm256_add_epi8(s_lo, v[j].lo);  // 4 codes of at most 63 per byte: < 256
      s_hi = _mm256_add_epi8(s_hi, v[j].hi);
      _mm256_store_si256(&u->w[j][0], _mm256_sub_epi8(v[j].lo, zc));
      _mm256_store_si256(&u->w[j][1], _mm256_sub_epi8(v[j].hi, zc));
    }
    const __m256i c_lo = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(s_lo, ones8), ones16), off);
    const __m256i c_hi = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(s_hi, ones8), ones16), off);
    _mm256_store_si256(&u->corr[h][0], _mm256_slli_epi32(_mm256_sub_epi32(zero, c_lo), 7));
    _mm256_store_si256(&u->corr[h][1], _mm256_slli_epi32(_mm256_sub_epi32(zero, c_hi), 7));
    const vf dh = mul(d, i8x16_ps(s + 16 * h));
    u->d[h][0] = dh.lo;
    u->d[h][1] = dh.hi;
    if constexpr (kMins) {
      const vf mh = mul(dmin, i8x16_ps(s + 32 + 16 * h));
      u->m[h][0] = mh.lo;
      u->m[h][1] = mh.hi;
    }
  }
}

// One half block's integer dot for rows 0-7 (lo) and 8-15 (hi): words 4h..4h+3 of x'.
template <int BITS>
inline void half_dot(const UnpackedKBlock& u, const int32_t* xw, int h, __m256i& a_lo, __m256i& a_hi) {
  constexpr int G = BITS == 8 ? 2 : 4;
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int j0 = 4 * h; j0 < 4 * h + 4; j0 += G) {
    __m256i xb = _mm256_set1_epi32(xw[j0]);
    __m256i s_lo = _mm256_maddubs_epi16(xb, u.w[j0][0]), s_hi = _mm256_maddubs_epi16(xb, u.w[j0][1]);
    for (int j = j0 + 1; j < j0 + G; ++j) {
      xb = _mm256_set1_epi32(xw[j]);
      s_lo = _mm256_add_epi16(s_lo, _mm256_maddubs_epi16(xb, u.w[j][0]));
      s_hi = _mm256_add_epi16(s_hi, _mm256_maddubs_epi16(xb, u.w[j][1]));
    }
    a_lo = _mm256_add_epi32(a_lo, _mm256_madd_epi16(s_lo, ones16));
    a_hi = _mm256_add_epi32(a_hi, _mm256_madd_epi16(s_hi, ones16));
  }
}

template <int BITS, bool kMins, int ZC>
inline void token_unpacked_k(const UnpackedKBlock* u, int64_t nbc, const QuantX& xq, int64_t K, int64_t nb, int64_t t,
                             int64_t b0, __m256& acc_lo, __m256& acc_hi) {
  const int32_t* xw0 = reinterpret_cast<const int32_t*>(xq.qu + t * K + b0 * QK);
  for (int64_t b = 0; b < nbc; ++b) {
    const int64_t xi = t * nb + b0 + b;
    __m256i a[2][2];
    for (int h = 0; h < 2; ++h) {
      a[h][0] = u[b].corr[h][0];
      a[h][1] = u[b].corr[h][1];
      if constexpr (kMins && ZC != 0) {  // sum(code q_x) = sum(c q_x) + ZC sum(q_x)
        const __m256i z = _mm256_set1_epi32(ZC * xq.hb[2 * xi + h]);
        a[h][0] = _mm256_add_epi32(a[h][0], z);
        a[h][1] = _mm256_add_epi32(a[h][1], z);
      }
      half_dot<BITS>(u[b], xw0 + b * (QK / 4), h, a[h][0], a[h][1]);
    }
    const __m256 dx = _mm256_set1_ps(xq.d[xi]);
    for (int h = 0; h < 2; ++h) {
      acc_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h][0]), _mm256_mul_ps(u[b].d[h][0], dx), acc_lo);
      acc_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h][1]), _mm256_mul_ps(u[b].d[h][1], dx), acc_hi);
    }
    if constexpr (kMins) {
      for (int h = 0; h < 2; ++h) {
        const __m256 sh = _mm256_set1_ps(xq.sh[2 * xi + h]);
        acc_lo = _mm256_fnmadd_ps(u[b].m[h][0], sh, acc_lo);
        acc_hi = _mm256_fnmadd_ps(u[b].m[h][1], sh, acc_hi);
      }
    }
  }
}

template <int BITS, bool kMins, int ZC, typename OutT>
void groups_unpacked_k(const KPacked& p, const QuantX& xq, int64_t t0, int64_t t1, OutT* out, int64_t ldo,
                       int64_t g0, int64_t g1) {
  alignas(64) UnpackedKBlock u[kUnpackBlocksK];  // on the stack (14 KiB; see groups_unpacked)
  const int64_t tb = tile_bytes(BITS), K = p.nb * QK, nb = p.nb;
  walk_unpacked(
      p.nb, p.n, kUnpackBlocksK, t0, t1, out, ldo, g0, g1,
      [&](int64_t g, int64_t b0, int64_t nbc) {
        for (int64_t b = 0; b < nbc; ++b) {
          const int64_t bb = b0 + b;
          const uint16_t* dd = p.dd + (g * (p.nb / 8) + bb / 8) * 32;
          unpack_kblock<BITS, kMins, ZC>(p.codes + (g * p.nb + bb) * tb, p.sc + (g * p.nb + bb) * 64, h16_ps(dd),
                                         h16_ps(dd + 16), &u[b]);
        }
      },
      [&xq, &u, K, nb](int64_t t, int64_t b0, int64_t nbc, __m256& lo, __m256& hi) {
        token_unpacked_k<BITS, kMins, ZC>(u, nbc, xq, K, nb, t, b0, lo, hi);
      });
}

// The unpacked path where the type's tile and offset have one (false: group_tile_k's).
template <int BITS, typename OutT>
bool groups_unpacked(const KPacked& p, const QuantX& xq, int64_t t0, int64_t t1, OutT* out, int64_t ldo, int64_t g0,
                     int64_t g1) {
  if constexpr (BITS == 4) {
    if (p.z == 0) groups_unpacked_k<4, true, 0>(p, xq, t0, t1, out, ldo, g0, g1);
    else if (p.z == 4) groups_unpacked_k<4, false, 4>(p, xq, t0, t1, out, ldo, g0, g1);
    else return false;
  } else if constexpr (BITS == 5) {
    if (p.z != 0) return false;
    groups_unpacked_k<5, true, 16>(p, xq, t0, t1, out, ldo, g0, g1);
  } else {
    if (p.z != 32) return false;
    groups_unpacked_k<8, false, 32>(p, xq, t0, t1, out, ldo, g0, g1);
  }
  return true;
}
#endif

// Row groups [g0, g1) of one thread, rows ldo elements apart in out; tokens 16
// (Q4_0..Q8_0) or 8 (then 4, 3, 2, 1) at a time, so a tile's codes are loaded and unpacked
// once per 16 or 8 tokens; tokens in chunks of 256 (their int8 codes, 147 KB at K=576, stay
// in L2 while the thread's row groups pass over them: 1.14x -> see benchmarks in the
// closing note of issue 16).
template <int BITS, typename P, typename OutT>
void run_groups(const P& p, const QuantX& xq, int64_t M, OutT* out, int64_t ldo, int64_t g0, int64_t g1) {
  constexpr int64_t kChunk = 256;
  // 16 tokens per tile load for the Q4_0..Q8_0 tiles (16 accumulators + 8 code vectors
  // fit the 32 registers; the K-quants' 4 scale vectors per block would not). On AVX2 (16
  // registers of half the width) neither 8 nor 16 tokens' accumulators stay in registers,
  // and 16 halves the unpacking of each tile per token: Q5_0 576->3072 / 1536->576 at 32
  // rows 96.1 / 129.2 GMAC/s against 82.2 / 79.8 at 8 (2 threads, 30 copies, alternating,
  // medians of 8; Q8_0 and Q4_1 +2-20%). Each token's arithmetic is the same either way.
  constexpr bool kMT16 = std::is_same<P, Packed>::value;
  for (int64_t c0 = 0; c0 < M; c0 += kChunk) {
    const int64_t c1 = std::min(M, c0 + kChunk);
#if !LLMS_AVX512
    if (c1 - c0 >= kUnpackMinTokens) {
      if constexpr (kMT16 && BITS != 8) {
        groups_unpacked<BITS>(p, xq, c0, c1, out, ldo, g0, g1);
        continue;
      } else if constexpr (!kMT16) {
        if (groups_unpacked<BITS>(p, xq, c0, c1, out, ldo, g0, g1)) continue;
      }
    }
#endif
    for (int64_t g = g0; g < g1; ++g) {
      int64_t t = c0;
      if constexpr (kMT16) for (; t + 16 <= c1; t += 16) group_tile<BITS, 16>(p, xq, g, t, out, ldo);
      for (; t + 8 <= c1; t += 8) group_tile<BITS, 8>(p, xq, g, t, out, ldo);
      for (; t + 4 <= c1; t += 4) group_tile<BITS, 4>(p, xq, g, t, out, ldo);
      switch (c1 - t) {
        case 3: group_tile<BITS, 3>(p, xq, g, t, out, ldo); break;
        case 2: group_tile<BITS, 2>(p, xq, g, t, out, ldo); break;
        case 1: group_tile<BITS, 1>(p, xq, g, t, out, ldo); break;
        default: break;
      }
    }
  }
}

// Row groups split over threads (run_groups each), the hook around each thread's columns.
template <int BITS, typename P, typename OutT>
void run(const P& p, const QuantX& xq, int64_t M, OutT* out, const LinearHook* hook) {
  const int64_t groups = (p.n + RG - 1) / RG, N = p.n;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * RG, n1 = std::min(N, g1 * RG);
    if (hook != nullptr) hook->pre(hook->ctx, n0, n1, N);
    run_groups<BITS>(p, xq, M, out, N, g0, g1);
    if (hook != nullptr) hook->post(hook->ctx, n0, n1, out, N);
  });
}

// The code offset z the kernels fold into their dot products (QuantX::zs): the symmetric
// tiles' 2^(bits-1) (m = moff * d, moff = -z), the K-quants' own (Q6_K, Q3_K; 0 with mins).
inline int32_t code_offset(const Packed& p) { return p.dms == 16 ? static_cast<int32_t>(-p.moff) : 0; }
inline int32_t code_offset(const KPacked& p) { return static_cast<int32_t>(p.z); }

template <typename P, typename OutT>
void dispatch(const P& p, const at::Tensor& x, OutT* out, const LinearHook* hook) {
  const int64_t M = x.size(0);
  const int32_t z = code_offset(p);
  const bool halves = std::is_same<P, KPacked>::value;
  std::unique_ptr<QuantX> xq;
  if (x.scalar_type() == at::kBFloat16) xq = std::make_unique<QuantX>(x.data_ptr<at::BFloat16>(), M, p.nb, z, halves);
  else if (x.scalar_type() == at::kHalf) xq = std::make_unique<QuantX>(x.data_ptr<at::Half>(), M, p.nb, z, halves);
  else xq = std::make_unique<QuantX>(x.data_ptr<float>(), M, p.nb, z, halves);
  if (p.bits == 4) run<4>(p, *xq, M, out, hook);
  else if (p.bits == 5) run<5>(p, *xq, M, out, hook);
  else run<8>(p, *xq, M, out, hook);
}

KPacked kpacked_of(const at::Tensor& codes, const at::Tensor& sc, const at::Tensor& dd, int64_t bits, int64_t z,
                   int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "kquant: bits must be 4, 5 or 8, got ", bits);
  TORCH_CHECK(codes.dim() == 3 && sc.dim() == 3 && dd.dim() == 3 && codes.scalar_type() == at::kByte &&
                  sc.scalar_type() == at::kChar && dd.scalar_type() == at::kShort && codes.is_contiguous() &&
                  sc.is_contiguous() && dd.is_contiguous() && codes.size(2) == tile_bytes(bits) &&
                  codes.size(1) % 8 == 0 && sc.size(2) == 64 && dd.size(2) == 32 &&
                  sc.size(0) == codes.size(0) && dd.size(0) == codes.size(0) && sc.size(1) == codes.size(1) &&
                  dd.size(1) * 8 == codes.size(1) && n > (codes.size(0) - 1) * RG && n <= codes.size(0) * RG,
              "kquant: codes uint8 [groups, nb, ", tile_bytes(bits), "], sc int8 [groups, nb, 64], dd int16 "
              "[groups, nb/8, 32] for ", n, " rows, got ", codes.sizes(), ", ", sc.sizes(), " and ", dd.sizes());
  return KPacked{codes.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(),
                 reinterpret_cast<const uint16_t*>(dd.data_ptr<int16_t>()), codes.size(1), n, bits, z};
}

// The hook at address `hook` (0: none), checked against the call: same ABI, made for x's
// rows and n columns, and an output in x's dtype.
const LinearHook* hook_at(int64_t hook, const at::Tensor& x, int64_t n, bool out_float, const char* what) {
  if (hook == 0) return nullptr;
  const auto* h = reinterpret_cast<const LinearHook*>(hook);
  TORCH_CHECK(h->abi == kLinearHookAbi && h->rows == x.size(0) && h->n == n && h->k == x.size(1) && !out_float,
              what, ": the hook does not fit this call (ABI ", h->abi, ", ", h->rows, " rows, ", h->n, " x ", h->k,
              " weights; the call: ", x.size(0), " rows, ", n, " x ", x.size(1), ", out_float ", out_float,
              "; a hook is armed for a step's rows by LoRAModule.arm)");
  return h;
}

template <typename P>
at::Tensor linear_of(const P& p, const at::Tensor& x, int64_t n, bool out_float, const char* what, int64_t hook) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == p.nb * QK, what, ": x ", x.sizes(), " does not fit a weight of ",
              p.nb * QK, " columns");
  const auto out_type = out_float ? at::kFloat : x.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              what, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  const LinearHook* h = hook_at(hook, x, n, out_float, what);
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(out_type));
  if (h != nullptr)
    h->begin(h->ctx, xc.data_ptr(), xc.size(1),
             x.scalar_type() == at::kFloat ? kHookF32 : x.scalar_type() == at::kBFloat16 ? kHookBF16 : kHookF16);
  if (out_type == at::kFloat) dispatch(p, xc, out.data_ptr<float>(), h);
  else if (out_type == at::kBFloat16) dispatch(p, xc, out.data_ptr<at::BFloat16>(), h);
  else dispatch(p, xc, out.data_ptr<at::Half>(), h);
  return out;
}

Packed packed_of(const at::Tensor& codes, const at::Tensor& dm, int64_t bits, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "quant: bits must be 4, 5 or 8, got ", bits);
  TORCH_CHECK(codes.dim() == 3 && dm.dim() == 3 && codes.scalar_type() == at::kByte &&
                  dm.scalar_type() == at::kShort && codes.is_contiguous() && dm.is_contiguous() &&
                  codes.size(2) == tile_bytes(bits) && (dm.size(2) == 32 || dm.size(2) == 16) &&
                  codes.size(0) == dm.size(0) && codes.size(1) == dm.size(1) && n > (codes.size(0) - 1) * RG &&
                  n <= codes.size(0) * RG,
              "quant: codes uint8 [groups, nb, ", tile_bytes(bits), "] and dm int16 [groups, nb, 32 or 16] for ", n,
              " rows, got ", codes.sizes(), " and ", dm.sizes());
  // 8-bit tiles are the symmetric Q8_0 / IQ4_NL only (d alone): the AVX2 kernel reads their
  // codes as signed w = code - 128 and would count an explicit m = -128 d twice.
  TORCH_CHECK(bits != 8 || dm.size(2) == 16, "quant: 8-bit codes take d only (dm [groups, nb, 16]), got ", dm.sizes());
  return Packed{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>()), codes.size(1),
                n, bits, dm.size(2), -static_cast<float>(1 << (bits - 1))};
}


// One part of a multi-part linear, ready to run: its packed weight, the QuantX of its code
// offset, its first output column and its row groups' place in the parts' joint range.
struct PartRun {
  bool kquant;
  Packed p;
  KPacked kp;
  const QuantX* xq;
  int64_t col0, g_begin, g_end;
};

template <typename OutT>
void run_part(const PartRun& r, int64_t M, OutT* out, int64_t ldo, int64_t g0, int64_t g1) {
  OutT* o = out + r.col0;
  const int64_t bits = r.kquant ? r.kp.bits : r.p.bits;
  if (r.kquant) {
    if (bits == 4) run_groups<4>(r.kp, *r.xq, M, o, ldo, g0, g1);
    else if (bits == 5) run_groups<5>(r.kp, *r.xq, M, o, ldo, g0, g1);
    else run_groups<8>(r.kp, *r.xq, M, o, ldo, g0, g1);
  } else {
    if (bits == 4) run_groups<4>(r.p, *r.xq, M, o, ldo, g0, g1);
    else if (bits == 5) run_groups<5>(r.p, *r.xq, M, o, ldo, g0, g1);
    else run_groups<8>(r.p, *r.xq, M, o, ldo, g0, g1);
  }
}

template <typename T>
std::unique_ptr<QuantX> quant_x_of(const at::Tensor& x, int64_t nb, int32_t z, bool halves, int slot) {
  return std::make_unique<QuantX>(x.data_ptr<T>(), x.size(0), nb, z, halves, slot);
}

// The parts' row groups as one range split over the threads, each thread running its share
// of every part it meets: one parallel region (and one barrier) where a call per part had
// one each, and no concatenation. Each part's QuantX is made once per distinct code offset.
template <typename OutT>
void run_parts(std::vector<PartRun>& runs, const at::Tensor& x, OutT* out, int64_t ldo) {
  std::vector<std::pair<std::pair<int32_t, bool>, std::unique_ptr<QuantX>>> xqs;
  for (auto& r : runs) {
    const int32_t z = r.kquant ? code_offset(r.kp) : code_offset(r.p);
    const int64_t nb = r.kquant ? r.kp.nb : r.p.nb;
    const auto key = std::make_pair(z, r.kquant);
    auto it = std::find_if(xqs.begin(), xqs.end(), [&](const auto& e) { return e.first == key; });
    if (it == xqs.end()) {
      TORCH_CHECK(static_cast<int>(xqs.size()) < kScratchSlots, "quant_linear_parts: more than ", kScratchSlots,
                  " kinds of parts");
      const int slot = static_cast<int>(xqs.size());
      auto xq = x.scalar_type() == at::kBFloat16 ? quant_x_of<at::BFloat16>(x, nb, z, r.kquant, slot)
                : x.scalar_type() == at::kHalf   ? quant_x_of<at::Half>(x, nb, z, r.kquant, slot)
                                                 : quant_x_of<float>(x, nb, z, r.kquant, slot);
      xqs.emplace_back(key, std::move(xq));
      it = xqs.end() - 1;
    }
    r.xq = it->second.get();
  }
  const int64_t M = x.size(0), groups = runs.back().g_end;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (const auto& r : runs) {
      const int64_t a = std::max(g0, r.g_begin), b = std::min(g1, r.g_end);
      if (a < b) run_part(r, M, out, ldo, a - r.g_begin, b - r.g_begin);
    }
  });
}

at::Tensor linear_parts_impl(const PackedLinearPart* parts, int64_t nparts, const at::Tensor& x, bool out_float) {
  TORCH_CHECK(nparts >= 1, "quant_linear_parts: no parts");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                               x.scalar_type() == at::kHalf),
              "quant_linear_parts: x must be 2-D float32, bfloat16 or float16, got ", x.sizes(), " ", x.scalar_type());
  std::vector<PartRun> runs(nparts);
  int64_t cols = 0, groups = 0;
  for (int64_t i = 0; i < nparts; ++i) {
    const PackedLinearPart& q = parts[i];
    PartRun& r = runs[i];
    r.kquant = q.kquant != 0;
    if (r.kquant) r.kp = kpacked_of(q.codes, q.scales, q.dd, q.bits, q.z, q.n);
    else r.p = packed_of(q.codes, q.scales, q.bits, q.n);
    const int64_t nb = r.kquant ? r.kp.nb : r.p.nb;
    TORCH_CHECK(x.size(1) == nb * QK, "quant_linear_parts: x ", x.sizes(), " does not fit part ", i, " of ",
                nb * QK, " columns");
    r.col0 = cols;
    r.g_begin = groups;
    groups += (q.n + RG - 1) / RG;
    r.g_end = groups;
    cols += q.n;
  }
  at::Tensor xc = x.contiguous();
  const auto out_type = out_float ? at::kFloat : x.scalar_type();
  at::Tensor out = at::empty({x.size(0), cols}, x.options().dtype(out_type));
  if (out_type == at::kFloat) run_parts(runs, xc, out.data_ptr<float>(), cols);
  else if (out_type == at::kBFloat16) run_parts(runs, xc, out.data_ptr<at::BFloat16>(), cols);
  else run_parts(runs, xc, out.data_ptr<at::Half>(), cols);
  return out;
}

at::Tensor packed_linear_entry(const PackedLinearPart* parts, int64_t nparts, const at::Tensor& x) {
  return linear_parts_impl(parts, nparts, x, false);
}

}  // namespace

// GGUF blocks uint8 [N, K/32*block_bytes] -> [codes uint8 [ceil(N/16), K/32, 256 (Q4),
// 320 (Q5) or 512 (Q8)], dm float16-as-int16 [ceil(N/16), K/32, 32 (Q4_1, Q5_1: d and m)
// or 16 (the symmetric types: d)]] (the layout above). Raises for a type or shape mismatch.
std::vector<at::Tensor> quant_repack(at::Tensor w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "quant_repack: w uint8 [N, row_bytes]");
  const int64_t bb = block_bytes(qtype), N = w.size(0);
  TORCH_CHECK(w.size(1) % bb == 0, "quant_repack: row of ", w.size(1), " bytes is not whole blocks of ", bb);
  const int64_t nb = w.size(1) / bb, groups = (N + RG - 1) / RG;
  const int bits = qbits(qtype);
  const int64_t tb = tile_bytes(bits);
  at::Tensor codes = at::zeros({groups, nb, tb}, w.options());
  const int64_t dms = scale_halfs(qtype);
  at::Tensor dm = at::zeros({groups, nb, dms}, w.options().dtype(at::kShort));
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(dm.data_ptr<int16_t>());
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    uint8_t q[32];
    uint16_t m_sym;  // the symmetric types' m: not stored, the kernels derive it from d
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t l = 0; l < RG && g * RG + l < N; ++l)
        for (int64_t b = 0; b < nb; ++b) {
          uint16_t* s = dp + (g * nb + b) * dms;
          split_block(src + ((g * RG + l) * nb + b) * bb, qtype, q, s[l], dms == 32 ? s[16 + l] : m_sym);
          for (int64_t k = 0; k < QK; ++k) set_tile_code(cp + (g * nb + b) * tb, bits, l, k, q[k]);
        }
  });
  return {codes, dm};
}

// out [M, N] = x [M, K] @ W.T for W repacked by quant_repack (bits 4 or 8, N rows); x
// float32, bfloat16 or float16, quantized per block to int8; out in x's dtype (float32
// sums rounded to nearest even once) or float32 with out_float. hook: the address of a
// LinearHook run by each thread around its columns (0: none).
at::Tensor quant_linear(at::Tensor x, at::Tensor codes, at::Tensor dm, int64_t bits, int64_t n, bool out_float,
                        int64_t hook) {
  return linear_of(packed_of(codes, dm, bits, n), x, n, out_float, "quant_linear", hook);
}

// The same for K-quant weights repacked by llmserve/ops/kquant.py (layout above KPacked).
at::Tensor kquant_linear(at::Tensor x, at::Tensor codes, at::Tensor sc, at::Tensor dd, int64_t bits, int64_t z,
                         int64_t n, bool out_float, int64_t hook) {
  return linear_of(kpacked_of(codes, sc, dd, bits, z, n), x, n, out_float, "kquant_linear", hook);
}

// Rows ids [T] of a K-quant weight, float32 [T, K], exactly gguf.quants' values.
at::Tensor kquant_rows(at::Tensor codes, at::Tensor sc, at::Tensor dd, int64_t bits, int64_t z, int64_t n,
                       at::Tensor ids) {
  const KPacked p = kpacked_of(codes, sc, dd, bits, z, n);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "kquant_rows: ids int64 [T]");
  at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const int64_t T = ids.size(0), tb = tile_bytes(p.bits);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < n, "kquant_rows: id ", ip[t], " out of range [0, ", n, ")");
  at::Tensor out = at::empty({T, p.nb * QK}, codes.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t g = ip[t] / RG, l = ip[t] % RG;
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint16_t* dd = p.dd + (g * (p.nb / 8) + b / 8) * 32;
      const float d = _cvtsh_ss(dd[l]), dmin = _cvtsh_ss(dd[16 + l]);
      const int8_t* s = p.sc + (g * p.nb + b) * 64;
      const uint8_t* tile = p.codes + (g * p.nb + b) * tb;
      for (int64_t k = 0; k < QK; ++k) {
        const int64_t h = k / 16;
        const float scale = d * static_cast<float>(s[h * 16 + l]), off = dmin * static_cast<float>(s[32 + h * 16 + l]);
        const float c = static_cast<float>(static_cast<int64_t>(tile_code(tile, p.bits, l, k)) - p.z);
        op[t * p.nb * QK + b * QK + k] = scale * c - off;
      }
    }
  }
  return out;
}

// Rows ids [T] (int64) of a repacked weight, dequantized exactly: float32 [T, K] (an
// embedding lookup from the tied LM head's blocks). Raises for an id out of range.
at::Tensor quant_rows(at::Tensor codes, at::Tensor dm, int64_t bits, int64_t n, at::Tensor ids) {
  const Packed p = packed_of(codes, dm, bits, n);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "quant_rows: ids int64 [T]");
  at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const int64_t T = ids.size(0), tb = tile_bytes(p.bits);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < n, "quant_rows: id ", ip[t], " out of range [0, ", n, ")");
  at::Tensor out = at::empty({T, p.nb * QK}, codes.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t g = ip[t] / RG, l = ip[t] % RG;
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint16_t* s = p.dm + (g * p.nb + b) * p.dms;
      const float d = _cvtsh_ss(s[l]), m = p.dms == 32 ? _cvtsh_ss(s[16 + l]) : p.moff * d;
      const uint8_t* tile = p.codes + (g * p.nb + b) * tb;
      for (int64_t k = 0; k < QK; ++k)
        op[t * p.nb * QK + b * QK + k] = d * static_cast<float>(tile_code(tile, p.bits, l, k)) + m;
    }
  }
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
    uint16_t d16, m16;
    for (int64_t b = b0; b < b1; ++b) {
      split_block(wp + b * bb, qtype, q, d16, m16);
      const float d = _cvtsh_ss(d16), m = _cvtsh_ss(m16);
      for (int i = 0; i < QK; ++i) op[b * QK + i] = d * static_cast<float>(q[i]) + m;
    }
  });
  return out;
}

// parts: (kquant, codes, scales, dd, bits, z, n) per type run of the rows, in order (dd:
// an empty tensor for QuantWeight parts) -> x [M, K] @ W.T [M, sum n] (out_float: float32).
at::Tensor quant_linear_parts(at::Tensor x, const std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor,
                                                                          int64_t, int64_t, int64_t>>& parts,
                              bool out_float) {
  std::vector<PackedLinearPart> ps;
  for (const auto& t : parts)
    ps.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t), std::get<5>(t),
                  std::get<6>(t)});
  return linear_parts_impl(ps.data(), static_cast<int64_t>(ps.size()), x, out_float);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear_parts", &quant_linear_parts, "x [M, K] @ W.T over parts of different GGUF types -> [M, sum n]",
        py::arg("x"), py::arg("parts"), py::arg("out_float") = false);
  m.def("packed_linear_address", []() { return reinterpret_cast<int64_t>(&packed_linear_entry); },
        "address of the C++ PackedLinearFn (packed_linear.h)");
  m.def("packed_linear_abi", []() { return kPackedLinearAbi; }, "PackedLinearFn's ABI number");
  m.def("quant_repack", &quant_repack, "GGUF rows -> [codes, dm] (see quant_gemv.cpp)", py::arg("w"), py::arg("qtype"));
  m.def("quant_linear", &quant_linear, "x [M, K] @ W.T from repacked codes/dm -> [M, n]", py::arg("x"),
        py::arg("codes"), py::arg("dm"), py::arg("bits"), py::arg("n"), py::arg("out_float") = false, py::arg("hook") = 0);
  m.def("quant_rows", &quant_rows, "rows ids of a repacked weight -> float32 [T, K]", py::arg("codes"),
        py::arg("dm"), py::arg("bits"), py::arg("n"), py::arg("ids"));
  m.def("quant_dequantize", &quant_dequantize, "GGUF rows -> float32 [N, K], exact");
  m.def("kquant_linear", &kquant_linear, "x [M, K] @ W.T from K-quant codes/sc/dd -> [M, n]", py::arg("x"),
        py::arg("codes"), py::arg("sc"), py::arg("dd"), py::arg("bits"), py::arg("z"), py::arg("n"),
        py::arg("out_float") = false, py::arg("hook") = 0);
  m.def("kquant_rows", &kquant_rows, "rows ids of a K-quant weight -> float32 [T, K]", py::arg("codes"),
        py::arg("sc"), py::arg("dd"), py::arg("bits"), py::arg("z"), py::arg("n"), py::arg("ids"));
}
