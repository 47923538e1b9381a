// Issue 46, the pieces: WatchJob's preview message refers to the hub's PNG (protobuf's own bytes, no copy), the HTTP
// door reads it back without copying the image, and the Server-Sent Event it writes in pieces is byte for byte the
// one it wrote whole before (`event: preview`, the image as a data: URL in place of `"image":""`); the heap trim
// after the last stream runs once for a burst of closes.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/api/codec.h"
#include "server/api/guards.h"
#include "server/http/routes.h"
#include "server/http/watch_events.h"
#include "server/job/base64.h"

namespace skyreels::test {
namespace {

namespace pb = ::skyreels::v1;
using server::ChunkPreviewImage;

std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng() & 0xff);
  return out;
}

std::shared_ptr<const ChunkPreviewImage> preview_image(size_t bytes) {
  auto image = std::make_shared<ChunkPreviewImage>();
  image->png = random_bytes(bytes, 46);
  return image;
}

// A preview event as the watch writes it, without its image.
pb::JobEvent preview_event() {
  pb::JobEvent event;
  event.set_job_id("j-0123456789abcdef0123456789abcdef");
  auto* p = event.mutable_preview();
  p->set_chunk_index(1);
  p->set_step(7);
  p->set_steps(30);
  p->set_latent_frame_begin(20);
  p->set_latent_frame_end(45);
  p->set_frame_width(120);
  p->set_frame_height(68);
  p->set_mime_type("image/png");
  return event;
}

