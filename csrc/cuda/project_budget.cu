// Exact budget projection on CUDA (ProM supplement A.2).
//
// The multiplier lives in a small device-side state and is found by a
// safeguarded Newton iteration on phi: every iteration is one pass over the
// data (eval_kernel: the U and F sums at lam plus the nearest breakpoints on
// either side, reduced per block into fixed slots) and one single-block
// update (update_kernel: deterministic reduction of the slots, then either the
// exact root of the linear piece — when it lies on the piece, which ends the
// search — or a Newton/bisection step inside the bracket). The host launches a
// fixed number of iterations and never waits: once the state says `done`,
// later kernels return at once. The only synchronisation is a single read of
// the error flag after the result is written (non-finite input or bad costs
// raise ValueError; the in-place variant then leaves theta untouched).
//
// All tensors of a list are processed by the same launches through a device
// table of (tensor, chunk) pairs uploaded asynchronously from pinned memory.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <math_constants.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "prunopt/checks.h"
#include "prunopt/projection_entry.h"
#include "prunopt/projection.h"

namespace prunopt {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 8192;   // elements per block
constexpr int kMaxIters = 64;      // Newton converges in a handful on real data
constexpr int kSlots = 8;          // per-block partials, see Slot

// Per-block partials.
enum Slot { kU = 0, kFct, kFcc, kPrev, kNext, kMaxKey1, kBadTheta, kBadCost };

// Device-side state of the search.
enum State { kLo = 0, kHi, kLam, kDone, kError, kResult, kStateSize };

struct TensorMeta {
  const void* t;
  const void* c;
  void* out;
  int64_t n;
};

struct ChunkMeta {
  int64_t tensor;
  int64_t start;
};

template <typename T>
__device__ __forceinline__ T block_reduce(T v, T* shared, int op /*0 sum, 1 max, 2 min*/) {
  const int tid = threadIdx.x;
  shared[tid] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (tid < s) {
      const T a = shared[tid], b = shared[tid + s];
      shared[tid] = op == 0 ? a + b : (op == 1 ? (a > b ? a : b) : (a < b ? a : b));
    }
    __syncthreads();
  }
  const T r = shared[0];
  __syncthreads();
  return r;
}

// One pass at lam (lam = 0 on the first pass, which also validates).
template <typename scalar_t, bool kCost, bool kFirst>
__global__ void eval_kernel(
    const TensorMeta* __restrict__ tensors,
    const ChunkMeta* __restrict__ chunks,
    double* __restrict__ state,
    double* __restrict__ partials) {
  if (!kFirst && state[kDone] != 0.0) {
    return;
  }
  __shared__ double shared[kThreads];
  const double inf = CUDART_INF;
  const double lam = kFirst ? 0.0 : state[kLam];
  const ChunkMeta ch = chunks[blockIdx.x];
  const TensorMeta tm = tensors[ch.tensor];
  const int64_t end = min(tm.n, ch.start + kChunk);
  const scalar_t* tp = static_cast<const scalar_t*>(tm.t);
  const scalar_t* cp = static_cast<const scalar_t*>(tm.c);
  double u = 0, fct = 0, fcc = 0, prev = -inf, next = inf, maxk1 = -inf, bad_t = 0, bad_c = 0;
  for (int64_t i = ch.start + threadIdx.x; i < end; i += blockDim.x) {
    const double t = static_cast<double>(tp[i]);
    const double c = kCost ? static_cast<double>(cp[i]) : 1.0;
    const double key1 = kCost ? t / c : t;
    const double key2 = kCost ? (t - 1.0) / c : t - 1.0;
    if (key2 >= lam) {
      u += c;
    } else if (key1 >= lam) {
      fct += c * t;
      fcc += c * c;
    }
    // nearest breakpoints: prev = max key < lam, next = min key >= lam
    if (key2 < lam) prev = fmax(prev, key2); else next = fmin(next, key2);
    if (key1 < lam) prev = fmax(prev, key1); else next = fmin(next, key1);
    if (kFirst) {
      maxk1 = fmax(maxk1, key1);
      bad_t += isfinite(t) ? 0.0 : 1.0;
      if (kCost) {
        bad_c += (isfinite(c) && c > 0.0) ? 0.0 : 1.0;
      }
    }
  }
  double* out = partials + static_cast<int64_t>(blockIdx.x) * kSlots;
  const double r_u = block_reduce(u, shared, 0);
  const double r_fct = block_reduce(fct, shared, 0);
  const double r_fcc = block_reduce(fcc, shared, 0);
  const double r_prev = block_reduce(prev, shared, 1);
  const double r_next = block_reduce(next, shared, 2);
  double r_maxk1 = -inf, r_bad_t = 0, r_bad_c = 0;
  if (kFirst) {
    r_maxk1 = block_reduce(maxk1, shared, 1);
    r_bad_t = block_reduce(bad_t, shared, 0);
    r_bad_c = block_reduce(bad_c, shared, 0);
  }
  if (threadIdx.x == 0) {
    out[kU] = r_u;
    out[kFct] = r_fct;
    out[kFcc] = r_fcc;
    out[kPrev] = r_prev;
    out[kNext] = r_next;
    out[kMaxKey1] = r_maxk1;
    out[kBadTheta] = r_bad_t;
    out[kBadCost] = r_bad_c;
  }
}

