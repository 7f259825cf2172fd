// The device pointers every attention call needs, named as the error messages name them. The fast and
// the general path check the same list; each adds its own alignment rules.
#pragma once
#include <array>
#include <type_traits>
#include "openvc/attention.h"  // Fp8Inputs

namespace openvc {

struct NamedPointer {
  const void* ptr;
  const char* name;
};

// Params: AttentionParams or GeneralAttentionParams (both hold `in` and `out`).
// With AttentionParams::q_unquantized set, Q is that tensor instead of in.q_codes / in.q_descale.
template <class Params>
std::array<NamedPointer, 7> call_pointers(const Params& p) {
  const Fp8Inputs& in = p.in;
  if constexpr (std::is_same_v<Params, AttentionParams>) {
    if (p.q_unquantized.data != nullptr)
      return {{{p.q_unquantized.data, "q_unquantized.data"}, {in.k_codes, "in.k_codes"}, {in.v_packed, "in.v_packed"},
               {p.q_unquantized.data, "q_unquantized.data"}, {in.k_descale, "in.k_descale"},
               {in.v_descale, "in.v_descale"}, {p.out, "out"}}};
  }
  return {{{in.q_codes, "in.q_codes"}, {in.k_codes, "in.k_codes"}, {in.v_packed, "in.v_packed"},
           {in.q_descale, "in.q_descale"}, {in.k_descale, "in.k_descale"}, {in.v_descale, "in.v_descale"},
           {p.out, "out"}}};
}

}  // namespace openvc
