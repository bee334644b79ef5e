// Python bindings of the llmserve CPU ops (the module torch.utils.cpp_extension builds).
#include "ops.h"
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/Exceptions.h>

void bind_layer_driver(pybind11::module_& m);  // layer_driver.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("fused_add_rms_norm", torch::wrap_pybind_function(fused_add_rms_norm), "fused_add_rms_norm");
  m.def("silu_and_mul", torch::wrap_pybind_function(silu_and_mul), "silu_and_mul");
  m.def("rotary_embedding", torch::wrap_pybind_function(rotary_embedding), "rotary_embedding");
  m.def("to_float", torch::wrap_pybind_function(to_float), "to_float");
  m.def("sample_inverse_cdf", torch::wrap_pybind_function(sample_inverse_cdf), "sample_inverse_cdf");
  m.def("apply_token_bitmask", torch::wrap_pybind_function(apply_token_bitmask), "apply_token_bitmask");
  m.def("reshape_and_cache", torch::wrap_pybind_function(reshape_and_cache), "reshape_and_cache");
  bind_layer_driver(m);
}
