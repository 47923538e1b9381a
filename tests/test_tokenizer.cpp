// The tokenizer side of the text encoder: our SentencePiece unigram against sentencepiece 0.1.97, the T5 conventions
// against transformers' slow T5Tokenizer, prompt cleaning against diffusers' prompt_clean with ftfy 6.3.1 (fixture
// tokenizer/k1_unigram768_bytefallback: 25 strings, raw and cleaned, ids exact). This binary links gRPC and LibTorch
// on purpose: the tokenizer must live in such a process (libsentencepiece cannot, build-notes P5).
#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/prompt_clean.h"
#include "model/tokenizer_unigram.h"
#include "tests/test_util.h"

namespace {

using skyreels::model::SentencePieceModelProto;
using skyreels::model::SentencePieceUnigram;
using skyreels::model::T5Tokenizer;
using skyreels::model::T5TokenizerOptions;
using skyreels::model::TokenizerError;

std::string case_dir() { return skyreels::test::golden_path("tokenizer/k1_unigram768_bytefallback"); }

const nlohmann::json& strings() {
  static const nlohmann::json j = [] {
    std::ifstream in(case_dir() + "/strings.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

const nlohmann::json& case_json() {
  static const nlohmann::json j = [] {
    std::ifstream in(case_dir() + "/case.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

const T5Tokenizer& tokenizer() {
  static const T5Tokenizer t = T5Tokenizer::load(case_dir());
  return t;
}

std::vector<int64_t> as_ids(const nlohmann::json& j) { return j.get<std::vector<int64_t>>(); }

std::vector<int64_t> ints(const std::vector<int>& v) { return std::vector<int64_t>(v.begin(), v.end()); }

std::vector<int64_t> row(const at::Tensor& t, int64_t i) {
  at::Tensor r = t[i].contiguous();
  return std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
}

// ---- the model file ----------------------------------------------------------------------------------------------

TEST(SentencePieceModel, ParsesPiecesAndSpecsOfTheFixtureModel) {
  const auto& sp = tokenizer().sentencepiece();
  const auto& proto = sp.proto();
  EXPECT_EQ(sp.piece_size(), 768);
  EXPECT_EQ(sp.unk_id(), 2);
  EXPECT_EQ(proto.normalizer_name, "nmt_nfkc");
  EXPECT_EQ(proto.precompiled_charsmap.size(), 237561u);
  EXPECT_TRUE(proto.add_dummy_prefix);
  EXPECT_TRUE(proto.remove_extra_whitespaces);
  EXPECT_TRUE(proto.escape_whitespaces);
  EXPECT_TRUE(proto.byte_fallback);
  EXPECT_EQ(proto.model_type, 1);
  std::map<SentencePieceModelProto::PieceType, int> counts;
  for (const auto& p : proto.pieces) counts[p.type]++;
  using T = SentencePieceModelProto::PieceType;
  EXPECT_EQ(counts[T::Control], 2);
  EXPECT_EQ(counts[T::Unknown], 1);
  EXPECT_EQ(counts[T::Byte], 256);
  EXPECT_EQ(counts[T::Normal], 509);
  EXPECT_EQ(sp.id_to_piece(3), "<0x00>");
  EXPECT_EQ(sp.id_to_piece(258), "<0xFF>");
  EXPECT_EQ(tokenizer().pad_id(), 0);
  EXPECT_EQ(tokenizer().eos_id(), 1);
  EXPECT_EQ(tokenizer().unk_id(), 2);
}

TEST(SentencePieceModel, EveryPieceScoreAndTypeEqualsVocabTsv) {
  const auto& proto = tokenizer().sentencepiece().proto();
  std::ifstream in(case_dir() + "/vocab.tsv");
  std::string line;
  std::getline(in, line);  // header: id piece score type
  const std::map<std::string, SentencePieceModelProto::PieceType> types = {
      {"NORMAL", SentencePieceModelProto::PieceType::Normal},
      {"UNKNOWN", SentencePieceModelProto::PieceType::Unknown},
      {"CONTROL", SentencePieceModelProto::PieceType::Control},
      {"BYTE", SentencePieceModelProto::PieceType::Byte}};
  size_t n = 0;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    size_t start = 0, tab;
    while ((tab = line.find('\t', start)) != std::string::npos) {
      f.push_back(line.substr(start, tab - start));
      start = tab + 1;
    }
    f.push_back(line.substr(start));
    ASSERT_EQ(f.size(), 4u) << line;
    const auto id = std::stoul(f[0]);
    ASSERT_LT(id, proto.pieces.size());
    EXPECT_EQ(proto.pieces[id].piece, f[1]) << "id " << id;
    const float score = std::stof(f[2]);  // vocab.tsv prints 6 significant digits
    EXPECT_NEAR(proto.pieces[id].score, score, 1e-5f * std::max(1.0f, std::abs(score))) << "id " << id;
    EXPECT_EQ(proto.pieces[id].type, types.at(f[3])) << "id " << id;
    ++n;
  }
  EXPECT_EQ(n, proto.pieces.size());
}

TEST(SentencePieceModel, TruncatedFileIsAnErrorNamingTheFile) {
  std::ifstream in(case_dir() + "/spiece.model", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = bytes.substr(0, bytes.size() / 2 + 3);
  try {
    SentencePieceUnigram(SentencePieceModelProto::parse(cut, "half.model"), "half.model");
    FAIL() << "a truncated model file was accepted";
  } catch (const TokenizerError& e) {
    EXPECT_NE(std::string(e.what()).find("half.model"), std::string::npos) << e.what();
  }
}

TEST(SentencePieceModel, NonUnigramModelsAreRejected) {
  std::ifstream in(case_dir() + "/spiece.model", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  SentencePieceModelProto proto = SentencePieceModelProto::parse(bytes, "spiece.model");
  proto.model_type = 2;  // BPE
  EXPECT_THROW(SentencePieceUnigram(proto, "bpe.model"), TokenizerError);
}

TEST(SentencePieceModel, MissingTokenizerFolderNamesWhatIsMissing) {
  const std::string dir = skyreels::test::temp_dir("tok-empty");
  try {
    T5Tokenizer::load(dir);
    FAIL();
  } catch (const TokenizerError& e) {
    EXPECT_NE(std::string(e.what()).find("spiece.model"), std::string::npos) << e.what();
  }
}

// ---- SentencePiece encoding --------------------------------------------------------------------------------------

TEST(SentencePieceEncode, IdsAndPiecesEqualTheLibraryForEveryFixtureString) {
  const auto& sp = tokenizer().sentencepiece();
  for (const auto& s : strings()) {
    const std::string text = s["text"];
    EXPECT_EQ(ints(sp.encode_as_ids(text)), as_ids(s["sp_ids"])) << s["name"];
    EXPECT_EQ(sp.encode_as_pieces(text), s["sp_pieces"].get<std::vector<std::string>>()) << s["name"];
  }
}

TEST(SentencePieceEncode, UnknownCharactersFallBackToTheirUtf8Bytes) {
  // 龘 is not in the 768-piece vocabulary: its three UTF-8 bytes E9 BE 98 become <0xE9> <0xBE> <0x98> (id = byte + 3).
  const auto pieces = tokenizer().sentencepiece().encode("\xE9\xBE\x98");
  ASSERT_EQ(pieces.size(), 4u);
  EXPECT_EQ(pieces[0].first, "\xE2\x96\x81");  // the dummy prefix
  EXPECT_EQ(pieces[1], std::make_pair(std::string("<0xE9>"), 0xE9 + 3));
  EXPECT_EQ(pieces[2], std::make_pair(std::string("<0xBE>"), 0xBE + 3));
  EXPECT_EQ(pieces[3], std::make_pair(std::string("<0x98>"), 0x98 + 3));
}

TEST(SentencePieceEncode, NormalizerAppliesNfkcAndCollapsesWhitespace) {
  const auto& sp = tokenizer().sentencepiece();
  EXPECT_EQ(sp.normalize("  ＡＢＣ\xE3\x80\x80x  "),
            "\xE2\x96\x81"
            "ABC"
            "\xE2\x96\x81"
            "x");
  EXPECT_EQ(sp.normalize("   "), "");
  EXPECT_EQ(sp.normalize("a\x07"),
            "\xE2\x96\x81"
            "a");  // control characters are deleted
  // Malformed UTF-8 becomes U+FFFD, one byte at a time, as in sentencepiece.
  EXPECT_EQ(sp.normalize("a\xFF"),
            "\xE2\x96\x81"
            "a\xEF\xBF\xBD");
}

// ---- T5 conventions ----------------------------------------------------------------------------------------------

TEST(T5Tokenizer, IdsEqualTransformersForEveryRawFixtureString) {
  for (const auto& s : strings()) {
    EXPECT_EQ(tokenizer().encode(s["text"].get<std::string>()), as_ids(s["t5_ids"])) << s["name"];
  }
}

TEST(T5Tokenizer, IdsEqualTransformersForEveryCleanedFixtureString) {
  for (const auto& s : strings()) {
    const std::string cleaned = skyreels::model::prompt_clean(s["text"].get<std::string>());
    EXPECT_EQ(tokenizer().encode(cleaned), as_ids(s["t5_ids_of_clean_with_ftfy"])) << s["name"];
  }
}

TEST(T5Tokenizer, LiteralSpecialTokensSplitTheTextAndBecomeTheirIds) {
  const auto parts = tokenizer().split_on_added_tokens("hello </s> world <pad> x <unk> y");
  ASSERT_EQ(parts.size(), 7u);
  EXPECT_EQ(parts[0], std::make_pair(std::string("hello "), int64_t{-1}));
  EXPECT_EQ(parts[1].second, 1);
  EXPECT_EQ(parts[3].second, 0);
  EXPECT_EQ(parts[5].second, 2);
  EXPECT_EQ(parts[6], std::make_pair(std::string(" y"), int64_t{-1}));
  // A text ending in the literal EOS gets no second one.
  const auto ids = tokenizer().encode("the end </s>");
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(ids.back(), 1);
  EXPECT_NE(ids[ids.size() - 2], 1);
}

TEST(T5Tokenizer, PaddedBatchesEqualTheFixtureTensorsRawAndCleaned) {
  const auto tensors = skyreels::test::load_tensors(case_dir() + "/ids.safetensors");
  std::vector<std::string> raw, cleaned;
  for (const auto& s : strings()) {
    raw.push_back(s["text"]);
    cleaned.push_back(skyreels::model::prompt_clean(raw.back()));
  }
  for (int64_t length : {226, 16}) {
    for (const bool clean : {false, true}) {
      const std::string prefix = clean ? "clean_" : "";
      const auto batch = tokenizer()(clean ? cleaned : raw, length);
      const at::Tensor& ids = tensors.at(prefix + "input_ids_L" + std::to_string(length));
      const at::Tensor& mask = tensors.at(prefix + "attention_mask_L" + std::to_string(length));
      ASSERT_EQ(batch.input_ids.size(), static_cast<size_t>(ids.size(0)));
      for (int64_t i = 0; i < ids.size(0); ++i) {
        EXPECT_EQ(batch.input_ids[static_cast<size_t>(i)], row(ids, i))
            << prefix << "L" << length << " " << strings()[static_cast<size_t>(i)]["name"];
        EXPECT_EQ(batch.attention_mask[static_cast<size_t>(i)], row(mask, i))
            << prefix << "L" << length << " " << strings()[static_cast<size_t>(i)]["name"];
      }
    }
  }
}

TEST(T5Tokenizer, TruncationKeepsRoomForTheEos) {
  const std::string text = strings()[24]["text"];  // long_text
  const auto ids = tokenizer().encode(text, 16);
  ASSERT_EQ(ids.size(), 16u);
  EXPECT_EQ(ids.back(), 1);
  const auto full = tokenizer().encode(text);
  EXPECT_EQ(std::vector<int64_t>(ids.begin(), ids.end() - 1), std::vector<int64_t>(full.begin(), full.begin() + 15));
}

TEST(T5Tokenizer, MaxLengthTooSmallToTruncateIsAnError) {
  // transformers logs an error and returns the untruncated ids (a batch of them cannot become a tensor).
  const auto& m = case_json()["max_length_1"];
  for (size_t i = 0; i < m["texts"].size(); ++i) {
    const std::string text = m["texts"][i];
    EXPECT_EQ(tokenizer().encode(text), as_ids(m["input_ids"][i])) << text;
    EXPECT_THROW(tokenizer().encode(text, 1), std::invalid_argument) << text;
  }
  EXPECT_EQ(tokenizer().encode("", 1), std::vector<int64_t>{1});
  EXPECT_THROW(tokenizer().encode("a", 0), std::invalid_argument);
}

TEST(T5Tokenizer, ExtraIdsAreAddedTokensThatEatSurroundingWhitespace) {
  T5TokenizerOptions options;
  options.extra_ids = 3;
  const T5Tokenizer t(SentencePieceUnigram::load(case_dir() + "/spiece.model"), options);
  EXPECT_EQ(t.vocab_size(), 771);
  const auto parts = t.split_on_added_tokens("a cat  <extra_id_0>  sat<extra_id_2>");
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[0].first, "a cat");  // rstripped by the token's lstrip
  EXPECT_EQ(parts[1].second, 768 - 1 + 3 - 0);
  EXPECT_EQ(parts[2].first, "sat");  // lstripped by the token's rstrip
  EXPECT_EQ(parts[3].second, 768 - 1 + 3 - 2);
}

TEST(T5Tokenizer, TokenizerConfigJsonSetsExtraIdsAndAddedTokens) {
  namespace fs = std::filesystem;
  const std::string dir = skyreels::test::temp_dir("tok-config");
  fs::copy_file(case_dir() + "/spiece.model", dir + "/spiece.model");
  std::ofstream(dir + "/tokenizer_config.json") << R"({"extra_ids": 2, "eos_token": "</s>", "pad_token": "<pad>"})";
  const T5Tokenizer with_extra = T5Tokenizer::load(dir);
  EXPECT_EQ(with_extra.vocab_size(), 770);
  const auto parts = with_extra.split_on_added_tokens("x<extra_id_1>y");
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[1].second, 768);  // piece_size - 1 + extra_ids - 1

  std::ofstream(dir + "/tokenizer_config.json")
      << R"({"added_tokens_decoder": {"0": {"content": "<pad>"}, "1": {"content": "</s>"},
             "2": {"content": "<unk>"}, "700": {"content": "[MARK]", "lstrip": true, "rstrip": false}}})";
  const T5Tokenizer with_added = T5Tokenizer::load(dir);
  const auto ids = with_added.encode("a [MARK] b");
  EXPECT_NE(std::find(ids.begin(), ids.end(), 700), ids.end());
  const auto split = with_added.split_on_added_tokens("a  [MARK] b");
  EXPECT_EQ(split[0].first, "a");  // the token eats whitespace on its left only
  EXPECT_EQ(split[2].first, " b");

  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<not-a-piece>"})";
  EXPECT_THROW(T5Tokenizer::load(dir), TokenizerError);
}

TEST(T5Tokenizer, WorksInAProcessThatLinksGrpcAndLibTorch) {
  // Both runtimes are initialised here; libsentencepiece would abort this process (protobuf 3.14 vs 3.21).
  EXPECT_FALSE(grpc::Version().empty());
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 20);
  const at::Tensor t = at::ones({2, 2});
  EXPECT_EQ(t.sum().item<float>(), 4.0f);
  EXPECT_EQ(tokenizer().encode("A cat sits on the mat."), as_ids(strings()[2]["t5_ids"]));
}

// ---- prompt cleaning ---------------------------------------------------------------------------------------------

TEST(PromptClean, EqualsDiffusersWithFtfyForEveryFixtureString) {
  for (const auto& s : strings()) {
    EXPECT_EQ(skyreels::model::prompt_clean(s["text"].get<std::string>()),
              s["clean"]["diffusers_prompt_clean_with_ftfy"].get<std::string>())
        << s["name"];
  }
}

TEST(PromptClean, FtfyFixTextEqualsFtfyForEveryFixtureString) {
  for (const auto& s : strings()) {
    EXPECT_EQ(skyreels::model::ftfy_fix_text(s["text"].get<std::string>()),
              s["clean"]["ftfy_fix_text"].get<std::string>())
        << s["name"];
  }
}

TEST(PromptClean, WithoutFtfyEqualsDiffusersChainWithIdentityFixText) {
  for (const auto& s : strings()) {
    const std::string text = s["text"];
    EXPECT_EQ(skyreels::model::whitespace_clean(skyreels::model::basic_clean(text, false)),
              s["clean"]["diffusers_prompt_clean_without_ftfy"].get<std::string>())
        << s["name"];
    EXPECT_EQ(skyreels::model::prompt_clean(text), s["clean"]["skyreels_original_clean_whitespace"].get<std::string>())
        << s["name"];
  }
}

// Expected values below were produced by ftfy 6.3.1 (fix_text) and Python 3.11's html.unescape.
TEST(PromptClean, FtfyRepairsMojibakeThroughEachEncodingPath) {
  using skyreels::model::ftfy_fix_text;
  EXPECT_EQ(ftfy_fix_text("s\u00c3\u00b3"), "s\u00f3");                        // latin-1
  EXPECT_EQ(ftfy_fix_text("voil\u00c3 le travail"), "voil\u00e0 le travail");  // byte A0 restored
  EXPECT_EQ(ftfy_fix_text("\u00e2\u20ac\u0153 like this \u00e2\u20ac\ufffd"),  // lossy sequence -> U+FFFD
            "\" like this \ufffd");
  EXPECT_EQ(ftfy_fix_text("\u221a\u00a9"), "\u00e9");  // MacRoman
  EXPECT_EQ(ftfy_fix_text("caf\u00c3\u00a0"), "caf\u00e0");
  EXPECT_EQ(ftfy_fix_text("Pr\u00c3\u00a9sentation de la 1\u00c3\u00a8re \u00c3\u00a9dition"),
            "Pr\u00e9sentation de la 1\u00e8re \u00e9dition");
  EXPECT_EQ(ftfy_fix_text("\u00c2\u00c2\u00c2"), "\u00c2\u00c2\u00c2");  // not mojibake: unchanged
  EXPECT_EQ(ftfy_fix_text("\u00d7\u00b2"), "\u05f2");
}

TEST(PromptClean, FtfyCharacterFixes) {
  using skyreels::model::ftfy_fix_text;
  EXPECT_EQ(ftfy_fix_text("\u0080 euro"), "\u20ac euro");  // C1 control as cp1252
  EXPECT_EQ(ftfy_fix_text("\uff2c\uff2f\uff35\uff24\u3000\uff2e\uff2f\uff29\uff33\uff25\uff33"), "LOUD NOISES");
  EXPECT_EQ(ftfy_fix_text("\uff71\uff72\uff73 \uff8a\uff9f"), "\u30a2\u30a4\u30a6 \u30d1");  // half-width kana
  EXPECT_EQ(ftfy_fix_text("\ufb02ubberi\ufb01c"), "flubberific");
  EXPECT_EQ(ftfy_fix_text("\x1b[36;44mblue\x1b[0m"), "blue");
  EXPECT_EQ(ftfy_fix_text("\ufeffbom"), "bom");
  EXPECT_EQ(ftfy_fix_text("l\u2019h\u00f4tel \u201cquoted\u201d"), "l'h\u00f4tel \"quoted\"");
  EXPECT_EQ(ftfy_fix_text("\u2028a\u2029b\u0085c\rd"), "\na\nb\u2026c\nd");
  EXPECT_EQ(ftfy_fix_text("e\u0301\u0323 \u1100\u1161\u11a8"), "\u1eb9\u0301 \uac01");  // NFC, Hangul
}

TEST(PromptClean, FtfyHtmlEntitiesStopAtALiteralLessThan) {
  using skyreels::model::ftfy_fix_text;
  EXPECT_EQ(ftfy_fix_text("P&EACUTE;REZ"), "P\u00c9REZ");
  EXPECT_EQ(ftfy_fix_text("&#x2019;s &#0; &#1;"), "'s \ufffd ");
  EXPECT_EQ(ftfy_fix_text("&lt;tag&gt; <b>"), "&lt;tag&gt; <b>");
  EXPECT_EQ(ftfy_fix_text("&lt;tag&gt;\n<b>&amp;</b>"), "<tag>\n<b>&amp;</b>");  // per line, then off for good
}

TEST(PromptClean, HtmlUnescapeFollowsPython) {
  using skyreels::model::html_unescape;
  EXPECT_EQ(html_unescape("&amp;"), "&");
  EXPECT_EQ(html_unescape("&ampx"), "&x");
  EXPECT_EQ(html_unescape("&amp;amp;"), "&amp;");
  EXPECT_EQ(html_unescape("&#65;&#x42;&#X43"), "ABC");
  EXPECT_EQ(html_unescape("&#0;|&#128;|&#xD800;|&#1;|&#99999999999;"), "\ufffd|\u20ac|\ufffd||\ufffd");
  EXPECT_EQ(html_unescape("&notit;"), "\u00acit;");
  EXPECT_EQ(html_unescape("&notin;"), "\u2209");
  EXPECT_EQ(html_unescape("&no"), "&no");
  EXPECT_EQ(html_unescape("& &; &#; &#x;"), "& &; &#; &#x;");
  EXPECT_EQ(html_unescape("&Eacute&eacute;"), "\u00c9\u00e9");
  EXPECT_EQ(html_unescape("&abcdefghijklmnopqrstuvwxyzabcdefghij;"), "&abcdefghijklmnopqrstuvwxyzabcdefghij;");
}

TEST(PromptClean, WhitespaceUsesPythonsUnicodeDefinition) {
  using skyreels::model::whitespace_clean;
  EXPECT_EQ(whitespace_clean(" \t a\u00a0\u2003b\u200bc\x1f d\u3000 "), "a b\u200bc d");  // U+200B is not space
}

TEST(PromptClean, InvalidUtf8IsRejectedWithItsOffset) {
  try {
    skyreels::model::prompt_clean("ok \xFF");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("offset 3"), std::string::npos) << e.what();
  }
}

}  // namespace
