// The layer order of server/README.md, checked on the source: every `#include "server/..."` in server/ points to the
// same folder or to a folder below it, model/ includes nothing of server/, cli/ or gRPC, and only the transports and
// the assembly include gRPC or libmicrohttpd. A new include against the order fails here, naming the file and line.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace skyreels::test {
namespace {

namespace fs = std::filesystem;

// server/README.md's ranks, top first. A folder may include its own files and those of any lower rank; folders of one
// rank include nothing of each other.
const std::vector<std::vector<std::string>> kServerRanks = {
    {"server/main.cpp"},                  // process
    {"server/app"},                       // assembly
    {"server/metrics"},                   // observability
    {"server/http", "server/api"},        // doors
    {"server/media", "server/webhook"},   // followers
    {"server/queue"},                     // scheduling
    {"server/store", "server/replica"},   // state and device
    {"server/policy", "server/job"},      // leaves
};

struct Include {
  std::string file;  // relative to the source root
  int line = 0;
  std::string target;  // as written between the quotes or brackets
};

std::string source_root() { return fs::canonical(data_path("../..")).string(); }

std::vector<Include> includes_under(const std::string& folder) {
  std::vector<Include> found;
  const std::string root = source_root();
  const std::regex include(R"(^\s*#\s*include\s*[<"]([^>"]+)[>"])");
  for (const auto& entry : fs::recursive_directory_iterator(root + "/" + folder)) {
    const std::string ext = entry.path().extension().string();
    if (!entry.is_regular_file() || (ext != ".h" && ext != ".cpp" && ext != ".inc" && ext != ".in")) continue;
    std::ifstream in(entry.path());
    int number = 0;
    for (std::string line; std::getline(in, line);) {
      ++number;
      std::smatch m;
      if (std::regex_search(line, m, include)) {
        found.push_back({fs::relative(entry.path(), root).string(), number, m[1].str()});
      }
    }
  }
  return found;
}

// The layer a server/ path belongs to: its folder, or server/main.cpp at the top level.
std::string layer_of(const std::string& path) {
  if (path == "server/main.cpp") return path;
  const auto second = path.find('/', std::string("server/").size());
  return second == std::string::npos ? path : path.substr(0, second);
}

int rank_of(const std::string& layer) {
  for (size_t i = 0; i < kServerRanks.size(); ++i) {
    if (std::find(kServerRanks[i].begin(), kServerRanks[i].end(), layer) != kServerRanks[i].end()) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

std::string where(const Include& inc) { return inc.file + ":" + std::to_string(inc.line) + " includes " + inc.target; }

bool is_grpc(const std::string& target) {
  return target.rfind("grpc", 0) == 0 || target.find(".grpc.pb.h") != std::string::npos;
}

TEST(Layers, EveryServerFolderIsInTheStatedOrder) {
  for (const auto& entry : fs::directory_iterator(source_root() + "/server")) {
    if (!entry.is_directory()) continue;
    const std::string folder = "server/" + entry.path().filename().string();
    EXPECT_GE(rank_of(folder), 0) << folder << " is not in server/README.md's layer order (nor in this test's copy)";
  }
}

TEST(Layers, ServerIncludesPointDownTheOrder) {
  std::vector<std::string> against;
  for (const Include& inc : includes_under("server")) {
    if (inc.target.rfind("server/", 0) != 0) continue;
    const std::string from = layer_of(inc.file), to = layer_of(inc.target);
    if (from == to) continue;
    const int from_rank = rank_of(from), to_rank = rank_of(to);
    ASSERT_GE(from_rank, 0) << inc.file << ": an unknown layer " << from;
    ASSERT_GE(to_rank, 0) << where(inc) << ": an unknown layer " << to;
    if (to_rank <= from_rank) against.push_back(where(inc));
  }
  EXPECT_TRUE(against.empty()) << against.size() << " include(s) against the layer order of server/README.md:\n"
                               << ::testing::PrintToString(against);
}

// server/CMakeLists.txt's libraries: skyreels_server_<folder> for each folder, its sources from that folder only,
// linking only the libraries of lower ranks (so the build graph is the picture above, and a link against the order
// fails here as an include would).
struct CmakeCall {
  std::string command;            // add_library, target_link_libraries
  std::vector<std::string> args;  // whitespace-separated words, comments dropped
};

std::vector<CmakeCall> cmake_calls(const std::string& path) {
  std::ifstream in(path);
  std::string text, line;
  while (std::getline(in, line)) text += line.substr(0, line.find('#')) + "\n";
  std::vector<CmakeCall> calls;
  const std::regex call(R"(([a-z_]+)\(([^)]*)\))");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), call); it != std::sregex_iterator(); ++it) {
    CmakeCall c{(*it)[1].str(), {}};
    std::istringstream words((*it)[2].str());
    for (std::string w; words >> w;) c.args.push_back(w);
    calls.push_back(c);
  }
  return calls;
}

std::string folder_library(const std::string& folder) { return "skyreels_server_" + folder.substr(7); }

