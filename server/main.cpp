// skyreels-server: serves SkyReels-V2 video generation over gRPC (and HTTP), one model replica per device. The
// assembly is server/app/app.cpp (its steps: app_steps.h), the flags server/app/server_flags.cpp.
#include "server/app/app.h"

int main(int argc, char** argv) { return skyreels::server::server_main(argc, argv); }
