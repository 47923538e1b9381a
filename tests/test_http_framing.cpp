// Issue 36, part 1: request smuggling on the HTTP port. Each ambiguous framing (RFC 9112 §6.1, §6.3, §5.2) is sent
// raw over TCP to the real server with a second request, `POST /v1/videos`, hidden in its body; the server must answer
// 400 once, close the connection, and never run the hidden request (the owner's jobs are counted over gRPC).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "model/umt5_encoder.h"
#include "tests/test_server_harness.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace pb = ::skyreels::v1;

const std::string kKey = "framing-key-0123456789abcdef0123456789";
const std::string kVideo = R"({"prompt":"A dog runs.","size":"48x32","seconds":2,"fps":8,"num_inference_steps":1})";

// Sends `raw` on a fresh connection and reads until the server closes it or `seconds` pass. The deadline is far above
// the time a close takes and far below the idle timeout (30 s).
RawExchange send_raw(int port, const std::string& raw, double seconds = 15) {
  return send_raw_http(port, raw, seconds);
}

int status_of(const std::string& answer) {
  if (answer.rfind("HTTP/1.", 0) != 0 || answer.size() < 12) return -1;
  return std::atoi(answer.substr(9, 3).c_str());
}

// The status of every status line ("HTTP/1.x NNN ") in what the connection got.
std::vector<int> statuses_in(const std::string& bytes) {
  std::vector<int> out;
  for (size_t at = bytes.find("HTTP/1."); at != std::string::npos; at = bytes.find("HTTP/1.", at + 1)) {
    if (at + 13 > bytes.size() || bytes[at + 8] != ' ' || bytes[at + 12] != ' ') continue;
    if (!std::isdigit(static_cast<unsigned char>(bytes[at + 9])) || !std::isdigit(static_cast<unsigned char>(bytes[at + 10])) ||
        !std::isdigit(static_cast<unsigned char>(bytes[at + 11]))) {
      continue;
    }
    out.push_back(std::atoi(bytes.substr(at + 9, 3).c_str()));
  }
  return out;
}

// The hidden request: a valid video submission of the same client (it creates a job whenever it is run).
std::string hidden_request() {
  return "POST /v1/videos HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + kKey +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(kVideo.size()) + "\r\n\r\n" + kVideo;
}

// The outer request's head up to (not including) its framing headers.
std::string head(const std::string& version = "HTTP/1.1") {
  return "POST /v1/videos " + version + "\r\nHost: x\r\nAuthorization: Bearer " + kKey +
         "\r\nContent-Type: application/json\r\n";
}

class HttpFramingTest : public ::testing::Test {
 protected:
  static void start_server() {
    const std::string dir = temp_dir("http-framing");
    std::ofstream(dir + "/keys") << kKey << " framing-client\n";
    encoder_dir_ = new std::string(temp_dir("http-framing-umt5"));
    model::write_tiny_text_encoder(*encoder_dir_, 32, 7);
    http_port_ = free_port();
    server_ = start_suite_server([&] {
      return std::make_unique<ServerProcess>(std::vector<std::string>{"--demo", "--devices", "cpu", "--dtype", "float32", "--text-encoder", *encoder_dir_,
                                 "--tokenizer", golden_path("umt5_encoder/e3_prompts_to_embeds/tokenizer"),
                                 "--api-keys", dir + "/keys", "--http-listen",
                                 "127.0.0.1:" + std::to_string(http_port_), "--http-idle-timeout-seconds", "30",
                                 "--max-jobs-per-client", "1000"},
                                true, kKey);
    });
  }
  void SetUp() override {
    if (!std::exchange(started_, true)) start_server();
    expect_suite_server(server_);
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    started_ = false;
    delete encoder_dir_;
  }

  // The client's jobs, as gRPC's ListJobs sees them.
  static int jobs() {
    int count = 0;
    pb::ListJobsRequest request;
    request.set_page_size(1000);
    do {
      auto ctx = server_->client().context(30);
      pb::ListJobsResponse page;
      const grpc::Status status = server_->client().stub().ListJobs(ctx.get(), request, &page);
      EXPECT_TRUE(status.ok()) << status.error_message();
      if (!status.ok()) return -1;
      count += page.jobs_size();
      request.set_page_token(page.next_page_token());
    } while (!request.page_token().empty());
    return count;
  }

