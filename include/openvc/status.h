// Status returned by every public entry point: a code plus a message that names the argument and what
// was expected. No exceptions cross the library boundary.
#pragma once
#include <string>
#include <utility>

namespace openvc {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad shape, stride, dtype, pointer, budget...
  kUnsupported,      // valid request that this build or GPU cannot run (e.g. not sm_90)
  kCudaError,        // a CUDA runtime/driver call failed
  kInternal,
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }
  static Status Invalid(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status Cuda(std::string m) { return {StatusCode::kCudaError, std::move(m)}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace openvc

// Early return of a non-ok Status.
#define OPENVC_RETURN_IF_ERROR(expr)           \
  do {                                         \
    ::openvc::Status _openvc_st = (expr);      \
    if (!_openvc_st.ok()) return _openvc_st;   \
  } while (0)
