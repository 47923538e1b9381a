// ftfy's mojibake detector (ftfy.badness, prompt_clean_detail.h): the character categories of the generated tables and
// BADNESS_RE as a list of fixed-length character-class sequences.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "model/prompt_clean_detail.h"

namespace skyreels::model::prompt_clean_detail {
namespace {

#include "model/prompt_clean_tables.inc"

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

}  // namespace

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

}  // namespace skyreels::model::prompt_clean_detail
