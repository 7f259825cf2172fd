// Shared helpers of the preparation suites (test_prepare.cu, test_prepare_varlen.cu): 16-bit inputs
// with their exact float values, strided device copies with poisoned gaps, byte comparisons.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "openvc/attention.h"

namespace openvc::testing {

using openvc::PrepareParams;

inline uint16_t to_bits(DType t, float x) {
  uint16_t b;
  if (t == DType::kBFloat16) {
    const __nv_bfloat16 v = __float2bfloat16_rn(x);
    std::memcpy(&b, &v, 2);
  } else {
    const __half v = __float2half_rn(x);
    std::memcpy(&b, &v, 2);
  }
  return b;
}
inline float from_bits(DType t, uint16_t b) {
  if (t == DType::kBFloat16) {
    __nv_bfloat16 v;
    std::memcpy(&v, &b, 2);
    return __bfloat162float(v);
  }
  __half v;
  std::memcpy(&v, &b, 2);
  return __half2float(v);
}

// A logical [B, S, H, D] tensor (packed [total, H, D] sequences: B = 1, S = total): the 16-bit values
// and their exact float values.
struct Tensor {
  int B = 0, S = 0, H = 0, D = 0;
  std::vector<uint16_t> bits;
  std::vector<float> values;
  int64_t index(int b, int s, int h, int d) const { return ((int64_t(b) * S + s) * H + h) * D + d; }
  void set(DType t, int64_t i, float x) {
    bits[i] = to_bits(t, x);
    values[i] = from_bits(t, bits[i]);
  }
};

// Fresh normal values, never zero after rounding, with about 1 in 2000 an outlier of 20 to 200.
inline Tensor random_tensor(DType t, int B, int S, int H, int D, std::mt19937& rng) {
  Tensor x{B, S, H, D, {}, {}};
  const size_t n = size_t(B) * S * H * D;
  x.bits.resize(n);
  x.values.resize(n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    float v;
    do {
      v = normal(rng);
      if (uni(rng) < 5e-4f) v *= 20.0f + 180.0f * uni(rng);
    } while (from_bits(t, to_bits(t, v)) == 0.0f);
    x.set(t, int64_t(i), v);
  }
  return x;
}

// Strides of the device copy, in elements (all multiples of 8, as prepare_fp8 requires).
enum class Layout { kContiguous, kPadded };
struct Strides {
  int64_t b, s, h;
};
inline Strides strides_of(Layout l, int S, int H, int D) {
  if (l == Layout::kContiguous) return {int64_t(S) * H * D, int64_t(H) * D, D};
  const int64_t sh = D + 16, ss = H * sh + 8;  // gaps between heads and tokens hold poison
  return {S * ss + 64, ss, sh};
}

// Device copy of x with the given strides; gaps hold a huge value that would show up in any amax.
struct DevTensor {
  DevBuf buf;
  Strides st;
  DevTensor(DType t, const Tensor& x, Strides s)
      : buf(size_t((x.B - 1) * s.b + (x.S - 1) * s.s + (x.H - 1) * s.h + x.D) * 2), st(s) {
    std::vector<uint16_t> staging(buf.bytes / 2, to_bits(t, 30000.0f));
    for (int b = 0; b < x.B; ++b)
      for (int i = 0; i < x.S; ++i)
        for (int h = 0; h < x.H; ++h)
          std::memcpy(&staging[b * s.b + i * s.s + h * s.h], &x.bits[x.index(b, i, h, 0)], size_t(x.D) * 2);
    if (buf.p) cudaMemcpy(buf.p, staging.data(), buf.bytes, cudaMemcpyHostToDevice);
  }
  TokenTensorView view() const { return {buf.p, st.b, st.s, st.h}; }
};

inline std::string hex(unsigned v) {
  std::ostringstream o;
  o << "0x" << std::hex << v;
  return o.str();
}

// Byte comparison of token-major codes [B, S, H, D]; reports the count and the first difference.
inline void expect_codes(const char* what, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                         const Tensor& x) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && bad++ == 0) first = int64_t(i);
  if (bad == 0) return;
  const int64_t d = first % x.D, h = first / x.D % x.H, s = first / (int64_t(x.D) * x.H) % x.S,
                b = first / (int64_t(x.D) * x.H * x.S);
  ADD_FAILURE() << what << ": " << bad << " of " << got.size() << " codes differ; first at b=" << b << " s=" << s
                << " h=" << h << " d=" << d << " (x=" << x.values[first] << "): got " << hex(got[first])
                << ", reference " << hex(want[first]);
}