// Single block: reduce the partials in a fixed order, then one step of the
// safeguarded Newton iteration. `iter` < 0 marks the first (validating) pass.
template <bool kFirst>
__global__ void update_kernel(const double* __restrict__ partials, int64_t nblocks, double* __restrict__ state,
    double budget, int iter) {
  if (!kFirst && state[kDone] != 0.0) {
    return;
  }
  __shared__ double shared[kThreads];
  const double inf = CUDART_INF;
  double u = 0, fct = 0, fcc = 0, prev = -inf, next = inf, maxk1 = -inf, bad_t = 0, bad_c = 0;
  for (int64_t b = threadIdx.x; b < nblocks; b += blockDim.x) {
    const double* p = partials + b * kSlots;
    u += p[kU];
    fct += p[kFct];
    fcc += p[kFcc];
    prev = fmax(prev, p[kPrev]);
    next = fmin(next, p[kNext]);
    if (kFirst) {
      maxk1 = fmax(maxk1, p[kMaxKey1]);
      bad_t += p[kBadTheta];
      bad_c += p[kBadCost];
    }
  }
  u = block_reduce(u, shared, 0);
  fct = block_reduce(fct, shared, 0);
  fcc = block_reduce(fcc, shared, 0);
  prev = block_reduce(prev, shared, 1);
  next = block_reduce(next, shared, 2);
  if (kFirst) {
    maxk1 = block_reduce(maxk1, shared, 1);
    bad_t = block_reduce(bad_t, shared, 0);
    bad_c = block_reduce(bad_c, shared, 0);
  }
  if (threadIdx.x != 0) {
    return;
  }
  projection::Piece piece;
  piece.u_c = u;
  piece.f_ct = fct;
  piece.f_cc = fcc;
  double lam = kFirst ? 0.0 : state[kLam];
  double lo = state[kLo], hi = state[kHi];
  if (kFirst) {
    state[kError] = bad_t > 0 ? 1.0 : (bad_c > 0 ? 2.0 : 0.0);
    if (bad_t > 0 || bad_c > 0) {
      state[kDone] = 1.0;
      return;
    }
    if (projection::phi(piece, 0.0, budget) <= 0.0) {  // slack budget
      state[kResult] = 0.0;
      state[kDone] = 1.0;
      return;
    }
    if (budget == 0.0) {  // every score goes to zero
      state[kResult] = inf;
      state[kDone] = 1.0;
      return;
    }
    lo = 0.0;
    hi = maxk1;  // phi(max key1) = -S < 0
  }
  // The sums at lam are exact on [prev, next] (next == lam: on [prev, lam]).
  const double root = projection::piece_root(piece, budget, CUDART_NAN);
  if (fcc > 0 && root >= prev && root <= next) {
    state[kResult] = fmin(fmax(root, lo), hi);
    state[kDone] = 1.0;
    return;
  }
  if (!kFirst) {
    if (projection::phi(piece, lam, budget) > 0.0) lo = lam; else hi = lam;
  }
  // Newton inside the bracket; every third step bisects to bound the worst case.
  double step = (root > lo && root < hi && (iter % 3) != 2) ? root : 0.5 * (lo + hi);
  if (!(step > lo && step < hi)) {
    state[kResult] = hi;  // the bracket is down to adjacent doubles
    state[kDone] = 1.0;
    return;
  }
  state[kLo] = lo;
  state[kHi] = hi;
  state[kLam] = step;
}

__global__ void finish_kernel(double* state) {
  if (state[kDone] == 0.0) {  // iteration budget spent: best point of the bracket
    state[kResult] = state[kLam];
    state[kDone] = 1.0;
  }
}

