// fusedmoe (internal): JSON text read as Python's json module reads it — the
// reader of HF transformers' config.json and of model.safetensors.index.json
// (transformers' sharded-checkpoint loading), where nlohmann's parser differs.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace fusedmoe::detail {

// Parses `text` (the file `shown`, as messages name it) as Python's json.loads
// does, so that a file HF reads is read and one it refuses is refused:
//   - a UTF-8 byte-order mark first: refused (json.load raises; nlohmann skips it);
//   - a NUL byte: refused with its offset (nlohmann said "unexpected end of input");
//   - the literals NaN, Infinity, -Infinity, numbers beyond the double range
//     (1e999: Python's inf), which nlohmann refuses, and integers beyond 64
//     bits (Python's int; nlohmann rounds them to a double): taken, each as a
//     binary value (a type no JSON text yields) that every typed read refuses
//     as it refuses a value of the wrong type, and json_as_written() prints
//     as written; one used as an object key is refused, as Python refuses it;
//   - a \uXXXX escape of a lone UTF-16 surrogate (Python keeps it; nlohmann
//     refuses the text): read as U+FFFD;
//   - nesting deeper than kMaxJsonDepth, or an integer of more than 4300
//     digits: refused (Python: RecursionError, ValueError).
// Throws Error(kIo) "<shown>: ..." (`what`: the file it should be, for the
// NUL message, e.g. "the model's config.json").
nlohmann::json parse_python_json(const std::string& text, const std::string& shown,
                                 const std::string& what);

// v.dump(), the non-finite values as the text spelled them (NaN, Infinity, -Infinity).
std::string json_as_written(const nlohmann::json& v);

// Python 3.12's json nests about 1500 levels before RecursionError.
inline constexpr int kMaxJsonDepth = 1500;

}  // namespace fusedmoe::detail