// Bitwise comparison of descales.
inline void expect_floats(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], 4) != 0) {
      uint32_t g, w;
      std::memcpy(&g, &got[i], 4);
      std::memcpy(&w, &want[i], 4);
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " (" << hex(g) << "), reference " << want[i] << " ("
                    << hex(w) << ")";
      return;
    }
  }
}

// Host copies of one preparation's outputs.
struct PreparedHost {
  std::vector<uint8_t> q_codes, k_codes, v_packed;
  std::vector<float> q_descale, k_descale, v_descale;
};

// Device outputs and workspace of one preparation (batched or packed): bound into PrepareParams,
// poisoned before a run and read back after it.
struct PreparedDevice {
  DevBuf q_codes, k_codes, v_packed, q_descale, k_descale, v_descale, workspace;

  // groups = sequences (or batch) x heads; nq, nk = Q and K descale blocks per group.
  PreparedDevice(size_t q_bytes, size_t k_bytes, size_t v_packed_bytes, size_t groups, int nq, int nk,
                 size_t workspace_bytes)
      : q_codes(q_bytes),
        k_codes(k_bytes),
        v_packed(v_packed_bytes),
        q_descale(groups * nq * 4),
        k_descale(groups * nk * 4),
        v_descale(groups * 4),
        workspace(workspace_bytes) {}
  void bind(PrepareParams& p) const {
    p.q_codes = q_codes.as<uint8_t>();
    p.k_codes = k_codes.as<uint8_t>();
    p.v_packed = v_packed.as<uint8_t>();
    p.q_descale = q_descale.as<float>();
    p.k_descale = k_descale.as<float>();
    p.v_descale = v_descale.as<float>();
    p.workspace = workspace.p;
    p.workspace_bytes = workspace.bytes;
  }
  bool allocated() const {
    return q_codes.p && k_codes.p && v_packed.p && q_descale.p && k_descale.p && v_descale.p && workspace.p;
  }
  // 0xAB everywhere, the workspace too: the kernels must write every output byte and zero the
  // V amax slots themselves.
  void poison(cudaStream_t st) const {
    for (const DevBuf* b : {&q_codes, &k_codes, &v_packed, &q_descale, &k_descale, &v_descale, &workspace})
      cudaMemsetAsync(b->p, 0xAB, b->bytes, st);
  }
  // The first q_count / k_count code bytes (the buffers may be padded), all descales and packed V.
  PreparedHost read(size_t q_count, size_t k_count) const {
    return {download<uint8_t>(q_codes.p, q_count),          download<uint8_t>(k_codes.p, k_count),
            download<uint8_t>(v_packed.p, v_packed.bytes),   download<float>(q_descale.p, q_descale.bytes / 4),
            download<float>(k_descale.p, k_descale.bytes / 4), download<float>(v_descale.p, v_descale.bytes / 4)};
  }
};

// ---- argument tests (prepare_fp8 fails before any CUDA call) ----------------------------------------

inline void* fake_address(uintptr_t a) { return reinterpret_cast<void*>(a); }

// Every output and the workspace at fake, aligned addresses (0x20000 .. 0x80000): the argument tests build
// one valid parameter set on them and break one field at a time.
inline void bind_fake_outputs(PrepareParams& p) {
  p.q_codes = static_cast<uint8_t*>(fake_address(0x20000));
  p.k_codes = static_cast<uint8_t*>(fake_address(0x30000));
  p.v_packed = static_cast<uint8_t*>(fake_address(0x40000));
  p.q_descale = static_cast<float*>(fake_address(0x50000));
  p.k_descale = static_cast<float*>(fake_address(0x60000));
  p.v_descale = static_cast<float*>(fake_address(0x70000));
  p.workspace = fake_address(0x80000);
}

// prepare_fp8 refuses p with `code`, in a message naming `names`.
inline void expect_rejected(const PrepareParams& p, StatusCode code, const std::string& names) {
  const Status st = prepare_fp8(p, nullptr);
  EXPECT_EQ(int(st.code()), int(code)) << st.message();
  EXPECT_NE(st.message().find(names), std::string::npos) << "message should name " << names << ": " << st.message();
}
inline void expect_invalid(const PrepareParams& p, const std::string& names) {
  expect_rejected(p, StatusCode::kInvalidArgument, names);
}

}  // namespace openvc::testing
