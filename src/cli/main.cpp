// Placeholder entry point until the CLI lands (replaced by src/cli/*).
#include <cstdio>
int main() {
  std::fprintf(stderr, "fusedmoe: command-line interface not built yet\n");
  return 1;
}