template <typename scalar_t, bool kCost>
__global__ void apply_kernel(const TensorMeta* __restrict__ tensors, const ChunkMeta* __restrict__ chunks,
    const double* __restrict__ state) {
  if (state[kError] != 0.0) {
    return;  // nothing is written on error
  }
  const double lam = state[kResult];
  const ChunkMeta ch = chunks[blockIdx.x];
  const TensorMeta tm = tensors[ch.tensor];
  const int64_t end = min(tm.n, ch.start + kChunk);
  const scalar_t* tp = static_cast<const scalar_t*>(tm.t);
  const scalar_t* cp = static_cast<const scalar_t*>(tm.c);
  scalar_t* op = static_cast<scalar_t*>(tm.out);
  for (int64_t i = ch.start + threadIdx.x; i < end; i += blockDim.x) {
    const double c = kCost ? static_cast<double>(cp[i]) : 1.0;
    op[i] = static_cast<scalar_t>(projection::project_one(static_cast<double>(tp[i]), c, lam));
  }
}

// Projects `inputs` into `outputs` (contiguous, same device; may alias).
void project_into(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& costs,
    const std::vector<at::Tensor>& outputs, double budget, const char* op) {
  std::vector<TensorMeta> metas;
  std::vector<ChunkMeta> chunks;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t n = inputs[i].numel();
    if (n == 0) {
      continue;
    }
    const int64_t idx = static_cast<int64_t>(metas.size());
    metas.push_back(TensorMeta{inputs[i].data_ptr(), costs.empty() ? nullptr : costs[i].data_ptr(),
        outputs[i].data_ptr(), n});
    for (int64_t s = 0; s < n; s += kChunk) {
      chunks.push_back(ChunkMeta{idx, s});
    }
  }
  if (chunks.empty()) {
    return;
  }
  const auto device = inputs[0].device();
  const c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  // One pinned host buffer with both tables, copied without blocking the host.
  const size_t meta_bytes = metas.size() * sizeof(TensorMeta);
  const size_t chunk_bytes = chunks.size() * sizeof(ChunkMeta);
  at::Tensor host = at::empty({static_cast<int64_t>(meta_bytes + chunk_bytes)},
      at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), metas.data(), meta_bytes);
  std::memcpy(static_cast<uint8_t*>(host.data_ptr()) + meta_bytes, chunks.data(), chunk_bytes);
  at::Tensor table = host.to(device, /*non_blocking=*/true);
  const auto* d_metas = reinterpret_cast<const TensorMeta*>(table.data_ptr());
  const auto* d_chunks = reinterpret_cast<const ChunkMeta*>(static_cast<uint8_t*>(table.data_ptr()) + meta_bytes);

  const int64_t nblocks = static_cast<int64_t>(chunks.size());
  const auto dopt = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor state = at::zeros({kStateSize}, dopt);
  at::Tensor partials = at::empty({nblocks * kSlots}, dopt);
  double* d_state = state.data_ptr<double>();
  double* d_partials = partials.data_ptr<double>();
  const bool has_cost = !costs.empty();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, inputs[0].scalar_type(), "project_budget_cuda", [&] {
    auto run = [&](auto cost_tag) {
      constexpr bool kCost = decltype(cost_tag)::value;
      eval_kernel<scalar_t, kCost, true><<<nblocks, kThreads, 0, stream>>>(d_metas, d_chunks, d_state, d_partials);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      update_kernel<true><<<1, kThreads, 0, stream>>>(d_partials, nblocks, d_state, budget, -1);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      for (int it = 0; it < kMaxIters; ++it) {
        eval_kernel<scalar_t, kCost, false><<<nblocks, kThreads, 0, stream>>>(d_metas, d_chunks, d_state, d_partials);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        update_kernel<false><<<1, kThreads, 0, stream>>>(d_partials, nblocks, d_state, budget, it);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      finish_kernel<<<1, 1, 0, stream>>>(d_state);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      apply_kernel<scalar_t, kCost><<<nblocks, kThreads, 0, stream>>>(d_metas, d_chunks, d_state);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (has_cost) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
  // The single synchronisation: report invalid input (nothing was written).
  const double error = state[kError].item<double>();
  TORCH_CHECK_VALUE(error != 1.0, op, ": theta contains a non-finite value");
  TORCH_CHECK_VALUE(error != 2.0, op, ": cost must be positive and finite everywhere");
}

std::vector<at::Tensor> project_budget_cuda(
    at::TensorList theta, c10::optional<at::TensorList> cost, double budget) {
  return project_budget_entry(theta, cost, budget, project_into);
}

void project_budget_inplace_cuda(
    at::TensorList theta, c10::optional<at::TensorList> cost, double budget) {
  project_budget_inplace_entry(theta, cost, budget, project_into);
}

// project_budget_apply_ on CUDA, composed of ATen ops (in double, rounded
// once; out may be theta itself).
void project_budget_apply_cuda(
    at::TensorList out, at::TensorList theta, c10::optional<at::TensorList> cost, double lam) {
  const char* op = "project_budget_apply_";
  check_projection_apply_args(out, theta, cost, lam, op);
  if (theta.empty()) {
    return;
  }
  c10::cuda::CUDAGuard guard(theta[0].device());
  for (size_t i = 0; i < theta.size(); ++i) {
    if (theta[i].numel() == 0) {
      continue;
    }
    at::Tensor x = theta[i].to(at::kDouble);
    if (std::isinf(lam)) {
      x.zero_();
    } else if (cost.has_value()) {
      x.sub_((*cost)[i].to(at::kDouble), lam);
    } else {
      x.sub_(lam);
    }
    out[i].copy_(x.clamp_(0.0, 1.0));
  }
}

// project_budget_bracket on CUDA, composed of ATen ops in double: the
// elements kept are data-dependent, so their number is read on the host
// anyway (as for topk_bracket). The same classes as the CPU pass: an element
// is kept when a breakpoint (t-1)/c or t/c lies strictly inside (lo, hi); of
// the others, U (key2 >= hi) adds c and F (key2 <= lo, key1 >= hi) adds c t
// and c^2 to the sums.
std::tuple<at::Tensor, at::Tensor, at::Tensor> project_budget_bracket_cuda(
    at::TensorList theta, c10::optional<at::TensorList> cost, double lo, double hi) {
  const char* op = "project_budget_bracket";
  check_projection_bracket_args(theta, cost, lo, hi, op);
  c10::cuda::CUDAGuard guard(theta[0].device());
  const auto opts = theta[0].options();
  at::Tensor summary = at::zeros({5}, opts.dtype(at::kDouble));
  std::vector<at::Tensor> ts, cs;
  for (size_t i = 0; i < theta.size(); ++i) {
    ts.push_back(theta[i].reshape({-1}));
    if (cost.has_value()) {
      cs.push_back((*cost)[i].reshape({-1}));
    }
  }
  const at::Tensor t = at::cat(ts);
  if (t.numel() == 0) {
    return {summary, at::empty({0}, opts), at::empty({0}, opts)};
  }
  const at::Tensor td = t.to(at::kDouble);
  const bool has_cost = cost.has_value();
  const at::Tensor c = has_cost ? at::cat(cs) : at::Tensor();
  const at::Tensor cd = has_cost ? c.to(at::kDouble) : at::ones_like(td);
  const bool bad_theta = !at::isfinite(td).all().item<bool>();
  const bool bad_cost = has_cost && !at::isfinite(cd).logical_and_(cd.gt(0.0)).all().item<bool>();
  if (bad_theta || bad_cost) {
    summary[3] = bad_theta ? 1.0 : 0.0;
    summary[4] = bad_cost ? 1.0 : 0.0;
    return {summary, at::empty({0}, opts), at::empty({0}, opts)};
  }
  const at::Tensor k1 = td.div(cd), k2 = td.sub(1.0).div_(cd);
  const at::Tensor in = k1.gt(lo).logical_and_(k1.lt(hi)).logical_or_(k2.gt(lo).logical_and_(k2.lt(hi)));
  const at::Tensor out = in.logical_not();
  const at::Tensor u = k2.ge(hi).logical_and_(out);
  const at::Tensor f = k2.le(lo).logical_and_(k1.ge(hi)).logical_and_(out);
  summary[0] = cd.mul(u).sum();
  summary[1] = cd.mul(td).mul_(f).sum();
  summary[2] = cd.square().mul_(f).sum();
  return {summary, t.masked_select(in), has_cost ? c.masked_select(in) : at::empty({0}, opts)};
}

}  // namespace
}  // namespace cuda
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CUDA, m) {
  m.impl("project_budget", &prunopt::cuda::project_budget_cuda);
  m.impl("project_budget_", &prunopt::cuda::project_budget_inplace_cuda);
  m.impl("project_budget_bracket", &prunopt::cuda::project_budget_bracket_cuda);
  m.impl("project_budget_apply_", &prunopt::cuda::project_budget_apply_cuda);
}