std::string joined(const std::vector<grpc::Slice>& slices) {
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `bytes` as a message of slices of 1 to 7 bytes.
grpc::ByteBuffer in_small_slices(const std::string& bytes) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0, n = 1; at < bytes.size(); at += n, n = n % 7 + 1) {
    slices.emplace_back(bytes.data() + at, std::min(n, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// What the SSE writer sent for a preview before issue 46: the whole event's JSON with its image cleared, `"image":""`
// replaced by the data: URL of the whole image in base64.
std::string sse_preview_as_before(const pb::JobEvent& event) {
  pb::JobEvent copy = event;
  copy.mutable_preview()->clear_image();
  std::string data = server::http::to_json(copy);
  const std::string empty_image = "\"image\":\"\"";
  const size_t at = data.find(empty_image);
  data.replace(at, empty_image.size(), "\"image_url\":\"data:" + event.preview().mime_type() + ";base64," +
                                           server::base64_encode(event.preview().image()) + "\"");
  return "event: preview\ndata: " + data + "\n\n";
}

std::string all_pieces(server::http::SseText text, size_t* largest) {
  std::string out;
  *largest = 0;
  while (auto piece = text.next_piece()) {
    *largest = std::max(*largest, piece->size());
    out += *piece;
  }
  return out;
}

TEST(WatchWire, APreviewMessageIsProtobufsBytesWithTheHubsPngReferredToNotCopied) {
  auto image = preview_image(100003);
  const std::weak_ptr<const ChunkPreviewImage> watched = image;
  const char* png = image->png.data();
  pb::JobEvent whole = preview_event();
  whole.mutable_preview()->set_image(image->png);
  {
    const grpc::ByteBuffer message = server::api::preview_message(preview_event(), std::move(image));
    grpc::Slice flat;
    ASSERT_TRUE(message.DumpToSingleSlice(&flat).ok());
    EXPECT_TRUE(std::string(reinterpret_cast<const char*>(flat.begin()), flat.size()) == whole.SerializeAsString());
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(message.Dump(&slices).ok());
    ASSERT_FALSE(slices.empty());
    EXPECT_EQ(reinterpret_cast<const char*>(slices.back().begin()), png) << "the PNG was copied";
    EXPECT_FALSE(watched.expired()) << "the message keeps the image alive";
  }
  EXPECT_TRUE(watched.expired()) << "the message's last copy let the image go";
}

TEST(WatchWire, ReadEventSplitsThePreviewsImageOutByReference) {
  auto image = preview_image(70001);
  const std::string png = image->png;
  const char* at = image->png.data();
  const grpc::ByteBuffer message = server::api::preview_message(preview_event(), std::move(image));
  const auto read = server::http::read_event(message);
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(read->event.SerializeAsString(), preview_event().SerializeAsString());
  EXPECT_TRUE(joined(read->image) == png);
  ASSERT_FALSE(read->image.empty());
  EXPECT_EQ(reinterpret_cast<const char*>(read->image.front().begin()), at) << "the image was copied";
}

TEST(WatchWire, ReadEventReadsAnyJobEventWhateverItsSlices) {
  pb::JobEvent preview = preview_event();
  preview.mutable_preview()->set_image(random_bytes(5000, 7));
  pb::JobEvent finished;
  finished.set_job_id("j-1");
  finished.set_sequence(42);
  finished.mutable_time()->set_seconds(1700000000);
  finished.mutable_chunk_finished()->set_chunk_index(3);
  for (const pb::JobEvent& event : {preview, finished}) {
    const auto read = server::http::read_event(in_small_slices(event.SerializeAsString()));
    ASSERT_TRUE(read.has_value()) << event.ShortDebugString();
    pb::JobEvent without = event;
    if (without.has_preview()) without.mutable_preview()->clear_image();
    EXPECT_EQ(read->event.SerializeAsString(), without.SerializeAsString());
    EXPECT_TRUE(joined(read->image) == event.preview().image());
  }
  EXPECT_FALSE(server::http::read_event(in_small_slices(std::string("\x0a\x7f", 2))).has_value()) << "truncated";
}

TEST(WatchWire, ThePreviewsServerSentEventIsTheWholeOneInPiecesOfAtMost16KiB) {
  for (const size_t bytes : {size_t{0}, size_t{1}, size_t{12288}, size_t{12289}, size_t{500000}}) {
    pb::JobEvent event = preview_event();
    event.mutable_preview()->set_image(random_bytes(bytes, static_cast<uint32_t>(bytes)));
    const auto read = server::http::read_event(in_small_slices(event.SerializeAsString()));
    ASSERT_TRUE(read.has_value());
    size_t largest = 0;
    const std::string text = all_pieces(server::http::SseText(*read), &largest);
    EXPECT_TRUE(text == sse_preview_as_before(event)) << bytes << " image bytes";
    EXPECT_LE(largest, size_t{16} << 10);
  }
  pb::JobEvent step;
  step.set_job_id("j-1");
  step.set_sequence(9);
  step.mutable_step()->set_step(3);
  size_t largest = 0;
  EXPECT_EQ(all_pieces(server::http::SseText({step, {}}), &largest),
            "id: 9\nevent: step\ndata: " + server::http::to_json(step) + "\n\n");
}

TEST(IdleTrimmer, ABurstOfRequestsIsJoinedIntoOneTrimNeverOnTheAskingThread) {
  std::atomic<int> trims{0};
  std::atomic<bool> on_asking_thread{false};
  const auto asking = std::this_thread::get_id();
  {
    server::IdleTrimmer trimmer([&] {
      on_asking_thread = on_asking_thread || std::this_thread::get_id() == asking;
      ++trims;
    });
    for (int i = 0; i < 100; ++i) trimmer.request();
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (trims == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  EXPECT_GE(trims.load(), 1);
  EXPECT_LT(trims.load(), 100) << "the burst's requests were not joined";
  EXPECT_FALSE(on_asking_thread);
  // Destroyed with a request pending: it stops without waiting for the delay's end or trimming.
  trims = 0;
  const auto t0 = std::chrono::steady_clock::now();
  {
    server::IdleTrimmer trimmer([&] { ++trims; }, std::chrono::hours(1));
    trimmer.request();
  }
  EXPECT_EQ(trims.load(), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::minutes(1));
}

}  // namespace
}  // namespace skyreels::test
