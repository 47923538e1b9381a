// When a generation runs classifier-free guidance, stated once (diffusers' do_classifier_free_guidance): a scale
// above 1 adds a second, negative-prompt pass per step, so the request needs negative embeddings and costs twice the
// transformer work. The model's loops, the server and the CLI all ask guided(). Torch-free.
#pragma once

#include <cstdint>

namespace skyreels::model {

constexpr bool guided(double guidance_scale) { return guidance_scale > 1.0; }

// Transformer passes per denoising row: the prompt's, and with guidance the negative prompt's.
constexpr int64_t passes_per_row(double guidance_scale) { return guided(guidance_scale) ? 2 : 1; }

}  // namespace skyreels::model
