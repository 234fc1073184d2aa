// bench_cuda_moe: the CUDA routed-experts benchmark (see cuda_bench.cu).
// usage: bench_cuda_moe [--shapes mixtral,qwen3,deepseek] [--tokens 1,16,...]
//                       [--routings 8] [--iters 40] [--dump-dir DIR] [--sweep] [--sweep-sm90]
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "bench/cuda/cuda_bench.h"

int main(int argc, char** argv) {
  fusedmoe::bench::CudaBenchOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--sweep") {
      o.sweep = true;
    } else if (a == "--sweep-sm90") {
      o.sweep_sm90 = true;
    } else if (a == "--shapes" && has_value) {
      o.shapes = argv[++i];
    } else if (a == "--tokens" && has_value) {
      o.tokens.clear();
      std::string t = argv[++i];
      for (size_t p = 0; p < t.size();) {
        size_t q = t.find(',', p);
        if (q == std::string::npos) q = t.size();
        o.tokens.push_back(std::stoll(t.substr(p, q - p)));
        p = q + 1;
      }
    } else if (a == "--routings" && has_value) {
      o.routings = std::atoi(argv[++i]);
    } else if (a == "--iters" && has_value) {
      o.iters = std::atoi(argv[++i]);
    } else if (a == "--dump-dir" && has_value) {
      o.dump_dir = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: bench_cuda_moe [--shapes mixtral,qwen3,deepseek] [--tokens 1,16,...] "
                   "[--routings 8] [--iters 40] [--dump-dir DIR] [--sweep] [--sweep-sm90]\n");
      return 2;
    }
  }
  try {
    return fusedmoe::bench::run_cuda_bench(o);
  } catch (const std::exception& e) {  // e.g. a --dump-dir file that cannot be written
    std::fprintf(stderr, "bench_cuda_moe: error: %s\n", e.what());
    return 1;
  }
}
