#include "server/http/http_server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace skyreels::server::http {

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// What one connection's current request has gathered between libmicrohttpd's calls.
struct Exchange {
  std::string body;
  bool headers_checked = false;  // the first call (headers only) has been answered
  bool answered = false;         // a refusal was queued before the body was read (too large)
  // Bytes of "scheme://authority" that start an absolute-form target (RFC 9112 §3.2.2), dropped before routing;
  // kMalformedTarget for an absolute form that is refused.
  long target_prefix = 0;
};

constexpr long kMalformedTarget = -1;

// "http://" or "https://" (any case) then an authority without '%': the length of both; 0 for any other target. The
// authority is refused with escapes because libmicrohttpd unescapes the target before the handler sees it, and a
// "%2F" in it would move where the path starts.
long absolute_form_prefix(const char* target) {
  if (target == nullptr) return 0;
  const std::string t = target;
  const size_t colon = t.find("://");
  if (colon == std::string::npos || t.find('/') < colon) return 0;
  const std::string scheme = lower(t.substr(0, colon));
  if (scheme != "http" && scheme != "https") return 0;
  const size_t authority = colon + 3;
  const size_t end = std::min(t.find_first_of("/?#", authority), t.size());
  if (end == authority || t.find('%', authority) < end) return kMalformedTarget;
  return static_cast<long>(end);
}

struct StreamState {
  std::shared_ptr<BodyStream> stream;
  std::string pending;
  size_t offset;
};

