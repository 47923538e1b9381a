// The HTTP/1.1 listener (--http-listen, and --metrics-listen with other bounds): libmicrohttpd with a thread per
// connection, bounded in number (in all and per client address), in header memory, in body size, in multipart parts,
// in idle time and optionally in total time. Every request is read whole (up to the limit) and handed to one handler
// function; the handler's answer goes back as one response. No routing or API here (server/http/http_api.* and
// metrics_port.* hold that): this file is the socket side only.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace skyreels::server::http {

// One part of a multipart/form-data body.
struct FormPart {
  std::string name;
  std::string filename;  // empty for a plain field
  std::string content_type;
  std::string data;
};

struct Request {
  std::string method;
  std::string path;  // without the query string, percent-decoded
  std::map<std::string, std::string> query;
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;
  std::vector<FormPart> parts;  // multipart/form-data bodies, parsed
  bool multipart = false;
  std::string peer;  // the client's address, without the port

  std::optional<std::string> header(const std::string& lower_case_name) const;
  std::optional<std::string> query_value(const std::string& name) const;
};

// A response body produced while it is sent (Server-Sent Events): next() blocks until it has bytes (it sends its own
// keep-alives) and returns nullopt at the end. It is called when the client has taken what came before, and the
// listener holds the piece it returned until it is sent, so a stream returns small pieces (an event stream's are at
// most 16 KiB, a download's one part). Destroyed on the listener's thread when the response ends or the client goes
// away, so its destructor is where it stops what feeds it.
class BodyStream {
 public:
  virtual ~BodyStream() = default;
  virtual std::optional<std::string> next() = 0;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  std::shared_ptr<BodyStream> stream;  // set: the body is the stream's, `body` is ignored
  int64_t stream_bytes = -1;           // the stream's length when known (Content-Length); -1: unknown (chunked)
};

using Handler = std::function<Response(const Request&)>;
// The answer to a request the listener refuses itself (a body over the limit, a malformed multipart): status, why.
using Refuser = std::function<Response(int status, const std::string& message)>;

struct HttpOptions {
  std::string listen;    // HOST:PORT (port 0: a free one)
  std::string flag = "--http-listen";  // the flag `listen` came from, named in errors
  std::string tls_cert;  // PEM contents (not paths); both or neither
  std::string tls_key;
  int64_t max_body_bytes = 64 << 20;
  unsigned max_connections = 256;
  unsigned max_connections_per_client = 32;
  unsigned idle_timeout_seconds = 30;  // a connection that sends nothing for this long is closed (slowloris)
  size_t header_memory_bytes = 64 << 10;  // request line + headers of one connection (a header bomb gets 431/413)
  size_t max_form_parts = 64;
  // Every connection is closed this long after it was accepted, whatever its client sends or reads (a client sending
  // a byte a second never reaches the idle timeout); 0: never (the HTTP port's downloads and event streams last as
  // long as their job).
  unsigned connection_deadline_seconds = 0;
};

class HttpServer {
 public:
  // Binds and starts serving; throws std::runtime_error when it cannot.
  HttpServer(HttpOptions options, Handler handler, Refuser refuse);
  ~HttpServer();  // stops accepting, waits for the connections' threads
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;
  int port() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// One request header line as received; in_place false when it was folded onto the line before (obs-fold).
struct HeaderLine {
  std::string name;
  std::string value;
  bool in_place = true;
};

// What is wrong with a request's framing, nullopt when nothing (RFC 9112): Transfer-Encoding with Content-Length, a
// Transfer-Encoding other than exactly "chunked" (or any in HTTP/1.0), more than one Content-Length or
// Transfer-Encoding, a Content-Length that is not one decimal number of at most 19 digits, a folded line, a header
// name that is not a token, a control byte other than HTAB in a value. The listener answers 400 with
// Connection: close and reads nothing more of the connection.
std::optional<std::string> framing_problem(const std::vector<HeaderLine>& headers, bool http_1_0);

// "bytes=A-B" / "bytes=A-" / "bytes=-N" against a body of `size` bytes: the [first, last] range, nullopt when the
// header is not one satisfiable single range (multi-range requests are answered whole).
std::optional<std::pair<uint64_t, uint64_t>> byte_range(const std::string& header, uint64_t size);

}  // namespace skyreels::server::http