TEST(Layers, EachServerFolderIsOneLibraryBuiltFromItsOwnFilesLinkingOnlyLowerRanks) {
  const auto calls = cmake_calls(source_root() + "/server/CMakeLists.txt");
  std::map<std::string, std::string> folder_of;  // library -> folder
  for (const auto& rank : kServerRanks) {
    for (const auto& folder : rank) {
      if (folder != "server/main.cpp") folder_of[folder_library(folder)] = folder;
    }
  }
  std::map<std::string, int> defined;
  for (const auto& c : calls) {
    if (c.command != "add_library" || c.args.empty() || folder_of.count(c.args[0]) == 0) continue;
    const std::string folder = folder_of[c.args[0]].substr(7) + "/";
    ++defined[c.args[0]];
    for (size_t i = 2; i < c.args.size(); ++i) {
      const std::string& source = c.args[i];
      if (source.find(".cpp") == std::string::npos || source.rfind("${CMAKE_CURRENT_BINARY_DIR}/", 0) == 0) continue;
      EXPECT_EQ(source.rfind(folder, 0), 0u) << c.args[0] << " compiles " << source << ", which is not in " << folder;
    }
  }
  for (const auto& [library, folder] : folder_of) EXPECT_EQ(defined[library], 1) << folder << " has no library " << library;
  int links_checked = 0;
  for (const auto& c : calls) {
    if (c.command != "target_link_libraries" || c.args.empty() || folder_of.count(c.args[0]) == 0) continue;
    const int from = rank_of(folder_of[c.args[0]]);
    for (size_t i = 1; i < c.args.size(); ++i) {
      if (folder_of.count(c.args[i]) == 0) continue;
      ++links_checked;
      EXPECT_GT(rank_of(folder_of[c.args[i]]), from) << c.args[0] << " links " << c.args[i] << ", which is not below it";
    }
  }
  EXPECT_GE(links_checked, 10) << "the check read no links";
}

TEST(Layers, OnlyTheTransportsAndTheAssemblyUseGrpcAndLibmicrohttpd) {
  const std::vector<std::string> allowed = {"server/main.cpp", "server/app", "server/http", "server/api"};
  std::vector<std::string> against;
  for (const Include& inc : includes_under("server")) {
    if (!is_grpc(inc.target) && inc.target != "microhttpd.h") continue;
    const std::string layer = layer_of(inc.file);
    if (std::find(allowed.begin(), allowed.end(), layer) == allowed.end()) against.push_back(where(inc));
  }
  EXPECT_TRUE(against.empty()) << ::testing::PrintToString(against);
}

TEST(Layers, TheModelIncludesNothingOfTheServerTheCliOrGrpc) {
  std::vector<std::string> against;
  for (const Include& inc : includes_under("model")) {
    const bool server = inc.target.rfind("server/", 0) == 0 || inc.target.rfind("cli/", 0) == 0;
    const bool proto = inc.target.find(".pb.h") != std::string::npos || inc.target.rfind("skyreels/v1", 0) == 0;
    if (server || proto || is_grpc(inc.target)) against.push_back(where(inc));
  }
  EXPECT_TRUE(against.empty()) << ::testing::PrintToString(against);
}

// The check itself: an include against the order is found (so that the tests above cannot pass by reading nothing).
TEST(Layers, TheCheckSeesTheIncludesItJudges) {
  const auto server = includes_under("server");
  EXPECT_GT(server.size(), 300u);
  bool queue_includes_replica_seam = false, store_includes_policy = false;
  for (const Include& inc : server) {
    queue_includes_replica_seam |= layer_of(inc.file) == "server/queue" && inc.target == "server/replica/chunk_executor.h";
    store_includes_policy |= layer_of(inc.file) == "server/store" && inc.target == "server/policy/claim_order.h";
  }
  EXPECT_TRUE(queue_includes_replica_seam);
  EXPECT_TRUE(store_includes_policy);
  EXPECT_LT(rank_of("server/queue"), rank_of("server/replica")) << "a queue file may include the replicas' seam";
  EXPECT_GT(rank_of("server/replica"), rank_of("server/api")) << "a replica file may not include the transport";
  EXPECT_EQ(rank_of("server/webhook"), rank_of("server/media")) << "webhook and media are one rank: neither includes the other";
  EXPECT_EQ(rank_of("server/http"), rank_of("server/api")) << "the doors are one rank";
  EXPECT_EQ(rank_of("server/store"), rank_of("server/replica")) << "state and device are one rank";
  // Metrics implements the sinks the layers below it declare (api/'s ApiMetrics included).
  EXPECT_LT(rank_of("server/metrics"), rank_of("server/api")) << "metrics implements api/'s sink";
}

// Metrics is above the doors (it implements api/'s sink) but never includes the listener that serves it: the
// assembly hands the HTTP listener a function that renders it.
TEST(Layers, MetricsIncludesNothingOfTheHttpListener) {
  std::vector<std::string> against;
  for (const Include& inc : includes_under("server")) {
    if (layer_of(inc.file) == "server/metrics" && inc.target.rfind("server/http/", 0) == 0) against.push_back(where(inc));
  }
  EXPECT_TRUE(against.empty()) << ::testing::PrintToString(against);
}

}  // namespace
}  // namespace skyreels::test
