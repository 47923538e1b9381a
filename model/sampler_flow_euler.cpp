#include "model/sampler_flow_euler.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include "model/sampler_table.h"
#include "model/scheduler_config_json.h"

namespace skyreels::model {

namespace {

[[noreturn]] void invalid(const std::string& message) { throw std::invalid_argument(message); }

// s * sigma / (1 + (s - 1) * sigma) in float32, operation by operation as torch / numpy compute it on float32 arrays
// with a Python float shift (the scalar cast to float32 first). This build never contracts to FMA.
float shift_f32(double shift, float sigma) {
  const auto s = static_cast<float>(shift);
  const auto s_minus_1 = static_cast<float>(shift - 1.0);
  const float numerator = s * sigma;
  const float denominator = 1.0f + s_minus_1 * sigma;
  return numerator / denominator;
}

std::string text(double v) {
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

}  // namespace

// ---- config ----------------------------------------------------------------------------------------------------

FlowEulerConfig FlowEulerConfig::from_json(const std::string& json_text, const std::string& origin) {
  using scheduler_json::Json;
  const Json j = scheduler_json::parse_object(json_text, origin);
  scheduler_json::require_class(j, origin, sampler_row(SamplerKind::kEuler).config_class);
  // diffusers tests each for truth: off is absent, false, null or 0.
  static const char* const kUnsupported[] = {"use_dynamic_shifting", "use_karras_sigmas",   "use_exponential_sigmas",
                                             "use_beta_sigmas",      "stochastic_sampling", "invert_sigmas",
                                             "shift_terminal"};
  for (const char* key : kUnsupported) scheduler_json::require_falsy(j, origin, key, "the Euler sampler");

  FlowEulerConfig c;
  c.num_train_timesteps = scheduler_json::get_typed<int64_t>(j, origin, "num_train_timesteps", c.num_train_timesteps);
  c.shift = scheduler_json::get_typed<double>(j, origin, "shift", c.shift);
  if (c.num_train_timesteps < 1) {
    scheduler_json::config_error(origin, "num_train_timesteps",
                                 "must be >= 1, got " + std::to_string(c.num_train_timesteps));
  }
  if (!std::isfinite(c.shift) || c.shift <= 0.0) {
    scheduler_json::config_error(origin, "shift", "must be a positive number, got " + text(c.shift));
  }

  // Read above, or read by dynamic shifting only (refused above), or bookkeeping.
  static const std::set<std::string> known_keys = {"_class_name",     "_diffusers_version",  "base_shift",
                                                   "max_shift",       "base_image_seq_len",  "max_image_seq_len",
                                                   "time_shift_type", "num_train_timesteps", "shift"};
  for (const auto& item : j.items()) {
    bool known = known_keys.count(item.key()) > 0;
    for (const char* key : kUnsupported) known = known || item.key() == key;
    if (!known) spdlog::warn("{}: ignoring unknown scheduler key '{}'", origin, item.key());
  }
  return c;
}

FlowEulerConfig FlowEulerConfig::from_file(const std::string& path) {
  return from_json(scheduler_json::read_text(path), path);
}

// ---- schedule --------------------------------------------------------------------------------------------------

void check_timestep_list(const std::vector<int64_t>& timesteps, int64_t num_train_timesteps) {
  const std::string field = "scheduler.timesteps: ";
  if (timesteps.empty()) invalid(field + "the list is empty");
  if (static_cast<int64_t>(timesteps.size()) > kMaxEulerTimesteps) {
    invalid(field + std::to_string(timesteps.size()) + " entries, more than " + std::to_string(kMaxEulerTimesteps));
  }
  for (size_t i = 0; i < timesteps.size(); ++i) {
    const int64_t t = timesteps[i];
    if (t <= 0 || t > num_train_timesteps) {
      invalid(field + "entry " + std::to_string(i) + " is " + std::to_string(t) + ", outside (0, " +
              std::to_string(num_train_timesteps) + "] (num_train_timesteps)");
    }
    if (i > 0 && t >= timesteps[i - 1]) {
      invalid(field + "must be strictly decreasing, but entry " + std::to_string(i) + " (" + std::to_string(t) +
              ") follows " + std::to_string(timesteps[i - 1]));
    }
  }
}

FlowEulerSchedule make_flow_euler_schedule(int64_t num_train_timesteps, double shift, int64_t num_inference_steps,
                                           const std::vector<int64_t>& timesteps) {
  if (num_train_timesteps < 1) {
    invalid("scheduler.num_train_timesteps: must be >= 1, got " + std::to_string(num_train_timesteps));
  }
  if (!std::isfinite(shift) || shift <= 0.0) invalid("flow_shift: must be a positive number, got " + text(shift));
  const auto train_f = static_cast<float>(num_train_timesteps);
  const auto train_d = static_cast<double>(num_train_timesteps);
  std::vector<float> sigmas;

  if (!timesteps.empty()) {
    check_timestep_list(timesteps, num_train_timesteps);
    if (num_inference_steps != static_cast<int64_t>(timesteps.size())) {
      invalid("scheduler.timesteps: " + std::to_string(timesteps.size()) + " entries, but num_inference_steps is " +
              std::to_string(num_inference_steps) + " (leave num_inference_steps unset, or give the list's length)");
    }
    // np.array(timesteps).astype(float32) / T, then the shift, all in float32.
    for (int64_t t : timesteps) sigmas.push_back(shift_f32(shift, static_cast<float>(t) / train_f));
  } else {
    if (num_inference_steps < 1) {
      invalid("num_inference_steps: must be >= 1, got " + std::to_string(num_inference_steps));
    }
    // __init__: the training sigmas linspace(1, T, T)[::-1] / T, shifted in float32; their ends as Python floats.
    const double sigma_max = shift_f32(shift, train_f / train_f);
    const double sigma_min = shift_f32(shift, 1.0f / train_f);
    // set_timesteps: numpy.linspace(sigma_max * T, sigma_min * T, N) in float64 (y_i = i * step + start, the last
    // one exactly stop), / T, shifted again in float64, then float32.
    const double start = sigma_max * train_d;
    const double stop = sigma_min * train_d;
    const int64_t n = num_inference_steps;
    const double step = n > 1 ? (stop - start) / static_cast<double>(n - 1) : 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double t = (n > 1 && i == n - 1) ? stop : static_cast<double>(i) * step + start;
      const double sigma = t / train_d;
      sigmas.push_back(static_cast<float>(shift * sigma / (1.0 + (shift - 1.0) * sigma)));
    }
  }

