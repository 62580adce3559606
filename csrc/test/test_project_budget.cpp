// C++ unit test of prunopt::project_budget through the dispatcher: the kernel
// against a brute-force float64 solution, and the ValueError of a bad budget.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}

// phi(lam) = sum clamp(t - lam, 0, 1) - S, solved by bisection to the last bit
// and then by the exact linear solve on the piece (unit costs).
double brute_lambda(const std::vector<double>& t, double S) {
  auto phi = [&](double lam) {
    double s = 0;
    for (double x : t) s += std::min(std::max(x - lam, 0.0), 1.0);
    return s - S;
  };
  if (phi(0.0) <= 0) return 0.0;
  double lo = 0, hi = *std::max_element(t.begin(), t.end());
  for (int i = 0; i < 2000 && hi - lo > 0; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (mid <= lo || mid >= hi) break;
    (phi(mid) > 0 ? lo : hi) = mid;
  }
  double u = 0, f = 0, n = 0;
  const double mid = 0.5 * (lo + hi);
  for (double x : t) {
    if (x - mid >= 1) u += 1;
    else if (x - mid > 0) { f += x; n += 1; }
  }
  return n > 0 ? (u + f - S) / n : hi;
}

}  // namespace

int main() {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("prunopt::project_budget", "")
                .typed<std::vector<at::Tensor>(at::TensorList, c10::optional<at::TensorList>, double)>();
  for (int64_t n : {1, 17, 4097, 200000}) {
    at::manual_seed(n);
    at::Tensor t = at::rand({n}, at::kDouble) * 1.5 - 0.25;
    const double S = 0.2 * static_cast<double>(n);
    std::vector<at::Tensor> in{t};
    at::Tensor out = op.call(in, c10::nullopt, S)[0];
    std::vector<double> tv(t.data_ptr<double>(), t.data_ptr<double>() + n);
    const double lam = brute_lambda(tv, S);
    double err = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double e = std::min(std::max(tv[i] - lam, 0.0), 1.0);
      err = std::max(err, std::abs(out.data_ptr<double>()[i] - e));
    }
    std::printf("n=%lld max error %.3g\n", static_cast<long long>(n), err);
    expect(err <= 1e-12, "projection matches the brute-force solution");
  }
  bool raised = false;
  try {
    std::vector<at::Tensor> in{at::rand({3})};
    op.call(in, c10::nullopt, -1.0);
  } catch (const c10::ValueError&) {
    raised = true;
  }
  expect(raised, "negative budget raises ValueError");
  std::printf("%s\n", failures ? "FAILED" : "OK");
  return failures ? 1 : 0;
}
