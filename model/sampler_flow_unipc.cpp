#include "model/sampler_flow_unipc.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>
#include <stdexcept>

#include "model/sampler_table.h"
#include "model/scheduler_config_json.h"

namespace skyreels::model {

// ---- config ----------------------------------------------------------------------------------------------------

namespace {

using scheduler_json::config_error;
using scheduler_json::get_typed;
using scheduler_json::Json;
using scheduler_json::require_falsy;
using scheduler_json::require_value;

// Keys diffusers stores that do not influence the flow-sigma path (betas, spacing of the discarded default grid...).
const std::set<std::string>& ignored_keys() {
  static const std::set<std::string> keys = {"_diffusers_version", "beta_start",    "beta_end",
                                             "beta_schedule",      "trained_betas", "dynamic_thresholding_ratio",
                                             "sample_max_value",   "steps_offset",  "rescale_betas_zero_snr",
                                             "time_shift_type",    "sigma_min",     "sigma_max",
                                             "timestep_spacing"};
  return keys;
}

}  // namespace

FlowUniPCConfig FlowUniPCConfig::from_json(const std::string& text, const std::string& origin) {
  const Json j = scheduler_json::parse_object(text, origin);
  scheduler_json::require_class(j, origin, sampler_row(SamplerKind::kUniPC).config_class);
  require_value(j, origin, "prediction_type", "flow_prediction");
  require_value(j, origin, "use_flow_sigmas", true);
  require_value(j, origin, "predict_x0", true);
  for (const char* key : {"thresholding", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                          "use_dynamic_shifting", "solver_p", "shift_terminal"}) {
    require_falsy(j, origin, key, "the flow UniPC sampler");
  }
  if (j.contains("timestep_spacing")) {
    const Json& v = j.at("timestep_spacing");
    if (v != "linspace" && v != "leading" && v != "trailing") {
      config_error(origin, "timestep_spacing", "must be linspace, leading or trailing, got " + v.dump());
    }
  }

  FlowUniPCConfig c;
  c.num_train_timesteps = get_typed<int64_t>(j, origin, "num_train_timesteps", c.num_train_timesteps);
  c.solver_order = get_typed<int64_t>(j, origin, "solver_order", c.solver_order);
  c.solver_type = get_typed<std::string>(j, origin, "solver_type", c.solver_type);
  c.lower_order_final = get_typed<bool>(j, origin, "lower_order_final", c.lower_order_final);
  c.disable_corrector = get_typed<std::vector<int64_t>>(j, origin, "disable_corrector", c.disable_corrector);
  c.final_sigmas_type = get_typed<std::string>(j, origin, "final_sigmas_type", c.final_sigmas_type);
  c.flow_shift = get_typed<double>(j, origin, "flow_shift", c.flow_shift);

  static const std::set<std::string> handled = {
      "_class_name",       "prediction_type",        "use_flow_sigmas", "predict_x0",           "thresholding",
      "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "use_dynamic_shifting", "solver_p",
      "shift_terminal",    "num_train_timesteps",    "solver_order",    "solver_type",          "lower_order_final",
      "disable_corrector", "final_sigmas_type",      "flow_shift"};
  for (const auto& item : j.items()) {
    if (!handled.count(item.key()) && !ignored_keys().count(item.key())) {
      spdlog::warn("{}: ignoring unknown scheduler key '{}'", origin, item.key());
    }
  }
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(e.what()) + " (in " + origin + ")");
  }
  return c;
}

FlowUniPCConfig FlowUniPCConfig::from_file(const std::string& path) {
  return from_json(scheduler_json::read_text(path), path);
}

void FlowUniPCConfig::validate() const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  require(num_train_timesteps >= 1, "num_train_timesteps: must be >= 1, got " + std::to_string(num_train_timesteps));
  require(solver_order == 1 || solver_order == 2,
          "solver_order: only 1 or 2 is supported, got " + std::to_string(solver_order));
  require(solver_type == "bh1" || solver_type == "bh2",
          "solver_type: must be \"bh1\" or \"bh2\", got \"" + solver_type + "\"");
  require(final_sigmas_type == "zero",
          "final_sigmas_type: only \"zero\" is supported, got \"" + final_sigmas_type + "\"");
  require(std::isfinite(flow_shift) && flow_shift > 0.0,
          "flow_shift: must be a positive number, got " + std::to_string(flow_shift));
}

// ---- schedule --------------------------------------------------------------------------------------------------

