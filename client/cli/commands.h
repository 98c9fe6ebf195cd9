// The plsh subcommands register themselves here, one file each
// (cmd_<name>.cpp), so that adding a subcommand touches no other file:
//
//   PLSH_REGISTER_COMMAND(compute, "Run attention on .npy files in this process",
//                         [](CLI::App& app) -> plsh::cli::RunFn { ... return [&args] { return run(args); }; });
//
// Files compiled straight into the plsh executable run their static
// initialisers, so the registration cannot be dropped by the linker (it
// could be if these files went into a static library).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "plsh/status.h"

namespace plsh::cli {

// Exit codes of every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitRuntime = 1;  // the work failed: backend, I/O, cancelled, ...
inline constexpr int kExitUsage = 2;    // bad flags or bad input files

// Runs a parsed subcommand and returns its exit code.
using RunFn = std::function<int()>;
// Adds the subcommand's flags to `app` (already named and described) and
// returns what runs it; the flags' storage must outlive the call.
using SetupFn = std::function<RunFn(CLI::App& app)>;

struct Command {
  std::string name;
  std::string description;
  SetupFn setup;
};

// Static registration; returns true so it can initialise a namespace-scope bool.
bool register_command(std::string name, std::string description, SetupFn setup);
// Every registered command, sorted by name (static initialisation order
// across files is unspecified, the help text should not be).
std::vector<Command> registered_commands();

// Prints "plsh <command>: <status>" as one line on stderr and returns the
// exit code for it: kExitUsage for INVALID_ARGUMENT, kExitRuntime otherwise.
int report_error(const std::string& command, const Status& status);

}  // namespace plsh::cli

#define PLSH_REGISTER_COMMAND(name, description, setup)               \
  [[maybe_unused]] static const bool plsh_command_registered_##name = \
      ::plsh::cli::register_command(#name, description, setup)
