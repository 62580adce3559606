// C++ unit test of prunopt::project_budget through the dispatcher: the kernel
// against a brute-force float64 solution (one tensor, and lists of small
// tensors), and the ValueError of a bad budget. tools/sanitize.sh runs it
// under AddressSanitizer and UndefinedBehaviorSanitizer.
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
  // Lists whose total is below the sample size and not a multiple of its
  // 8-element runs (the runs overlapped and read element -1 of the next
  // tensor: a heap-buffer-overflow under AddressSanitizer), unit costs and
  // costs, each member its own allocation.
  for (const std::vector<int64_t>& sizes : std::vector<std::vector<int64_t>>{
           {6, 4}, {1, 1, 1}, {7, 9, 3}, {13, 2, 1, 5}, {4095, 3}, {2049, 2047, 1}, {8191, 1}}) {
    at::manual_seed(static_cast<uint64_t>(sizes.size() * 1000 + sizes[0]));
    std::vector<at::Tensor> in, cost;
    std::vector<double> tv;
    for (int64_t n : sizes) {
      in.push_back(at::rand({n}, at::kFloat) * 1.2);
      cost.push_back(at::ones({n}, at::kFloat));
      const float* p = in.back().data_ptr<float>();
      tv.insert(tv.end(), p, p + n);
    }
    const double S = 0.3 * static_cast<double>(tv.size());
    const double lam = brute_lambda(tv, S);
    for (int with_cost = 0; with_cost < 2; ++with_cost) {
      std::vector<at::Tensor> out =
          with_cost ? op.call(in, c10::optional<at::TensorList>(cost), S) : op.call(in, c10::nullopt, S);
      double err = 0;
      size_t j = 0;
      for (const at::Tensor& o : out) {
        for (int64_t i = 0; i < o.numel(); ++i, ++j) {
          const double e = std::min(std::max(tv[j] - lam, 0.0), 1.0);
          err = std::max(err, std::abs(static_cast<double>(o.data_ptr<float>()[i]) - e));
        }
      }
      std::printf("list of %zu (total %zu, cost %d) max error %.3g\n", sizes.size(), tv.size(), with_cost, err);
      expect(j == tv.size() && err <= 1e-5, "list projection matches the brute-force solution");
    }
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
