// The kernels one translation unit calls in another (each defined in the file named).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace moebench_kernels {

// rows_linear.cpp: y[n, O] = x[n, K] @ w[O, K]^T in x's dtype, the kernel up to max_rows rows, at::mm above.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, int64_t max_rows, bool widen_bf16);

}  // namespace moebench_kernels
