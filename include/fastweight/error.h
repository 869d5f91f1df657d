// fastweight/error.h: the one exception type of the library.
//
// Every failure (bad argument, CUDA error, unsupported build) is a fastweight::Error whose message
// names the op, the argument and what was expected, e.g.
//   "layernorm_fwd: weight: expected shape (1024), got (1000)".
// The Python binding turns it into a ValueError/RuntimeError with the same text.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace fastweight {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Thrown for invalid arguments (shape, dtype, stride, alignment, device): Python's ValueError.
class ArgumentError : public Error {
 public:
  explicit ArgumentError(const std::string& what) : Error(what) {}
};

namespace detail {
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

}  // namespace fastweight

// FW_CHECK_ARG(cond, op, arg, what...): throws ArgumentError "op: arg: what..." when cond is false.
#define FW_CHECK_ARG(cond, op, arg, ...)                                                    \
  do {                                                                                      \
    if (!(cond))                                                                            \
      throw ::fastweight::ArgumentError(::fastweight::detail::cat(op, ": ", arg, ": ",      \
                                                                  __VA_ARGS__));            \
  } while (0)
