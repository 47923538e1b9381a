#include "model/prompt_clean.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace skyreels::model {
namespace {

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
constexpr char32_t kNone = 0xFFFFFFFF;
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

#include "model/prompt_clean_tables.inc"

using U32 = std::u32string;

// ---- UTF-8 ---------------------------------------------------------------------------------------------------------

// Strict decoding (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF), as Python's "utf-8" codec.
// Returns false on malformed input; `error_at` gets the byte offset.
bool utf8_decode(std::string_view bytes, U32& out, size_t* error_at = nullptr) {
  out.clear();
  out.reserve(bytes.size());
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  auto fail = [&](size_t at) {
    if (error_at) *error_at = at;
    return false;
  };
  while (i < n) {
    const unsigned c = s[i];
    if (c < 0x80) {
      out.push_back(c);
      ++i;
      continue;
    }
    int len = 0;
    char32_t cp = 0;
    char32_t min = 0;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return fail(i);
    }
    if (i + static_cast<size_t>(len) > n) return fail(i);
    for (int k = 1; k < len; ++k) {
      const unsigned t = s[i + static_cast<size_t>(k)];
      if ((t & 0xC0) != 0x80) return fail(i);
      cp = (cp << 6) | (t & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return fail(i);
    out.push_back(cp);
    i += static_cast<size_t>(len);
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

bool in_ranges(const CpRange* begin, const CpRange* end, char32_t cp) {
  const CpRange* it = std::upper_bound(begin, end, cp, [](char32_t c, const CpRange& r) { return c < r.lo; });
  return it != begin && cp <= (it - 1)->hi;
}

bool is_word(char32_t cp) {  // Python re's \w on str patterns
  return cp == U'_' || in_ranges(std::begin(kAlnum), std::end(kAlnum), cp);
}

bool is_decimal(char32_t cp) { return in_ranges(std::begin(kDecimal), std::end(kDecimal), cp); }

bool is_ascii_letter(char32_t cp) { return (cp >= U'a' && cp <= U'z') || (cp >= U'A' && cp <= U'Z'); }

// ---- NFC -----------------------------------------------------------------------------------------------------------

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

// ---- Python's html.unescape ----------------------------------------------------------------------------------------

template <typename Table>
const char* find_entity(const Table& table, std::string_view name) {
  auto begin = std::begin(table);
  auto end = std::end(table);
  auto it = std::lower_bound(begin, end, name, [](const Entity& e, std::string_view n) { return e.name < n; });
  return (it != end && std::string_view(it->name) == name) ? it->value : nullptr;
}

bool is_ascii_digit(char32_t c) { return c >= U'0' && c <= U'9'; }
bool is_hex_digit(char32_t c) { return is_ascii_digit(c) || (c >= U'a' && c <= U'f') || (c >= U'A' && c <= U'F'); }
uint32_t hex_value(char32_t c) { return is_ascii_digit(c) ? c - U'0' : (c >= U'a' ? c - U'a' + 10 : c - U'A' + 10); }

// The replacement of a numeric reference with value `num` (saturated above U+10FFFF), per html._replace_charref.
U32 numeric_charref(uint64_t num) {
  for (const auto& inv : kHtmlInvalidCharrefs) {
    if (inv.cp == num) return u32_of_table_string(inv.value);
  }
  if ((num >= 0xD800 && num <= 0xDFFF) || num > 0x10FFFF) return U32(1, 0xFFFD);
  if (std::binary_search(std::begin(kHtmlInvalidCodepoints), std::end(kHtmlInvalidCodepoints),
                         static_cast<char32_t>(num))) {
    return U32();
  }
  return U32(1, static_cast<char32_t>(num));
}

// Parses the digits of a numeric reference starting at `pos`; returns the end position (0 digits -> pos).
size_t parse_number(const U32& s, size_t pos, bool hex, uint64_t& num) {
  num = 0;
  size_t i = pos;
  while (i < s.size() && (hex ? is_hex_digit(s[i]) : is_ascii_digit(s[i]))) {
    num = num * (hex ? 16 : 10) + (hex ? hex_value(s[i]) : s[i] - U'0');
    if (num > 0x110000) num = 0x110000;  // only "too large" matters from here on
    ++i;
  }
  return i;
}

bool is_named_ref_char(char32_t c) {  // [^\t\n\f <&#;]
  return c != U'\t' && c != U'\n' && c != U'\f' && c != U' ' && c != U'<' && c != U'&' && c != U'#' && c != U';';
}

U32 html_unescape_u32(const U32& s) {
  if (s.find(U'&') == U32::npos) return s;
  U32 out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != U'&') {
      out.push_back(s[i++]);
      continue;
    }
    const size_t start = i + 1;
    // &#[0-9]+;?  |  &#[xX][0-9a-fA-F]+;?
    if (start < s.size() && s[start] == U'#') {
      uint64_t num = 0;
      size_t end = parse_number(s, start + 1, false, num);
      if (end == start + 1 && start + 1 < s.size() && (s[start + 1] == U'x' || s[start + 1] == U'X')) {
        end = parse_number(s, start + 2, true, num);
        if (end == start + 2) end = start + 1;  // no hex digits: not a reference
      }
      if (end > start + 1) {
        if (end < s.size() && s[end] == U';') ++end;
        out += numeric_charref(num);
        i = end;
        continue;
      }
      out.push_back(s[i++]);
      continue;
    }
    // [^\t\n\f <&#;]{1,32};?
    size_t end = start;
    while (end < s.size() && end - start < 32 && is_named_ref_char(s[end])) ++end;
    if (end == start) {
      out.push_back(s[i++]);
      continue;
    }
    if (end < s.size() && s[end] == U';') ++end;
    const U32 name32 = s.substr(start, end - start);
    const std::string name = utf8_encode(name32);
    if (const char* value = find_entity(kHtml5Entities, name)) {
      out += u32_of_table_string(value);
    } else {
      // The longest known prefix of at least two characters, the rest kept as text.
      bool found = false;
      for (size_t x = name32.size() - 1; x >= 2 && !found; --x) {
        if (const char* v = find_entity(kHtml5Entities, utf8_encode(name32.substr(0, x)))) {
          out += u32_of_table_string(v);
          out += name32.substr(x);
          found = true;
        }
      }
      if (!found) {
        out.push_back(U'&');
        out += name32;
      }
    }
    i = end;
  }
  return out;
}

// ---- ftfy: HTML entities -------------------------------------------------------------------------------------------

bool is_ascii_alnum(char32_t c) { return is_ascii_digit(c) || is_ascii_letter(c); }

// ftfy.fixes.unescape_html: entities matching &#?[0-9A-Za-z]{1,24}; only.
U32 ftfy_unescape_html(const U32& s) {
  U32 out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == U'&') {
      size_t j = i + 1;
      if (j < s.size() && s[j] == U'#') ++j;
      const size_t run_start = j;
      while (j < s.size() && is_ascii_alnum(s[j])) ++j;
      const size_t run = j - run_start;
      if (run >= 1 && run <= 24 && j < s.size() && s[j] == U';') {
        const U32 match = s.substr(i, j + 1 - i);
        const std::string key = utf8_encode(match);
        if (const char* value = find_entity(kFtfyEntities, key)) {
          out += u32_of_table_string(value);
        } else if (match.size() > 1 && match[1] == U'#') {
          const U32 unescaped = html_unescape_u32(match);
          out += (unescaped.find(U';') != U32::npos) ? match : unescaped;
        } else {
          out += match;
        }
        i = j + 1;
        continue;
      }
    }
    out.push_back(s[i++]);
  }
  return out;
}

