// fusedmoe: errors.
//
// Every check at an API boundary throws fusedmoe::Error with a message that
// names the argument, the expected and the actual value. Inside the library
// code trusts what the boundary checked.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace fusedmoe {

enum class ErrorCode {
  kInvalidArgument,  // wrong shape, dtype, value of an argument or config field
  kIo,               // a file that cannot be opened, read or parsed
  kUnsupported,      // valid input that this build or backend does not handle
  kInternal,         // a broken invariant inside the library
  kOutOfMemory,      // an allocation that failed, or whose size overflows 64 bits (the
                     // message names what was allocated and how many bytes)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// `text` with each control character (below 0x20, 0x7f, and the C1 controls
// U+0080-U+009F) and each byte that is not part of valid UTF-8 written as \xNN,
// the invisible format characters (U+00AD, U+061C, U+180E, U+200B-U+200F,
// U+2028-U+202E, U+2060-U+206F, U+FEFF, U+FFF9-U+FFFB, U+E0000-U+E007F:
// zero-width, bidi marks, overrides, isolates, separators, tags) as \uNNNN
// (\UNNNNNNNN past U+FFFF), and a backslash as \\ (so that an escape shown is
// one, not the text's own; `escape_backslash` false leaves backslashes, for a
// message whose quoted parts are escaped already): names and values read from
// files (config strings, tensor names, metadata) that an error message quotes
// stay on one line, and cannot move the cursor, recolour the terminal or
// reorder the text shown, nor put bytes that are no text on it.
std::string printable(std::string_view text, bool escape_backslash = true);

// A byte count as out-of-memory errors give it: "34359738368 bytes (32 GiB)",
// "100 bytes".
std::string bytes_str(unsigned long long bytes);

}  // namespace fusedmoe

// FUSEDMOE_CHECK(cond, "message parts", value, ...): throws Error(kInvalidArgument).
#define FUSEDMOE_CHECK(cond, ...)                                       \
  do {                                                                  \
    if (!(cond))                                                        \
      throw ::fusedmoe::Error(::fusedmoe::ErrorCode::kInvalidArgument,  \
                              ::fusedmoe::detail::concat(__VA_ARGS__)); \
  } while (0)

// FUSEDMOE_THROW(code, "message parts", ...): throws Error(code).
#define FUSEDMOE_THROW(code, ...) \
  throw ::fusedmoe::Error(::fusedmoe::ErrorCode::code, ::fusedmoe::detail::concat(__VA_ARGS__))
