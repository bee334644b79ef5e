// A Llama-family model's decoder layers in one C++ call per step, for models whose linear
// layers all run on GGUF blocks (the packed kernels of quant_gemv.cpp, reached through
// PackedLinearFn): the same kernels, in the same order, on the same tensors as the Python
// layer loop (llmserve/models/llama.py: LlamaDecoderLayer.forward with the CPU kernels),
// so the outputs are the same numbers. What it removes is the interpreter between them:
// ~12 Python-to-C++ calls a layer, each with its argument parsing, checks and tensor
// allocation, were ~20% of a batch-1 decode step's CPU samples in perf (SmolLM2, 30
// layers, AVX2), the worker thread spinning at a barrier meanwhile.
#include "ops.h"
#include "packed_linear.h"
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// A linear layer's packed parts (packed_linear.h) and optional bias [n].
struct DriverLinear {
  std::vector<PackedLinearPart> parts;
  std::optional<at::Tensor> bias;
};

struct DriverLayer {
  at::Tensor in_norm, post_norm;  // RMSNorm weights [hidden]
  double in_eps, post_eps;
  DriverLinear qkv, o, gate_up, down;
  std::optional<at::Tensor> q_norm, k_norm;  // Qwen3's per-head RMSNorm weights [head_dim]
  double qk_eps;
  double scale;      // softmax scale
  int64_t window;    // sliding window in tokens, 0: none
  double softcap;    // attention logit soft cap, 0: none
};

using PartTuple = std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t>;

DriverLinear linear_of(const std::vector<PartTuple>& parts, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(!parts.empty(), "LlamaLayers: a linear without parts");
  DriverLinear l;
  for (const auto& t : parts)
    l.parts.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t),
                       std::get<5>(t), std::get<6>(t)});
  l.bias = bias;
  return l;
}

}  // namespace

// The decoder layers of one model (add_layer in order), run by run().
class LlamaLayers {
 public:
  // linear_fn: quant_ops.packed_linear_address(); abi: quant_ops.packed_linear_abi().
  LlamaLayers(int64_t linear_fn, int64_t abi, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t intermediate)
      : fn_(reinterpret_cast<PackedLinearFn>(linear_fn)), nh_(num_heads), nkv_(num_kv_heads), hd_(head_dim),
        inter_(intermediate) {
    TORCH_CHECK(abi == kPackedLinearAbi, "LlamaLayers: packed linear ABI ", abi, ", expected ", kPackedLinearAbi,
                " (rebuild the kernels)");
    TORCH_CHECK(linear_fn != 0 && num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && intermediate > 0,
                "LlamaLayers: bad shape or linear");
  }

