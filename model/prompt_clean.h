// diffusers' prompt cleaning as the SkyReels-V2 pipeline runs it in practice (with the ftfy package installed):
//
//   prompt_clean(text) = whitespace_clean(basic_clean(text))
//   basic_clean(text)  = strip(html.unescape(html.unescape(ftfy.fix_text(text))))
//   whitespace_clean   = re.sub(r"\s+", " ", text).strip()          (Python's Unicode \s)
//
// ftfy_fix_text() is a port of ftfy 6.3.1's fix_text with its default configuration: HTML entity decoding (off for
// the rest of the text once a line holds a literal '<', as ftfy does), mojibake repair (its `badness` heuristic; the
// ten single-byte encodings it tries, with byte-A0 restoration, lossy-sequence replacement and the CESU-8 / Java-null
// UTF-8 variants; decode_inconsistent_utf8 for mojibake embedded in other text; the Latin-1 -> Windows-1252
// fallback), C1 control repair, Latin ligatures, character width, curly quotes, line breaks, ANSI terminal escapes,
// control-character removal and NFC, repeated until the text stops changing, line by line. The character data
// (prompt_clean_tables.inc) is generated from ftfy 6.3.1 and Python 3.11 (Unicode 14.0, as the fixtures) by
// prompt_clean_tables.py. Checked against the real ftfy / html.unescape / unicodedata on 33,000 random strings
// (mojibake in ten encodings, entities, controls, wide and combining characters) and NFC on every code point.
// Not implemented: ftfy's fix_surrogates (UTF-8 input cannot hold surrogates) and its `explain` output.
//
// All functions take and return UTF-8 and throw std::invalid_argument (naming the byte offset) on malformed UTF-8.
// Torch-free header.
#pragma once

#include <string>
#include <string_view>

namespace skyreels::model {

// What the pipeline tokenizes: prompt_clean with ftfy.
std::string prompt_clean(std::string_view text);

// basic_clean; use_ftfy = false gives the chain with ftfy.fix_text as the identity (what the golden files call
// "diffusers_prompt_clean_without_ftfy" once whitespace_clean follows).
std::string basic_clean(std::string_view text, bool use_ftfy = true);
std::string whitespace_clean(std::string_view text);

// ftfy.fix_text(text) with ftfy 6.3.1's defaults (see the list above for what is not implemented).
std::string ftfy_fix_text(std::string_view text);

// Python's html.unescape (HTML5 named references with and without ';', numeric references, the invalid-reference
// rules).
std::string html_unescape(std::string_view text);

// Unicode NFC (unicodedata.normalize("NFC", text)).
std::string nfc_normalize(std::string_view text);

// Python's str.isspace() for one code point (what re's \s and str.strip() use).
bool is_python_space(char32_t cp);

}  // namespace skyreels::model
