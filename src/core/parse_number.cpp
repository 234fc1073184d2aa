#include "core/parse_number.h"

#include <charconv>
#include <cmath>
#include <system_error>

namespace fusedmoe {
namespace {

bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// Length of the run of digits at text[at...].
size_t digits(std::string_view text, size_t at) {
  size_t n = 0;
  while (at + n < text.size() && is_digit(text[at + n])) ++n;
  return n;
}

// An optional sign and one or more digits, nothing else: the digits (with a
// '-' kept, a '+' dropped), else an empty view.
std::string_view integer_text(std::string_view text, bool& negative) {
  negative = !text.empty() && text[0] == '-';
  const size_t sign = !text.empty() && (text[0] == '-' || text[0] == '+') ? 1 : 0;
  const size_t n = digits(text, sign);
  if (n == 0 || sign + n != text.size()) return {};
  return text[0] == '+' ? text.substr(1) : text;
}

}  // namespace

ParseNumber parse_decimal(std::string_view text, int64_t& value) {
  bool negative = false;
  const std::string_view t = integer_text(text, negative);
  if (t.empty()) return ParseNumber::kNotDecimal;
  int64_t v = 0;
  const auto r = std::from_chars(t.data(), t.data() + t.size(), v, 10);
  if (r.ec == std::errc::result_out_of_range) return ParseNumber::kOutOfRange;
  if (r.ec != std::errc() || r.ptr != t.data() + t.size()) return ParseNumber::kNotDecimal;
  value = v;
  return ParseNumber::kOk;
}

ParseNumber parse_decimal(std::string_view text, uint64_t& value) {
  bool negative = false;
  std::string_view t = integer_text(text, negative);
  if (t.empty()) return ParseNumber::kNotDecimal;
  if (negative) t.remove_prefix(1);
  uint64_t v = 0;
  const auto r = std::from_chars(t.data(), t.data() + t.size(), v, 10);
  if (r.ec == std::errc::result_out_of_range) return ParseNumber::kOutOfRange;
  if (r.ec != std::errc() || r.ptr != t.data() + t.size()) return ParseNumber::kNotDecimal;
  if (negative && v != 0) return ParseNumber::kOutOfRange;
  value = v;
  return ParseNumber::kOk;
}

ParseNumber parse_decimal(std::string_view text, double& value) {
  // [sign] (digits [. [digits]] | . digits) [(e|E) [sign] digits]
  size_t at = !text.empty() && (text[0] == '-' || text[0] == '+') ? 1 : 0;
  const size_t whole = digits(text, at);
  at += whole;
  size_t fraction = 0;
  if (at < text.size() && text[at] == '.') {
    fraction = digits(text, at + 1);
    at += 1 + fraction;
  }
  if (whole + fraction == 0) return ParseNumber::kNotDecimal;
  if (at < text.size() && (text[at] == 'e' || text[at] == 'E')) {
    size_t e = at + 1;
    if (e < text.size() && (text[e] == '-' || text[e] == '+')) ++e;
    const size_t n = digits(text, e);
    if (n == 0) return ParseNumber::kNotDecimal;
    at = e + n;
  }
  if (at != text.size()) return ParseNumber::kNotDecimal;
  // from_chars takes no '+'; the grammar above is a subset of what it reads.
  const std::string_view t = text[0] == '+' ? text.substr(1) : text;
  double v = 0;
  const auto r = std::from_chars(t.data(), t.data() + t.size(), v, std::chars_format::general);
  // Beyond the largest double, or so small that from_chars reports an
  // underflow (1e-400): out of range either way.
  if (r.ec == std::errc::result_out_of_range) return ParseNumber::kOutOfRange;
  if (r.ec != std::errc() || r.ptr != t.data() + t.size()) return ParseNumber::kNotDecimal;
  if (!std::isfinite(v)) return ParseNumber::kOutOfRange;
  value = v;
  return ParseNumber::kOk;
}

}  // namespace fusedmoe
