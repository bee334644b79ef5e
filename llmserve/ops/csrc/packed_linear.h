// The C++ entry of the packed-weight linear (quant_gemv.cpp, the quant_ops extension) that
// other extensions call without Python: cpu_ops' decoder-layer driver (layer_driver.cpp)
// gets its address once from quant_ops.packed_linear_address() and checks the ABI number.
#pragma once
#include <ATen/core/Tensor.h>

// One run of a linear's output rows held in one GGUF type, in the layouts of
// llmserve/ops/quant_ops.py (QuantWeight: codes, dm) and llmserve/ops/kquant.py
// (KQuantWeight: codes, sc, dd); a fused linear (qkv, gate_up) whose parts differ in type
// (Q4_K_M files) is several, their rows stacked in order.
struct PackedLinearPart {
  int64_t kquant;                  // 0: QuantWeight, 1: KQuantWeight
  at::Tensor codes, scales, dd;    // scales: dm (QuantWeight) or sc (KQuantWeight); dd: K-quants only
  int64_t bits, z, n;              // code bits 4 / 5 / 8, K-quant code offset, output rows
};

// x [M, K] float32 / bfloat16 / float16 -> [M, sum of the parts' n] in x's dtype, every part
// in one parallel region (each part's columns exactly as its own call gives them).
// Raises (c10::Error) for a shape or type mismatch.
using PackedLinearFn = at::Tensor (*)(const PackedLinearPart* parts, int64_t nparts, const at::Tensor& x);
constexpr int64_t kPackedLinearAbi = 1;
