// fusedmoe: numbers as users give them, on the command line (src/cli) and in
// FUSEDMOE_* environment variables: plain decimal text, the whole of it.
//   integer: an optional sign and decimal digits ("12", "-3", "+7", "007" is 7);
//   real:    an optional sign, digits with an optional decimal point, an
//            optional exponent ("0.5", ".5", "5.", "1e-5", "2.5E+3"); a finite
//            double (not beyond its range, at either end).
// Anything else is refused: spaces around or inside, hexadecimal ("0x10") and
// other prefixes, digit separators, "inf", "nan", an empty text. Callers turn
// a refusal into an error naming the option or variable, the expected form and
// the text given.
#pragma once

#include <cstdint>
#include <string_view>

namespace fusedmoe {

enum class ParseNumber {
  kOk,
  kNotDecimal,  // not of the form above
  kOutOfRange,  // of the form, but beyond the type (a real: beyond the range of a double)
};

ParseNumber parse_decimal(std::string_view text, int64_t& value);
// Negative values (other than zero) are kOutOfRange.
ParseNumber parse_decimal(std::string_view text, uint64_t& value);
ParseNumber parse_decimal(std::string_view text, double& value);

}  // namespace fusedmoe
