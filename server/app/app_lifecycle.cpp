// The process's life after the start: signals (SIGTERM / SIGINT counted, SIGHUP reloads), readiness and liveness until
// the first signal, then the drain (see app.cpp for what a shutdown does).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>

#include "server/api/probes.h"
#include "server/app/app_steps.h"

namespace skyreels::server::assembly {

namespace {

// After the drain ends, how long running chunks get to stop (they check after every transformer block).
constexpr auto kFinalWait = std::chrono::seconds(5);

// A handler, not a blocked mask and sigwait: libraries start threads before main (LibTorch 2.x, OpenMP), and a
// process signal may land on any thread that does not block it. The handler only writes the signal number into a
// pipe (async-signal-safe); a watcher thread reads it and counts it.
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_shutdown_signal(int sig) {
  const int saved_errno = errno;
  const auto byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t written = ::write(g_signal_pipe[1], &byte, 1);
  errno = saved_errno;
}

void reload(Signals& signals) {
  std::function<void()> on_reload;
  {
    std::lock_guard<std::mutex> lock(signals.mu);
    on_reload = signals.on_reload;
  }
  if (!on_reload) return;
  try {
    on_reload();
    spdlog::info("event=reloaded signal=SIGHUP");
  } catch (const std::exception& e) {
    spdlog::error("event=reload_failed error=\"{}\" (the previous keys stay in use)", e.what());
  }
}

}  // namespace

void watch_signals(Signals& signals) {
  if (::pipe2(g_signal_pipe, O_CLOEXEC) != 0) throw std::runtime_error("cannot create the signal pipe");
  struct sigaction action {};
  action.sa_handler = on_shutdown_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGHUP, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  std::thread([&signals] {
    while (true) {
      unsigned char byte = 0;
      const ssize_t n = ::read(g_signal_pipe[0], &byte, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n != 1) return;
      if (byte == SIGHUP) {
        reload(signals);
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(signals.mu);
        ++signals.count;
        signals.last = byte;
      }
      signals.cv.notify_all();
      spdlog::info("event=signal signal={}", static_cast<int>(byte));
    }
  }).detach();
}

namespace {

void wait_for(Signals& signals, int count, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(signals.mu);
  signals.cv.wait_for(lock, timeout, [&] { return signals.count >= count; });
}

int signal_count(Signals& signals) {
  std::lock_guard<std::mutex> lock(signals.mu);
  return signals.count;
}

}  // namespace

// Until a signal: readiness follows the queue and whether unary calls are answered, liveness the replicas.
void serve_until_signal(const Options& o, Signals& signals, JobQueue& jobs, grpc::Server& server, TempDir& demo_dir,
                        Health& state) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  UnaryProbe unary(server);
  bool ready = false, live = true;
  while (signal_count(signals) == 0) {
    if (!demo_dir.path.empty() && jobs.all_loaded()) {
      // Every replica has its (mapped or copied) weights: the files can go now, even if the process is killed later.
      std::error_code ec;
      std::filesystem::remove_all(demo_dir.path, ec);
      demo_dir.path.clear();
    }
    const bool now_ready = jobs.ready() && unary.answered();
    if (now_ready != ready) {
      health->SetServingStatus("", now_ready);
      state.ready = now_ready;
      spdlog::info("event=readiness serving={}", now_ready);
      ready = now_ready;
    }
    if (const bool now_live = jobs.live(); now_live != live) {
      health->SetServingStatus("liveness", now_live);
      state.live = now_live;
      if (now_live) {
        spdlog::info("event=liveness serving=true");
      } else {
        spdlog::error(
            "event=liveness serving=false reason=\"no healthy replica for {} s\" (the pod should be restarted)",
            std::chrono::duration_cast<std::chrono::seconds>(o.scheduling.liveness_grace).count());
      }
      live = now_live;
    }
    wait_for(signals, 1, std::chrono::milliseconds(100));
  }
}

// Readiness off, no new jobs; admitted ones finish within the drain timeout, else they stop (kept in the store).
void drain(const Options& o, Signals& signals, JobQueue& jobs, grpc::Server& server, VideoEncoder* video,
           Health& state) {
  state.ready = false;
  spdlog::info("event=draining signal={} queued={} running={} timeout_seconds={}", signals.last, jobs.queued_jobs(),
               jobs.running_jobs(), o.drain_timeout_seconds);
  server.GetHealthCheckService()->SetServingStatus("", false);
  jobs.begin_drain();
  const auto drain_deadline = Clock::now() + std::chrono::seconds(o.drain_timeout_seconds);
  bool idle = false;
  while (!(idle = jobs.wait_idle(std::min(drain_deadline, Clock::now() + std::chrono::milliseconds(100))))) {
    if (Clock::now() >= drain_deadline || signal_count(signals) >= 2) break;
  }
  if (!idle) {
    const std::string reason = signal_count(signals) >= 2 ? "server stopped (second signal)" : "drain timeout";
    spdlog::warn("event=drain_abort reason=\"{}\" queued={} running={}", reason, jobs.queued_jobs(),
                 jobs.running_jobs());
    jobs.abort_all(reason);
    // Running chunks stop after their current transformer block; a block that does not end in time is abandoned.
    if (!jobs.wait_idle(Clock::now() + kFinalWait)) {
      spdlog::error("event=exit forced=true reason=\"{} chunk(s) still running {} s after the drain ended\"",
                    jobs.running_jobs(), std::chrono::duration_cast<std::chrono::seconds>(kFinalWait).count());
      spdlog::default_logger()->flush();
      std::_Exit(0);  // the workers are inside a forward: destructors would wait for them
    }
  } else if (signal_count(signals) < 2) {
    // MP4s trail the latents by one VAE decode; then let clients that follow a job fetch its result.
    if (video) video->wait_idle(drain_deadline);
    wait_for(signals, 2, std::chrono::milliseconds(1500));
  }
}

}  // namespace skyreels::server::assembly
