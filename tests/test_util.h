// Helpers shared by the test suites: fixture paths, tensor files, closeness with a readable failure.
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

namespace skyreels::test {

// tests/data/<relative>
std::string data_path(const std::string& relative);
// tests/data/golden/<relative>
std::string golden_path(const std::string& relative);
// build/bin/<name>
std::string bin_path(const std::string& name);
// A fresh empty directory under the system temp dir, removed at process exit.
std::string temp_dir(const std::string& tag);

// Every tensor of a safetensors file, as owning CPU tensors.
std::map<std::string, at::Tensor> load_tensors(const std::string& path);

// max |a - b| (in float64), and whether |a - b| <= atol + rtol * |b| holds everywhere.
double max_abs_diff(const at::Tensor& a, const at::Tensor& b);
::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected, double atol,
                                     double rtol = 0.0);

// Runs a shell command, returns its exit status; output captured into `output` when given.
int run_command(const std::string& command, std::string* output = nullptr);

}  // namespace skyreels::test
