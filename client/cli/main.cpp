// plsh: the command-line tool. Each subcommand lives in its own
// cmd_<name>.cpp and registers itself (commands.h); main only parses and
// dispatches, and turns every failure into one line on stderr and an exit
// code (0 ok, 1 runtime failure, 2 usage or input error).
#include <algorithm>
#include <exception>
#include <iostream>
#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/commands.h"

namespace plsh::cli {

namespace {
std::vector<Command>& registry() {
  static std::vector<Command> commands;
  return commands;
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}
}  // namespace

bool register_command(std::string name, std::string description, SetupFn setup) {
  registry().push_back(Command{std::move(name), std::move(description), std::move(setup)});
  return true;
}

std::vector<Command> registered_commands() {
  std::vector<Command> sorted = registry();
  std::sort(sorted.begin(), sorted.end(), [](const Command& a, const Command& b) { return a.name < b.name; });
  return sorted;
}

int report_error(const std::string& command, const Status& status) {
  std::cerr << "plsh " << command << ": " << one_line(status.to_string()) << std::endl;
  return status.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitRuntime;
}

namespace {

int run_main(int argc, char** argv) {
  CLI::App app{"plsh: ALiBi attention with positional LSH, exact and windowed baselines, and error estimates", "plsh"};
  app.set_version_flag("--version", PLSH_VERSION);
  app.require_subcommand(1);

  std::map<std::string, RunFn> runs;
  std::map<std::string, CLI::App*> subcommands;
  for (const Command& c : registered_commands()) {
    CLI::App* sub = app.add_subcommand(c.name, c.description);
    subcommands[c.name] = sub;
    runs[c.name] = c.setup(*sub);
  }

  // CLI11 calls a mistyped subcommand "a subcommand is required"; say what
  // was typed and what exists instead.
  if (argc > 1 && argv[1][0] != '-' && subcommands.count(argv[1]) == 0) {
    std::string known;
    for (const auto& [name, sub] : subcommands) known += (known.empty() ? "" : ", ") + name;
    std::cerr << "plsh: unknown subcommand '" << argv[1] << "', expected one of: " << known << std::endl;
    return kExitUsage;
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // CLI11's own report adds a second line ("Run with --help ..."); one
    // line naming the subcommand is easier to read in a script's log.
    std::string where = "plsh";
    for (const auto& [name, sub] : subcommands)
      if (sub->parsed()) where = "plsh " + name;
    std::cerr << where << ": " << one_line(e.what()) << " (see " << where << " --help)" << std::endl;
    return kExitUsage;
  }

  for (const auto& [name, sub] : subcommands) {
    if (sub->parsed()) return runs[name]();
  }
  std::cerr << "plsh: no subcommand given (see plsh --help)" << std::endl;
  return kExitUsage;
}

}  // namespace
}  // namespace plsh::cli

int main(int argc, char** argv) {
  // Nothing below should throw past a subcommand, but a crash is never an
  // acceptable answer to bad input: report and exit.
  try {
    return plsh::cli::run_main(argc, argv);
  } catch (const std::bad_alloc&) {
    std::cerr << "plsh: RESOURCE_EXHAUSTED: out of memory" << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "plsh: INTERNAL: " << e.what() << std::endl;
  }
  return plsh::cli::kExitRuntime;
}
