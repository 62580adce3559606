// fb_reconstruct's generic row kernels on the CPU: the part shared by
// csrc/cpu/fb_reconstruct.cpp and the per-capability objects that compile
// csrc/cpu/fb_reconstruct_kernels.inc on ATen's at::vec::Vectorized
// (fb_reconstruct_default.cpp, fb_reconstruct_avx2.cpp,
// fb_reconstruct_avx512.cpp; chosen with prunopt/vec_capability.h). The
// float 3x3 basis keeps its own loops in fb_reconstruct.cpp. Torch-free.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace prunopt {
namespace fb_rows {

// The problem: rows x N coefficients, N x K basis, rows x K filters.
struct Dims {
  int64_t rows, n, k;
};

constexpr int64_t kBlockRows = 32;  // rows per short block of the dg reduction
// Rows of up to 128 bytes (32 floats, 16 doubles) take the vector path: up to
// 4 vectors of 8 / 4 lanes, 2 of 16 / 8.
constexpr int64_t kMaxRowBytes = 128;

template <typename scalar_t>
struct BackwardArgs {
  const scalar_t* dh;
  const scalar_t* lam;
  const scalar_t* mu;
  const scalar_t* gtpad;  // k x C vectors: g^T padded (dlam)
  Dims d;
  scalar_t* dlam;         // nullptr: not needed
  double* dg;             // n x k, nullptr: not needed (added to)
};

// Rows [r0, r1) of one thread chunk split into the rows whose C*V-wide reads
// and writes stay inside the chunk ([r0, fast_end)) and the rest.
inline int64_t fast_end(int64_t r0, int64_t r1, int64_t width, int64_t len_a, int64_t len_b) {
  // a row of length len written `width` wide spills into the next ceil((width - len) / len) rows
  auto ahead = [&](int64_t len) { return len >= width ? 0 : (width - len + len - 1) / len; };
  return std::max(r0, r1 - std::max(ahead(len_a), ahead(len_b)));
}

// One capability's row kernels for one dtype: `lanes` per vector; c vectors
// per row (the padded basis is c * lanes wide).
template <typename T>
struct RowsT {
  int lanes;
  void (*forward)(const T* lam, const T* mu, const T* gpad, const Dims& d, int c, T* h, int64_t r0, int64_t r1);
  void (*backward)(const BackwardArgs<T>& a, int c, int64_t r0, int64_t r1);
};

struct Rows {
  RowsT<float> f;
  RowsT<double> d;
  template <typename T>
  const RowsT<T>& get() const {
    if constexpr (std::is_same_v<T, float>) {
      return f;
    } else {
      return d;
    }
  }
};

// The clones (fb_reconstruct_default.cpp; the others on x86-64 only).
namespace DEFAULT {
const Rows* rows();
}
namespace AVX2 {
const Rows* rows();
}
namespace AVX512 {
const Rows* rows();
}

}  // namespace fb_rows
}  // namespace prunopt