// ---- ftfy: mojibake detection (ftfy.badness) -----------------------------------------------------------------------

enum Category : uint16_t {
  kCommon = 1 << 0,
  kC1 = 1 << 1,
  kBad = 1 << 2,
  kLaw = 1 << 3,
  kCurrency = 1 << 4,
  kStartPunct = 1 << 5,
  kEndPunct = 1 << 6,
  kNumeric = 1 << 7,
  kKaomoji = 1 << 8,
  kUpperAccented = 1 << 9,
  kLowerAccented = 1 << 10,
  kUpperCommon = 1 << 11,
  kLowerCommon = 1 << 12,
  kBox = 1 << 13,
};

uint16_t category_mask(char32_t cp) {
  const CpMask* begin = std::begin(kMojibakeCategories);
  const CpMask* end = std::end(kMojibakeCategories);
  const CpMask* it = std::lower_bound(begin, end, cp, [](const CpMask& m, char32_t c) { return m.cp < c; });
  return (it != end && it->cp == cp) ? it->mask : 0;
}

// One bracketed element of the badness expression.
struct CharClass {
  uint16_t categories = 0;
  std::u32string literals;
  enum Flag : uint8_t { kLowerAscii = 1, kUpperAscii = 2, kSpace = 4, kWord = 8, kAnyButNewline = 16, kNotLatin = 32 };
  uint8_t flags = 0;

