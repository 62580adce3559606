// prunAdag on CUDA (Porcelli et al.): the exact top-T threshold and the fused
// step, with no host synchronisation inside the step.
//
// Layout follows apex's multi_tensor_apply: the tensor list is cut into fixed
// chunks; a kernel argument struct (Meta) carries up to kMaxTensors pointers
// and kMaxChunks chunk descriptors, one block per chunk; longer lists take
// several launches. Selection is a radix select on bits(|g|), 11 bits per pass
// (float: 3 passes, double: 6): each pass builds a shared-memory histogram
// per block and adds it to a global one with integer atomics (order-independent,
// so deterministic); the last block of the pass (a ticket counter, over all its
// launches) picks the digit with a block-wide scan and clears the histogram.
// Norms (versions 1, 3, relevant_only) use per-block partials that the last
// norms block sums in a fixed order. A non-finite gradient sets a device flag;
// the element kernel then writes nothing (the scope's step is skipped) and,
// when the caller passes found_nonfinite, the flag is set there after the first
// pass (and a set flag on entry skips the scope too), so the optimizer can skip
// a multi-scope step as a whole and report it without a host synchronisation
// (see docs/prunadag.md).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "prunopt/checks.h"
#include "prunopt/prunadag.h"
#include "prunopt/prunadag_reduced.h"
#include "prunopt/topk_slice.h"
#include "prunopt/tensor_list.h"

namespace prunopt {
namespace cuda {
namespace {

using namespace prunopt::prunadag;

constexpr int kMaxTensors = 36;
constexpr int kMaxChunks = 320;
constexpr int kChunk = 16384;
constexpr int kThreads = 256;
constexpr int kDigit = 11;           // float: 3 passes (11, 11, 9 bits), double: 6
constexpr int kBins = 1 << kDigit;
constexpr int kUnroll = 8;           // loads in flight per thread in the selection passes
constexpr int kUnrollUpdate = 4;     // in the element pass (4 streams each)

struct Meta {
  void* x[kMaxTensors];
  void* so[kMaxTensors];
  void* sd[kMaxTensors];
  const void* g[kMaxTensors];
  int64_t n[kMaxTensors];
  int row[kMaxTensors];                      // row of `hyper`
  unsigned char tensor_of[kMaxChunks];
  int chunk_of[kMaxChunks];                  // chunk index inside its tensor
  int nchunks;
  int block_offset;                          // global index of this launch's first block
};

struct State {
  unsigned long long prefix;
  unsigned long long pmask;
  long long k;        // rank still to find among keys with the prefix; 0: all relevant
  unsigned long long n;  // pruned elements (counted by the first pass)
  int bad;            // a gradient is inf/nan
  int collapse;       // step op: T >= n makes every element relevant
  double r;           // ||g||_R / ||x||_M
  unsigned int done;  // blocks of the current pass that have finished (last-block pattern)
};

// One device buffer per call: the State, the global histogram, the norm partials.
constexpr size_t kHistOffset = (sizeof(State) + 15) / 16 * 16;
constexpr size_t kPartialsOffset = kHistOffset + kBins * sizeof(unsigned long long);

struct Host {
  void* x;
  void* so;
  void* sd;
  const void* g;
  int64_t n;
  int row;
};

std::vector<Meta> make_batches(const std::vector<Host>& ts) {
  std::vector<Meta> out;
  Meta m{};
  int nt = 0, blocks = 0;
  auto flush = [&]() {
    out.push_back(m);
    blocks += m.nchunks;
    m = Meta{};
    m.block_offset = blocks;
    nt = 0;
  };
  auto add_tensor = [&](const Host& t) {
    m.x[nt] = t.x;
    m.so[nt] = t.so;
    m.sd[nt] = t.sd;
    m.g[nt] = t.g;
    m.n[nt] = t.n;
    m.row[nt] = t.row;
    ++nt;
  };
  for (const auto& t : ts) {
    const int64_t chunks = (t.n + kChunk - 1) / kChunk;
    if (nt == kMaxTensors) {
      flush();
    }
    add_tensor(t);
    for (int64_t c = 0; c < chunks; ++c) {
      if (m.nchunks == kMaxChunks) {
        flush();
        add_tensor(t);  // the current tensor continues in the next launch
      }
      m.tensor_of[m.nchunks] = static_cast<unsigned char>(nt - 1);
      m.chunk_of[m.nchunks] = static_cast<int>(c);
      ++m.nchunks;
    }
  }
  if (m.nchunks > 0) {
    out.push_back(m);
  }
  return out;
}

// Sets up the State and clears the histogram (one block).
__global__ void init_state(State* st, unsigned long long* ghist, long long k, int collapse) {
  if (threadIdx.x == 0) {
    st->prefix = 0;
    st->pmask = 0;
    st->k = k;
    st->n = 0;
    st->bad = 0;
    st->collapse = collapse;
    st->r = 0.0;
    st->done = 0;
  }
  for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
    ghist[j] = 0;
  }
}

// Whether tensor t of a launch takes part in the selection (hyper == nullptr:
// the threshold op, every tensor does).
__device__ __forceinline__ bool pruned(const Meta& m, const double* hyper, int t) {
  return hyper == nullptr || hyper[m.row[t] * kHyperCols + kPrune] != 0.0;
}

// Last-block pattern: after a block's global writes, true in exactly one block
// (the last of all `total` blocks of the pass, over all its launches) once
// every other block's writes are visible.
__device__ __forceinline__ bool last_block(State* st, unsigned int total) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(&st->done, 1u) == total - 1u;
  }
  __syncthreads();
  if (last) {
    __threadfence();
  }
  return last;
}

