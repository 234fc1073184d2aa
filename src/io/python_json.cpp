// fusedmoe (internal): JSON text read as Python's json module reads it (see python_json.h).
#include "io/python_json.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "core/json_error.h"
#include "fusedmoe/core/error.h"

namespace fusedmoe::detail {

namespace {

using json = nlohmann::json;

constexpr const char* kLiterals[] = {"NaN", "Infinity", "-Infinity"};
// A marker string: \x01 then the text ("\x01f" would be one hex escape).
constexpr std::string_view kMarker =
    "\x01"
    "fusedmoe-non-finite:";
constexpr std::string_view kMarkerJson = "\"\\u0001fusedmoe-non-finite:";

struct Marked {
  std::string text;
  // Per marker: its offset in `text` and in the original, and its length in each.
  struct At {
    size_t marked, original, marked_len, original_len;
  };
  std::vector<At> at;
};

// The text with NaN / Infinity / -Infinity, numbers beyond the double range
// and integers beyond 64 bits outside strings as marker strings, and lone
// UTF-16 surrogate escapes inside strings as U+FFFD; nullopt when it has none
// of these. Throws Error(kIo) for an integer Python's int would refuse.
std::optional<Marked> mark_non_finite(const std::string& text, const std::string& shown_) {
  Marked m;
  m.text.reserve(text.size() + 64);
  bool in_string = false;
  // The marker keeps the text it stands for (letters, digits, + - . e E: no escapes needed).
  const auto emit = [&](size_t i, size_t n) {
    const size_t start = m.text.size();
    m.text += kMarkerJson;
    m.text.append(text, i, n);
    m.text += '"';
    m.at.push_back({start, i, m.text.size() - start, n});
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      // A \uXXXX escape of a lone UTF-16 surrogate (Python's json keeps it in
      // the string; nlohmann refuses the text): U+FFFD in its place.
      const auto unit = [&](size_t at) -> int {  // the code unit of "\uXXXX" at `at`, or -1
        if (at + 6 > text.size() || text[at] != '\\' || text[at + 1] != 'u') return -1;
        char* end = nullptr;
        const std::string hex = text.substr(at + 2, 4);
        const long u = std::strtol(hex.c_str(), &end, 16);
        return end == hex.c_str() + 4 ? static_cast<int>(u) : -1;
      };
      const int u = c == '\\' ? unit(i) : -1;
      if (u >= 0xD800 && u <= 0xDFFF) {
        const int next = unit(i + 6);
        if (u <= 0xDBFF && next >= 0xDC00 && next <= 0xDFFF) {  // a pair: kept
          m.text.append(text, i, 12);
          i += 11;
        } else {
          m.text += "\\ufffd";
          m.at.push_back({m.text.size() - 6, i, 6, 6});
          i += 5;
        }
        continue;
      }
      m.text += c;
      if (c == '\\' && i + 1 < text.size())
        m.text += text[++i];
      else if (c == '"')
        in_string = false;
      continue;
    }
    bool matched = false;
    for (const char* lit : kLiterals) {
      const size_t n = std::strlen(lit);
      if (text.compare(i, n, lit) == 0) {
        emit(i, n);
        i += n - 1;
        matched = true;
        break;
      }
    }
    if (matched) continue;
    if (c == '-' || (c >= '0' && c <= '9')) {
      // A number: kept, unless beyond the double range (Python's float: inf)
      // or an integer beyond 64 bits (Python's int; nlohmann rounds it to a
      // double); an integer of more than 4300 digits Python's int refuses.
      size_t j = i + 1;
      while (j < text.size() && (std::strchr("0123456789+-.eE", text[j]) != nullptr)) ++j;
      const std::string run = text.substr(i, j - i);
      const std::string_view digits = std::string_view(run).substr(run[0] == '-' ? 1 : 0);
      const bool integer =
          !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos;
      if (integer && digits.size() > 4300)
        FUSEDMOE_THROW(kIo, shown_, ": an integer of ", digits.size(), " digits at byte ", i,
                       ", more than Python's int reads from text (4300: ValueError)");
      // Past 2^64 - 1 (positive) or below -2^63: nlohmann's integers end there.
      const std::string_view most = run[0] == '-' ? "9223372036854775808" : "18446744073709551615";
      const bool big = integer && (digits.size() > most.size() ||
                                   (digits.size() == most.size() && digits > most));
      char* end = nullptr;
      const double v = integer ? 0.0 : std::strtod(run.c_str(), &end);
      if (big || (!integer && end == run.c_str() + run.size() && std::isinf(v))) {
        emit(i, run.size());
      } else {
        m.text += run;
      }
      i = j - 1;
      continue;
    }
    if (c == '"') in_string = true;
    m.text += c;
  }
  if (m.at.empty()) return std::nullopt;
  return m;
}

// nlohmann's "line L, column C" of a parse error in the marked text, as the
// original text's line and column (markers hold no newline).
std::string unmarked_position(const std::string& what, const Marked& m, const std::string& text,
                              size_t marked_byte) {
  size_t original = marked_byte;
  for (const Marked::At& a : m.at) {
    if (a.marked >= marked_byte) break;
    original = marked_byte < a.marked + a.marked_len
                   ? a.original
                   : a.original + a.original_len + (marked_byte - a.marked - a.marked_len);
  }
  if (original > text.size()) original = text.size();
  size_t line = 1, col = 0;
  for (size_t i = 0; i < original; ++i) {
    if (text[i] == '\n')
      ++line, col = 0;
    else
      ++col;
  }
  const size_t at = what.find("at line ");
  const size_t colon = at == std::string::npos ? at : what.find(':', at);
  if (colon == std::string::npos) return what;
  return what.substr(0, at) + "at line " + std::to_string(line) + ", column " +
         std::to_string(col) + what.substr(colon);
}

// Marker strings to binary values (holding the text they stand for); the depth
// checked and object keys that were literals refused.
// Iterative: the depth is checked before anything recurses.
void finish(json& root, const std::string& shown, bool marked) {
  std::vector<std::pair<json*, int>> stack{{&root, 1}};
  while (!stack.empty()) {
    auto [v, depth] = stack.back();
    stack.pop_back();
    if (depth > kMaxJsonDepth)
      FUSEDMOE_THROW(kIo, shown, ": JSON nested deeper than ", kMaxJsonDepth,
                     " levels, which Python's json (HF transformers' reader) refuses "
                     "(RecursionError)");
    if (marked && v->is_string()) {
      const std::string& s = v->get_ref<const std::string&>();
      if (!s.starts_with(kMarker)) continue;
      *v = json::binary(std::vector<uint8_t>(s.begin() + kMarker.size(), s.end()));
    } else if (v->is_object()) {
      for (auto it = v->begin(); it != v->end(); ++it) {
        if (marked && std::string_view(it.key()).starts_with(kMarker))
          FUSEDMOE_THROW(kIo, shown, ": not valid JSON: ", it.key().substr(kMarker.size()),
                         " as an object key (Python's json takes only strings as keys)");
        stack.push_back({&it.value(), depth + 1});
      }
    } else if (v->is_array()) {
      for (json& e : *v) stack.push_back({&e, depth + 1});
    }
  }
}

}  // namespace