  bool matches(char32_t cp) const {
    if ((flags & kAnyButNewline) && cp != U'\n') return true;
    if ((flags & kNotLatin) && !is_ascii_letter(cp)) return true;
    if ((flags & kLowerAscii) && cp >= U'a' && cp <= U'z') return true;
    if ((flags & kUpperAscii) && cp >= U'A' && cp <= U'Z') return true;
    if ((flags & kSpace) && is_python_space(cp)) return true;
    if ((flags & kWord) && is_word(cp)) return true;
    if (categories && (category_mask(cp) & categories)) return true;
    return literals.find(cp) != U32::npos;
  }
};

struct BadnessPattern {
  std::vector<CharClass> seq;
  bool anchored = false;  // '^': only at the start of the text
};

CharClass cls(uint16_t categories, std::u32string literals = U"", uint8_t flags = 0) {
  return CharClass{categories, std::move(literals), flags};
}
CharClass lit(std::u32string literals) { return cls(0, std::move(literals)); }

// ftfy 6.3.1 badness.BADNESS_RE, one entry per alternative (`\s?` spelled as two entries).
const std::vector<BadnessPattern>& badness_patterns() {
  static const std::vector<BadnessPattern> patterns = [] {
    using F = CharClass;
    const uint16_t punct_etc =
        kBad | kLowerAccented | kUpperAccented | kBox | kStartPunct | kEndPunct | kCurrency | kNumeric | kLaw;
    const uint16_t accented = kLowerAccented | kUpperAccented;
    std::vector<BadnessPattern> p;
    auto add = [&](std::vector<CharClass> seq, bool anchored = false) { p.push_back({std::move(seq), anchored}); };
    add({cls(kC1)});
    add({cls(punct_etc), cls(kBad)});
    add({cls(0, U"", F::kLowerAscii | F::kUpperAscii), cls(kLowerCommon | kUpperCommon), cls(kBad)});
    add({cls(kBad), cls(punct_etc & ~kBad)});
    add({cls(kLowerAccented | kLowerCommon | kBox | kEndPunct | kCurrency | kNumeric), cls(kUpperAccented)});
    add({cls(kBox | kEndPunct | kCurrency | kNumeric), cls(kLowerAccented)});
    add({cls(kLowerAccented | kBox | kEndPunct), cls(kCurrency)});
    add({cls(0, U"", F::kSpace), cls(kUpperAccented), cls(kCurrency)});
    add({cls(kUpperAccented | kBox), cls(kNumeric | kLaw)});
    add({cls(accented | kBox | kCurrency | kEndPunct), cls(kStartPunct), cls(kNumeric)});
    add({cls(accented | kCurrency | kNumeric | kBox | kLaw), cls(kEndPunct), cls(kStartPunct)});
    add({cls(kCurrency | kNumeric | kBox), cls(kStartPunct)});
    add({cls(0, U"", F::kLowerAscii), cls(kUpperAccented), cls(kStartPunct | kCurrency)});
    add({cls(kBox), cls(kKaomoji)});
    add({cls(accented | kCurrency | kNumeric | kStartPunct | kEndPunct | kLaw), cls(kBox)});
    add({cls(kBox), cls(kEndPunct)});
    add({cls(accented), cls(kStartPunct | kEndPunct), cls(0, U"", F::kWord)});
    add({lit(U"\u0152\u0153"), cls(0, U"", F::kNotLatin)});  // [Œœ][^A-Za-z]
    add({cls(kUpperAccented), lit(U"\u00B0")});              // [upper]°
    add({lit(U"\u00C2\u00C3\u00CE\u00D0"),                   // [ÂÃÎÐ][€œŠš¢£Ÿž...]
         cls(kStartPunct | kEndPunct,
             U"\u20AC\u0153\u0160\u0161\u00A2\u00A3\u0178\u017E\u00A0\u00AD\u00AE\u00A9\u00B0\u00B7\u00BB"
             U"\u2013\u2014\u00B4")});
    add({lit(U"\u00D7"), lit(U"\u00B2\u00B3")});  // × [²³]
    {
      const CharClass arabic = lit(U"\u00D8\u00D9");
      const CharClass after =
          cls(kCommon | kCurrency | kBad | kNumeric | kStartPunct, U"\u0178\u0160\u00AE\u00B0\u00B5\u00BB");
      add({arabic, after, arabic, after});
    }
    add({lit(U"\u00E0"), lit(U"\u00B2\u00B5\u00B9\u00BC\u00BD\u00BE")});  // à[²µ¹¼½¾]
    add({lit(U"\u221A"),                                                  // √[±∂†≠®™´≤≥¥µø]
         lit(U"\u00B1\u2202\u2020\u2260\u00AE\u2122\u00B4\u2264\u2265\u00A5\u00B5\u00F8")});
    add({lit(U"\u2248"), lit(U"\u00B0\u00A2")});  // ≈[°¢]
    add({lit(U"\u201A"), lit(U"\u00C4"),          // ‚Ä[ìîïòôúùû†°¢π]
         lit(U"\u00EC\u00EE\u00EF\u00F2\u00F4\u00FA\u00F9\u00FB\u2020\u00B0\u00A2\u03C0")});
    add({lit(U"\u201A"), lit(U"\u00E2\u00F3"), lit(U"\u00E0\u00E4\u00B0\u00EA")});  // ‚[âó][àä°ê]
    add({lit(U"\u0432"), lit(U"\u0402")});                                          // вЂ
    {
      const CharClass cyr = lit(U"\u0412\u0413\u0420\u0421");  // [ВГРС]
      add({cyr, cls(kC1 | kBad | kStartPunct | kEndPunct | kCurrency, U"\u00B0\u00B5"), cyr});
    }
    add({lit(U"\u0413"), lit(U"\u045E"), lit(U"\u0412"), lit(U"\u0402"), lit(U"\u0412"),  // ГўВЂВ.[A-Za-z ]
         cls(0, U"", F::kAnyButNewline), cls(0, U" ", F::kLowerAscii | F::kUpperAscii)});
    add({lit(U"\u00C3"), lit(U"\u00A0\u00A1")});                          // Ã[\xa0¡]
    add({cls(0, U"", F::kLowerAscii), lit(U"\u00C3\u00C2"), lit(U" ")});  // [a-z]\s?[ÃÂ][ ]
    add({cls(0, U"", F::kLowerAscii), cls(0, U"", F::kSpace), lit(U"\u00C3\u00C2"), lit(U" ")});
    add({lit(U"\u00C3\u00C2"), lit(U" ")}, /*anchored=*/true);  // ^[ÃÂ][ ]
    add({cls(kEndPunct, U".,?!", F::kLowerAscii), lit(U"\u00C2"), cls(kStartPunct | kEndPunct, U" ")});
    add({lit(U"\u03B2"), lit(U"\u20AC"), lit(U"\u2122\u00A0\u0386\u00AD\u00AE\u00B0")});  // β€[™\xa0Ά\xad®°]
    {
      const CharClass greek = lit(U"\u0392\u0393\u039E\u039F");  // [ΒΓΞΟ]
      add({greek, cls(kC1 | kBad | kStartPunct | kEndPunct | kCurrency, U"\u00B0"), greek});
    }
    add({lit(U"\u0101"), lit(U"\u20AC")});  // ā€
    return p;
  }();
  return patterns;
}

