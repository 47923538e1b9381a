// skyreels-server as a function: parses the flags (server_flags.h), assembles the server and serves until a signal
// drains it. Returns the process's exit status (0 after a drain, 2 on a usage error, 1 on a fatal error).
#pragma once

namespace skyreels::server {

int server_main(int argc, char** argv);

}  // namespace skyreels::server