ssize_t read_stream(void* cls, uint64_t, char* buffer, size_t max) {
  auto* state = static_cast<StreamState*>(cls);
  while (state->offset >= state->pending.size()) {
    std::optional<std::string> more;
    try {
      more = state->stream->next();
    } catch (const std::exception& e) {
      spdlog::warn("event=http_stream_failed error=\"{}\"", e.what());
      return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    if (!more) return MHD_CONTENT_READER_END_OF_STREAM;
    state->pending = std::move(*more);
    state->offset = 0;
  }
  const size_t n = std::min(max, state->pending.size() - state->offset);
  std::memcpy(buffer, state->pending.data() + state->offset, n);
  state->offset += n;
  return static_cast<ssize_t>(n);
}

void free_stream(void* cls) { delete static_cast<StreamState*>(cls); }

struct FormState {
  std::vector<FormPart>* parts;
  size_t max_parts;
  int64_t max_bytes;
  int64_t bytes = 0;
  bool too_many = false;
};

// One header line as libmicrohttpd parsed it, and whether its value sits right after its name in the read buffer.
struct RawHeader {
  std::string name;
  std::string value;
  bool in_place = true;  // false: libmicrohttpd moved the name (it does that, and only that, to a folded line)
  const char* name_at = nullptr;    // where the name starts in the read buffer
  const char* value_end = nullptr;  // where the value, as libmicrohttpd measured it, ends there
};

MHD_Result collect_raw(void* cls, MHD_ValueKind, const char* key, size_t key_size, const char* value,
                       size_t value_size) {
  auto* out = static_cast<std::vector<RawHeader>*>(cls);
  RawHeader h{std::string(key ? key : "", key ? key_size : 0), std::string(value ? value : "", value ? value_size : 0)};
  // libmicrohttpd 0.9.75 parses "Name: value" in place: the colon becomes NUL, blanks follow, then the value. A folded
  // line (obs-fold: a line starting with SP/HT) is appended to the *name* of the line before, which moves the name to
  // a new block of the connection's pool, away from its value (it is then no longer followed by NUL and blanks up to
  // the value). That displacement is the only trace of the fold that the library leaves.
  if (key != nullptr && value != nullptr) {
    h.name_at = key;
    h.value_end = value + value_size;
    const char* end = key + key_size;
    constexpr ptrdiff_t kMaxBlanks = 1 << 16;
    const ptrdiff_t gap = value - end;
    h.in_place = gap >= 1 && gap <= kMaxBlanks && *end == '\0' &&
                 std::all_of(end + 1, value, [](char c) { return c == ' ' || c == '\t'; });
  }
  out->push_back(std::move(h));
  return MHD_YES;
}

// Whether the request's header section, [begin, end) in the read buffer, holds bytes no header shows. libmicrohttpd
// 0.9.75 parses it in place and measures each value with strlen: a NUL in a line ends the value there, and a line that
// starts with one ends the section, so what follows the NUL is read by neither the framing checks nor the handler
// while a proxy in front reads it (`Content-Length: 0<NUL>N`). In place, a clean section is the request line, then
// per header its name, a NUL (the colon), blanks and the value, each line end (CRLF or LF) turned into one or two
// NULs: between one line's last shown byte and the next name only 1 or 2 NULs may lie, and 2 to 4 before `end` (the
// last line's end and the empty line's). A value ending in one NUL on a bare-LF line hides no byte and passes.
bool hides_bytes(const char* begin, const char* end, const char* version, const std::vector<RawHeader>& headers) {
  auto only_nuls = [](const char* from, const char* to, ptrdiff_t least, ptrdiff_t most) {
    return to - from >= least && to - from <= most && std::all_of(from, to, [](char c) { return c == '\0'; });
  };
  const char* at = version + std::strlen(version);
  if (version < begin || at > end) return true;
  for (const RawHeader& h : headers) {
    if (h.name_at == nullptr || h.name_at < at || h.value_end > end || !only_nuls(at, h.name_at, 1, 2)) return true;
    at = h.value_end;
  }
  return !only_nuls(at, end, 2, 4);
}

MHD_Result collect_value(void* cls, MHD_ValueKind, const char* key, const char* value) {
  auto* out = static_cast<std::map<std::string, std::string>*>(cls);
  if (key) (*out)[lower(key)] = value ? value : "";
  return MHD_YES;
}

MHD_Result collect_argument(void* cls, MHD_ValueKind, const char* key, const char* value) {
  auto* out = static_cast<std::map<std::string, std::string>*>(cls);
  if (key) (*out)[key] = value ? value : "";
  return MHD_YES;
}

MHD_Result collect_part(void* cls, MHD_ValueKind, const char* key, const char* filename, const char* content_type,
                        const char*, const char* data, uint64_t offset, size_t size) {
  auto* form = static_cast<FormState*>(cls);
  if (offset == 0 || form->parts->empty() || form->parts->back().name != (key ? key : "")) {
    if (form->parts->size() >= form->max_parts) {
      form->too_many = true;
      return MHD_NO;
    }
    form->parts->push_back({key ? key : "", filename ? filename : "", content_type ? content_type : "", ""});
  }
  form->bytes += static_cast<int64_t>(size);
  if (form->bytes > form->max_bytes) return MHD_NO;
  form->parts->back().data.append(data, size);
  return MHD_YES;
}

std::string peer_of(MHD_Connection* connection) {
  const MHD_ConnectionInfo* info = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  if (info == nullptr || info->client_addr == nullptr) return "unknown";
  char host[INET6_ADDRSTRLEN] = {0};
  const sockaddr* a = info->client_addr;
  if (a->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a)->sin_addr, host, sizeof host);
  } else if (a->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr, host, sizeof host);
  } else {
    return "unknown";
  }
  return host;
}

// HOST:PORT ("[::1]:8080", "0.0.0.0:8080", "localhost:0") of `flag` into a socket address.
sockaddr_storage resolve(const std::string& listen, const std::string& flag, bool* ipv6) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) throw std::runtime_error(flag + ": expected HOST:PORT, got '" + listen + "'");
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  char* end = nullptr;
  const long number = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || number < 0 || number > 65535) {
    throw std::runtime_error(flag + ": bad port in '" + listen + "'");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0 || found == nullptr) {
    throw std::runtime_error(flag + ": cannot resolve '" + host + "'");
  }
  sockaddr_storage address{};
  std::memcpy(&address, found->ai_addr, found->ai_addrlen);
  *ipv6 = found->ai_family == AF_INET6;
  freeaddrinfo(found);
  return address;
}

// Closes every connection `deadline` after it was accepted, whatever its client sends or reads. libmicrohttpd's own
// timeout is an idle one; here shutdown() of the socket makes the connection's thread see the end of it at once (a
// read of nothing, a failed write), and libmicrohttpd closes it then. Only libmicrohttpd ever closes the socket: it
// reports the connection closed (closed()) before it does, so a number reused by a later socket is never shut here.
class ConnectionDeadlines {
 public:
  explicit ConnectionDeadlines(std::chrono::seconds deadline) : deadline_(deadline), thread_([this] { run(); }) {}
  ~ConnectionDeadlines() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  ConnectionDeadlines(const ConnectionDeadlines&) = delete;
  ConnectionDeadlines& operator=(const ConnectionDeadlines&) = delete;

