#include "server/logging.h"

#include <spdlog/sinks/stdout_sinks.h>

#include <chrono>
#include <ctime>

namespace plsh::server {

namespace {

bool g_json = false;

std::string utc_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
  return buf;
}

// key=value, quoting values that would not read back as one word.
std::string text_value(const nlohmann::json& v) {
  if (!v.is_string()) return v.dump();
  const std::string& s = v.get_ref<const std::string&>();
  if (!s.empty() && s.find_first_of(" \"=\t\n") == std::string::npos) return s;
  return nlohmann::json(s).dump();
}

}  // namespace

Status init_logging(const std::string& level, const std::string& format) {
  if (format != "text" && format != "json")
    return invalid_argument("log_format = '" + format + "', expected text or json");
  const spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off")
    return invalid_argument("log_level = '" + level + "', expected trace, debug, info, warn or error");
  g_json = format == "json";
  // stderr, unbuffered line by line: container runtimes and tests read it live.
  auto logger = spdlog::stderr_logger_mt("plsh");
  logger->set_level(lvl);
  logger->set_pattern(g_json ? "%v" : "%Y-%m-%dT%H:%M:%S.%eZ %l %v", spdlog::pattern_time_type::utc);
  logger->flush_on(spdlog::level::trace);
  spdlog::set_default_logger(logger);
  return Status::Ok();
}

void log_event(spdlog::level::level_enum level, const std::string& event, const nlohmann::json& fields) {
  if (!spdlog::should_log(level)) return;
  if (g_json) {
    nlohmann::json line = {
        {"time", utc_now()}, {"level", spdlog::level::to_string_view(level).data()}, {"event", event}};
    if (fields.is_object())
      for (auto it = fields.begin(); it != fields.end(); ++it) line[it.key()] = it.value();
    spdlog::log(level, "{}", line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    return;
  }
  std::string text = event;
  if (fields.is_object())
    for (auto it = fields.begin(); it != fields.end(); ++it) text += " " + it.key() + "=" + text_value(it.value());
  spdlog::log(level, "{}", text);
}

}  // namespace plsh::server
