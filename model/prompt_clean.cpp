// The prompt cleaning's entry points (prompt_clean.h): ftfy's simple character fixes (ligatures, width, curly quotes,
// line breaks, terminal escapes, control characters), its fix_text loop over segments, and diffusers' basic_clean /
// whitespace_clean. The layers below are in prompt_clean_unicode.cpp, prompt_clean_html.cpp, prompt_clean_badness.cpp
// and prompt_clean_mojibake.cpp (prompt_clean_detail.h).
#include "model/prompt_clean.h"

#include <algorithm>
#include <iterator>
#include <string>

#include "model/prompt_clean_detail.h"

namespace skyreels::model {
namespace prompt_clean_detail {
namespace {

#include "model/prompt_clean_tables.inc"

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
}  // namespace prompt_clean_detail

using prompt_clean_detail::decode_or_throw;
using prompt_clean_detail::ftfy_fix_text_u32;
using prompt_clean_detail::html_unescape_u32;
using prompt_clean_detail::nfc;
using prompt_clean_detail::strip;
using prompt_clean_detail::U32;
using prompt_clean_detail::utf8_encode;

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