bool is_bad(const U32& text) {
  for (const auto& pattern : badness_patterns()) {
    const size_t len = pattern.seq.size();
    const size_t last_start = pattern.anchored ? 0 : (text.size() >= len ? text.size() - len : 0);
    for (size_t start = 0; start <= last_start && start + len <= text.size(); ++start) {
      bool ok = true;
      for (size_t k = 0; k < len && ok; ++k) ok = pattern.seq[k].matches(text[start + k]);
      if (ok) return true;
    }
  }
  return false;
}

// ---- ftfy: single-byte encodings -----------------------------------------------------------------------------------

struct Codec {
  const Charmap* map;
  std::unordered_map<char32_t, uint8_t> encode;  // every character the codec can produce -> its byte
};

const std::vector<Codec>& codecs() {
  static const std::vector<Codec> all = [] {
    std::vector<Codec> out;
    for (const auto& map : kCharmaps) {
      Codec codec{&map, {}};
      for (unsigned b = 0; b < 0x80; ++b) {
        if (b == 0x1A && map.sloppy) continue;
        codec.encode.emplace(static_cast<char32_t>(b), static_cast<uint8_t>(b));
      }
      if (map.sloppy) codec.encode.emplace(0xFFFD, 0x1A);
      for (unsigned b = 0x80; b < 0x100; ++b) {
        const char32_t cp = map.high[b - 0x80];
        if (cp != kNone) codec.encode.emplace(cp, static_cast<uint8_t>(b));
      }
      out.push_back(std::move(codec));
    }
    return out;
  }();
  return all;
}

const Codec& codec_named(std::string_view name) {
  for (const auto& codec : codecs()) {
    if (name == codec.map->name) return codec;
  }
  throw std::logic_error("prompt_clean: no codec " + std::string(name));
}