nlohmann::json parse_python_json(const std::string& text, const std::string& shown,
                                 const std::string& what) {
  // nlohmann's parser skips a byte-order mark; Python's json.load refuses the file.
  if (text.starts_with("\xEF\xBB\xBF"))
    FUSEDMOE_THROW(kIo, shown,
                   ": starts with a UTF-8 byte-order mark (bytes EF BB BF), which Python's "
                   "json.load and so HF transformers refuse; expected JSON text without one "
                   "(save the file as UTF-8 without a BOM)");
  // nlohmann reports a NUL byte as "unexpected end of input": name it.
  if (const size_t nul = text.find('\0'); nul != std::string::npos)
    FUSEDMOE_THROW(kIo, shown, ": not JSON text: contains a NUL byte at offset ", nul,
                   " (a binary or damaged file?); expected ", what);
  json root;
  const std::optional<Marked> marked = mark_non_finite(text, shown);
  if (!marked) {
    try {
      root = json::parse(text);
    } catch (const json::exception& e) {
      FUSEDMOE_THROW(kIo, shown, ": not valid JSON: ", printable_json_error(e.what()));
    }
    finish(root, shown, false);
    return root;
  }
  try {
    root = json::parse(marked->text);
  } catch (const json::parse_error& e) {
    // Placed in the text as written (the markers are longer than what they stand for).
    FUSEDMOE_THROW(kIo, shown, ": not valid JSON: ",
                   printable_json_error(unmarked_position(e.what(), *marked, text, e.byte)));
  } catch (const json::exception& e) {
    FUSEDMOE_THROW(kIo, shown, ": not valid JSON: ", printable_json_error(e.what()));
  }
  finish(root, shown, true);
  return root;
}

std::string json_as_written(const nlohmann::json& v) {
  if (v.is_binary()) {
    const auto& b = v.get_binary();
    return std::string(b.begin(), b.end());
  }
  if (!v.is_structured()) return v.dump();
  std::string out;
  if (v.is_array()) {
    out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + json_as_written(v[i]);
    return out + "]";
  }
  out = "{";
  bool first = true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    out += (first ? "" : ",") + json(it.key()).dump() + ":" + json_as_written(it.value());
    first = false;
  }
  return out + "}";
}

}  // namespace fusedmoe::detail
