// fusedmoe internal: JSON library errors in fusedmoe's messages.
#pragma once

#include <string>
#include <string_view>

namespace fusedmoe {

// The message of a JSON library error (nlohmann::json's what()) as printable()
// writes text: the control characters it quotes as "<U+0010>" become "\x10",
// as in every other message.
std::string printable_json_error(std::string_view what);

}  // namespace fusedmoe