  void opened(const void* connection, int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    open_[connection] = {fd, Clock::now() + deadline_};  // never sooner than the one run() waits for: no wake-up
  }

  void closed(const void* connection) {
    std::lock_guard<std::mutex> lock(mu_);
    open_.erase(connection);
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Open {
    int fd;
    Clock::time_point deadline;
  };

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      const auto now = Clock::now();
      auto next = now + deadline_;
      for (auto it = open_.begin(); it != open_.end();) {
        if (it->second.deadline > now) {
          next = std::min(next, it->second.deadline);
          ++it;
          continue;
        }
        ::shutdown(it->second.fd, SHUT_RDWR);
        it = open_.erase(it);
      }
      wake_.wait_until(lock, next);
    }
  }

  const std::chrono::seconds deadline_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::map<const void*, Open> open_;
  bool stopping_ = false;
  std::thread thread_;  // last: it starts once the rest is made
};

// libmicrohttpd's URI log callback: the target as sent, before it is unescaped, when a request line has been read. The
// request's Exchange starts here (libmicrohttpd hands it to on_request as its context and to on_completed).
void* on_target(void*, const char* uri, MHD_Connection*) {
  auto* exchange = new Exchange;
  exchange->target_prefix = absolute_form_prefix(uri);
  return exchange;
}

void on_connection(void* cls, MHD_Connection* connection, void**, MHD_ConnectionNotificationCode code) {
  auto* deadlines = static_cast<ConnectionDeadlines*>(cls);
  if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
    deadlines->closed(connection);
    return;
  }
  const MHD_ConnectionInfo* info = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  if (info != nullptr) deadlines->opened(connection, info->connect_fd);
}

}  // namespace

std::optional<std::string> framing_problem(const std::vector<HeaderLine>& headers, bool http_1_0) {
  auto is_tchar = [](unsigned char c) {
    return std::isalnum(c) || (c != 0 && std::strchr("!#$%&'*+-.^_`|~", c) != nullptr);
  };
  size_t lengths = 0, encodings = 0;
  std::string length, encoding;
  for (const HeaderLine& h : headers) {
    if (!h.in_place) {
      return "obsolete line folding (a header line starting with a space or tab) is not accepted";
    }
    if (h.name.empty() || !std::all_of(h.name.begin(), h.name.end(), [&](char c) { return is_tchar(c); })) {
      return "malformed header name '" + h.name + "' (no spaces before the colon, no folded lines)";
    }
    // RFC 9110 §5.5: no control byte but HTAB in a value (a bare CR, which libmicrohttpd keeps, included).
    const auto control = std::find_if(h.value.begin(), h.value.end(), [](unsigned char c) {
      return (c < 0x20 && c != '\t') || c == 0x7f;
    });
    if (control != h.value.end()) {
      char code[8];
      std::snprintf(code, sizeof code, "0x%02x", static_cast<unsigned char>(*control));
      return std::string("a control byte (") + code + ") in the value of header '" + h.name + "'";
    }
    const std::string name = lower(h.name);
    if (name == "content-length") {
      ++lengths;
      length = h.value;
    } else if (name == "transfer-encoding") {
      ++encodings;
      encoding = h.value;
    }
  }
  if (encodings > 0 && lengths > 0) return "a request may not have both Transfer-Encoding and Content-Length";
  if (encodings > 1) return "more than one Transfer-Encoding header";
  if (encodings == 1) {
    if (http_1_0) return "Transfer-Encoding in an HTTP/1.0 request";
    if (lower(encoding) != "chunked") return "Transfer-Encoding: only 'chunked' is accepted, not '" + encoding + "'";
  }
  if (lengths > 1) return "more than one Content-Length header";
  if (lengths == 1) {
    // 1*DIGIT, at most 19 digits: fits in int64 (a list such as "5, 5", a sign or blanks are refused).
    if (length.empty() || length.size() > 19 ||
        !std::all_of(length.begin(), length.end(), [](unsigned char c) { return std::isdigit(c); })) {
      return "malformed Content-Length '" + length + "' (expected one decimal number)";
    }
  }
  return std::nullopt;
}

