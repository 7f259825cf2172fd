// Helpers shared by the binding files (module.cc, gpu.cc, gpu_repair.cc, gpu_vc.cc): the one Status ->
// Python exception mapping, and the binders that turn a C++ parameter struct into a Python class whose
// fields are set by name (device pointers travel as ints, e.g. torch's data_ptr(); 0 is nullptr).
// Adding a field to a C++ struct is one OPENVC_FIELD line in its binding.
#pragma once
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

#include "openvc/status.h"

namespace openvc_bindings {

namespace nb = nanobind;

// InvalidArgument -> ValueError, anything else -> RuntimeError.
inline void check(const openvc::Status& st) {
  if (st.ok()) return;
  if (st.code() == openvc::StatusCode::kInvalidArgument) throw nb::value_error(st.message().c_str());
  throw std::runtime_error(st.message());
}

// A read-write property for the struct member `Member`: pointers as uintptr_t, everything else (ints,
// floats, enums, nested bound structs, returned by reference so `p.in_.batch = 1` sets it in place) as is.
template <auto Member, typename C>
void field(nb::class_<C>& cls, const char* name) {
  using T = std::remove_reference_t<decltype(std::declval<C&>().*Member)>;
  if constexpr (std::is_pointer_v<T>) {
    cls.def_prop_rw(
        name, [](const C& p) { return reinterpret_cast<uintptr_t>(p.*Member); },
        [](C& p, uintptr_t v) { p.*Member = reinterpret_cast<T>(v); });
  } else {
    cls.def_rw(name, Member);
  }
}
#define OPENVC_FIELD(cls, Struct, member) ::openvc_bindings::field<&Struct::member>(cls, #member)

// A default-constructible parameter struct as a Python class (fields added with OPENVC_FIELD).
template <typename C>
nb::class_<C> params_class(nb::module_& m, const char* name, const char* doc) {
  nb::class_<C> cls(m, name, doc);
  cls.def(nb::init<>());
  return cls;
}

// Binds `fn(const Params&, cudaStream_t) -> Status` as `name(params, stream)`: the call only enqueues
// work, so it runs with the GIL released (other Python threads need not wait on the launches), then a
// non-ok Status raises.
template <typename Params, openvc::Status (*Fn)(const Params&, cudaStream_t)>
void def_enqueue(nb::module_& m, const char* name, const char* doc) {
  m.def(
      name,
      [](const Params& p, uintptr_t stream) {
        openvc::Status st;
        {
          nb::gil_scoped_release release;
          st = Fn(p, reinterpret_cast<cudaStream_t>(stream));
        }
        check(st);
      },
      nb::arg("params"), nb::arg("stream"), doc);
}

}  // namespace openvc_bindings