bool can_encode(const U32& text, const Codec& codec) {
  return std::all_of(text.begin(), text.end(), [&](char32_t cp) { return codec.encode.count(cp) != 0; });
}

std::string encode_bytes(const U32& text, const Codec& codec) {
  std::string out;
  out.reserve(text.size());
  for (char32_t cp : text) out.push_back(static_cast<char>(codec.encode.at(cp)));
  return out;
}

// Decodes bytes with a single-byte codec; false when a byte is undefined.
bool decode_bytes(std::string_view bytes, const Charmap& map, U32& out) {
  out.clear();
  for (unsigned char b : bytes) {
    char32_t cp = b;
    if (b >= 0x80) cp = map.high[b - 0x80];
    if (b == 0x1A && map.sloppy) cp = 0xFFFD;
    if (cp == kNone) return false;
    out.push_back(cp);
  }
  return true;
}

// ---- ftfy: byte-level fixed-length patterns (ALTERED_UTF8_RE, LOSSY_UTF8_RE) ----------------------------------------

using ByteSet = std::array<bool, 256>;
ByteSet bytes_in(std::initializer_list<std::pair<int, int>> ranges) {
  ByteSet set{};
  for (auto [lo, hi] : ranges) {
    for (int b = lo; b <= hi; ++b) set[static_cast<size_t>(b)] = true;
  }
  return set;
}
using BytePattern = std::vector<ByteSet>;

// re.sub over alternatives of fixed length: at each position the first alternative that matches is replaced.
std::string byte_sub(const std::string& bytes, const std::vector<BytePattern>& alternatives,
                     const std::function<std::string(std::string_view)>& replace, bool* found = nullptr) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  if (found) *found = false;
  while (i < bytes.size()) {
    const BytePattern* hit = nullptr;
    for (const auto& alt : alternatives) {
      if (i + alt.size() > bytes.size()) continue;
      bool ok = true;
      for (size_t k = 0; k < alt.size() && ok; ++k) ok = alt[k][static_cast<unsigned char>(bytes[i + k])];
      if (ok) {
        hit = &alt;
        break;
      }
    }
    if (hit) {
      out += replace(std::string_view(bytes).substr(i, hit->size()));
      i += hit->size();
      if (found) *found = true;
    } else {
      out.push_back(bytes[i++]);
    }
  }
  return out;
}

const std::vector<BytePattern>& altered_utf8_patterns() {
  static const std::vector<BytePattern> p = [] {
    const ByteSet sp = bytes_in({{0x20, 0x20}});
    const ByteSet cont = bytes_in({{0x80, 0xBF}});
    const ByteSet cont_no_85_a0 = bytes_in({{0x80, 0x84}, {0x86, 0x9F}, {0xA1, 0xBF}});
    const ByteSet f0 = bytes_in({{0xF0, 0xF0}});
    return std::vector<BytePattern>{
        {bytes_in({{0xC2, 0xC3}, {0xC5, 0xC5}, {0xCE, 0xCE}, {0xD0, 0xD0}, {0xD9, 0xD9}}), sp},
        {bytes_in({{0xE2, 0xE3}}), sp, cont_no_85_a0},
        {bytes_in({{0xE0, 0xE3}}), cont_no_85_a0, sp},
        {f0, sp, cont, cont},
        {f0, cont, sp, cont},
        {f0, cont, cont, sp},
    };
  }();
  return p;
}

const std::vector<BytePattern>& lossy_utf8_patterns() {
  static const std::vector<BytePattern> p = [] {
    const ByteSet sub = bytes_in({{0x1A, 0x1A}});
    const ByteSet sub_q = bytes_in({{0x1A, 0x1A}, {'?', '?'}});
    const ByteSet sub_cont = bytes_in({{0x1A, 0x1A}, {0x80, 0xBF}});
    const ByteSet sub_q_cont = bytes_in({{0x1A, 0x1A}, {'?', '?'}, {0x80, 0xBF}});
    const ByteSet ed = bytes_in({{0xED, 0xED}});
    const ByteSet hi_a = bytes_in({{0xA0, 0xAF}});
    const ByteSet lo_b = bytes_in({{0xB0, 0xBF}});
    const ByteSet lead3 = bytes_in({{0xE0, 0xEF}});
    const ByteSet lead4 = bytes_in({{0xF0, 0xF4}});
    return std::vector<BytePattern>{
        {bytes_in({{0xC2, 0xDF}}), sub},
        {bytes_in({{0xC2, 0xC3}}), bytes_in({{'?', '?'}})},
        {ed, hi_a, sub_q, ed, lo_b, sub_q_cont},
        {ed, hi_a, sub_q_cont, ed, lo_b, sub_q},
        {lead3, sub_q, sub_cont},
        {lead3, sub_cont, sub_q},
        {lead4, sub_q, sub_cont, sub_cont},
        {lead4, sub_cont, sub_q, sub_cont},
        {lead4, sub_cont, sub_cont, sub_q},
        {sub},
    };
  }();
  return p;
}

