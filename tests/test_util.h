// Helpers shared by the test suites: fixture paths, tensor files, closeness with a readable failure.
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <functional>
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

// The message of whatever `action` throws ("" when it does not throw).
std::string error_of(const std::function<void()>& action);
// Success when `text` contains `part`; the failure shows the whole text.
::testing::AssertionResult has_text(const std::string& text, const std::string& part);
#define EXPECT_HAS(text, part) EXPECT_TRUE(::skyreels::test::has_text((text), (part)))

// Rewrites the JSON header of a safetensors file in place (as text through `edit`); the data area is kept byte for
// byte, so a header can be made to lie about it.
void edit_header_text(const std::string& path, const std::function<void(std::string&)>& edit);

// Runs a shell command, returns its exit status; output captured into `output` when given.
int run_command(const std::string& command, std::string* output = nullptr);

}  // namespace skyreels::test
