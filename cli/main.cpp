// `skyreels`: the command-line tool (inspect, convert, forward, generate, decode, encode-text, submit, watch, ...).
#include <spdlog/spdlog.h>

#include <cstring>
#include <iostream>

#include "cli/command.h"
#include "model/runtime.h"

namespace {

void print_help() {
  std::cout << "usage: skyreels <command> [flags]\n\n"
               "SkyReels-V2 diffusion-forcing video generation in C++ (LibTorch).\n\ncommands:\n";
  for (const auto& [name, command] : skyreels::cli::registry()) {
    std::cout << "  " << name;
    for (size_t i = name.size(); i < 14; ++i) std::cout << ' ';
    std::cout << command.summary << "\n";
  }
  std::cout << "\nRun `skyreels <command> --help` for the flags of one command.\n";
}

}  // namespace

int main(int argc, char** argv) {
  skyreels::runtime::init_process(argc, argv);
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "help")) {
    print_help();
    return argc < 2 ? 2 : 0;
  }
  const std::string name = argv[1];
  auto& commands = skyreels::cli::registry();
  auto it = commands.find(name);
  if (it == commands.end()) {
    std::cerr << "skyreels: unknown command '" << name << "'\n\n";
    print_help();
    return 2;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      std::cout << it->second.usage << "\n";
      return 0;
    }
  }
  try {
    return it->second.run(args);
  } catch (const skyreels::cli::UsageError& e) {
    std::cerr << "skyreels " << name << ": " << e.what() << "\n\n" << it->second.usage << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "skyreels " << name << ": error: " << e.what() << "\n";
    return 1;
  }
}
