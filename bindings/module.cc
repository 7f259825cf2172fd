// _openvc_ext: the nanobind module of open_vc_attn. This file binds the CPU reference of
// docs/numerics.md (numpy in, numpy out; argument checks with readable messages live in
// open_vc_attn/reference.py, long calls drop the GIL); the GPU entry points and their parameter
// structs are registered by register_gpu (gpu.cc), register_gpu_call (gpu_call.cc), register_vc
// (gpu_vc.cc), register_repair (gpu_repair.cc) and register_rotary (gpu_rotary.cc). A non-ok Status
// becomes ValueError (InvalidArgument) or RuntimeError (util.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "openvc/reference.h"
#include "openvc/status.h"
#include "util.h"

namespace nb = nanobind;
namespace ref = openvc::reference;

void register_gpu(nb::module_& m);  // gpu.cc
void register_vc(nb::module_& m);   // gpu_vc.cc
void register_repair(nb::module_& m);  // gpu_repair.cc
void register_gpu_call(nb::module_& m);  // gpu_call.cc
void register_rotary(nb::module_& m);  // gpu_rotary.cc

namespace {

template <typename T>
using In = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <typename T>
using Out = nb::ndarray<nb::numpy, T, nb::c_contig>;
using CuSeqlens = std::optional<std::vector<int>>;

using openvc_bindings::check;

[[noreturn]] void invalid(const std::string& msg) { throw nb::value_error(msg.c_str()); }

// Hands a vector to numpy without a copy: the capsule owns it and frees it with the array.
template <typename T>
Out<T> to_numpy(std::vector<T>&& v, const std::vector<size_t>& shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  if (n != v.size()) throw std::runtime_error("internal: result size does not match its shape");
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return Out<T>(heap->data(), shape.size(), shape.data(), owner);
}

template <typename A>
std::vector<size_t> shape_of(const A& a) {
  std::vector<size_t> s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = a.shape(i);
  return s;
}

int to_int(size_t v, const char* name) {
  if (v > static_cast<size_t>(INT_MAX)) invalid(std::string(name) + ": dimension too large for int");
  return static_cast<int>(v);
}

// [B,S,H,D] -> batched sequences (cu_seqlens must be None); [T,H,D] -> packed with cu_seqlens, or one
// sequence of T tokens when cu_seqlens is None.
template <typename A>
ref::Sequences sequences_of(const A& x, const CuSeqlens& cu, const char* name) {
  ref::Sequences seqs;
  if (x.ndim() == 4) {
    if (cu) invalid(std::string(name) + ": cu_seqlens needs a packed [T, H, D] array, got rank 4");
    seqs = ref::Sequences::Batched(to_int(x.shape(0), name), to_int(x.shape(1), name),
                                   to_int(x.shape(2), name), to_int(x.shape(3), name));
  } else if (x.ndim() == 3) {
    const int total = to_int(x.shape(0), name);
    seqs.cu_seqlens = cu ? *cu : std::vector<int>{0, total};
    seqs.num_heads = to_int(x.shape(1), name);
    seqs.head_dim = to_int(x.shape(2), name);
    if (seqs.cu_seqlens.empty() || seqs.cu_seqlens.back() != total)
      invalid(std::string(name) + ": cu_seqlens must end at the token count " + std::to_string(total));
  } else {
    invalid(std::string(name) + ": expected rank 4 [B, S, H, D] or rank 3 [T, H, D], got rank " +
            std::to_string(x.ndim()));
  }
  check(seqs.validate(name));
  return seqs;
}

// lse / per-group tensors: [B, H, S] for a batch, [nseq, H, max_len] for packed input.
std::vector<size_t> group_shape(const ref::Sequences& s, size_t last) {
  return {static_cast<size_t>(s.count()), static_cast<size_t>(s.num_heads), last};
}

template <typename A>
void same_heads(const A& a, const A& b, const char* na, const char* nb_) {
  const size_t ra = a.ndim(), rb = b.ndim();
  if (ra < 3 || rb < 3) invalid(std::string(ra < 3 ? na : nb_) + ": expected rank 3 or 4");
  if (ra != rb || a.shape(ra - 2) != b.shape(rb - 2) || a.shape(ra - 1) != b.shape(rb - 1))
    invalid(std::string(nb_) + ": rank, heads and head_dim must match " + na);
}

ref::AttentionOptions options(float softmax_scale, int query_tile, int key_tile, int mid_window_blocks,
                              bool causal) {
  ref::AttentionOptions opt;
  opt.softmax_scale = softmax_scale;
  opt.query_tile = query_tile;
  opt.key_tile = key_tile;
  opt.mid_window_blocks = mid_window_blocks;
  opt.causal = causal;
  return opt;
}

nb::tuple result_tuple(ref::AttentionResult&& res, const std::vector<size_t>& out_shape,
                       const ref::Sequences& q_seqs) {
  const size_t max_len = static_cast<size_t>(q_seqs.max_length());
  auto lse_shape = group_shape(q_seqs, max_len);
  return nb::make_tuple(to_numpy(std::move(res.out), out_shape), to_numpy(std::move(res.lse), lse_shape),
                        res.rescales);
}

nb::dict repair_dict(ref::VRepair&& r, const ref::Sequences& seqs) {
  nb::dict d;
  const size_t rows = r.tokens.size();
  d["tokens_per_head"] = r.tokens_per_head;
  const std::vector<size_t> gs = {static_cast<size_t>(seqs.count()), static_cast<size_t>(seqs.num_heads)};
  d["count"] = to_numpy(std::move(r.count), gs);
  d["offset"] = to_numpy(std::move(r.offset), gs);
  d["tokens"] = to_numpy(std::move(r.tokens), {rows});
  d["codes"] = to_numpy(std::move(r.codes), {rows, static_cast<size_t>(seqs.head_dim)});
  return d;
}

// ---- element-wise helpers ---------------------------------------------------------------------------
Out<uint8_t> e4m3_encode(In<float> x) {
  std::vector<uint8_t> out(x.size());
  const float* p = x.data();
  for (size_t i = 0; i < out.size(); ++i) out[i] = ref::e4m3_encode(p[i]);
  return to_numpy(std::move(out), shape_of(x));
}

Out<float> e4m3_decode(In<uint8_t> c) {
  std::vector<float> out(c.size());
  const uint8_t* p = c.data();
  for (size_t i = 0; i < out.size(); ++i) out[i] = ref::e4m3_decode(p[i]);
  return to_numpy(std::move(out), shape_of(c));
}

Out<float> round_to_bf16(In<float> x) {
  std::vector<float> out(x.size());
  const float* p = x.data();
  for (size_t i = 0; i < out.size(); ++i) out[i] = ref::round_to_bf16(p[i]);
  return to_numpy(std::move(out), shape_of(x));
}

// Arrays of one shape (Python broadcasts them first).
Out<uint8_t> expcast_code(In<float> acc, In<float> a, In<float> row_max) {
  if (a.size() != acc.size() || row_max.size() != acc.size())
    invalid("expcast_code: acc, a and row_max must have the same number of elements");
  std::vector<uint8_t> out(acc.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = ref::expcast_code(acc.data()[i], a.data()[i], row_max.data()[i]);
  return to_numpy(std::move(out), shape_of(acc));
}

// ---- quantization -----------------------------------------------------------------------------------
nb::tuple quantize_blocks(In<float> x, CuSeqlens cu) {
  ref::Sequences seqs = sequences_of(x, cu, "x");
  ref::BlockQuantized q;
  openvc::Status st;
  {
    nb::gil_scoped_release release;
    st = ref::quantize_blocks(x.data(), seqs, &q);
  }
  check(st);
  return nb::make_tuple(to_numpy(std::move(q.codes), shape_of(x)),
                        to_numpy(std::move(q.descale), group_shape(seqs, q.max_blocks)));
}

nb::tuple quantize_heads(In<float> x, CuSeqlens cu) {
  ref::Sequences seqs = sequences_of(x, cu, "x");
  ref::HeadQuantized q;
  openvc::Status st;
  {
    nb::gil_scoped_release release;
    st = ref::quantize_heads(x.data(), seqs, &q);
  }
  check(st);
  const std::vector<size_t> gs = {static_cast<size_t>(seqs.count()), static_cast<size_t>(seqs.num_heads)};
  return nb::make_tuple(to_numpy(std::move(q.codes), shape_of(x)), to_numpy(std::move(q.descale), gs),
                        to_numpy(std::move(q.scale_inv), gs));
}

nb::dict select_v_repair(In<float> v, double budget, CuSeqlens cu) {
  ref::Sequences seqs = sequences_of(v, cu, "v");
  ref::HeadQuantized vq;
  ref::VRepair repair;
  openvc::Status st;
  {
    nb::gil_scoped_release release;
    st = ref::quantize_heads(v.data(), seqs, &vq);
    if (st.ok()) st = ref::select_v_repair(v.data(), seqs, vq, budget, &repair);
  }
  check(st);
  return repair_dict(std::move(repair), seqs);
}

// ---- attention --------------------------------------------------------------------------------------
nb::tuple attention_expcast(In<float> q, In<float> k, In<float> v, CuSeqlens cu_q, CuSeqlens cu_k,
                            float softmax_scale, int query_tile, int key_tile, int mid_window_blocks,
                            bool causal, double repair_budget) {
  same_heads(q, k, "q", "k");
  same_heads(k, v, "k", "v");
  if (shape_of(k) != shape_of(v)) invalid("v: shape must equal k's shape");
  ref::Sequences qs = sequences_of(q, cu_q, "q"), ks = sequences_of(k, cu_k, "k");
  const auto opt = options(softmax_scale, query_tile, key_tile, mid_window_blocks, causal);
  ref::PreparedInputs in;
  ref::VRepair repair;
  ref::AttentionResult res;
  openvc::Status st;
  {
    nb::gil_scoped_release release;
    st = ref::prepare_inputs(q.data(), k.data(), v.data(), qs, ks, &in);
    // A zero budget is the plain path; anything else (NaN included) goes through the budget check.
    if (st.ok() && repair_budget != 0.0) {
      st = ref::select_v_repair(v.data(), ks, in.v, repair_budget, &repair);
      in.repair = &repair;
    }
    if (st.ok()) st = ref::attention_expcast(in, opt, &res);
  }
  check(st);
  return result_tuple(std::move(res), shape_of(q), qs);
}

nb::tuple attention_exact(In<float> q, In<float> k, In<float> v, CuSeqlens cu_q, CuSeqlens cu_k,
                          float softmax_scale, bool causal) {
  same_heads(q, k, "q", "k");
  same_heads(k, v, "k", "v");
  if (shape_of(k) != shape_of(v)) invalid("v: shape must equal k's shape");
  ref::Sequences qs = sequences_of(q, cu_q, "q"), ks = sequences_of(k, cu_k, "k");
  std::vector<double> out, lse;
  openvc::Status st;
  {
    nb::gil_scoped_release release;
    st = ref::attention_exact(q.data(), k.data(), v.data(), qs, ks, softmax_scale, causal, &out, &lse);
  }
  check(st);
  return nb::make_tuple(to_numpy(std::move(out), shape_of(q)),
                        to_numpy(std::move(lse), group_shape(qs, qs.max_length())));
}

Out<int> vc_grouping(In<float> v, CuSeqlens cu) {
  ref::Sequences seqs = sequences_of(v, cu, "v");
  std::vector<int> perm;
  openvc::Status st;
  {
    nb::gil_scoped_release release;
    st = ref::vc_grouping(v.data(), seqs, &perm);
  }
  check(st);
  return to_numpy(std::move(perm), group_shape(seqs, seqs.max_length()));
}

nb::tuple attention_vc(In<float> q, In<float> k, In<float> v, std::optional<In<int>> permutation,
                       CuSeqlens cu_q, CuSeqlens cu_k, float softmax_scale, int query_tile, int key_tile,
                       bool causal) {
  same_heads(q, k, "q", "k");
  same_heads(k, v, "k", "v");
  if (shape_of(k) != shape_of(v)) invalid("v: shape must equal k's shape");
  ref::Sequences qs = sequences_of(q, cu_q, "q"), ks = sequences_of(k, cu_k, "k");
  std::vector<int> perm;
  if (permutation) {
    const size_t want = static_cast<size_t>(ks.count()) * ks.num_heads * ks.max_length();
    if (permutation->size() != want)
      invalid("permutation: expected " + std::to_string(want) + " entries ([nseq, H, max_len_k]), got " +
              std::to_string(permutation->size()));
    perm.assign(permutation->data(), permutation->data() + want);
  }
  const auto opt = options(softmax_scale, query_tile, key_tile, ref::kNaturalOrder, causal);
  ref::AttentionResult res;
  openvc::Status st;
  {
    nb::gil_scoped_release release;
    if (!permutation) st = ref::vc_grouping(v.data(), ks, &perm);
    if (st.ok()) st = ref::attention_vc(q.data(), k.data(), v.data(), qs, ks, perm, opt, &res);
  }
  check(st);
  return result_tuple(std::move(res), shape_of(q), qs);
}

nb::dict compare(In<float> out, In<double> reference) {
  if (out.size() != reference.size()) invalid("compare: out and ref must have the same number of elements");
  ref::ErrorMetrics m;
  {
    nb::gil_scoped_release release;
    m = ref::compare(out.data(), reference.data(), static_cast<int64_t>(out.size()));
  }
  nb::dict d;
  d["rel_l2"] = m.rel_l2;
  d["max_abs"] = m.max_abs;
  d["rmse"] = m.rmse;
  d["cosine"] = m.cosine;
  return d;
}

}  // namespace

NB_MODULE(_openvc_ext, m) {
  m.doc() = "openvc: CPU reference and GPU entry points (use open_vc_attn's Python API instead)";
  m.attr("QUANT_BLOCK") = ref::kQuantBlock;
  m.attr("E4M3_MAX") = ref::kE4M3Max;
  m.attr("MAX_CODE") = ref::kMaxCode;
  m.attr("NATURAL_ORDER") = ref::kNaturalOrder;
  m.attr("VC_CLUSTERS") = ref::kVcClusters;
  m.attr("VC_ITERATIONS") = ref::kVcIterations;

  m.def("e4m3_encode", &e4m3_encode, nb::arg("x"));
  m.def("e4m3_decode", &e4m3_decode, nb::arg("codes"));
  m.def("round_to_bf16", &round_to_bf16, nb::arg("x"));
  m.def("expcast_code", &expcast_code, nb::arg("acc"), nb::arg("a"), nb::arg("row_max"));
  m.def("expcast_multiplier", &ref::expcast_multiplier, nb::arg("softmax_scale"), nb::arg("descale_q"),
        nb::arg("descale_k"));
  m.def("key_block_order", &ref::key_block_order, nb::arg("diag"), nb::arg("n"), nb::arg("mid_window_blocks"));
  m.def("diagonal_block", &ref::diagonal_block, nb::arg("first_query_row"), nb::arg("sq"), nb::arg("sk"),
        nb::arg("key_tile"));
  m.def("quantize_blocks", &quantize_blocks, nb::arg("x"), nb::arg("cu_seqlens") = nb::none());
  m.def("quantize_heads", &quantize_heads, nb::arg("x"), nb::arg("cu_seqlens") = nb::none());
  m.def("select_v_repair", &select_v_repair, nb::arg("v"), nb::arg("budget"), nb::arg("cu_seqlens") = nb::none());
  m.def("attention_expcast", &attention_expcast, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("cu_seqlens_q") = nb::none(), nb::arg("cu_seqlens_k") = nb::none(),
        nb::arg("softmax_scale") = 0.0f, nb::arg("query_tile") = 128, nb::arg("key_tile") = 128,
        nb::arg("mid_window_blocks") = ref::AttentionOptions{}.mid_window_blocks, nb::arg("causal") = false,
        nb::arg("repair_budget") = 0.0,
        "Returns (out float32 [q's shape], lse float32 [nseq, H, max_q_len], rescales).");
  m.def("attention_exact", &attention_exact, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("cu_seqlens_q") = nb::none(), nb::arg("cu_seqlens_k") = nb::none(),
        nb::arg("softmax_scale") = 0.0f, nb::arg("causal") = false,
        "Returns (out float64 [q's shape], lse float64 [nseq, H, max_q_len]).");
  m.def("vc_grouping", &vc_grouping, nb::arg("v"), nb::arg("cu_seqlens") = nb::none());
  m.def("attention_vc", &attention_vc, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("permutation") = nb::none(), nb::arg("cu_seqlens_q") = nb::none(),
        nb::arg("cu_seqlens_k") = nb::none(), nb::arg("softmax_scale") = 0.0f, nb::arg("query_tile") = 128,
        nb::arg("key_tile") = 128, nb::arg("causal") = false);
  m.def("compare", &compare, nb::arg("out"), nb::arg("ref"));
  register_gpu(m);
  register_gpu_call(m);
  register_vc(m);
  register_repair(m);
  register_rotary(m);
}