FlowSchedule make_flow_schedule(const FlowUniPCConfig& config, int64_t num_inference_steps) {
  config.validate();
  if (num_inference_steps < 1) {
    throw std::invalid_argument("num_inference_steps: must be >= 1, got " + std::to_string(num_inference_steps));
  }
  const int64_t n = num_inference_steps;
  const double train = static_cast<double>(config.num_train_timesteps);
  const double s = config.flow_shift;
  // numpy.linspace(1, 1/T, N+1)[:-1]: y_i = i * step + start, in float64 (this build never contracts to FMA).
  const double start = 1.0;
  const double step = (1.0 / train - start) / static_cast<double>(n);
  std::vector<double> sigma(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double linear = static_cast<double>(i) * step + start;
    sigma[static_cast<size_t>(i)] = s * linear / (1.0 + (s - 1.0) * linear);
  }
  // diffusers >= v0.37 nudges a first sigma of exactly 1 so that log(sigma) stays finite.
  if (std::fabs(sigma[0] - 1.0) < 1e-6) sigma[0] -= 1e-6;

  FlowSchedule out;
  out.timesteps.reserve(static_cast<size_t>(n));
  out.sigmas.reserve(static_cast<size_t>(n + 1));
  for (double v : sigma) {
    out.timesteps.push_back(static_cast<int64_t>(v * train));  // truncation, as tensor.to(int64)
    out.sigmas.push_back(static_cast<float>(v));
  }
  out.sigmas.push_back(0.0f);
  return out;
}

// ---- per-step coefficients -------------------------------------------------------------------------------------
// Every scalar is a 0-dim fp32 CPU tensor produced by the same ATen operations, in the same order, as diffusers'
// multistep_uni_p_bh_update / multistep_uni_c_bh_update, so they are bit-identical to diffusers' on CPU.

struct FlowUniPCSampler::StepCoefficients {
  at::Tensor sigma;  // sigmas[k]: x0 = x - sigma * v
  // Corrector UniC (from sigma[k-1] to sigma[k]), when `corrector`.
  bool corrector = false;
  int64_t corrector_order = 0;
  at::Tensor c_ratio, c_a, c_b, c_rk, c_rho0, c_rho_last;
  // Predictor UniP (from sigma[k] to sigma[k+1]).
  int64_t predictor_order = 1;
  at::Tensor p_ratio, p_a, p_b, p_rk;
};

struct FlowUniPCSampler::Impl {
  FlowUniPCConfig config;
  FlowSchedule schedule;
  at::Tensor sigmas;  // fp32 [N+1], CPU
  std::vector<StepCoefficients> steps;

  at::Tensor sigma_at(int64_t i) const { return sigmas.select(0, i); }
  static at::Tensor lambda(const at::Tensor& sigma) {
    const at::Tensor alpha = at::rsub(sigma, 1);  // flow sigmas: alpha = 1 - sigma
    return at::log(alpha) - at::log(sigma);
  }
  at::Tensor b_of_h(const at::Tensor& hh) const { return config.solver_type == "bh1" ? hh : at::expm1(hh); }

  int64_t order_at(int64_t k) const {
    const int64_t n = static_cast<int64_t>(schedule.timesteps.size());
    int64_t order = config.lower_order_final ? std::min(config.solver_order, n - k) : config.solver_order;
    const int64_t lower_order_nums = std::min(k, config.solver_order);  // calls so far, capped
    return std::min(order, lower_order_nums + 1);
  }
  bool corrector_at(int64_t k) const {
    if (k == 0) return false;
    const auto& off = config.disable_corrector;
    return std::find(off.begin(), off.end(), k - 1) == off.end();
  }

  void fill_predictor(int64_t k, StepCoefficients& c) const {
    c.predictor_order = order_at(k);
    const at::Tensor sigma_t = sigma_at(k + 1);
    const at::Tensor sigma_s0 = sigma_at(k);
    const at::Tensor alpha_t = at::rsub(sigma_t, 1);
    const at::Tensor lambda_s0 = lambda(sigma_s0);
    const at::Tensor h = lambda(sigma_t) - lambda_s0;
    if (c.predictor_order == 2) c.p_rk = (lambda(sigma_at(k - 1)) - lambda_s0) / h;
    const at::Tensor hh = -h;
    c.p_ratio = sigma_t / sigma_s0;
    c.p_a = alpha_t * at::expm1(hh);
    c.p_b = alpha_t * b_of_h(hh);
  }