// Run by every thread of the last block of a pass: picks the digit of the
// k-th largest key from the global histogram (read past L1), resets the
// histogram and the block counter for the next pass. After the first pass,
// k >= n means T >= n: every element is relevant (k = 0). The flag (step op)
// records a non-finite gradient once the first pass has seen every element.
__device__ void select_digit(State* st, unsigned long long* ghist, int shift, int bits, bool first, float* flag) {
  __shared__ unsigned long long part[kThreads];
  __shared__ long long k_s;
  constexpr int kPer = kBins / kThreads;  // bins per thread, highest digits first
  volatile State* vs = st;
  if (threadIdx.x == 0) {
    long long k = vs->k;
    if (first && vs->collapse && k >= static_cast<long long>(vs->n)) {
      k = 0;
      vs->k = 0;
    }
    if (first && flag != nullptr && vs->bad) {
      *flag = 1.0f;
    }
    k_s = k;
  }
  __syncthreads();
  const long long k = k_s;
  const int nb = 1 << bits;
  const int top = nb - 1 - static_cast<int>(threadIdx.x) * kPer;  // this thread's highest bin
  unsigned long long mine = 0;
  if (k > 0) {
    for (int q = 0; q < kPer; ++q) {
      const int j = top - q;
      mine += j >= 0 ? __ldcg(&ghist[j]) : 0ull;
    }
  }
  part[threadIdx.x] = mine;
  __syncthreads();
  // inclusive scan over threads (thread 0 holds the highest bins)
  for (int off = 1; off < kThreads; off <<= 1) {
    const unsigned long long v = threadIdx.x >= static_cast<unsigned>(off) ? part[threadIdx.x - off] : 0ull;
    __syncthreads();
    part[threadIdx.x] += v;
    __syncthreads();
  }
  const unsigned long long incl = part[threadIdx.x];
  const unsigned long long excl = incl - mine;
  if (k > 0 && excl < static_cast<unsigned long long>(k) && incl >= static_cast<unsigned long long>(k)) {
    // the k-th largest key lies in this thread's bins: exactly one thread
    long long above = static_cast<long long>(excl);
    int j = top;
    for (int q = 0; q < kPer - 1 && j > 0; ++q, --j) {
      const long long c = static_cast<long long>(__ldcg(&ghist[j]));
      if (above + c >= k) {
        break;
      }
      above += c;
    }
    vs->k = k - above;
    vs->prefix = vs->prefix | (static_cast<unsigned long long>(j) << shift);
    vs->pmask = vs->pmask | (static_cast<unsigned long long>(nb - 1) << shift);
  }
  __syncthreads();  // the selecting thread has read its bins before they are cleared
  for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
    ghist[j] = 0;
  }
  if (threadIdx.x == 0) {
    vs->done = 0;
  }
  __threadfence();
}