  // `raw` is refused with 400, once, the connection closed by the server, and no job made.
  static void expect_refused(const std::string& what, const std::string& raw, int status = 400) {
    const int before = jobs();
    const RawExchange got = send_raw(http_port_, raw);
    EXPECT_EQ(status_of(got.bytes), status) << what << ":\n" << got.bytes;
    EXPECT_TRUE(got.closed) << what << ": the server kept the connection open";
    // One answer: the refusal (libmicrohttpd 0.9.75 writes the head of its own refusals twice, hence "every").
    const std::vector<int> statuses = statuses_in(got.bytes);
    EXPECT_TRUE(!statuses.empty() && std::all_of(statuses.begin(), statuses.end(), [&](int s) { return s == status; }))
        << what << ": the body was read as another request:\n" << got.bytes;
    EXPECT_NE(got.bytes.find("Connection: close"), std::string::npos) << what << ":\n" << got.bytes;
    // A hidden request would have been answered on this connection before it closed; its job exists by then.
    EXPECT_EQ(jobs(), before) << what << ": the hidden request made a job";
  }

  static inline ServerProcess* server_ = nullptr;
  static inline bool started_ = false;
  static inline std::string* encoder_dir_ = nullptr;
  static inline int http_port_ = 0;
};

TEST_F(HttpFramingTest, TheHiddenRequestMakesAJobWhenSentOnItsOwn) {
  // The control: the request hidden in the cases below is a valid submission.
  const int before = jobs();
  const RawExchange got = send_raw(http_port_, hidden_request());
  EXPECT_EQ(status_of(got.bytes), 200) << got.bytes;
  EXPECT_EQ(jobs(), before + 1);
}

TEST_F(HttpFramingTest, ContentLengthWithTransferEncodingIsRefusedInEitherOrder) {
  const std::string chunked_end = "0\r\n\r\n";
  const std::string body = chunked_end + hidden_request();
  for (const std::string te : {"chunked", "Chunked", "CHUNKED"}) {
    expect_refused("CL then TE " + te, head() + "Content-Length: " + std::to_string(chunked_end.size()) +
                                          "\r\nTransfer-Encoding: " + te + "\r\n\r\n" + body);
    expect_refused("TE " + te + " then CL", head() + "Transfer-Encoding: " + te + "\r\nContent-Length: " +
                                                std::to_string(chunked_end.size()) + "\r\n\r\n" + body);
  }
  // The whole body as Content-Length says, the hidden request after it as chunked framing reads it.
  expect_refused("CL covering everything, TE chunked",
                 head() + "Transfer-Encoding: chunked\r\nContent-Length: " + std::to_string(body.size()) +
                     "\r\n\r\n" + body);
}

TEST_F(HttpFramingTest, TransferEncodingsOtherThanChunkedAreRefused) {
  const std::string body = "0\r\n\r\n" + hidden_request();
  for (const std::string te : {"gzip, chunked", "chunked, chunked", "identity", "chunked;q=1", " chunked x"}) {
    expect_refused("TE '" + te + "'", head() + "Transfer-Encoding: " + te + "\r\n\r\n" + body);
  }
  expect_refused("two TE lines", head() + "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n" + body);
  expect_refused("TE in HTTP/1.0", head("HTTP/1.0") + "Transfer-Encoding: chunked\r\n\r\n" + body);
}

TEST_F(HttpFramingTest, TwoContentLengthsOrAMalformedOneAreRefused) {
  const std::string hidden = hidden_request();
  expect_refused("CL 0 then CL n", head() + "Content-Length: 0\r\nContent-Length: " + std::to_string(hidden.size()) +
                                       "\r\n\r\n" + hidden);
  expect_refused("CL n then CL 0", head() + "Content-Length: " + std::to_string(hidden.size()) +
                                       "\r\nContent-Length: 0\r\n\r\n" + hidden);
  expect_refused("the same CL twice", head() + "Content-Length: 0\r\nContent-Length: 0\r\n\r\n" + hidden);
  expect_refused("CL list", head() + "Content-Length: 0, 0\r\n\r\n" + hidden);
  for (const std::string length : {"+0", "-0", "0x0", "", "0 0", "0.0"}) {
    expect_refused("CL '" + length + "'", head() + "Content-Length: " + length + "\r\n\r\n" + hidden);
  }
  // Lengths past 2^64 (libmicrohttpd's own 413) or past the body limit: 413, closed, nothing run.
  for (const std::string length : {"99999999999999999999", "18446744073709551616", "9999999999999999999"}) {
    expect_refused("CL '" + length + "'", head() + "Content-Length: " + length + "\r\n\r\n" + hidden, 413);
  }
}

TEST_F(HttpFramingTest, FoldedHeaderLinesAndBlanksBeforeTheColonAreRefused) {
  const std::string hidden = hidden_request();
  // The length folded onto a second line: read as no length at all, the hidden request would follow.
  expect_refused("folded CL", head() + "Content-Length:\r\n " + std::to_string(hidden.size()) + "\r\n\r\n" + hidden);
  expect_refused("folded CL (tab)",
                 head() + "Content-Length:\r\n\t" + std::to_string(hidden.size()) + "\r\n\r\n" + hidden);
  expect_refused("folded other header", head() + "X-Note: one\r\n two\r\nContent-Length: 0\r\n\r\n" + hidden);
  expect_refused("folded TE", head() + "Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n" + hidden);
  expect_refused("blank before the colon",
                 head() + "Content-Length : " + std::to_string(hidden.size()) + "\r\n\r\n" + hidden);
}