// ftfy.fixes.restore_byte_a0: b"\xc3 " not followed by " ", "quele", "quela", "quilo" or "s " gets its A0 back, then
// ALTERED_UTF8_RE matches have their spaces turned into A0.
std::string restore_byte_a0(const std::string& bytes) {
  std::string step;
  step.reserve(bytes.size() + 8);
  for (size_t i = 0; i < bytes.size();) {
    if (static_cast<unsigned char>(bytes[i]) == 0xC3 && i + 1 < bytes.size() && bytes[i + 1] == ' ') {
      const std::string_view rest = std::string_view(bytes).substr(i + 2);
      const bool excluded = rest.substr(0, 1) == " " || rest.substr(0, 5) == "quele" || rest.substr(0, 5) == "quela" ||
                            rest.substr(0, 5) == "quilo" || rest.substr(0, 2) == "s ";
      if (!excluded) {
        step += "\xC3\xA0 ";
        i += 2;
        continue;
      }
    }
    step.push_back(bytes[i++]);
  }
  return byte_sub(step, altered_utf8_patterns(), [](std::string_view m) {
    std::string s(m);
    std::replace(s.begin(), s.end(), ' ', '\xA0');
    return s;
  });
}

std::string replace_lossy_sequences(const std::string& bytes) {
  return byte_sub(bytes, lossy_utf8_patterns(), [](std::string_view) { return std::string("\xEF\xBF\xBD"); });
}

// ftfy's "utf-8-variants": UTF-8 plus CESU-8 surrogate pairs and the Java null C0 80.
bool decode_utf8_variants(const std::string& bytes, U32& out) {
  out.clear();
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t plain_start = 0;
  auto flush_plain = [&](size_t end) {
    U32 part;
    if (!utf8_decode(bytes.substr(plain_start, end - plain_start), part)) return false;
    out += part;
    return true;
  };
  for (size_t i = 0; i < n;) {
    if (s[i] == 0xC0 && i + 1 < n && s[i + 1] == 0x80) {
      if (!flush_plain(i)) return false;
      out.push_back(0);
      i += 2;
      plain_start = i;
    } else if (s[i] == 0xED && i + 5 < n && s[i + 1] >= 0xA0 && s[i + 1] <= 0xAF && (s[i + 2] & 0xC0) == 0x80 &&
               s[i + 3] == 0xED && s[i + 4] >= 0xB0 && s[i + 4] <= 0xBF && (s[i + 5] & 0xC0) == 0x80) {
      if (!flush_plain(i)) return false;
      out.push_back(static_cast<char32_t>(((s[i + 1] & 0x0F) << 16) + ((s[i + 2] & 0x3F) << 10) +
                                          ((s[i + 4] & 0x0F) << 6) + (s[i + 5] & 0x3F) + 0x10000));
      i += 6;
      plain_start = i;
    } else {
      ++i;
    }
  }
  return flush_plain(n);
}

bool has_c1(const U32& text) {
  return std::any_of(text.begin(), text.end(), [](char32_t c) { return c >= 0x80 && c <= 0x9F; });
}

U32 fix_c1_controls(const U32& text) {
  const Charmap& sloppy1252 = *codec_named("sloppy-windows-1252").map;
  U32 out = text;
  for (char32_t& c : out) {
    if (c >= 0x80 && c <= 0x9F) c = sloppy1252.high[c - 0x80];
  }
  return out;
}

U32 fix_encoding(U32 text);

// ftfy.chardata.UTF8_DETECTOR_RE membership.
enum Clue : uint16_t { kFirstOf2 = 1, kFirstOf3 = 2, kFirstOf4 = 4, kContinuation = 8, kContinuationStrict = 16 };

uint16_t clue_mask(char32_t cp) {
  const CpMask* begin = std::begin(kUtf8Clues);
  const CpMask* end = std::end(kUtf8Clues);
  const CpMask* it = std::lower_bound(begin, end, cp, [](const CpMask& m, char32_t c) { return m.cp < c; });
  return (it != end && it->cp == cp) ? it->mask : 0;
}

