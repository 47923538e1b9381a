// Text from files, file names and errors made valid UTF-8 before it reaches a proto3 `string`, a JSON body or a log
// line (issue 46): a proto3 string holding invalid UTF-8 fails to parse on the client's side, nlohmann::json refuses to
// dump it. Torch-free; model/ and server/ both use it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace skyreels::model {

// The length of the well-formed UTF-8 sequence starting at text[i] (1 to 4), or 0 when none starts there: a stray
// continuation byte, 0xC0/0xC1/0xF5-0xFF, an overlong form, a surrogate, a value above U+10FFFF or a sequence cut
// short (the Unicode Standard's table 3-7, which RFC 3629 and Python's "utf-8" codec follow).
size_t utf8_sequence_length(std::string_view text, size_t i);

// Whether `text` is well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
bool is_valid_utf8(std::string_view text);

// `text` with every byte that is not part of a well-formed UTF-8 sequence written as \xNN (lower-case hex); valid
// sequences (ASCII and multi-byte) are kept as they are. Idempotent, and the identity on valid UTF-8.
std::string utf8_escape(std::string_view text);

}  // namespace skyreels::model
