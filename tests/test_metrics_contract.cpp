// Every family of the metrics contract (server/metrics/metric_families.*) has a served test that makes it move: a
// test that starts skyreels-server, drives it, scrapes /metrics and checks the family's value. The table below names
// that test per family; this suite fails when a family is added without one, when the named test is gone, or when
// its file no longer checks the family. (Families that exist from the start prove nothing by being there.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "server/metrics/metric_families.h"
#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace fs = std::filesystem;

struct MovedBy {
  const char* file;  // under tests/
  const char* test;  // Suite.Name, as gtest names it (a parameterised suite without its prefix)
};

// Family -> the served test that makes it move.
const std::map<std::string, MovedBy>& moved_by() {
  static const std::map<std::string, MovedBy> table = {
      {"skyreels_jobs_submitted_total", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_jobs_finished_total", {"test_server_load.cpp", "ServerLoad.ManyConcurrentClientsEveryJobAccountedFor"}},
      {"skyreels_jobs_rejected_total", {"test_server.cpp", "SlowServerTest.FullQueueAnswersResourceExhaustedWithARetryHint"}},
      {"skyreels_jobs_running", {"test_server.cpp", "SlowServerTest.FullQueueAnswersResourceExhaustedWithARetryHint"}},
      {"skyreels_queue_depth", {"test_server.cpp", "SlowServerTest.FullQueueAnswersResourceExhaustedWithARetryHint"}},
      {"skyreels_queue_wait_seconds", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_chunk_duration_seconds", {"test_server_load.cpp", "ServerLoad.ManyConcurrentClientsEveryJobAccountedFor"}},
      {"skyreels_step_duration_seconds", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_frames_generated_total", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_replica_busy", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_replica_healthy",
       {"test_server_hardening_exec.cpp",
        "ReplicaHealing.AnOutOfMemoryChunkFailsItsJobResourceExhaustedAndTheReplicaKeepsServing"}},
      {"skyreels_chunk_handoffs_total", {"test_server.cpp", "FaultServerTest.AChunkRetriedOnTheOtherReplicaCountsAHandoff"}},
      {"skyreels_chunk_retries_total", {"test_server.cpp", "FaultServerTest.AChunkRetriedOnTheOtherReplicaCountsAHandoff"}},
      {"skyreels_replicas_ready", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_replica_recoveries_total",
       {"test_server_hardening_exec.cpp", "ReplicaHealing.AReplicaTakenOutIsNotReadyThenPassesItsReTestAndServesAgain"}},
      {"skyreels_video_chunks_encoded_total",
       {"test_server_hardening_exec.cpp", "Mp4OnDemand.OnlyJobsThatAskForMp4AreDecodedAndEndedJobsDropTheirDecode"}},
      {"skyreels_video_jobs_pending",
       {"test_server_hardening_exec.cpp", "Mp4OnDemand.OnlyJobsThatAskForMp4AreDecodedAndEndedJobsDropTheirDecode"}},
      {"skyreels_build_info", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_streams_open", {"test_server_hardening_io.cpp", "HardeningIo.Item2_SixHundredWatchersHoldNoThreadAndUnaryCallsKeepWorking"}},
      {"skyreels_streams_rejected_total",
       {"test_server_hardening_io.cpp",
        "CappedServerTest.Item2_StreamsAreCappedPerClientAndInTotalAndOnlyTheNewStreamIsRefused"}},
      {"skyreels_text_encode_seconds", {"test_server.cpp", "TextServerTest.AResubmittedPromptAndRepeatedPromptChangesAreEncodedOnce"}},
      {"skyreels_text_embedding_cache_hits_total",
       {"test_server.cpp", "TextServerTest.AResubmittedPromptAndRepeatedPromptChangesAreEncodedOnce"}},
      {"skyreels_text_embedding_cache_misses_total",
       {"test_server.cpp", "TextServerTest.AResubmittedPromptAndRepeatedPromptChangesAreEncodedOnce"}},
      {"skyreels_text_embedding_cache_bytes",
       {"test_server.cpp", "TextServerTest.AResubmittedPromptAndRepeatedPromptChangesAreEncodedOnce"}},
      {"skyreels_job_store_seconds", {"test_server_store.cpp", "JobStore.AnMp4MadeBeforeARestartIsReadBackNotDecodedAgain"}},
      {"skyreels_lease_takeovers_total", {"test_server_peers.cpp", "Peers.ThreePodsShareOneQueueAndAPodKilledMidChunkLosesNothing"}},
      {"skyreels_global_queue_depth", {"test_server.cpp", "SlowServerTest.FullQueueAnswersResourceExhaustedWithARetryHint"}},
      {"skyreels_transformer_token_blocks_total",
       {"test_server_store.cpp", "CachedLongVideo.OnTwoReplicasKilledMidRunEqualsTheSingleProcessCachedRun"}},
      {"skyreels_job_duration_seconds", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_time_to_first_chunk_seconds", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_model_load_seconds", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_vae_seconds", {"test_server_store.cpp", "JobStore.AnMp4MadeBeforeARestartIsReadBackNotDecodedAgain"}},
      {"grpc_server_started_total", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"grpc_server_handled_total", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"grpc_server_handling_seconds", {"test_server.cpp", "ServerTest.MetricsExposeEveryContractMetric"}},
      {"skyreels_http_requests_total", {"test_http.cpp", "HttpServerTest.ProbesAndMetricsAnswerWithoutAKey"}},
      {"skyreels_http_request_duration_seconds", {"test_http.cpp", "HttpServerTest.ProbesAndMetricsAnswerWithoutAKey"}},
      {"skyreels_webhook_deliveries_total", {"test_webhooks.cpp", "Webhooks.AServerKilledWhileItsReceiverFailsDeliversEverythingAfterARestart"}},
      {"skyreels_previews_total",
       {"test_server_previews.cpp", "ServedPreviews.EveryChunkShowsPreviewsBeforeItsFramesAndTheVideoIsTheSameWithout"}},
      {"skyreels_preview_bytes_total",
       {"test_server_previews.cpp", "ServedPreviews.EveryChunkShowsPreviewsBeforeItsFramesAndTheVideoIsTheSameWithout"}},
      {"skyreels_adapter_loads_total",
       {"test_server_adapters.cpp", "ServedAdapters.JobsWithDifferentAdaptersAtOnceEachEqualGenerateWithTheirAdapters"}},
      {"skyreels_adapters_resident",
       {"test_server_adapters.cpp", "ServedAdapters.JobsWithDifferentAdaptersAtOnceEachEqualGenerateWithTheirAdapters"}},
      {"skyreels_adapter_jobs_total",
       {"test_server_adapters.cpp", "ServedAdapters.JobsWithDifferentAdaptersAtOnceEachEqualGenerateWithTheirAdapters"}},
      {"skyreels_previews_dropped_total",
       {"test_watch_memory.cpp", "PreviewsDropped.AWatcherThatStopsReadingSkipsToTheLatestPreviewAndTheSkipsAreCounted"}},
      {"skyreels_test_hooks_enabled",
       {"test_server_hardening_exec.cpp", "TestHooks.WithEnableTestHooksTheServerSaysSoInItsLogServerInfoAndMetrics"}},
  };
  return table;
}

// Families no served test makes move yet, each with the reason; the suite lists them so that the gap stays visible.
// None now: a new family without a served test that moves it fails the test below, or is listed here with why.
const std::map<std::string, std::string>& not_yet_moved() {
  static const std::map<std::string, std::string> gaps = {};
  return gaps;
}

std::string read_test_file(const std::string& name) {
  std::ifstream in(fs::canonical(data_path("..")).string() + "/" + name);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The body of TEST*(Suite, Name) in `source`, up to the next TEST; empty when there is none.
std::string test_body(const std::string& source, const std::string& test) {
  const size_t dot = test.find('.');
  const std::regex head("TEST(_F|_P)?\\(" + test.substr(0, dot) + ",\\s*" + test.substr(dot + 1) + "\\)");
  std::smatch m;
  if (!std::regex_search(source, m, head)) return "";
  const size_t begin = static_cast<size_t>(m.position(0));
  const size_t next = source.find("\nTEST", begin + 1);
  return source.substr(begin, next == std::string::npos ? std::string::npos : next - begin);
}

TEST(MetricsContract, EveryFamilyNamesTheServedTestThatMakesItMove) {
  std::set<std::string> families;
  for (const server::MetricFamily& family : server::metric_families()) families.insert(family.name);
  for (const std::string& name : families) {
    EXPECT_TRUE(moved_by().count(name) || not_yet_moved().count(name)) << name << ": no served test named";
  }
  for (const auto& [name, why] : not_yet_moved()) {
    EXPECT_FALSE(moved_by().count(name)) << name << ": named and listed as a gap";
    std::cout << "not moved by a served test yet: " << name << " (" << why << ")\n";
  }
  for (const auto& [name, by] : moved_by()) EXPECT_TRUE(families.count(name)) << name << ": not in the contract";
}

TEST(MetricsContract, EachNamedTestStartsAServerAndChecksItsFamily) {
  for (const auto& [name, by] : moved_by()) {
    const std::string source = read_test_file(by.file);
    ASSERT_FALSE(source.empty()) << by.file;
    const std::string body = test_body(source, by.test);
    ASSERT_FALSE(body.empty()) << name << ": " << by.file << " has no test " << by.test;
    // The family is checked in the test's body, or in a helper of its file the body calls (webhooks).
    const bool in_body = body.find(name) != std::string::npos;
    EXPECT_TRUE(in_body || source.find(name) != std::string::npos) << name << " is not checked in " << by.file;
    EXPECT_TRUE(source.find("ServerProcess") != std::string::npos) << by.file << " starts no skyreels-server";
  }
}

}  // namespace
}  // namespace skyreels::test
