// Random DF-1.3B-shaped transformer weights for benchmarks (bench_transformer, bench_step_savings).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "model/checkpoint.h"
#include "model/transformer_skyreels_v2.h"

namespace skyreels::bench {

// Random weights of the right scale (so activations stay finite), generated tensor by tensor to keep the peak at
// the model's own size.
inline skyreels::checkpoint::StateDict random_weights(const skyreels::model::TransformerConfig& c, at::ScalarType dtype) {
  at::manual_seed(0);
  skyreels::checkpoint::StateDict out;
  for (const auto& spec : skyreels::model::transformer_parameter_specs(c)) {
    at::Tensor t = at::empty(spec.shape, at::kFloat);
    const bool matrix = spec.shape.size() >= 2 && spec.name.find("scale_shift_table") == std::string::npos;
    if (matrix) {
      const int64_t fan_in = t.numel() / spec.shape[0];
      t.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(fan_in)));
    } else if (spec.name.find("norm") != std::string::npos && spec.name.find(".weight") != std::string::npos) {
      t.fill_(1.0);
    } else {
      t.normal_(0.0, 0.02);
    }
    out[spec.name] = t.to(spec.keep_fp32 ? at::kFloat : dtype);
  }
  return out;
}

}  // namespace skyreels::bench
