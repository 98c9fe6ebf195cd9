// Shared by the server unit tests: status checks that name the expected code
// and message parts, and a bounded wait for conditions no hook reports.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <initializer_list>
#include <string>
#include <thread>

#include "plsh/status.h"

namespace plsh::server::testing {

inline constexpr StatusCode kInvalid = StatusCode::kInvalidArgument;
inline constexpr StatusCode kExhausted = StatusCode::kResourceExhausted;

// Every part must occur in the message: errors name the field, the value and
// what was expected (SPEC section 7).
inline ::testing::AssertionResult has_error(const Status& status, StatusCode code,
                                            std::initializer_list<const char*> parts) {
  if (status.code() != code)
    return ::testing::AssertionFailure() << "got " << status.to_string() << ", expected code "
                                         << status_code_name(code);
  for (const char* part : parts)
    if (status.message().find(part) == std::string::npos)
      return ::testing::AssertionFailure() << "message \"" << status.message() << "\" lacks \"" << part << "\"";
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult is_ok(const Status& status) {
  if (status.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << status.to_string();
}

// Generous: a loaded 2-core machine may stall a thread for seconds, and a
// passing run never waits this long.
inline constexpr std::chrono::seconds kWaitLimit{30};

// For states the code under test gives no signal for (a worker parked on
// its condition variable, a stop() begun on another thread): polls `done`,
// yielding, until it holds or kWaitLimit passes. No timing assumption: it
// only decides how long to give up after.
inline bool eventually(const std::function<bool()>& done) {
  const auto give_up = std::chrono::steady_clock::now() + kWaitLimit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

}  // namespace plsh::server::testing
