// One adapter of one transformer call, applied unmerged (TransformerForwardArgs::adapters, GenerationParams::adapters).
// Its own header so that the pipelines' parameters carry adapters without including the transformer.
#pragma once

#include <memory>

namespace skyreels::model {

struct LoraAdapter;  // model/lora.h

// Each linear layer the adapter updates computes y = W x + b + scale * factor * B (A x) (low-rank: factor =
// alpha / r), + scale * factor * x delta^T (a full weight diff), + scale * factor * bias delta. Its tensors must lie
// on the model's device in the dtype of the parameter they update (place_lora); the weights are never written.
// Shared, so that a bank may let an adapter go while a call still runs with it.
struct ActiveAdapter {
  std::shared_ptr<const LoraAdapter> adapter;
  double scale = 1.0;
};

}  // namespace skyreels::model
