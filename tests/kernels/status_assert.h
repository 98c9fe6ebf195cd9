// ASSERT_OK_AND_ASSIGN for the tests (as absl's status_matchers): the
// StatusOr's value, or a fatal failure that prints its status. For the
// tests of kernels/, tests/gpu and tests/integration, which all include
// this folder.
#pragma once

#include <gtest/gtest.h>

#include <utility>

#include "plsh/status.h"

#define PLSH_ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  ASSERT_TRUE(tmp.ok()) << tmp.status().to_string();   \
  lhs = std::move(tmp).value()

// lhs (a declaration or an lvalue) = the value of expr (a StatusOr), or the
// test stops there with expr's status.
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  PLSH_ASSERT_OK_AND_ASSIGN_IMPL(PLSH_CONCAT(plsh_assert_statusor_, __LINE__), lhs, expr)