// Issue 46: libmicrohttpd 0.9.75 reads a header value as a C string, so a NUL cuts it there while a proxy in front
// reads the whole line: `Content-Length: 0<NUL>N` is a length of 0 here and of N there.
TEST_F(HttpFramingTest, NulsAndControlBytesInHeaderLinesAreRefused) {
  const std::string hidden = hidden_request();
  const std::string n = std::to_string(hidden.size());
  const std::string nul(1, '\0');
  expect_refused("CL 0<NUL>N", head() + "Content-Length: 0" + nul + n + "\r\n\r\n" + hidden);
  expect_refused("CL N<NUL>0", head() + "Content-Length: " + n + nul + "0\r\n\r\n" + hidden);
  expect_refused("CL 0<NUL>", head() + "Content-Length: 0" + nul + "\r\n\r\n" + hidden);
  expect_refused("CL 0<NUL><NUL>N", head() + "Content-Length: 0" + nul + nul + n + "\r\n\r\n" + hidden);
  expect_refused("NUL in another value", head() + "X-Note: a" + nul + "b\r\nContent-Length: 0\r\n\r\n" + hidden);
  expect_refused("TE chunked<NUL>x", head() + "Transfer-Encoding: chunked" + nul + "x\r\n\r\n0\r\n\r\n" + hidden);
  // A line that starts with a NUL ends the header section for libmicrohttpd; the length after it would be its body.
  expect_refused("<NUL>Content-Length", head() + nul + "Content-Length: " + n + "\r\n\r\n" + hidden);
  expect_refused("<NUL> after the request line",
                 "POST /v1/videos HTTP/1.1\r\n" + nul + "Content-Length: " + n + "\r\n\r\n" + hidden);
  expect_refused("NUL in a name", head() + "X-No" + nul + "te: a\r\nContent-Length: 0\r\n\r\n" + hidden);
  for (const char c : {'\x01', '\x1f', '\x7f', '\r', '\x0b'}) {
    const std::string what = "control byte " + std::to_string(static_cast<int>(c));
    expect_refused(what + " in another value",
                   head() + "X-Note: a" + std::string(1, c) + "b\r\nContent-Length: 0\r\n\r\n" + hidden);
    expect_refused(what + " in CL", head() + "Content-Length: 0" + std::string(1, c) + "\r\n\r\n" + hidden);
  }
}

TEST_F(HttpFramingTest, TabsInHeaderValuesAreStillAccepted) {
  // RFC 9110 §5.5: a field value may hold HTAB (and SP) between its characters.
  const std::string ok = "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Note: a\tb \t c\r\nConnection: close\r\n\r\n";
  const RawExchange got = send_raw(http_port_, ok);
  EXPECT_EQ(statuses_in(got.bytes), std::vector<int>{200}) << got.bytes;
}

