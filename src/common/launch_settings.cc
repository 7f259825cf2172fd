// include/openvc/launch.h: the setting is read at every launch (one relaxed atomic load), so that a caller
// can compare both launch forms in one process.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "openvc/launch.h"

namespace openvc {
namespace {

std::atomic<int>& pdl_setting() {   // -1: not yet read from the environment
  static std::atomic<int> setting{-1};
  return setting;
}

}  // namespace

bool programmatic_launch() {
  std::atomic<int>& s = pdl_setting();
  int v = s.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("OPENVC_PDL");
    const int from_env = env != nullptr && std::strcmp(env, "0") == 0 ? 0 : 1;
    s.compare_exchange_strong(v, from_env, std::memory_order_relaxed);   // a concurrent set wins
    v = s.load(std::memory_order_relaxed);
  }
  return v != 0;
}

bool set_programmatic_launch(bool on) {
  const bool previous = programmatic_launch();
  pdl_setting().store(on ? 1 : 0, std::memory_order_relaxed);
  return previous;
}

}  // namespace openvc
