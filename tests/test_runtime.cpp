// Process defaults: dtype resolution and threads.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>

#include "model/runtime.h"

namespace rt = skyreels::runtime;

TEST(Runtime, ExplicitDtypesAreKept) {
  EXPECT_EQ(rt::resolve_dtype_name("float32", "cpu"), "float32");
  EXPECT_EQ(rt::resolve_dtype_name("bf16", "cpu"), "bfloat16");
  EXPECT_THROW(rt::resolve_dtype_name("float8", "cpu"), std::invalid_argument);
}

TEST(Runtime, AutoDtypeFollowsTheCpu) {
  const auto f = rt::cpu_features();
  const bool fast_bf16 = f.amx_bf16 || f.avx512_bf16;
  EXPECT_EQ(rt::resolve_dtype_name("auto", "cpu"), fast_bf16 ? "bfloat16" : "float32");
  EXPECT_EQ(rt::resolve_dtype_name("auto", "cuda:0"), "bfloat16");
}

TEST(Runtime, UsesEveryAvailableCore) { EXPECT_EQ(at::get_num_threads(), rt::available_cores()); }

TEST(Runtime, OpenblasCoretypeIsSetBeforeStart) {
  const auto f = rt::cpu_features();
  if (!f.avx2 && !f.avx512f) GTEST_SKIP() << "no AVX2/AVX-512: OpenBLAS detects this CPU itself";
  ASSERT_NE(std::getenv("OPENBLAS_CORETYPE"), nullptr);
}
