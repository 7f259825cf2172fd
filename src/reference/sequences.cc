// Sequences: packed-sequence descriptions, their validation, and the per-group thread pool.
#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <string>

#include "reference/internal.h"

namespace openvc::reference {

int Sequences::max_length() const {
  int m = 0;
  for (int s = 0; s < count(); ++s) m = std::max(m, length(s));
  return m;
}

Sequences Sequences::Batched(int batch, int seqlen, int num_heads, int head_dim) {
  Sequences s;
  s.num_heads = num_heads;
  s.head_dim = head_dim;
  s.cu_seqlens.push_back(0);
  for (int b = 0; b < batch; ++b) s.cu_seqlens.push_back(s.cu_seqlens.back() + seqlen);
  return s;
}

Status Sequences::validate(const char* name) const {
  const std::string n = name ? name : "sequences";
  if (num_heads <= 0) return Status::Invalid(n + ": num_heads must be > 0, got " + std::to_string(num_heads));
  if (head_dim <= 0) return Status::Invalid(n + ": head_dim must be > 0, got " + std::to_string(head_dim));
  if (cu_seqlens.size() < 2) {
    return Status::Invalid(n + ": cu_seqlens must hold at least 2 offsets (one sequence), got " +
                           std::to_string(cu_seqlens.size()));
  }
  if (cu_seqlens[0] != 0) {
    return Status::Invalid(n + ": cu_seqlens[0] must be 0, got " + std::to_string(cu_seqlens[0]));
  }
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    if (cu_seqlens[i] < cu_seqlens[i - 1]) {
      return Status::Invalid(n + ": cu_seqlens must be non-decreasing, but cu_seqlens[" + std::to_string(i) +
                             "] = " + std::to_string(cu_seqlens[i]) + " < cu_seqlens[" + std::to_string(i - 1) +
                             "] = " + std::to_string(cu_seqlens[i - 1]));
    }
  }
  return Status::Ok();
}

namespace internal {

void parallel_for(int n, const std::function<void(int)>& f) {
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int i = next++; i < n; i = next++) f(i);
  };
  const int extra = std::min(n, static_cast<int>(std::thread::hardware_concurrency())) - 1;
  std::vector<std::thread> pool;
  for (int t = 0; t < extra; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // fewer threads, same results
    }
  }
  worker();
  for (auto& th : pool) th.join();
}

Status check_sequence_pair(const Sequences& q_seqs, const Sequences& k_seqs) {
  OPENVC_RETURN_IF_ERROR(q_seqs.validate("q_seqs"));
  OPENVC_RETURN_IF_ERROR(k_seqs.validate("k_seqs"));
  if (q_seqs.count() != k_seqs.count()) {
    return Status::Invalid("k_seqs: sequence count must equal q_seqs's (" + std::to_string(q_seqs.count()) +
                           "), got " + std::to_string(k_seqs.count()));
  }
  if (q_seqs.num_heads != k_seqs.num_heads) {
    return Status::Invalid("k_seqs: num_heads must equal q_seqs's (" + std::to_string(q_seqs.num_heads) +
                           "), got " + std::to_string(k_seqs.num_heads));
  }
  if (q_seqs.head_dim != k_seqs.head_dim) {
    return Status::Invalid("k_seqs: head_dim must equal q_seqs's (" + std::to_string(q_seqs.head_dim) +
                           "), got " + std::to_string(k_seqs.head_dim));
  }
  return Status::Ok();
}

}  // namespace internal
}  // namespace openvc::reference
