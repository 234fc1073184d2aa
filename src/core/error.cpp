// fusedmoe: error-message helpers (include/fusedmoe/core/error.h).
#include "fusedmoe/core/error.h"

#include <cctype>
#include <cstdio>

#include "core/json_error.h"

namespace fusedmoe {

std::string printable(std::string_view text, bool escape_backslash) {
  std::string out;
  const auto escape = [&](unsigned char u) {
    char hex[5];
    std::snprintf(hex, sizeof hex, "\\x%02x", u);
    out += hex;
  };
  const auto byte = [&](size_t i) -> unsigned {
    return i < text.size() ? static_cast<unsigned char>(text[i]) : 0u;
  };
  for (size_t i = 0; i < text.size();) {
    const unsigned u = byte(i);
    if (u < 0x80) {
      if (u == '\\' && escape_backslash)
        out += "\\\\";  // so that a typed "\x01" or "\u200b" is not read as an escape
      else if (u >= 0x20 && u != 0x7f)
        out += static_cast<char>(u);
      else
        escape(static_cast<unsigned char>(u));
      ++i;
      continue;
    }
    // A UTF-8 sequence (RFC 3629: no overlong forms, surrogates or code points
    // past U+10FFFF) is kept, but for the C1 controls U+0080-U+009F; any other
    // byte is escaped alone.
    const size_t n = u >= 0xc2 && u <= 0xdf   ? 2
                     : u >= 0xe0 && u <= 0xef ? 3
                     : u >= 0xf0 && u <= 0xf4 ? 4
                                              : 0;
    const unsigned lo = u == 0xe0 ? 0xa0 : u == 0xf0 ? 0x90 : u == 0xc2 ? 0xa0 : 0x80;
    const unsigned hi = u == 0xed ? 0x9f : u == 0xf4 ? 0x8f : 0xbf;
    bool valid = n > 0 && byte(i + 1) >= lo && byte(i + 1) <= hi;
    for (size_t j = 2; valid && j < n; ++j) valid = byte(i + j) >= 0x80 && byte(i + j) <= 0xbf;
    if (valid) {
      // Invisible format characters that reorder or hide the text around them
      // on a terminal (soft hyphen, Arabic letter mark, Mongolian vowel
      // separator, zero-width characters, bidi marks, embeddings, overrides
      // and isolates, line / paragraph separators, U+FEFF, interlinear
      // annotation, tag characters): written as \uNNNN (\UNNNNNNNN past U+FFFF).
      unsigned cp = n == 2 ? u & 0x1f : n == 3 ? u & 0x0f : u & 0x07;
      for (size_t j = 1; j < n; ++j) cp = (cp << 6) | (byte(i + j) & 0x3f);
      if (cp == 0xad || cp == 0x61c || cp == 0x180e || (cp >= 0x200b && cp <= 0x200f) ||
          (cp >= 0x2028 && cp <= 0x202e) || (cp >= 0x2060 && cp <= 0x206f) || cp == 0xfeff ||
          (cp >= 0xfff9 && cp <= 0xfffb) || (cp >= 0xe0000 && cp <= 0xe007f)) {
        char hex[12];
        std::snprintf(hex, sizeof hex, cp > 0xffff ? "\\U%08x" : "\\u%04x", cp);
        out += hex;
        i += n;
        continue;
      }
    }
    if (valid) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      escape(static_cast<unsigned char>(u));
      ++i;
    }
  }
  return out;
}

std::string printable_json_error(std::string_view what) {
  // Each "<U+00XX>" (XX < 0x20) back to its byte, then printable() writes it as \xXX.
  std::string raw;
  for (size_t i = 0; i < what.size(); ++i) {
    const auto hex = [&](size_t k) { return std::isxdigit(static_cast<unsigned char>(what[k])); };
    if (what.compare(i, 5, "<U+00") == 0 && i + 8 <= what.size() && what[i + 7] == '>' &&
        (what[i + 5] == '0' || what[i + 5] == '1') && hex(i + 6)) {
      raw += static_cast<char>(std::stoi(std::string(what.substr(i + 5, 2)), nullptr, 16));
      i += 7;
      continue;
    }
    raw += what[i];
  }
  // The library's advice "must be escaped to \u0001" is the library's text, not
  // the file's: its backslash is shown as written, not as "\\".
  std::string out = printable(raw);
  static constexpr std::string_view kAdvice = "must be escaped to \\\\u";
  for (size_t at = out.find(kAdvice); at != std::string::npos; at = out.find(kAdvice, at + 1))
    out.erase(at + kAdvice.size() - 2, 1);
  return out;
}

std::string bytes_str(unsigned long long bytes) {
  std::string out = std::to_string(bytes) + " bytes";
  if (bytes < 1024) return out;
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024 && u < 5) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, " (%.3g %s)", v, kUnits[u]);
  return out + buf;
}

}  // namespace fusedmoe
