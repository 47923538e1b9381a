#include "tests/test_util.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "model/safetensors.h"

namespace skyreels::test {

std::string data_path(const std::string& relative) { return std::string(SKYREELS_TEST_DATA) + "/" + relative; }

std::string golden_path(const std::string& relative) { return data_path("golden/" + relative); }

std::string bin_path(const std::string& name) { return std::string(SKYREELS_BIN_DIR) + "/" + name; }

std::string temp_dir(const std::string& tag) {
  namespace fs = std::filesystem;
  static int counter = 0;
  fs::path dir = fs::temp_directory_path() /
                 ("skyreels-test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  fs::remove_all(dir);
  fs::create_directories(dir);
  struct Cleanup {
    std::vector<fs::path> dirs;
    ~Cleanup() {
      std::error_code ec;
      for (const auto& d : dirs) fs::remove_all(d, ec);
    }
  };
  static Cleanup cleanup;
  cleanup.dirs.push_back(dir);
  return dir.string();
}

std::map<std::string, at::Tensor> load_tensors(const std::string& path) { return safetensors::load_all(path); }

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kCPU, at::kDouble) - b.to(at::kCPU, at::kDouble)).abs().max().item<double>();
}

::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected, double atol, double rtol) {
  if (actual.sizes() != expected.sizes()) {
    std::ostringstream os;
    os << "shape " << actual.sizes() << " != expected " << expected.sizes();
    return ::testing::AssertionFailure() << os.str();
  }
  at::Tensor a = actual.to(at::kCPU, at::kDouble);
  at::Tensor e = expected.to(at::kCPU, at::kDouble);
  at::Tensor diff = (a - e).abs();
  at::Tensor bound = atol + rtol * e.abs();
  const bool nan_mismatch = !at::equal(a.isnan(), e.isnan());
  at::Tensor over = (diff > bound).logical_and(e.isnan().logical_not());
  if (!nan_mismatch && !over.any().item<bool>()) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os << "max |diff| = " << diff.nan_to_num(0).max().item<double>() << " (atol " << atol << ", rtol " << rtol << "), "
     << over.sum().item<int64_t>() << " of " << a.numel() << " elements out of tolerance"
     << (nan_mismatch ? ", NaN positions differ" : "");
  return ::testing::AssertionFailure() << os.str();
}

std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

::testing::AssertionResult has_text(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected \"" << part << "\" in:\n" << text;
}

void edit_header_text(const std::string& path, const std::function<void(std::string&)>& edit) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  std::string text = bytes.substr(8, len);
  edit(text);
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((text.size() >> (8 * i)) & 0xff));
  out << text << bytes.substr(8 + len);
}

int run_command(const std::string& command, std::string* output) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  std::array<char, 4096> buffer{};
  std::string text;
  size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) text.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  if (output != nullptr) *output = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace skyreels::test
