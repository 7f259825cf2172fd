// Section 8: error metrics of an output against a double-precision reference.
#include <algorithm>
#include <cmath>
#include <limits>

#include "reference/internal.h"

namespace openvc::reference {

// Null pointers with n > 0 give NaN metrics (there is no Status to return); n <= 0 gives zeros.
// Degenerate norms: rel_l2 is 0 when both are zero and inf when only the reference is; cosine is 1
// when both are zero and 0 when only one is.
ErrorMetrics compare(const float* out, const double* ref, int64_t n) {
  ErrorMetrics m;
  if (n <= 0) return m;
  if (out == nullptr || ref == nullptr) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    return ErrorMetrics{nan, nan, nan, nan};
  }
  double diff2 = 0, ref2 = 0, out2 = 0, cross = 0, max_abs = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double o = out[i], r = ref[i], d = o - r;
    diff2 += d * d;
    ref2 += r * r;
    out2 += o * o;
    cross += o * r;
    max_abs = std::max(max_abs, std::fabs(d));
  }
  m.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : (diff2 > 0 ? std::numeric_limits<double>::infinity() : 0.0);
  m.max_abs = std::isnan(diff2) ? diff2 : max_abs;  // std::max would hide a NaN difference
  m.rmse = std::sqrt(diff2 / static_cast<double>(n));
  m.cosine = (ref2 > 0 && out2 > 0) ? cross / std::sqrt(ref2 * out2) : (ref2 == 0 && out2 == 0 ? 1.0 : 0.0);
  return m;
}

}  // namespace openvc::reference
