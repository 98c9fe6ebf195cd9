// Server logs through spdlog, as text ("request id=r1 peer=... status=OK")
// or as one JSON object per line, chosen by --log-format. Every call names an
// event and its fields, so the two formats carry the same information.
#pragma once

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include <string>

#include "plsh/status.h"

namespace plsh::server {

// level: trace|debug|info|warn|error; format: text|json.
Status init_logging(const std::string& level, const std::string& format);

void log_event(spdlog::level::level_enum level, const std::string& event, const nlohmann::json& fields = {});

}  // namespace plsh::server
