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

}  // namespace openvc_bindings
