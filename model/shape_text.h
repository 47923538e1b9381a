// A tensor's shape as error messages write it, e.g. "[1, 16, 3, 4, 6]".
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <sstream>
#include <string>

namespace skyreels::model {

inline std::string shape_text(c10::IntArrayRef shape) {
  std::ostringstream os;
  os << shape;
  return os.str();
}

}  // namespace skyreels::model