// One radix pass: histogram of digit [shift, shift+bits) over the pruned keys
// that carry the current prefix; the last block picks the digit. The first
// pass also counts n and flags inf/nan anywhere (pruned or not).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) hist_kernel(Meta m, const double* hyper, bool use_x, State* st,
    unsigned long long* ghist, int shift, int bits, bool first, unsigned int total_blocks, float* flag) {
  using K = typename KeyOf<scalar_t>::type;
  __shared__ unsigned int h[kBins];
  for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
    h[j] = 0;
  }
  __syncthreads();
  const int t = m.tensor_of[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(m.chunk_of[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, m.n[t]);
  const scalar_t* g = static_cast<const scalar_t*>(m.g[t]);
  const scalar_t wd = static_cast<scalar_t>(hyper ? hyper[m.row[t] * kHyperCols + kWeightDecay] : 0.0);
  const scalar_t sgn = hyper != nullptr && hyper[m.row[t] * kHyperCols + kMaximize] != 0.0 ? scalar_t(-1) : scalar_t(1);
  // x enters the key only through weight decay (as in the CPU scan): without it
  // the radix passes read g alone (then the sign of g does not change |g|)
  const scalar_t* x = use_x && wd != scalar_t(0) ? static_cast<const scalar_t*>(m.x[t]) : nullptr;
  const K prefix = static_cast<K>(st->prefix), pmask = static_cast<K>(st->pmask);
  const bool part = pruned(m, hyper, t);
  const bool counting = st->k > 0 && part;
  if (first && part && threadIdx.x == 0) {
    atomicAdd(&st->n, static_cast<unsigned long long>(end - begin));
  }
  const K dmask = static_cast<K>((1u << bits) - 1u);
  bool bad = false;
  if (first || counting) {  // later passes read nothing where nothing is counted
    for (int64_t base = begin + threadIdx.x; base < end; base += static_cast<int64_t>(kUnroll) * kThreads) {
      scalar_t gv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * kThreads;
        gv[u] = i < end ? (x != nullptr ? effective_grad<scalar_t>(x[i], g[i], wd, sgn) : g[i]) : scalar_t(0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const K key = magnitude_key<scalar_t>(gv[u]);
        bad |= key >= KeyOf<scalar_t>::kInf;
        if (counting && base + static_cast<int64_t>(u) * kThreads < end && (key & pmask) == prefix) {
          atomicAdd(&h[static_cast<int>((key >> shift) & dmask)], 1u);
        }
      }
    }
  }
  if (first && bad) {
    atomicOr(&st->bad, 1);
  }
  __syncthreads();
  if (counting) {
    for (int j = threadIdx.x; j < (1 << bits); j += blockDim.x) {
      if (h[j] != 0) {
        atomicAdd(&ghist[j], static_cast<unsigned long long>(h[j]));
      }
    }
  }
  if (last_block(st, total_blocks)) {
    select_digit(st, ghist, shift, bits, first, flag);
  }
}

template <typename scalar_t>
__device__ scalar_t tau_of(const State* st) {
  // k == 0 from the start: T >= n, tau = 0 makes every element relevant
  return st->pmask == 0 ? scalar_t(0) : value_of_key<scalar_t>(static_cast<typename KeyOf<scalar_t>::type>(st->prefix));
}

// Per-block partial sums of ||g||_R^2 and ||x||_M^2 (double); the last block
// adds the partials in a fixed order (deterministic) and sets r.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) norms_kernel(Meta m, const double* hyper, State* st, double* partials,
    unsigned int total_blocks, double* raw = nullptr) {
  __shared__ double sg[kThreads];
  __shared__ double sx[kThreads];
  const int t = m.tensor_of[blockIdx.x];
  double gr = 0.0, xm = 0.0;
  if (pruned(m, hyper, t)) {
    const int64_t begin = static_cast<int64_t>(m.chunk_of[blockIdx.x]) * kChunk;
    const int64_t end = min(begin + kChunk, m.n[t]);
    const scalar_t* g = static_cast<const scalar_t*>(m.g[t]);
    const scalar_t* x = static_cast<const scalar_t*>(m.x[t]);
    const double* h = hyper + m.row[t] * kHyperCols;
    const scalar_t wd = static_cast<scalar_t>(h[kWeightDecay]);
    const scalar_t sgn = h[kMaximize] != 0.0 ? scalar_t(-1) : scalar_t(1);
    const scalar_t tau = tau_of<scalar_t>(st);
    for (int64_t base = begin + threadIdx.x; base < end; base += static_cast<int64_t>(kUnrollUpdate) * kThreads) {
      scalar_t xv[kUnrollUpdate], gv[kUnrollUpdate];
#pragma unroll
      for (int u = 0; u < kUnrollUpdate; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * kThreads;
        xv[u] = i < end ? x[i] : scalar_t(0);
        gv[u] = i < end ? g[i] : scalar_t(0);
      }
#pragma unroll
      for (int u = 0; u < kUnrollUpdate; ++u) {
        // padding lanes (x = g = 0) add 0 to both sums
        const scalar_t xi = xv[u];
        const scalar_t gi = effective_grad<scalar_t>(xi, gv[u], wd, sgn);
        const bool rel = (gi < scalar_t(0) ? -gi : gi) >= tau;
        const double gd = gi, xd = xi;
        gr += rel ? gd * gd : 0.0;
        xm += (!rel && xi * gi > scalar_t(0)) ? xd * xd : 0.0;
      }
    }
  }
  sg[threadIdx.x] = gr;
  sx[threadIdx.x] = xm;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      sg[threadIdx.x] += sg[threadIdx.x + s];
      sx[threadIdx.x] += sx[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partials[2 * (m.block_offset + blockIdx.x)] = sg[0];
    partials[2 * (m.block_offset + blockIdx.x) + 1] = sx[0];
  }
  if (!last_block(st, total_blocks)) {
    return;
  }
  gr = 0.0;
  xm = 0.0;
  for (unsigned int b = threadIdx.x; b < total_blocks; b += blockDim.x) {
    gr += __ldcg(&partials[2 * b]);
    xm += __ldcg(&partials[2 * b + 1]);
  }
  sg[threadIdx.x] = gr;
  sx[threadIdx.x] = xm;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      sg[threadIdx.x] += sg[threadIdx.x + s];
      sx[threadIdx.x] += sx[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    st->r = ratio(sg[0], sx[0]);
    st->done = 0;
    if (raw != nullptr) {  // prunadag_norms: the sums themselves and the non-finite flag
      raw[0] = sg[0];
      raw[1] = sx[0];
      raw[2] = st->bad ? 1.0 : 0.0;
    }
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) update_kernel(Meta m, const double* hyper, const State* st,
    const float* flag, int version) {
  if (st->bad || (flag != nullptr && *flag != 0.0f)) {
    return;  // non-finite gradient (this scope or an earlier one of the step): skip
  }
  const int t = m.tensor_of[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(m.chunk_of[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, m.n[t]);
  scalar_t* x = static_cast<scalar_t*>(m.x[t]);
  scalar_t* so = static_cast<scalar_t*>(m.so[t]);
  scalar_t* sd = static_cast<scalar_t*>(m.sd[t]);
  const scalar_t* g = static_cast<const scalar_t*>(m.g[t]);
  const double* h = hyper + m.row[t] * kHyperCols;
  const scalar_t wd = static_cast<scalar_t>(h[kWeightDecay]);
  const scalar_t sgn = h[kMaximize] != 0.0 ? scalar_t(-1) : scalar_t(1);
  const scalar_t tau_eff = pruned(m, hyper, t) ? tau_of<scalar_t>(st) : scalar_t(-1);
  const scalar_t lr = static_cast<scalar_t>(h[kLrK]);
  const scalar_t nlr = static_cast<scalar_t>(-h[kLrK]);
  const scalar_t a_scale = static_cast<scalar_t>(h[kLrK1] * a_factor(version, st->r));
  const scalar_t eps = static_cast<scalar_t>(h[kEps]);
  for (int64_t base = begin + threadIdx.x; base < end; base += static_cast<int64_t>(kUnrollUpdate) * kThreads) {
    scalar_t xv[kUnrollUpdate], sov[kUnrollUpdate], sdv[kUnrollUpdate], gv[kUnrollUpdate];
#pragma unroll
    for (int u = 0; u < kUnrollUpdate; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kThreads;
      if (i < end) {
        xv[u] = x[i];
        sov[u] = so[i];
        sdv[u] = sd[i];
        gv[u] = g[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnrollUpdate; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kThreads;
      if (i < end) {
        const scalar_t gi = effective_grad<scalar_t>(xv[u], gv[u], wd, sgn);
        update_one<scalar_t>(xv[u], sov[u], sdv[u], gi, tau_eff, nlr, lr, a_scale, eps, version);
        x[i] = xv[u];
        so[i] = sov[u];
        sd[i] = sdv[u];
      }
    }
  }
}

// A selection given by the caller ([tau, r] in float64 on the device): the
// threshold becomes the radix prefix with every bit known, and the ratio is
// taken as it is (set after the first pass, which has flagged non-finite values).
template <typename scalar_t>
__global__ void given_selection_kernel(State* st, const double* sel) {
  st->prefix = static_cast<unsigned long long>(magnitude_key<scalar_t>(static_cast<scalar_t>(sel[0])));
  st->pmask = ~0ull;
  st->r = sel[1];
}

__global__ void write_tau_kernel(const State* st, float* out_f, double* out_d) {
  if (out_f != nullptr) {
    *out_f = st->bad ? __int_as_float(0x7fc00000) : tau_of<float>(st);
  } else {
    *out_d = st->bad ? __longlong_as_double(0x7ff8000000000000ll) : tau_of<double>(st);
  }
}

unsigned int count_blocks(const std::vector<Meta>& batches) {
  unsigned int n = 0;
  for (const auto& m : batches) {
    n += static_cast<unsigned int>(m.nchunks);
  }
  return n;
}

// Runs the radix passes; leaves prefix (tau) and the bad flag in *st.
template <typename scalar_t>
void select(const std::vector<Meta>& batches, const double* hyper, bool wd, State* st, unsigned long long* ghist,
    float* flag, cudaStream_t stream) {
  const unsigned int total = count_blocks(batches);
  int bits_left = KeyOf<scalar_t>::kBits;
  bool first = true;
  while (bits_left > 0) {
    const int bits = bits_left < kDigit ? bits_left : kDigit;
    const int shift = bits_left - bits;
    for (const Meta& m : batches) {
      // without weight decay the key needs g only
      hist_kernel<scalar_t><<<m.nchunks, kThreads, 0, stream>>>(m, hyper, wd, st, ghist, shift, bits, first, total,
                                                                 flag);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    bits_left = shift;
    first = false;
  }
}

at::Tensor make_buffer(const at::Tensor& like, int64_t nblocks) {
  return at::empty({static_cast<int64_t>(kPartialsOffset) + 16 * nblocks}, like.options().dtype(at::kByte));
}

at::Tensor topk_threshold_cuda(at::TensorList values, int64_t k) {
  TORCH_CHECK_VALUE(!values.empty(), "topk_threshold: values must not be empty");
  const auto& v0 = values[0];
  TORCH_CHECK_VALUE(v0.scalar_type() == at::kFloat || v0.scalar_type() == at::kDouble,
      "topk_threshold: values must be float32 or float64, got ", v0.scalar_type());
  c10::cuda::CUDAGuard guard(v0.device());
  std::vector<at::Tensor> keep;
  std::vector<Host> hs;
  int64_t total = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    TORCH_CHECK_VALUE(values[i].scalar_type() == v0.scalar_type() && values[i].device() == v0.device(),
        "topk_threshold: values[", i, "] must have the dtype and device of values[0]");
    if (values[i].numel() == 0) {
      continue;
    }
    keep.push_back(values[i].contiguous());
    hs.push_back(Host{nullptr, nullptr, nullptr, keep.back().data_ptr(), values[i].numel(), 0});
    total += values[i].numel();
  }
  TORCH_CHECK_VALUE(k >= 1 && k <= total, "topk_threshold: k must be in [1, n=", total, "], got ", k);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto batches = make_batches(hs);
  at::Tensor buf = make_buffer(v0, 0);
  State* st = reinterpret_cast<State*>(buf.data_ptr());
  auto* ghist = reinterpret_cast<unsigned long long*>(static_cast<char*>(buf.data_ptr()) + kHistOffset);
  init_state<<<1, kThreads, 0, stream>>>(st, ghist, k, 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor out = at::empty({}, v0.options());
  AT_DISPATCH_FLOATING_TYPES(v0.scalar_type(), "topk_threshold", [&] {
    select<scalar_t>(batches, nullptr, false, st, ghist, nullptr, stream);
  });
  if (v0.scalar_type() == at::kFloat) {
    write_tau_kernel<<<1, 1, 0, stream>>>(st, out.data_ptr<float>(), nullptr);
  } else {
    write_tau_kernel<<<1, 1, 0, stream>>>(st, nullptr, out.data_ptr<double>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void prunadag_step_cuda(at::TensorList params, at::TensorList opt_sums, at::TensorList dec_sums,
    at::TensorList grads, const at::Tensor& hyper, int64_t relevant, int64_t version,
    const std::optional<at::Tensor>& found_nonfinite, const std::optional<at::Tensor>& selection) {
  TORCH_CHECK_VALUE(version >= 0 && version <= 4, "prunadag_step_: version must be 0 (relevant_only) or 1..4, got ",
      version);
  check_prunadag_writes(params, opt_sums, dec_sums, found_nonfinite, "prunadag_step_");
  const size_t nt = params.size();
  if (nt == 0) {
    return;
  }
  if (is_reduced_float(params[0].scalar_type())) {
    // float16 / bfloat16: computed in float32, stored in the params' dtype (the
    // copy back runs unconditionally: no host synchronisation on the flag)
    return step_in_float32(params, opt_sums, dec_sums, grads, hyper, relevant, version, found_nonfinite, selection,
        /*host_flag=*/false, &prunadag_step_cuda);
  }
  const auto& p0 = params[0];
  // A given [tau, r] is read on the device (its values are the caller's to
  // check: reading them here would synchronise)
  const bool given = selection.has_value() && selection->defined();
  if (given) {
    const auto& sel = *selection;
    // (a third element, "gradients already checked finite", is accepted and
    // not used: the device passes check finiteness without a host read anyway)
    TORCH_CHECK_VALUE(sel.scalar_type() == at::kDouble && (sel.numel() == 2 || sel.numel() == 3) &&
        sel.device() == p0.device() && sel.is_contiguous(), "prunadag_step_: selection must be a contiguous float64 "
        "tensor of 2 elements [tau, r] (or 3: [tau, r, checked]) on ", p0.device(), ", got ", sel.scalar_type(), " ",
        sel.sizes(), " on ", sel.device());
  }
  float* flag = nullptr;
  if (found_nonfinite.has_value() && found_nonfinite->defined()) {
    const auto& f = *found_nonfinite;
    TORCH_CHECK_VALUE(f.scalar_type() == at::kFloat && f.numel() == 1 && f.device() == p0.device() &&
        f.is_contiguous(), "prunadag_step_: found_nonfinite must be a one-element float32 tensor on ", p0.device());
    flag = f.data_ptr<float>();
  }
  TORCH_CHECK_VALUE(p0.scalar_type() == at::kFloat || p0.scalar_type() == at::kDouble,
      "prunadag_step_: params must be float16, bfloat16, float32 or float64, got ", p0.scalar_type());
  TORCH_CHECK_VALUE(hyper.scalar_type() == at::kDouble && hyper.dim() == 2 && hyper.size(0) == (int64_t)nt &&
      hyper.size(1) == kHyperCols && hyper.device() == p0.device(),
      "prunadag_step_: hyper must be a float64 tensor of shape (", nt, ", ", kHyperCols, ") on ", p0.device());
  for (size_t i = 0; i < nt; ++i) {
    TORCH_CHECK_VALUE(params[i].scalar_type() == p0.scalar_type() && params[i].device() == p0.device(),
        "prunadag_step_: params[", i, "] must have the dtype and device of params[0]");
  }
  TORCH_CHECK_VALUE(opt_sums.size() == nt && dec_sums.size() == nt && grads.size() == nt,
      "prunadag_step_: opt_sums, dec_sums and grads must have ", nt, " tensors");
  for (size_t i = 0; i < nt; ++i) {
    for (const auto* lst : {&opt_sums, &dec_sums, &grads}) {
      const auto& t = (*lst)[i];
      TORCH_CHECK_VALUE(t.scalar_type() == p0.scalar_type() && t.device() == p0.device() &&
          t.sizes() == params[i].sizes(), "prunadag_step_: opt_sums[", i, "], dec_sums[", i, "] and grads[", i,
          "] must match params[", i, "] in dtype, device and shape");
    }
  }
  c10::cuda::CUDAGuard guard(p0.device());
  // Which tensors are pruned and how many elements take part is read from
  // `hyper` on the device (no host synchronisation); the Python wrapper has
  // already checked 1 <= T <= n.
  const at::Tensor h = hyper.contiguous();
  const auto xs = contiguous_all(params), sos = contiguous_all(opt_sums), sds = contiguous_all(dec_sums),
             gs = contiguous_all(grads);
  std::vector<Host> hs;
  for (size_t i = 0; i < nt; ++i) {
    if (params[i].numel() == 0) {
      continue;
    }
    hs.push_back(Host{xs[i].data_ptr(), sos[i].data_ptr(), sds[i].data_ptr(), gs[i].data_ptr(), params[i].numel(),
        static_cast<int>(i)});
  }
  if (hs.empty()) {
    return;
  }
  TORCH_CHECK_VALUE(given || relevant >= 0, "prunadag_step_: relevant (T) must be >= 0, got ", relevant);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto batches = make_batches(hs);
  const unsigned int nblocks = count_blocks(batches);
  at::Tensor buf = make_buffer(p0, nblocks);
  State* st = reinterpret_cast<State*>(buf.data_ptr());
  char* base = static_cast<char*>(buf.data_ptr());
  auto* ghist = reinterpret_cast<unsigned long long*>(base + kHistOffset);
  auto* partials = reinterpret_cast<double*>(base + kPartialsOffset);
  // given: k = 0, so the radix passes only flag non-finite gradients
  init_state<<<1, kThreads, 0, stream>>>(st, ghist, given ? 0 : relevant, given ? 0 : 1);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const double* hyp = h.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(p0.scalar_type(), "prunadag_step_", [&] {
    select<scalar_t>(batches, hyp, true, st, ghist, flag, stream);
    if (given) {
      given_selection_kernel<scalar_t><<<1, 1, 0, stream>>>(st, selection->data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else if (uses_ratio(static_cast<int>(version))) {  // versions 2 and 4 need no norms
      for (const Meta& m : batches) {
        norms_kernel<scalar_t><<<m.nchunks, kThreads, 0, stream>>>(m, hyp, st, partials, nblocks);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
    for (const Meta& m : batches) {
      update_kernel<scalar_t><<<m.nchunks, kThreads, 0, stream>>>(m, hyp, st, flag, static_cast<int>(version));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  copy_back(xs, params);
  copy_back(sos, opt_sums);
  copy_back(sds, dec_sums);
}

// The bracket scan on CUDA, composed of ATen ops: the candidates' count is
// data-dependent, so the output size is read on the host anyway (the sharded
// threshold takes the radix passes on CUDA, which need no bracket).
std::tuple<at::Tensor, at::Tensor> topk_bracket_cuda(at::TensorList values, double lo, double hi) {
  const char* op = "topk_bracket";
  TORCH_CHECK_VALUE(!values.empty(), op, ": values must not be empty");
  const auto& v0 = values[0];
  TORCH_CHECK_VALUE(v0.scalar_type() == at::kFloat || v0.scalar_type() == at::kDouble, op,
      ": values must be float32 or float64, got ", v0.scalar_type());
  for (size_t i = 0; i < values.size(); ++i) {
    TORCH_CHECK_VALUE(values[i].scalar_type() == v0.scalar_type() && values[i].device() == v0.device() &&
        values[i].layout() == at::kStrided, op, ": values[", i, "] must be a dense tensor of the dtype and device "
        "of values[0]");
  }
  TORCH_CHECK_VALUE(std::isfinite(lo) && lo >= 0.0, op, ": lo must be finite and >= 0, got ", lo);
  TORCH_CHECK_VALUE(!std::isnan(hi) && hi >= lo, op, ": hi must be >= lo (inf allowed), got lo=", lo, ", hi=", hi);
  c10::cuda::CUDAGuard guard(v0.device());
  std::vector<at::Tensor> flat;
  for (const auto& v : values) {
    flat.push_back(v.reshape({-1}));
  }
  const at::Tensor a = at::cat(flat).abs();
  AT_DISPATCH_FLOATING_TYPES(v0.scalar_type(), "topk_bracket", [&] {
    TORCH_CHECK_VALUE(static_cast<double>(static_cast<scalar_t>(lo)) == lo &&
        static_cast<double>(static_cast<scalar_t>(hi)) == hi, op,
        ": lo and hi must be values of the values' dtype, got lo=", lo, ", hi=", hi);
  });
  TORCH_CHECK_VALUE(at::isfinite(a).all().item<bool>(), op, ": values contain a non-finite value");
  at::Tensor above = a.gt(hi).sum().to(at::kLong);
  at::Tensor cands = a.masked_select(a.ge(lo).logical_and_(a.le(hi)));
  return {above, cands};
}

// params and grads of one length (not 0: the device is that of params[0])
// and hyper float64 (len, kHyperCols) on that device.
void check_lists_and_hyper(at::TensorList params, at::TensorList grads, const at::Tensor& hyper, const char* op) {
  const size_t nt = params.size();
  TORCH_CHECK_VALUE(grads.size() == nt, op, ": grads must have ", nt, " tensors, got ", grads.size());
  TORCH_CHECK_VALUE(nt > 0, op, ": params must not be empty on CUDA (the device is unknown)");
  const auto& p0 = params[0];
  TORCH_CHECK_VALUE(hyper.scalar_type() == at::kDouble && hyper.dim() == 2 && hyper.size(0) == (int64_t)nt &&
      hyper.size(1) == kHyperCols && hyper.device() == p0.device(), op, ": hyper must be a float64 tensor of shape (",
      nt, ", ", kHyperCols, ") on ", p0.device());
}

at::Tensor prunadag_norms_cuda(at::TensorList params, at::TensorList grads, const at::Tensor& hyper,
    const at::Tensor& tau) {
  const char* op = "prunadag_norms";
  const size_t nt = params.size();
  check_lists_and_hyper(params, grads, hyper, op);
  const auto& p0 = params[0];
  TORCH_CHECK_VALUE(tau.scalar_type() == at::kDouble && tau.numel() == 1 && tau.device() == p0.device(), op,
      ": tau must be a one-element float64 tensor on ", p0.device());
  if (is_reduced_float(p0.scalar_type())) {
    std::vector<at::Tensor> xs, gs;
    for (size_t i = 0; i < nt; ++i) {
      TORCH_CHECK_VALUE(params[i].scalar_type() == p0.scalar_type() && grads[i].scalar_type() == p0.scalar_type() &&
          params[i].device() == p0.device() && grads[i].device() == p0.device() &&
          grads[i].sizes() == params[i].sizes(), op, ": params[", i, "] and grads[", i,
          "] must have the dtype and device of params[0] and one shape");
      xs.push_back(params[i].to(at::kFloat));
      gs.push_back(grads[i].to(at::kFloat));
    }
    return prunadag_norms_cuda(xs, gs, hyper, tau);
  }
  TORCH_CHECK_VALUE(p0.scalar_type() == at::kFloat || p0.scalar_type() == at::kDouble, op,
      ": params must be float16, bfloat16, float32 or float64, got ", p0.scalar_type());
  for (size_t i = 0; i < nt; ++i) {
    TORCH_CHECK_VALUE(params[i].scalar_type() == p0.scalar_type() && grads[i].scalar_type() == p0.scalar_type() &&
        params[i].device() == p0.device() && grads[i].device() == p0.device() &&
        grads[i].sizes() == params[i].sizes(), op, ": params[", i, "] and grads[", i,
        "] must have the dtype and device of params[0] and one shape");
  }
  c10::cuda::CUDAGuard guard(p0.device());
  auto out = at::zeros({3}, hyper.options());
  const at::Tensor h = hyper.contiguous();
  const auto xs = contiguous_all(params), gs = contiguous_all(grads);
  std::vector<Host> hs;
  for (size_t i = 0; i < nt; ++i) {
    if (params[i].numel() == 0) {
      continue;
    }
    hs.push_back(Host{const_cast<void*>(xs[i].data_ptr()), nullptr, nullptr, gs[i].data_ptr(), params[i].numel(),
        static_cast<int>(i)});
  }
  if (hs.empty()) {
    return out;
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto batches = make_batches(hs);
  const unsigned int nblocks = count_blocks(batches);
  at::Tensor buf = make_buffer(p0, nblocks);
  State* st = reinterpret_cast<State*>(buf.data_ptr());
  char* base = static_cast<char*>(buf.data_ptr());
  auto* ghist = reinterpret_cast<unsigned long long*>(base + kHistOffset);
  auto* partials = reinterpret_cast<double*>(base + kPartialsOffset);
  at::Tensor sel = at::cat({tau.reshape({1}), at::zeros({1}, tau.options())});  // [tau, r unused]
  init_state<<<1, kThreads, 0, stream>>>(st, ghist, 0, 0);  // k = 0: the passes only flag non-finite values
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const double* hyp = h.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(p0.scalar_type(), "prunadag_norms", [&] {
    select<scalar_t>(batches, hyp, true, st, ghist, nullptr, stream);
    given_selection_kernel<scalar_t><<<1, 1, 0, stream>>>(st, sel.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    for (const Meta& m : batches) {
      norms_kernel<scalar_t><<<m.nchunks, kThreads, 0, stream>>>(m, hyp, st, partials, nblocks,
                                                                  out.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

// prunAdag's bracket pass on CUDA, composed of ATen ops (as topk_bracket: the
// candidates' count is data-dependent, so the output size is read on the host
// anyway; the sharded step takes the radix passes on CUDA).
std::tuple<at::Tensor, at::Tensor, at::Tensor> prunadag_bracket_cuda(at::TensorList params, at::TensorList grads,
    const at::Tensor& hyper, double lo, double hi) {
  const char* op = "prunadag_bracket";
  const size_t nt = params.size();
  check_lists_and_hyper(params, grads, hyper, op);
  const auto& p0 = params[0];
  TORCH_CHECK_VALUE(std::isfinite(lo) && lo >= 0.0, op, ": lo must be finite and >= 0, got ", lo);
  TORCH_CHECK_VALUE(!std::isnan(hi) && hi >= lo, op, ": hi must be >= lo (inf allowed), got lo=", lo, ", hi=", hi);
  TORCH_CHECK_VALUE(p0.scalar_type() == at::kFloat || p0.scalar_type() == at::kDouble, op,
      ": params must be float32 or float64, got ", p0.scalar_type());
  for (size_t i = 0; i < nt; ++i) {
    TORCH_CHECK_VALUE(params[i].scalar_type() == p0.scalar_type() && grads[i].scalar_type() == p0.scalar_type() &&
        params[i].device() == p0.device() && grads[i].device() == p0.device() &&
        params[i].layout() == at::kStrided && grads[i].layout() == at::kStrided &&
        grads[i].sizes() == params[i].sizes(), op, ": params[", i, "] and grads[", i,
        "] must be dense tensors of the dtype and device of params[0] and one shape");
  }
  AT_DISPATCH_FLOATING_TYPES(p0.scalar_type(), "prunadag_bracket", [&] {
    TORCH_CHECK_VALUE(static_cast<double>(static_cast<scalar_t>(lo)) == lo &&
        static_cast<double>(static_cast<scalar_t>(hi)) == hi, op,
        ": lo and hi must be values of the params' dtype, got lo=", lo, ", hi=", hi);
  });
  c10::cuda::CUDAGuard guard(p0.device());
  const at::Tensor hc = hyper.to(at::kCPU).contiguous();
  const double* hp = hc.data_ptr<double>();
  at::Tensor above = at::zeros({}, hyper.options()), g2 = at::zeros({}, hyper.options()),
             x2 = at::zeros({}, hyper.options());
  at::Tensor finite = at::ones({}, p0.options().dtype(at::kBool));
  std::vector<at::Tensor> cg, cx;
  for (size_t i = 0; i < nt; ++i) {
    if (params[i].numel() == 0) {
      continue;
    }
    const at::Tensor x = params[i].reshape({-1});
    at::Tensor ge = grads[i].reshape({-1});
    if (hp[i * kHyperCols + kMaximize] != 0.0) {
      ge = ge.neg();
    }
    if (hp[i * kHyperCols + kWeightDecay] != 0.0) {
      ge = ge.add(x, hp[i * kHyperCols + kWeightDecay]);
    }
    finite.logical_and_(at::isfinite(ge).all());
    if (hp[i * kHyperCols + kPrune] == 0.0) {
      continue;
    }
    const at::Tensor a = ge.abs();
    const at::Tensor up = a.gt(hi), in = a.ge(lo).logical_and_(a.le(hi));
    above.add_(up.sum());
    g2.add_(ge.to(at::kDouble).square().mul_(up).sum());
    x2.add_(x.to(at::kDouble).square().mul_(a.lt(lo).logical_and_(x.mul(ge).gt(0))).sum());
    cg.push_back(a.masked_select(in));
    cx.push_back(x.to(at::kDouble).square().mul_(x.mul(ge).gt(0)).masked_select(in));
  }
  auto summary = at::zeros({4}, hyper.options());
  if (!finite.item<bool>()) {
    summary[3] = 1.0;  // reported, not raised: the processes agree on it first
    return {summary, at::empty({0}, p0.options()), at::empty({0}, hyper.options())};
  }
  summary[0] = above;
  summary[1] = g2;
  summary[2] = x2;
  if (cg.empty()) {
    return {summary, at::empty({0}, p0.options()), at::empty({0}, hyper.options())};
  }
  return {summary, at::cat(cg), at::cat(cx)};
}

}  // namespace
}  // namespace cuda
}  // namespace prunopt

TORCH_LIBRARY_IMPL(prunopt, CUDA, m) {
  m.impl("topk_threshold", &prunopt::cuda::topk_threshold_cuda);
  m.impl("prunadag_step_", &prunopt::cuda::prunadag_step_cuda);
  m.impl("prunadag_norms", &prunopt::cuda::prunadag_norms_cuda);
  m.impl("topk_bracket", &prunopt::cuda::topk_bracket_cuda);
  m.impl("prunadag_bracket", &prunopt::cuda::prunadag_bracket_cuda);
  // host logic around topk_threshold, topk_bracket and prunadag_bracket (csrc/cpu/topk_slice.cpp)
  m.impl("topk_slice", &prunopt::topk_slice);
  m.impl("prunadag_slice", &prunopt::prunadag_slice);
}
