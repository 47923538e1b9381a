// Client text made safe for one log line, for every layer that logs what a request carried (the transport's
// refusals, a job's restore). Torch-free, gRPC-free.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace skyreels::server {

// Control characters, quotes, backslashes and bytes >= 0x80 are escaped (\n, \", \xNN), and the result is cut at
// `max_bytes` input bytes with "...(N bytes)" appended.
std::string log_escape(std::string_view text, size_t max_bytes = 200);

}  // namespace skyreels::server