std::optional<std::string> Request::header(const std::string& lower_case_name) const {
  auto it = headers.find(lower_case_name);
  if (it == headers.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Request::query_value(const std::string& name) const {
  auto it = query.find(name);
  if (it == query.end()) return std::nullopt;
  return it->second;
}

struct HttpServer::Impl {
  HttpOptions options;
  Handler handler;
  std::unique_ptr<ConnectionDeadlines> deadlines;  // with connection_deadline_seconds; outlives the daemon
  MHD_Daemon* daemon = nullptr;
  int port = 0;

  // hides_bytes() over this request's header section: from `method`, where libmicrohttpd's read buffer holds the
  // request line, for the section's size (the request line and the empty line included).
  static bool section_hides_bytes(MHD_Connection* connection, const char* method, const char* version,
                                  const std::vector<RawHeader>& raw) {
    const MHD_ConnectionInfo* info = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    if (info == nullptr || method == nullptr || version == nullptr) return true;
    return hides_bytes(method, method + info->header_size, version, raw);
  }

  // The path of an absolute-form target (its first `prefix` bytes, scheme and authority, are as sent: no escapes).
  static std::string origin_form(const char* url, long prefix) {
    const std::string target = url;
    if (target.size() < static_cast<size_t>(prefix)) return "/";
    const std::string path = target.substr(static_cast<size_t>(prefix));
    return path.empty() ? "/" : path;
  }

  static MHD_Result send(MHD_Connection* connection, const Response& r) {
    MHD_Response* response =
        r.stream ? MHD_create_response_from_callback(r.stream_bytes >= 0 ? static_cast<uint64_t>(r.stream_bytes)
                                                                         : MHD_SIZE_UNKNOWN,
                                                     16 << 10, &read_stream,
                                                     new StreamState{r.stream, {}, 0}, &free_stream)
                 : MHD_create_response_from_buffer(r.body.size(), const_cast<char*>(r.body.data()),
                                                   MHD_RESPMEM_MUST_COPY);
    if (response == nullptr) return MHD_NO;
    if (!r.content_type.empty()) MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, r.content_type.c_str());
    for (const auto& [name, value] : r.headers) MHD_add_response_header(response, name.c_str(), value.c_str());
    const MHD_Result queued = MHD_queue_response(connection, static_cast<unsigned>(r.status), response);
    MHD_destroy_response(response);
    return queued;
  }

  // An answer after which the connection is closed (what is left of the request is never read).
  static MHD_Result send_closing(MHD_Connection* connection, Response r) {
    r.headers.emplace_back("Connection", "close");
    return send(connection, r);
  }

  Refuser refuse;

  Response refusal(int status, const std::string& message) const { return refuse(status, message); }

  MHD_Result answer(MHD_Connection* connection, const char* url, const char* method, const char* version,
                    const char* upload, size_t* upload_size, void** context) {
    auto* exchange = static_cast<Exchange*>(*context);
    if (exchange == nullptr) {  // made by on_target, always called first; in case a libmicrohttpd does not
      exchange = new Exchange;
      *context = exchange;
    }
    if (!exchange->headers_checked) {  // headers only so far
      exchange->headers_checked = true;
      // The body's framing is checked before a byte of it is read (RFC 9112 §6.1, §6.3, §5.2): an answer queued now
      // makes libmicrohttpd read no body and no further request on this connection, and close it once sent.
      std::vector<RawHeader> raw;
      MHD_get_connection_values_n(connection, MHD_HEADER_KIND, collect_raw, &raw);
      std::vector<HeaderLine> lines;
      lines.reserve(raw.size());
      for (RawHeader& h : raw) lines.push_back({std::move(h.name), std::move(h.value), h.in_place});
      const bool http_1_0 = version != nullptr && std::strcmp(version, MHD_HTTP_VERSION_1_0) == 0;
      std::optional<std::string> problem = framing_problem(lines, http_1_0);
      if (!problem && section_hides_bytes(connection, method, version, raw)) {
        problem = "a NUL in the header section (the bytes after it would be read by no check here)";
      }
      if (!problem && exchange->target_prefix == kMalformedTarget) {
        problem = "malformed absolute-form request target (no authority, or one with escapes)";
      }
      if (problem) {
        exchange->answered = true;
        spdlog::warn("event=http_framing_refused peer={} method={} path={} reason=\"{}\"", peer_of(connection), method,
                     url, *problem);
        return send_closing(connection, refusal(400, *problem));
      }
      const char* length = MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
      if (length != nullptr && std::strtoull(length, nullptr, 10) > static_cast<uint64_t>(options.max_body_bytes)) {
        exchange->answered = true;
        return send_closing(connection, refusal(413, "the request body is over " +
                                                         std::to_string(options.max_body_bytes) + " bytes"));
      }
      return MHD_YES;
    }
    if (*upload_size != 0) {
      if (exchange->answered) {  // not reached: an early answer makes libmicrohttpd discard the body
        return MHD_NO;
      }
      if (exchange->body.size() + *upload_size > static_cast<size_t>(options.max_body_bytes)) {
        // A chunked body grown over the limit: libmicrohttpd 0.9.75 cannot queue an answer in the middle of a body
        // (only before it or after all of it), so the connection is closed here, without reading any more of it.
        exchange->answered = true;
        spdlog::warn("event=http_body_over_limit peer={} method={} path={} limit={}", peer_of(connection), method, url,
                     options.max_body_bytes);
        return MHD_NO;
      }
      exchange->body.append(upload, *upload_size);
      *upload_size = 0;
      return MHD_YES;
    }
    if (exchange->answered) return MHD_YES;
    Request request;
    request.method = method;
    request.path = exchange->target_prefix > 0 ? origin_form(url, exchange->target_prefix) : url;
    request.peer = peer_of(connection);
    MHD_get_connection_values(connection, MHD_HEADER_KIND, collect_value, &request.headers);
    MHD_get_connection_values(connection, MHD_GET_ARGUMENT_KIND, collect_argument, &request.query);
    request.body = std::move(exchange->body);
    const std::string type = lower(request.header("content-type").value_or(""));
    if (type.rfind("multipart/form-data", 0) == 0) {
      if (std::optional<Response> refused = parse_form(connection, request)) return send(connection, *refused);
    }
    Response response;
    try {
      response = handler(request);
    } catch (const std::exception& e) {
      spdlog::error("event=http_handler_failed method={} path={} error=\"{}\"", request.method, request.path, e.what());
      response = refusal(500, "internal error");
    }
    return send(connection, response);
  }

  // The body's parts into request.parts; a refusal when it has too many or is not multipart at all.
  std::optional<Response> parse_form(MHD_Connection* connection, Request& request) const {
    request.multipart = true;
    FormState form{&request.parts, options.max_form_parts, options.max_body_bytes};
    MHD_PostProcessor* processor = MHD_create_post_processor(connection, 64 << 10, collect_part, &form);
    if (processor == nullptr) return refusal(400, "malformed multipart/form-data (no boundary)");
    const MHD_Result ok = MHD_post_process(processor, request.body.data(), request.body.size());
    const MHD_Result finished = MHD_destroy_post_processor(processor);
    if (form.too_many) {
      return refusal(400, "multipart/form-data with more than " + std::to_string(options.max_form_parts) + " parts");
    }
    if (ok != MHD_YES || finished != MHD_YES) return refusal(400, "malformed multipart/form-data body");
    request.body.clear();
    return std::nullopt;
  }
};

namespace {

MHD_Result on_request(void* cls, MHD_Connection* connection, const char* url, const char* method,
                      const char* version, const char* upload, size_t* upload_size, void** context) {
  return static_cast<HttpServer::Impl*>(cls)->answer(connection, url, method, version, upload, upload_size, context);
}

void on_completed(void*, MHD_Connection*, void** context, MHD_RequestTerminationCode) {
  delete static_cast<Exchange*>(*context);
  *context = nullptr;
}

void on_log(void*, const char* format, va_list arguments) {
  char line[512];
  std::vsnprintf(line, sizeof line, format, arguments);
  std::string text(line);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  spdlog::debug("event=http_library message=\"{}\"", text);
}

}  // namespace

HttpServer::HttpServer(HttpOptions options, Handler handler, Refuser refuse) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->handler = std::move(handler);
  impl_->refuse = std::move(refuse);
  const HttpOptions& o = impl_->options;
  bool ipv6 = false;
  sockaddr_storage address = resolve(o.listen, o.flag, &ipv6);
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_ERROR_LOG;
  if (ipv6) flags |= MHD_USE_IPv6;
  const bool tls = !o.tls_cert.empty();
  if (tls) {
    if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
      throw std::runtime_error(o.flag + ": this libmicrohttpd has no TLS");
    }
    flags |= MHD_USE_TLS;
  }
  std::vector<MHD_OptionItem> items = {
      {MHD_OPTION_SOCK_ADDR, 0, &address},
      {MHD_OPTION_CONNECTION_LIMIT, o.max_connections, nullptr},
      {MHD_OPTION_PER_IP_CONNECTION_LIMIT, o.max_connections_per_client, nullptr},
      {MHD_OPTION_CONNECTION_TIMEOUT, o.idle_timeout_seconds, nullptr},
      {MHD_OPTION_CONNECTION_MEMORY_LIMIT, static_cast<intptr_t>(o.header_memory_bytes), nullptr},
      {MHD_OPTION_LISTENING_ADDRESS_REUSE, 1, nullptr},
      {MHD_OPTION_NOTIFY_COMPLETED, reinterpret_cast<intptr_t>(&on_completed), nullptr},
      {MHD_OPTION_URI_LOG_CALLBACK, reinterpret_cast<intptr_t>(&on_target), nullptr},
      {MHD_OPTION_EXTERNAL_LOGGER, reinterpret_cast<intptr_t>(&on_log), nullptr},
  };
  if (o.connection_deadline_seconds > 0) {
    impl_->deadlines = std::make_unique<ConnectionDeadlines>(std::chrono::seconds(o.connection_deadline_seconds));
    items.push_back({MHD_OPTION_NOTIFY_CONNECTION, reinterpret_cast<intptr_t>(&on_connection), impl_->deadlines.get()});
  }
  if (tls) {
    items.push_back({MHD_OPTION_HTTPS_MEM_CERT, 0, const_cast<char*>(o.tls_cert.c_str())});
    items.push_back({MHD_OPTION_HTTPS_MEM_KEY, 0, const_cast<char*>(o.tls_key.c_str())});
  }
  items.push_back({MHD_OPTION_END, 0, nullptr});
  impl_->daemon = MHD_start_daemon(flags, 0, nullptr, nullptr, &on_request, impl_.get(), MHD_OPTION_ARRAY,
                                   items.data(), MHD_OPTION_END);
  if (impl_->daemon == nullptr) throw std::runtime_error(o.flag + ": cannot listen on " + o.listen);
  const MHD_DaemonInfo* info = MHD_get_daemon_info(impl_->daemon, MHD_DAEMON_INFO_BIND_PORT);
  impl_->port = info != nullptr ? info->port : 0;
}

