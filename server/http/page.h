// The one static page (server/http/page.html, compiled in): a prompt, the main parameters, live progress from the
// job's event stream, the video playing chunk by chunk as it is made (MSE on the MP4 segments), replicas and queue.
#pragma once

namespace skyreels::server::http {

extern const char* const kPageHtml;

}  // namespace skyreels::server::http
