// ftfy's mojibake repair (ftfy.fixes.fix_encoding and its helpers, prompt_clean_detail.h): re-encoding with the ten
// single-byte codecs it tries, byte-A0 restoration and lossy-sequence replacement (fixed-length byte patterns), the
// CESU-8 / Java-null UTF-8 variants, decode_inconsistent_utf8 for mojibake embedded in other text, the Latin-1 ->
// Windows-1252 fallback and C1 control repair.
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "model/prompt_clean_detail.h"

namespace skyreels::model::prompt_clean_detail {
namespace {

#include "model/prompt_clean_tables.inc"

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

}  // namespace

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

namespace {

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

}  // namespace

U32 fix_encoding(U32 text) {
  while (true) {
    U32 fixed = fix_encoding_one_step(text);
    if (fixed == text) return fixed;
    text = std::move(fixed);
  }
}

}  // namespace skyreels::model::prompt_clean_detail
