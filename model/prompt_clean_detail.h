// Internal to the prompt cleaning (prompt_clean.h), which is split by concept over prompt_clean_unicode.cpp (UTF-8,
// character classes, NFC), prompt_clean_html.cpp (Python's html.unescape and ftfy's entity fix),
// prompt_clean_badness.cpp (ftfy's mojibake detector), prompt_clean_mojibake.cpp (ftfy's fix_encoding: re-encoding
// with the single-byte codecs, byte-level repairs, C1 controls) and prompt_clean.cpp (the simple character fixes,
// ftfy's fix_text loop and the public entry points): the helpers these files share and the types of the generated
// tables. Not a public header: only those files include it. Torch-free.
//
// Each file includes the generated tables (prompt_clean_tables.inc) in its own unnamed namespace and uses only the
// tables of its concept; constexpr tables a file does not use emit nothing.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "model/prompt_clean.h"

namespace skyreels::model::prompt_clean_detail {

// ---- table types (filled by the generated prompt_clean_tables.inc) ------------------------------------------------
struct CccRange {
  char32_t lo, hi;
  uint8_t ccc;
};
struct Decomposition {
  char32_t cp;
  uint16_t offset, length;
};
struct Composition {
  char32_t first, second, composite;
};
struct CpRange {
  char32_t lo, hi;
};
struct Entity {
  const char* name;
  const char* value;
};
struct InvalidCharref {
  char32_t cp;
  const char* value;
};
inline constexpr char32_t kNone = 0xFFFFFFFF;
struct Charmap {
  const char* name;
  bool sloppy;                     // byte 0x1A decodes to U+FFFD (ftfy's sloppy-* codecs)
  std::array<char32_t, 128> high;  // bytes 0x80..0xFF
};
struct CpString {
  char32_t cp;
  const char* value;
};
struct CpMask {
  char32_t cp;
  uint16_t mask;
};

using U32 = std::u32string;

// ---- UTF-8 and character classes (prompt_clean_unicode.cpp) --------------------------------------------------------

// Strict, as Python's "utf-8" codec; false on malformed input, `error_at` getting the byte offset.
bool utf8_decode(std::string_view bytes, U32& out, size_t* error_at = nullptr);
// utf8_decode, or std::invalid_argument naming `what` and the byte offset.
U32 decode_or_throw(std::string_view text, const char* what);
std::string utf8_encode(const U32& text);
U32 u32_of_table_string(const char* utf8);  // a string of the generated tables (valid UTF-8)

bool is_word(char32_t cp);     // Python re's \w on str patterns
bool is_decimal(char32_t cp);  // str.isdecimal() (re's \d)
bool is_ascii_letter(char32_t cp);

// Unicode NFC.
U32 nfc(const U32& text);

// ---- HTML entities (prompt_clean_html.cpp) -------------------------------------------------------------------------

// Python's html.unescape.
U32 html_unescape_u32(const U32& s);
// ftfy.fixes.unescape_html: entities matching &#?[0-9A-Za-z]{1,24}; only.
U32 ftfy_unescape_html(const U32& s);

// ---- mojibake (prompt_clean_badness.cpp, prompt_clean_mojibake.cpp) ------------------------------------------------

// ftfy.badness.is_bad: the text matches BADNESS_RE somewhere.
bool is_bad(const U32& text);
// ftfy.fixes.fix_encoding: one fix step after another until the text stops changing.
U32 fix_encoding(U32 text);
bool has_c1(const U32& text);
// C1 controls U+0080..U+009F as the Windows-1252 characters of their bytes (ftfy.fixes.fix_c1_controls).
U32 fix_c1_controls(const U32& text);

}  // namespace skyreels::model::prompt_clean_detail