  void add_layer(at::Tensor in_norm, double in_eps, at::Tensor post_norm, double post_eps,
                 const std::vector<PartTuple>& qkv, std::optional<at::Tensor> qkv_bias,
                 const std::vector<PartTuple>& o, std::optional<at::Tensor> o_bias,
                 const std::vector<PartTuple>& gate_up, std::optional<at::Tensor> gate_up_bias,
                 const std::vector<PartTuple>& down, std::optional<at::Tensor> down_bias,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, double qk_eps, double scale,
                 int64_t window, double softcap) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "LlamaLayers: q_norm and k_norm come together");
    layers_.push_back({in_norm, post_norm, in_eps, post_eps, linear_of(qkv, qkv_bias), linear_of(o, o_bias),
                       linear_of(gate_up, gate_up_bias), linear_of(down, down_bias), q_norm, k_norm, qk_eps, scale,
                       window, softcap});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [T, H] (the embeddings) -> (hidden [T, H], residual [T, H]) after the last
  // layer, before the final norm: LlamaModel's layer loop. positions [T] int64; cos / sin
  // float32 tables [P, head_dim / 2]; kv_caches one [2, blocks, block_size, kv_heads,
  // head_dim] per layer; slots [T] int64; tables [T, M] / lens [T] int32: each token's
  // block table and causal length (backend.py's _token_tables). hidden becomes the first
  // residual and is updated in place, as in the Python loop. Raises (RuntimeError) for a
  // shape or dtype mismatch, from the kernels' own checks.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                                         const std::vector<at::Tensor>& kv_caches, at::Tensor slots,
                                         at::Tensor tables, at::Tensor lens) const {
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "LlamaLayers: ", kv_caches.size(),
                " KV caches for ", num_layers(), " layers");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "LlamaLayers: hidden [T, H] contiguous");
    at::Tensor residual = hidden, x;
    for (int64_t i = 0; i < num_layers(); ++i) {
      const DriverLayer& L = layers_[i];
      x = at::empty_like(hidden);
      if (i == 0) rms_norm(x, hidden, L.in_norm, L.in_eps);
      else fused_add_rms_norm(x, hidden, residual, L.in_norm, L.in_eps);
      at::Tensor attn = attention(L, x, positions, cos, sin, kv_caches[i], slots, tables, lens);
      x = at::empty_like(attn);
      fused_add_rms_norm(x, attn, residual, L.post_norm, L.post_eps);
      hidden = mlp(L, x);
    }
    return {hidden, residual};
  }

 private:
  at::Tensor linear(const DriverLinear& l, const at::Tensor& x) const {
    at::Tensor y = fn_(l.parts.data(), static_cast<int64_t>(l.parts.size()), x);
    return l.bias ? y.add_(*l.bias) : y;
  }

  // LlamaAttention.forward: qkv; q and k normed per head (Qwen3) then rotated each, or
  // rotated side by side; the cache write and paged attention of every token over its
  // causal context; o_proj.
  at::Tensor attention(const DriverLayer& L, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slots,
                       const at::Tensor& tables, const at::Tensor& lens) const {
    const int64_t t = x.size(0), qs = nh_ * hd_, kvs = nkv_ * hd_;
    at::Tensor qkv = linear(L.qkv, x);
    at::Tensor q = qkv.narrow(1, 0, qs).view({t, nh_, hd_}), k = qkv.narrow(1, qs, kvs).view({t, nkv_, hd_});
    if (L.q_norm) {
      at::Tensor qn = at::empty({t, nh_, hd_}, x.options()), kn = at::empty({t, nkv_, hd_}, x.options());
      rms_norm(qn, q, *L.q_norm, L.qk_eps);
      rms_norm(kn, k, *L.k_norm, L.qk_eps);
      rotary_embedding(positions, qn, cos, sin);
      rotary_embedding(positions, kn, cos, sin);
      q = qn;
      k = kn;
    } else {
      rotary_embedding(positions, qkv.narrow(1, 0, qs + kvs).view({t, nh_ + nkv_, hd_}), cos, sin);
    }
    reshape_and_cache(k, qkv.narrow(1, qs + kvs, kvs).view({t, nkv_, hd_}), kv_cache, slots);
    at::Tensor out = at::empty({t, nh_, hd_}, x.options());
    paged_decode(out, q, kv_cache, tables, lens, t, L.scale, L.window, L.softcap);
    return linear(L.o, out.view({t, qs}));
  }

  at::Tensor mlp(const DriverLayer& L, const at::Tensor& x) const {
    at::Tensor gate_up = linear(L.gate_up, x);
    at::Tensor act = at::empty({x.size(0), inter_}, x.options());
    silu_and_mul(act, gate_up);
    return linear(L.down, act);
  }

  PackedLinearFn fn_;
  int64_t nh_, nkv_, hd_, inter_;
  std::vector<DriverLayer> layers_;
};

void bind_layer_driver(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<LlamaLayers>(m, "LlamaLayers")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>(), py::arg("linear_fn"), py::arg("abi"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate_size"))
      .def("add_layer", &LlamaLayers::add_layer)
      .def("num_layers", &LlamaLayers::num_layers)
      .def("run", &LlamaLayers::run, py::call_guard<py::gil_scoped_release>());
}
