// Pointer alignment, for the host-side argument checks of every entry point (TMA, vector loads and
// the workspace layouts need 16-byte, 4-byte or element alignment). Host code only.
#pragma once
#include <cstdint>

namespace openvc {

inline bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace openvc