  FlowEulerSchedule out;
  for (float sigma : sigmas) {
    const float t = sigma * train_f;  // torch: sigmas * num_train_timesteps, float32
    out.timesteps.push_back(t);
    out.model_timesteps.push_back(static_cast<int64_t>(t));  // .long(): truncation
  }
  out.sigmas = sigmas;
  out.sigmas.push_back(0.0f);

  // diffusers' step() finds a frame's first step by comparing the int64 step-matrix value with its float timesteps:
  // the first must be an integer and appear once.
  const float first = out.timesteps.front();
  const std::string what = timesteps.empty() ? "flow_shift: " : "scheduler.timesteps: ";
  if (std::trunc(first) != first) {
    invalid(what + "the first timestep becomes " + text(first) + " after the shift (flow_shift " + text(shift) +
            "), not an integer: the DF pipeline tells the transformer " + std::to_string(out.model_timesteps[0]) +
            " and diffusers' scheduler cannot find its first step (diffusers fails); start the list at " +
            std::to_string(num_train_timesteps));
  }
  if (out.timesteps.size() > 1 && out.timesteps[1] == first) {
    invalid(what + "the first two timesteps are equal after the shift (" + text(first) + ")");
  }
  return out;
}

FlowEulerSampler::FlowEulerSampler(FlowEulerSchedule schedule) : schedule_(std::move(schedule)) {
  if (schedule_.timesteps.empty() || schedule_.sigmas.size() != schedule_.timesteps.size() + 1) {
    throw std::invalid_argument("FlowEulerSampler: a schedule of N timesteps needs N + 1 sigmas");
  }
  const at::Tensor sigmas = at::tensor(schedule_.sigmas, at::kFloat);
  for (int64_t k = 0; k < num_steps(); ++k) dt_.push_back(sigmas.select(0, k + 1) - sigmas.select(0, k));
}

const at::Tensor& FlowEulerSampler::dt(int64_t step) const {
  if (step < 0 || step >= num_steps()) {
    throw std::out_of_range("flow Euler: step " + std::to_string(step) + " outside the schedule of " +
                            std::to_string(num_steps()) + " steps");
  }
  return dt_[static_cast<size_t>(step)];
}

FlowEulerFrames::FlowEulerFrames(std::shared_ptr<const FlowEulerSampler> sampler, int64_t num_frames)
    : sampler_(std::move(sampler)) {
  if (!sampler_) throw std::invalid_argument("FlowEulerFrames: sampler is null");
  if (num_frames < 1) throw std::invalid_argument("FlowEulerFrames: num_frames must be >= 1");
  steps_.assign(static_cast<size_t>(num_frames), 0);
}

int64_t FlowEulerFrames::steps_taken(int64_t frame) const { return steps_.at(static_cast<size_t>(frame)); }

float FlowEulerFrames::sigma(int64_t frame) const {
  return sampler_->schedule().sigmas.at(static_cast<size_t>(steps_taken(frame)));
}

at::Tensor FlowEulerFrames::step(const std::vector<int64_t>& frames, const at::Tensor& model_output,
                                 const at::Tensor& sample) {
  if (frames.empty()) throw std::invalid_argument("FlowEulerFrames::step: no frames given");
  for (int64_t f : frames) {
    if (f < 0 || f >= num_frames()) {
      throw std::invalid_argument("FlowEulerFrames::step: frame " + std::to_string(f) + " out of range");
    }
  }
  const int64_t k = steps_[static_cast<size_t>(frames[0])];
  for (int64_t f : frames) {
    if (steps_[static_cast<size_t>(f)] != k) {
      throw std::invalid_argument("FlowEulerFrames::step: frames " + std::to_string(frames[0]) + " and " +
                                  std::to_string(f) + " are at different steps");
    }
  }
  if (k >= sampler_->num_steps()) {
    throw std::invalid_argument("FlowEulerFrames::step: frame " + std::to_string(frames[0]) + " already took all " +
                                std::to_string(sampler_->num_steps()) + " steps");
  }
  const auto group = static_cast<int64_t>(frames.size());
  if (sample.dim() != 5 || model_output.sizes() != sample.sizes() || sample.size(2) != group) {
    std::ostringstream os;
    os << "FlowEulerFrames::step: expected model_output and sample [B, C, " << group << ", H, W], got "
       << model_output.sizes() << " and " << sample.sizes();
    throw std::invalid_argument(os.str());
  }
  // diffusers: sample.to(float32) + (sigma_next - sigma) * model_output, cast to model_output's dtype; the pipeline
  // writes it back into its latents.
  const at::Tensor next = sample.to(at::kFloat) + sampler_->dt(k) * model_output;
  for (int64_t f : frames) ++steps_[static_cast<size_t>(f)];
  return next.to(model_output.scalar_type()).to(sample.scalar_type());
}

}  // namespace skyreels::model
