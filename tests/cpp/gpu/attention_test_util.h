// Host-side helpers shared by the attention GPU suites (fast path, general path, VC): reference V codes
// in the kernels' packed layout, and BF16 output bits as floats.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#include "openvc/attention.h"
#include "openvc/reference.h"

namespace openvc::testing {

// Reference V codes [total_k, H, D] -> [nseq, H, D, nk*128] (prepare_fp8's layout): each sequence from
// column 0 of its own slab, keys permuted per kPackedKeyOrder inside each 16-key group, zero padding.
// A batch [B, S, H, D] is reference::Sequences::Batched(B, S, H, D) with nk = ceil(S / 128).
inline std::vector<uint8_t> pack_v(const std::vector<uint8_t>& codes, const reference::Sequences& ks, int nk) {
  const int H = ks.num_heads, D = ks.head_dim, sp = nk * kQuantBlock;
  std::vector<uint8_t> out(size_t(ks.count()) * H * D * sp, 0);
  for (int s = 0; s < ks.count(); ++s)
    for (int h = 0; h < H; ++h)
      for (int col = 0; col < sp; ++col) {
        const int key = (col / 16) * 16 + kPackedKeyOrder[col % 16];
        if (key >= ks.length(s)) continue;
        for (int d = 0; d < D; ++d)
          out[((size_t(s) * H + h) * D + d) * sp + col] = codes[(size_t(ks.cu_seqlens[s] + key) * H + h) * D + d];
      }
  return out;
}

inline std::vector<uint8_t> pack_v(const std::vector<uint8_t>& codes, int B, int S, int H, int D) {
  return pack_v(codes, reference::Sequences::Batched(B, S, H, D), int(num_quant_blocks(S)));
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace openvc::testing
