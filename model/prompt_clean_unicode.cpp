// The prompt cleaning's Unicode layer (prompt_clean_detail.h): strict UTF-8 decoding and encoding, the character
// classes of Python's re and str (\w, \d, isspace), and NFC (canonical decomposition, ordering and composition,
// Hangul included).
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>

#include "model/prompt_clean_detail.h"
#include "model/utf8_text.h"

namespace skyreels::model::prompt_clean_detail {
namespace {

#include "model/prompt_clean_tables.inc"

}  // namespace

// ---- UTF-8 ---------------------------------------------------------------------------------------------------------

// Strict decoding (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF), as Python's "utf-8" codec.
// Returns false on malformed input; `error_at` gets the byte offset.
bool utf8_decode(std::string_view bytes, U32& out, size_t* error_at) {
  out.clear();
  out.reserve(bytes.size());
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < bytes.size();) {
    const size_t len = utf8_sequence_length(bytes, i);
    if (len == 0) {
      if (error_at) *error_at = i;
      return false;
    }
    char32_t cp = len == 1 ? s[i] : s[i] & (0x7Fu >> len);  // the lead byte's payload bits
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (s[i + k] & 0x3Fu);
    out.push_back(cp);
    i += len;
  }
  return true;
}

U32 decode_or_throw(std::string_view text, const char* what) {
  U32 out;
  size_t at = 0;
  if (!utf8_decode(text, out, &at)) {
    throw std::invalid_argument(std::string(what) + ": text is not valid UTF-8 (byte offset " + std::to_string(at) +
                                ")");
  }
  return out;
}

namespace {

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace

std::string utf8_encode(const U32& text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t cp : text) utf8_append(out, cp);
  return out;
}

U32 u32_of_table_string(const char* utf8) {
  U32 out;
  utf8_decode(utf8, out);  // generated tables hold valid UTF-8
  return out;
}

// ---- character classes ---------------------------------------------------------------------------------------------

namespace {

bool in_ranges(const CpRange* begin, const CpRange* end, char32_t cp) {
  const CpRange* it = std::upper_bound(begin, end, cp, [](char32_t c, const CpRange& r) { return c < r.lo; });
  return it != begin && cp <= (it - 1)->hi;
}

}  // namespace

bool is_word(char32_t cp) {  // Python re's \w on str patterns
  return cp == U'_' || in_ranges(std::begin(kAlnum), std::end(kAlnum), cp);
}

bool is_decimal(char32_t cp) { return in_ranges(std::begin(kDecimal), std::end(kDecimal), cp); }

bool is_ascii_letter(char32_t cp) { return (cp >= U'a' && cp <= U'z') || (cp >= U'A' && cp <= U'Z'); }

// ---- NFC -----------------------------------------------------------------------------------------------------------

namespace {

constexpr char32_t kHangulBase = 0xAC00, kHangulL = 0x1100, kHangulV = 0x1161, kHangulT = 0x11A7;
constexpr char32_t kHangulVCount = 21, kHangulTCount = 28, kHangulNCount = kHangulVCount * kHangulTCount;
constexpr char32_t kHangulCount = 19 * kHangulNCount;

uint8_t combining_class(char32_t cp) {
  const CccRange* begin = std::begin(kCombiningClass);
  const CccRange* end = std::end(kCombiningClass);
  const CccRange* it = std::upper_bound(begin, end, cp, [](char32_t c, const CccRange& r) { return c < r.lo; });
  return (it != begin && cp <= (it - 1)->hi) ? (it - 1)->ccc : 0;
}

void decompose_into(char32_t cp, U32& out) {
  if (cp >= kHangulBase && cp < kHangulBase + kHangulCount) {
    const char32_t s = cp - kHangulBase;
    out.push_back(kHangulL + s / kHangulNCount);
    out.push_back(kHangulV + (s % kHangulNCount) / kHangulTCount);
    if (s % kHangulTCount != 0) out.push_back(kHangulT + s % kHangulTCount);
    return;
  }
  const Decomposition* begin = std::begin(kDecomposition);
  const Decomposition* end = std::end(kDecomposition);
  const Decomposition* it =
      std::lower_bound(begin, end, cp, [](const Decomposition& d, char32_t c) { return d.cp < c; });
  if (it != end && it->cp == cp) {
    out.append(kDecompositionPool + it->offset, it->length);  // already the full (recursive) decomposition
  } else {
    out.push_back(cp);
  }
}

char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kHangulL && a < kHangulL + 19 && b >= kHangulV && b < kHangulV + kHangulVCount) {
    return kHangulBase + ((a - kHangulL) * kHangulVCount + (b - kHangulV)) * kHangulTCount;
  }
  if (a >= kHangulBase && a < kHangulBase + kHangulCount && (a - kHangulBase) % kHangulTCount == 0 && b > kHangulT &&
      b < kHangulT + kHangulTCount) {
    return a + (b - kHangulT);
  }
  const Composition* begin = std::begin(kComposition);
  const Composition* end = std::end(kComposition);
  const Composition* it = std::lower_bound(begin, end, std::make_pair(a, b), [](const Composition& c, auto key) {
    return c.first < key.first || (c.first == key.first && c.second < key.second);
  });
  return (it != end && it->first == a && it->second == b) ? it->composite : kNone;
}

}  // namespace

U32 nfc(const U32& text) {
  U32 d;
  d.reserve(text.size());
  for (char32_t cp : text) decompose_into(cp, d);
  // Canonical ordering: stable sort of every run of non-starters by combining class.
  for (size_t i = 0; i < d.size();) {
    if (combining_class(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && combining_class(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + static_cast<std::ptrdiff_t>(i), d.begin() + static_cast<std::ptrdiff_t>(j),
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  // Canonical composition: a character joins the last starter unless a character in between blocks it.
  U32 out;
  out.reserve(d.size());
  std::ptrdiff_t starter = -1;
  uint8_t last_cc = 0;
  for (char32_t cp : d) {
    const uint8_t cc = combining_class(cp);
    if (starter >= 0) {
      const bool adjacent = static_cast<std::ptrdiff_t>(out.size()) - 1 == starter;
      if (adjacent || (last_cc != 0 && last_cc < cc)) {
        const char32_t composite = compose_pair(out[static_cast<size_t>(starter)], cp);
        if (composite != kNone) {
          out[static_cast<size_t>(starter)] = composite;
          continue;
        }
      }
    }
    if (cc == 0) starter = static_cast<std::ptrdiff_t>(out.size());
    out.push_back(cp);
    last_cc = cc;
  }
  return out;
}

}  // namespace skyreels::model::prompt_clean_detail

namespace skyreels::model {

bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

}  // namespace skyreels::model