  void fill_corrector(int64_t k, StepCoefficients& c) const {
    c.corrector = corrector_at(k);
    if (!c.corrector) return;
    const int64_t order = order_at(k - 1);  // UniC uses the order of the previous predictor call
    c.corrector_order = order;
    const at::Tensor sigma_t = sigma_at(k);
    const at::Tensor sigma_s0 = sigma_at(k - 1);
    const at::Tensor alpha_t = at::rsub(sigma_t, 1);
    const at::Tensor lambda_s0 = lambda(sigma_s0);
    const at::Tensor h = lambda(sigma_t) - lambda_s0;
    std::vector<at::Tensor> rks;
    if (order == 2) {
      c.c_rk = (lambda(sigma_at(k - 2)) - lambda_s0) / h;
      rks.push_back(c.c_rk);
    }
    rks.push_back(at::ones({}, at::kFloat));
    const at::Tensor rk_vec = at::stack(rks);
    const at::Tensor hh = -h;
    const at::Tensor h_phi_1 = at::expm1(hh);
    at::Tensor h_phi_k = h_phi_1 / hh - 1;
    const at::Tensor b_h = b_of_h(hh);
    int64_t factorial = 1;
    std::vector<at::Tensor> r_rows, b;
    for (int64_t i = 1; i <= order; ++i) {
      r_rows.push_back(at::pow(rk_vec, i - 1));
      b.push_back(h_phi_k * factorial / b_h);
      factorial *= i + 1;
      h_phi_k = h_phi_k / hh - 1.0 / static_cast<double>(factorial);
    }
    if (order == 1) {
      c.c_rho_last = at::full({}, 0.5, at::kFloat);
    } else {
      const at::Tensor rhos = at::linalg_solve(at::stack(r_rows), at::stack(b));
      c.c_rho0 = rhos.select(0, 0);
      c.c_rho_last = rhos.select(0, order - 1);
    }
    c.c_ratio = sigma_t / sigma_s0;
    c.c_a = alpha_t * h_phi_1;
    c.c_b = alpha_t * b_h;
  }
};

namespace {

// Equal consecutive fp32 sigmas make h = 0 and the UniPC coefficients 0/0; refuse such schedules up front.
void check_distinct_sigmas(const FlowSchedule& schedule, const FlowUniPCConfig& config) {
  for (size_t i = 0; i + 1 < schedule.sigmas.size(); ++i) {
    if (schedule.sigmas[i] == schedule.sigmas[i + 1]) {
      std::ostringstream os;
      os << "num_inference_steps: " << schedule.timesteps.size() << " steps at flow_shift " << config.flow_shift
         << " give equal fp32 sigmas at steps " << i << " and " << i + 1 << "; use fewer steps or a smaller shift";
      throw std::invalid_argument(os.str());
    }
  }
}

}  // namespace

FlowUniPCSampler::FlowUniPCSampler(FlowUniPCConfig config, int64_t num_inference_steps) : impl_(new Impl) {
  impl_->config = std::move(config);
  impl_->schedule = make_flow_schedule(impl_->config, num_inference_steps);
  check_distinct_sigmas(impl_->schedule, impl_->config);
  impl_->sigmas = at::tensor(impl_->schedule.sigmas, at::kFloat);
  impl_->steps.resize(static_cast<size_t>(num_inference_steps));
  for (int64_t k = 0; k < num_inference_steps; ++k) {
    auto& c = impl_->steps[static_cast<size_t>(k)];
    c.sigma = impl_->sigma_at(k);
    impl_->fill_corrector(k, c);
    impl_->fill_predictor(k, c);
  }
}

FlowUniPCSampler::~FlowUniPCSampler() = default;

const FlowUniPCConfig& FlowUniPCSampler::config() const { return impl_->config; }
const FlowSchedule& FlowUniPCSampler::schedule() const { return impl_->schedule; }
int64_t FlowUniPCSampler::num_steps() const { return static_cast<int64_t>(impl_->steps.size()); }
int64_t FlowUniPCSampler::predictor_order(int64_t step) const { return coefficients(step).predictor_order; }
bool FlowUniPCSampler::uses_corrector(int64_t step) const { return coefficients(step).corrector; }

const FlowUniPCSampler::StepCoefficients& FlowUniPCSampler::coefficients(int64_t step) const {
  if (step < 0 || step >= num_steps()) {
    throw std::out_of_range("flow UniPC: step " + std::to_string(step) + " outside the schedule of " +
                            std::to_string(num_steps()) + " steps");
  }
  return impl_->steps[static_cast<size_t>(step)];
}

// ---- per-frame state -------------------------------------------------------------------------------------------

FlowUniPCFrames::FlowUniPCFrames(std::shared_ptr<const FlowUniPCSampler> sampler, int64_t num_frames)
    : sampler_(std::move(sampler)) {
  if (!sampler_) throw std::invalid_argument("FlowUniPCFrames: sampler is null");
  if (num_frames < 1) throw std::invalid_argument("FlowUniPCFrames: num_frames must be >= 1");
  const auto n = static_cast<size_t>(num_frames);
  steps_.assign(n, 0);
  x0_prev_.resize(n);
  x0_cur_.resize(n);
  last_sample_.resize(n);
}

