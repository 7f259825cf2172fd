// Helpers shared by the GPU binding files (gpu.cc, gpu_repair.cc, gpu_vc.cc): raw device pointers
// travel as ints, token tensors as (pointer, stride_batch, stride_seq, stride_head) tuples, and a
// non-ok Status becomes ValueError (invalid argument) or RuntimeError.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>

#include "openvc/attention.h"
#include "openvc/status.h"

namespace openvc_bindings {

namespace nb = nanobind;

// (data pointer, stride_batch, stride_seq, stride_head), strides in elements.
using View = std::tuple<uintptr_t, int64_t, int64_t, int64_t>;

inline void check(const openvc::Status& st) {
  if (st.ok()) return;
  if (st.code() == openvc::StatusCode::kInvalidArgument) throw nb::value_error(st.message().c_str());
  throw std::runtime_error(st.message());
}

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

inline openvc::TokenTensorView view(const View& v) {
  openvc::TokenTensorView t;
  t.data = ptr<const void>(std::get<0>(v));
  t.stride_batch = std::get<1>(v);
  t.stride_seq = std::get<2>(v);
  t.stride_head = std::get<3>(v);
  return t;
}

// The sized pointers of prepared FP8 inputs, as every attention binding receives them.
inline openvc::Fp8Inputs fp8_inputs(int batch, int seqlen_q, int seqlen_k, int heads, int head_dim,
                                    uintptr_t q_codes, uintptr_t q_descale, uintptr_t k_codes, uintptr_t k_descale,
                                    uintptr_t v_packed, uintptr_t v_descale) {
  openvc::Fp8Inputs in;
  in.batch = batch, in.seqlen_q = seqlen_q, in.seqlen_k = seqlen_k, in.heads = heads, in.head_dim = head_dim;
  in.q_codes = ptr<const uint8_t>(q_codes), in.q_descale = ptr<const float>(q_descale);
  in.k_codes = ptr<const uint8_t>(k_codes), in.k_descale = ptr<const float>(k_descale);
  in.v_packed = ptr<const uint8_t>(v_packed), in.v_descale = ptr<const float>(v_descale);
  return in;
}

// The output side every attention parameter struct shares (AttentionParams, GeneralAttentionParams,
// VcAttentionParams): out with element strides, optional LSE (0: none), softmax scale.
template <typename Params>
void set_output(Params& p, uintptr_t out, int64_t out_stride_batch, int64_t out_stride_seq, int64_t out_stride_head,
                uintptr_t lse, float softmax_scale) {
  p.out = ptr<void>(out);
  p.out_stride_batch = out_stride_batch, p.out_stride_seq = out_stride_seq, p.out_stride_head = out_stride_head;
  p.lse = ptr<float>(lse);
  p.softmax_scale = softmax_scale;
}

// Runs an API call that only enqueues work (it returns a Status) with the GIL released, so other
// Python threads need not wait on the launches, then raises on a non-ok Status.
template <typename Call>
void enqueue(Call&& call) {
  openvc::Status st;
  {
    nb::gil_scoped_release release;
    st = call();
  }
  check(st);
}

}  // namespace openvc_bindings