// RFC 9112 §3.2.2: a server must accept the absolute form of a request target; it routes as its path does, and the
// authority in it grants nothing (keys are still asked for).
TEST_F(HttpFramingTest, AnAbsoluteFormTargetRoutesLikeItsPath) {
  const std::string authority = "127.0.0.1:" + std::to_string(http_port_);
  for (const std::string& target : {"http://" + authority + "/healthz", "HTTP://" + authority + "/healthz",
                                   std::string("http://other.example/healthz")}) {
    const RawExchange got =
        send_raw(http_port_, "GET " + target + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(statuses_in(got.bytes), std::vector<int>{200}) << target << ":\n" << got.bytes;
  }
  // The same refusal as for "/v1/videos": no key, no listing.
  const RawExchange origin = send_raw(http_port_, "GET /v1/videos HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  const RawExchange absolute =
      send_raw(http_port_, "GET http://" + authority + "/v1/videos HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(origin.bytes), 401) << origin.bytes;
  EXPECT_EQ(status_of(absolute.bytes), 401) << absolute.bytes;
  // With the key, the listing.
  const RawExchange keyed = send_raw(http_port_, "GET http://" + authority + "/v1/videos HTTP/1.1\r\nHost: x\r\n" +
                                                    "Authorization: Bearer " + kKey + "\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(keyed.bytes), 200) << keyed.bytes;
  // An authority with escapes is refused: unescaped, its "%2F" would move where the path starts.
  const RawExchange escaped = send_raw(http_port_, "GET http://x%2Fv1%2Fvideos/healthz HTTP/1.1\r\nHost: x\r\n" +
                                                      std::string("Connection: close\r\n\r\n"));
  EXPECT_EQ(statuses_in(escaped.bytes), std::vector<int>{400}) << escaped.bytes;
}

TEST_F(HttpFramingTest, ChunkSizesAndChunkedBodiesAreBounded) {
  const int before = jobs();
  // A chunk size of 17 hex digits (over 2^64): libmicrohttpd refuses it itself (413) and closes.
  {
    const RawExchange got =
        send_raw(http_port_, head() + "Transfer-Encoding: chunked\r\n\r\n10000000000000000\r\n" + hidden_request());
    EXPECT_EQ(status_of(got.bytes), 413) << got.bytes;
    EXPECT_TRUE(got.closed);
    EXPECT_EQ(statuses_in(got.bytes), std::vector<int>(statuses_in(got.bytes).size(), 413)) << got.bytes;
  }
  // A chunk of 2^63 bytes: read up to the body limit (64 MiB), then the connection is closed; what we sent past that
  // is never read.
  {
    const int fd = connect_loopback(http_port_);
    ASSERT_GE(fd, 0);
    const std::string start = head() + "Transfer-Encoding: chunked\r\n\r\n8000000000000000\r\n";
    ASSERT_EQ(::send(fd, start.data(), start.size(), MSG_NOSIGNAL), static_cast<ssize_t>(start.size()));
    const std::string block(1 << 20, 'x');
    int64_t sent = 0;
    bool refused = false;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (sent < (int64_t{256} << 20) && std::chrono::steady_clock::now() < until) {
      const ssize_t n = ::send(fd, block.data(), block.size(), MSG_NOSIGNAL);
      if (n <= 0) {
        refused = true;  // EPIPE / ECONNRESET: the server closed it
        break;
      }
      sent += n;
    }
    EXPECT_TRUE(refused) << "256 MiB of one chunk were accepted";
    EXPECT_LT(sent, int64_t{128} << 20);
    ::close(fd);
  }
  // Many small chunks over the limit: the same.
  {
    const int fd = connect_loopback(http_port_);
    ASSERT_GE(fd, 0);
    const std::string start = head() + "Transfer-Encoding: chunked\r\n\r\n";
    ASSERT_EQ(::send(fd, start.data(), start.size(), MSG_NOSIGNAL), static_cast<ssize_t>(start.size()));
    std::string block;
    for (int i = 0; i < 256; ++i) block += "1000\r\n" + std::string(4096, 'y') + "\r\n";  // 1 MiB in 4 KiB chunks
    int64_t sent = 0;
    bool refused = false;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (sent < (int64_t{256} << 20) && std::chrono::steady_clock::now() < until) {
      const ssize_t n = ::send(fd, block.data(), block.size(), MSG_NOSIGNAL);
      if (n <= 0) {
        refused = true;
        break;
      }
      sent += n;
    }
    EXPECT_TRUE(refused) << "256 MiB of chunks were accepted";
    ::close(fd);
  }
  EXPECT_EQ(jobs(), before);
  // The server answers as before.
  const RawExchange ok = send_raw(http_port_, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(ok.bytes), 200) << ok.bytes;
}

TEST_F(HttpFramingTest, WellFormedRequestsStillWorkChunkedOrNot) {
  const int before = jobs();
  // Content-Length, kept alive: a second request on the same connection is answered too.
  const std::string plain = "POST /v1/videos HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + kKey +
                            "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(kVideo.size()) +
                            "\r\n\r\n" + kVideo;
  const RawExchange two = send_raw(http_port_, plain + "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(two.bytes), 200) << two.bytes;
  EXPECT_EQ(statuses_in(two.bytes), (std::vector<int>{200, 200})) << two.bytes;
  EXPECT_TRUE(two.closed);
  // A chunked body in three chunks (with an extension and a trailer).
  const std::string a = kVideo.substr(0, 10), b = kVideo.substr(10, 20), c = kVideo.substr(30);
  auto hex = [](size_t n) {
    char text[32];
    std::snprintf(text, sizeof text, "%zx", n);
    return std::string(text);
  };
  const std::string chunked = head() + "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + hex(a.size()) +
                              "\r\n" + a + "\r\n" + hex(b.size()) + ";ext=1\r\n" + b + "\r\n" + hex(c.size()) +
                              "\r\n" + c + "\r\n0\r\nX-Trailer: t\r\n\r\n";
  const RawExchange got = send_raw(http_port_, chunked);
  EXPECT_EQ(status_of(got.bytes), 200) << got.bytes;
  EXPECT_EQ(jobs(), before + 2);
}

}  // namespace
}  // namespace skyreels::test
