// Test helpers: expecting a fusedmoe::Error and checking its message.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "fusedmoe/core/error.h"

namespace fusedmoe::test {

// Runs f, expects Error(code) and returns its message ("" if none was thrown).
template <typename F>
std::string error_of(F&& f, ErrorCode code = ErrorCode::kIo) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no fusedmoe::Error thrown";
  return "";
}

}  // namespace fusedmoe::test

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "message: " << (haystack)
