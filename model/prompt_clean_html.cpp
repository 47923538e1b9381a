// HTML entities in the prompt cleaning (prompt_clean_detail.h): Python's html.unescape (HTML5 named references with
// and without ';', numeric references, the invalid-reference rules) and ftfy's narrower unescape_html.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>

#include "model/prompt_clean_detail.h"

namespace skyreels::model::prompt_clean_detail {
namespace {

#include "model/prompt_clean_tables.inc"

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

}  // namespace

// ---- Python's html.unescape ----------------------------------------------------------------------------------------

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

namespace {

bool is_ascii_alnum(char32_t c) { return is_ascii_digit(c) || is_ascii_letter(c); }

}  // namespace

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

}  // namespace skyreels::model::prompt_clean_detail
