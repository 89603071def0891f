// Errors as values. Input from outside (files, flags, HTTP bodies) returns Result<T>; the
// message names the file / key / tensor / field that was wrong. TS_CHECK guards programmer
// invariants and stays on in release builds.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <variant>

namespace ts {

struct Error {
  std::string message;
};

inline Error make_error(std::string message) { return Error{std::move(message)}; }

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}            // NOLINT(google-explicit-constructor)
  Result(Error error) : v_(std::move(error)) {}        // NOLINT(google-explicit-constructor)
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &std::get<0>(v_); }
  const T* operator->() const { return &std::get<0>(v_); }
  T& operator*() & { return std::get<0>(v_); }
  const Error& error() const { return std::get<1>(v_); }

 private:
  std::variant<T, Error> v_;
};

// Result<void>: success or an Error.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT
  static Status ok_status() { return Status(); }
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { return error_; }

 private:
  Error error_;
  bool ok_ = true;
};

[[noreturn]] inline void check_failed(const char* file, int line, const char* cond,
                                      const char* why) {
  std::fprintf(stderr, "turbospark: internal check failed at %s:%d: %s (%s)\n", file, line, cond,
               why);
  std::abort();
}

}  // namespace ts

#define TS_CHECK(cond, why)                                        \
  do {                                                             \
    if (!(cond)) ::ts::check_failed(__FILE__, __LINE__, #cond, why); \
  } while (0)

// Propagate an error from an expression returning Status or Result<T>.
#define TS_TRY(expr)                               \
  do {                                             \
    auto ts_try_r_ = (expr);                       \
    if (!ts_try_r_.ok()) return ts_try_r_.error(); \
  } while (0)

#define TS_CONCAT_INNER(a, b) a##b
#define TS_CONCAT(a, b) TS_CONCAT_INNER(a, b)
// Bind the value of a Result<T> expression or return its error.
#define TS_ASSIGN(lhs, expr)                                              \
  auto TS_CONCAT(ts_assign_r_, __LINE__) = (expr);                       \
  if (!TS_CONCAT(ts_assign_r_, __LINE__).ok())                           \
    return TS_CONCAT(ts_assign_r_, __LINE__).error();                    \
  lhs = std::move(TS_CONCAT(ts_assign_r_, __LINE__)).value()
