// Small text helpers that the library, the server and the clients share.
//
// Enum names: an enum that has names (in messages, flags, JSON, metric
// labels) lists them once, as a constexpr table of {value, name}; its name
// function, its parser and the "expected a, b or c" of the parser's error
// all read that table, so that a value added or renamed cannot leave one of
// them behind. Header-only and C++17, since CUDA sources include params.h.
#pragma once

#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

#include "plsh/status.h"

namespace plsh {

template <typename E>
struct EnumName {
  E value;
  const char* name;
};

// `value`'s name in `table`, or `fallback` for a value the table lacks (an
// out-of-range cast).
template <typename E, size_t N>
constexpr const char* name_of(const EnumName<E> (&table)[N], E value, const char* fallback = "?") {
  for (const EnumName<E>& e : table)
    if (e.value == value) return e.name;
  return fallback;
}

// The value that `name` names in `table`, or nullopt.
template <typename E, size_t N>
constexpr std::optional<E> value_named(const EnumName<E> (&table)[N], std::string_view name) {
  for (const EnumName<E>& e : table)
    if (name == e.name) return e.value;
  return std::nullopt;
}

// "a, b or c" from `names(i)`, i = 0..n-1.
template <typename NameAt>
std::string or_list(size_t n, NameAt names) {
  std::string text;
  for (size_t i = 0; i < n; ++i) text += (i == 0 ? "" : i + 1 == n ? " or " : ", ") + std::string(names(i));
  return text;
}

// "a, b or c": the names of `table`, for error messages and help texts.
template <typename E, size_t N>
std::string names_text(const EnumName<E> (&table)[N]) {
  return or_list(N, [&](size_t i) { return table[i].name; });
}
template <size_t N>
std::string names_text(const char* const (&names)[N]) {
  return or_list(N, [&](size_t i) { return names[i]; });
}

// The value that `text` names in `table`, else INVALID_ARGUMENT
// "<field> = '<shown>', expected a, b or c". `shown` is how the message
// quotes the text (the text itself, or echo_value(text) for one that a
// client sent).
template <typename E, size_t N>
StatusOr<E> parse_named(const EnumName<E> (&table)[N], const std::string& text, const char* field,
                        const std::string& shown) {
  if (std::optional<E> v = value_named(table, text)) return *v;
  return invalid_argument(std::string(field) + " = '" + shown + "', expected " + names_text(table));
}
template <typename E, size_t N>
StatusOr<E> parse_named(const EnumName<E> (&table)[N], const std::string& text, const char* field) {
  return parse_named(table, text, field, text);
}

// printf's %.<digits>g of v: what messages and flags print a double as
// (17 digits round-trips it, 3 reads well in a log line).
inline std::string g_text(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return buf;
}

}  // namespace plsh