// Length of one unit of UTF8_DETECTOR_RE at `pos` (a lead character and its 1, 2 or 3 continuations, alternatives
// tried in that order), or 0.
size_t utf8_clue_unit(const U32& text, size_t pos) {
  const uint16_t lead = clue_mask(text[pos]);
  for (const auto& [bit, continuations] : {std::pair<uint16_t, size_t>{kFirstOf2, 1}, {kFirstOf3, 2}, {kFirstOf4, 3}}) {
    if (!(lead & bit) || pos + continuations >= text.size()) continue;
    bool ok = true;
    for (size_t k = 1; k <= continuations && ok; ++k) ok = (clue_mask(text[pos + k]) & kContinuation) != 0;
    if (ok) return 1 + continuations;
  }
  return 0;
}

// ftfy.fixes.decode_inconsistent_utf8: every run of UTF-8-looking mojibake (not preceded by a strict continuation
// character) that is shorter than the text and looks bad is fixed on its own.
U32 decode_inconsistent_utf8(const U32& text) {
  U32 out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const bool after_strict = i > 0 && (clue_mask(text[i - 1]) & kContinuationStrict);
    size_t end = i;
    if (!after_strict) {
      while (end < text.size()) {
        const size_t unit = utf8_clue_unit(text, end);
        if (unit == 0) break;
        end += unit;
      }
    }
    if (end == i) {
      out.push_back(text[i++]);
      continue;
    }
    const U32 run = text.substr(i, end - i);
    out += (run.size() < text.size() && is_bad(run)) ? fix_encoding(run) : run;
    i = end;
  }
  return out;
}

bool has_utf8_clue_run(const U32& text) {
  for (size_t i = 0; i < text.size(); ++i) {
    if ((i == 0 || !(clue_mask(text[i - 1]) & kContinuationStrict)) && utf8_clue_unit(text, i)) return true;
  }
  return false;
}

// One step of ftfy's _fix_encoding_one_step_and_explain.
U32 fix_encoding_one_step(const U32& text) {
  if (text.empty()) return text;
  const bool ascii = std::all_of(text.begin(), text.end(), [](char32_t c) { return c < 0x80; });
  if (ascii || !is_bad(text)) return text;
  bool latin1_possible = false;
  const size_t n_tried = std::size(kCharmaps) - 1;  // the last table is strict windows-1252, not tried here
  for (size_t e = 0; e < n_tried; ++e) {
    const Codec& codec = codecs()[e];
    const std::string name = codec.map->name;
    if (!can_encode(text, codec)) continue;
    if (name == "latin-1") latin1_possible = true;
    std::string bytes = encode_bytes(text, codec);
    bool altered = false;
    if (name != "macroman")
      byte_sub(
          bytes, altered_utf8_patterns(), [](std::string_view m) { return std::string(m); }, &altered);
    if (altered) bytes = restore_byte_a0(bytes);
    if (name.rfind("sloppy", 0) == 0) bytes = replace_lossy_sequences(bytes);
    U32 fixed;
    const bool variants = bytes.find('\xED') != std::string::npos || bytes.find('\xC0') != std::string::npos;
    if (variants ? decode_utf8_variants(bytes, fixed) : utf8_decode(bytes, fixed)) return fixed;
  }
  if (has_utf8_clue_run(text)) {
    U32 fixed = decode_inconsistent_utf8(text);
    if (fixed != text) return fixed;
  }
  if (latin1_possible) {
    // Latin-1 text with C1 controls was probably meant as Windows-1252 (strict: undefined bytes give up).
    U32 fixed;
    const std::string bytes = encode_bytes(text, codec_named("latin-1"));
    if (decode_bytes(bytes, kCharmaps[std::size(kCharmaps) - 1], fixed) && fixed != text) return fixed;
  }
  if (has_c1(text)) return fix_c1_controls(text);
  return text;
}

U32 fix_encoding(U32 text) {
  while (true) {
    U32 fixed = fix_encoding_one_step(text);
    if (fixed == text) return fixed;
    text = std::move(fixed);
  }
}

// ---- ftfy: the simple character fixes ------------------------------------------------------------------------------

U32 translate(const U32& text, const CpString* begin, const CpString* end) {
  U32 out;
  out.reserve(text.size());
  for (char32_t cp : text) {
    const CpString* it = std::lower_bound(begin, end, cp, [](const CpString& m, char32_t c) { return m.cp < c; });
    if (it != end && it->cp == cp) {
      out += u32_of_table_string(it->value);
    } else {
      out.push_back(cp);
    }
  }
  return out;
}

