// gtest main for every suite: the same process defaults as our binaries (OpenBLAS core type, threads).
#include <gtest/gtest.h>

#include "model/runtime.h"

int main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