HttpServer::~HttpServer() {
  if (impl_->daemon != nullptr) MHD_stop_daemon(impl_->daemon);
}

int HttpServer::port() const { return impl_->port; }

std::optional<std::pair<uint64_t, uint64_t>> byte_range(const std::string& header, uint64_t size) {
  const std::string prefix = "bytes=";
  if (header.rfind(prefix, 0) != 0 || size == 0) return std::nullopt;
  const std::string spec = header.substr(prefix.size());
  if (spec.find(',') != std::string::npos) return std::nullopt;
  const size_t dash = spec.find('-');
  if (dash == std::string::npos) return std::nullopt;
  const std::string a = spec.substr(0, dash), b = spec.substr(dash + 1);
  auto number = [](const std::string& s, uint64_t* out) {
    if (s.empty() || s.size() > 19 || !std::all_of(s.begin(), s.end(), ::isdigit)) return false;
    *out = std::stoull(s);
    return true;
  };
  uint64_t first = 0, last = size - 1;
  if (a.empty()) {  // the last N bytes
    uint64_t n = 0;
    if (!number(b, &n) || n == 0) return std::nullopt;
    first = n >= size ? 0 : size - n;
  } else {
    if (!number(a, &first) || first >= size) return std::nullopt;
    if (!b.empty()) {
      if (!number(b, &last) || last < first) return std::nullopt;
      last = std::min(last, size - 1);
    }
  }
  return std::make_pair(first, last);
}

}  // namespace skyreels::server::http