U32 uncurl_quotes(U32 text) {
  for (char32_t& c : text) {
    if (c == 0x02BC || (c >= 0x2018 && c <= 0x201B)) c = U'\'';
    if (c >= 0x201C && c <= 0x201F) c = U'"';
  }
  return text;
}

U32 fix_line_breaks(const U32& text) {
  U32 out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const char32_t c = text[i];
    if (c == U'\r') {
      if (i + 1 < text.size() && text[i + 1] == U'\n') ++i;
      out.push_back(U'\n');
    } else if (c == 0x2028 || c == 0x2029 || c == 0x85) {
      out.push_back(U'\n');
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// "\033\[((?:\d|;)*)([a-zA-Z])" removed.
U32 remove_terminal_escapes(const U32& text) {
  U32 out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text[i] == 0x1B && i + 1 < text.size() && text[i + 1] == U'[') {
      size_t j = i + 2;
      while (j < text.size() && (is_decimal(text[j]) || text[j] == U';')) ++j;
      if (j < text.size() && is_ascii_letter(text[j])) {
        i = j + 1;
        continue;
      }
    }
    out.push_back(text[i++]);
  }
  return out;
}

bool is_removed_control(char32_t c) {
  return c <= 0x08 || c == 0x0B || (c >= 0x0E && c <= 0x1F) || c == 0x7F || (c >= 0x206A && c <= 0x206F) ||
         c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFC);
}

U32 remove_control_chars(U32 text) {
  text.erase(std::remove_if(text.begin(), text.end(), is_removed_control), text.end());
  return text;
}

// ftfy.fix_and_explain on one segment, until nothing changes.
U32 fix_segment(U32 text, bool unescape_html) {
  while (true) {
    const U32 orig = text;
    if (unescape_html) text = ftfy_unescape_html(text);
    text = fix_encoding(std::move(text));
    if (has_c1(text)) text = fix_c1_controls(text);
    text = translate(text, std::begin(kLigatures), std::end(kLigatures));
    text = translate(text, std::begin(kWidthMap), std::end(kWidthMap));
    text = uncurl_quotes(std::move(text));
    text = fix_line_breaks(text);
    text = remove_terminal_escapes(text);
    text = remove_control_chars(std::move(text));
    text = nfc(text);
    if (text == orig) return text;
  }
}

U32 ftfy_fix_text_u32(const U32& text) {
  constexpr size_t kMaxDecodeLength = 1000000;
  bool unescape_html = true;  // "auto": switched off for good once a segment holds a literal '<'
  U32 out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    size_t brk = text.find(U'\n', pos);
    brk = (brk == U32::npos) ? text.size() : brk + 1;
    brk = std::min(brk, pos + kMaxDecodeLength);
    const U32 segment = text.substr(pos, brk - pos);
    if (unescape_html && segment.find(U'<') != U32::npos) unescape_html = false;
    out += fix_segment(segment, unescape_html);
    pos = brk;
  }
  return out;
}

U32 strip(const U32& text) {
  size_t b = 0, e = text.size();
  while (b < e && is_python_space(text[b])) ++b;
  while (e > b && is_python_space(text[e - 1])) --e;
  return text.substr(b, e - b);
}

}  // namespace

bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string ftfy_fix_text(std::string_view text) {
  return utf8_encode(ftfy_fix_text_u32(decode_or_throw(text, "ftfy_fix_text")));
}

std::string html_unescape(std::string_view text) {
  return utf8_encode(html_unescape_u32(decode_or_throw(text, "html_unescape")));
}

std::string nfc_normalize(std::string_view text) { return utf8_encode(nfc(decode_or_throw(text, "nfc_normalize"))); }

std::string basic_clean(std::string_view text, bool use_ftfy) {
  U32 t = decode_or_throw(text, "basic_clean");
  if (use_ftfy) t = ftfy_fix_text_u32(t);
  t = html_unescape_u32(html_unescape_u32(t));
  return utf8_encode(strip(t));
}

std::string whitespace_clean(std::string_view text) {
  const U32 t = decode_or_throw(text, "whitespace_clean");
  U32 out;
  out.reserve(t.size());
  for (size_t i = 0; i < t.size();) {
    if (is_python_space(t[i])) {
      while (i < t.size() && is_python_space(t[i])) ++i;
      out.push_back(U' ');
    } else {
      out.push_back(t[i++]);
    }
  }
  return utf8_encode(strip(out));
}

std::string prompt_clean(std::string_view text) { return whitespace_clean(basic_clean(text, true)); }

}  // namespace skyreels::model