int64_t FlowUniPCFrames::steps_taken(int64_t frame) const { return steps_.at(static_cast<size_t>(frame)); }

float FlowUniPCFrames::sigma(int64_t frame) const {
  return sampler_->schedule().sigmas.at(static_cast<size_t>(steps_taken(frame)));
}

at::Tensor FlowUniPCFrames::last_x0(int64_t frame) const { return x0_cur_.at(static_cast<size_t>(frame)); }

at::Tensor FlowUniPCFrames::last_corrected_sample(int64_t frame) const {
  return last_sample_.at(static_cast<size_t>(frame));
}

namespace {

at::Tensor gather(const std::vector<at::Tensor>& per_frame, const std::vector<int64_t>& frames) {
  if (frames.size() == 1) return per_frame[static_cast<size_t>(frames[0])];
  std::vector<at::Tensor> parts;
  parts.reserve(frames.size());
  for (int64_t f : frames) parts.push_back(per_frame[static_cast<size_t>(f)]);
  return at::cat(parts, 2);
}

void scatter(std::vector<at::Tensor>& per_frame, const std::vector<int64_t>& frames, const at::Tensor& group) {
  for (size_t j = 0; j < frames.size(); ++j) {
    per_frame[static_cast<size_t>(frames[j])] = group.narrow(2, static_cast<int64_t>(j), 1);
  }
}

}  // namespace

at::Tensor FlowUniPCFrames::step(const std::vector<int64_t>& frames, const at::Tensor& model_output,
                                 const at::Tensor& sample) {
  if (frames.empty()) throw std::invalid_argument("FlowUniPCFrames::step: no frames given");
  for (int64_t f : frames) {
    if (f < 0 || f >= num_frames()) {
      throw std::invalid_argument("FlowUniPCFrames::step: frame " + std::to_string(f) + " out of range");
    }
  }
  const int64_t k = steps_[static_cast<size_t>(frames[0])];
  for (int64_t f : frames) {
    if (steps_[static_cast<size_t>(f)] != k) {
      throw std::invalid_argument("FlowUniPCFrames::step: frames " + std::to_string(frames[0]) + " and " +
                                  std::to_string(f) + " are at different steps");
    }
  }
  if (k >= sampler_->num_steps()) {
    throw std::invalid_argument("FlowUniPCFrames::step: frame " + std::to_string(frames[0]) + " already took all " +
                                std::to_string(sampler_->num_steps()) + " steps");
  }
  const auto group = static_cast<int64_t>(frames.size());
  if (sample.dim() != 5 || model_output.sizes() != sample.sizes() || sample.size(2) != group) {
    std::ostringstream os;
    os << "FlowUniPCFrames::step: expected model_output and sample [B, C, " << group << ", H, W], got "
       << model_output.sizes() << " and " << sample.sizes();
    throw std::invalid_argument(os.str());
  }
  const auto& c = sampler_->coefficients(k);

  // convert_model_output: sigma * v keeps v's dtype (bf16 in the real pipeline), then fp32 x minus it.
  const at::Tensor x0 = sample - c.sigma * model_output;

  at::Tensor x = sample;
  if (c.corrector) {  // UniC: correct the incoming sample with the new x0
    const at::Tensor m0 = gather(x0_cur_, frames);
    const at::Tensor last = gather(last_sample_, frames);
    const at::Tensor base = c.c_ratio * last - c.c_a * m0;
    const at::Tensor d1_t = x0 - m0;
    at::Tensor residual = c.c_rho_last * d1_t;
    if (c.corrector_order == 2) {
      const at::Tensor d1 = (gather(x0_prev_, frames) - m0) / c.c_rk;
      residual = c.c_rho0 * d1 + residual;
    }
    x = (base - c.c_b * residual).to(last.scalar_type());
  }

  // History shift; the predictor below uses the (corrected) sample and the two latest x0 predictions.
  const at::Tensor x0_before = c.predictor_order == 2 ? gather(x0_cur_, frames) : at::Tensor();
  at::Tensor next = c.p_ratio * x - c.p_a * x0;
  if (c.predictor_order == 2) {
    const at::Tensor d1 = (x0_before - x0) / c.p_rk;
    next = next - c.p_b * (0.5 * d1);
  }
  next = next.to(x.scalar_type());

  for (int64_t f : frames) x0_prev_[static_cast<size_t>(f)] = x0_cur_[static_cast<size_t>(f)];
  scatter(x0_cur_, frames, x0);
  scatter(last_sample_, frames, x);
  for (int64_t f : frames) ++steps_[static_cast<size_t>(f)];
  return next;
}

}  // namespace skyreels::model
