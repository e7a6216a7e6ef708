// Small-batch linear layers on the CPU at memory speed, on every intra-op thread.
//
// Owns: y[n, O] = x[n, K] @ w[O, K]^T for the few rows a decode step gives a weight (n <= max_rows),
// the weight rows claimed in chunks by the calling thread and the kernel's own helper threads (as
// many threads in all as torch.set_num_threads says), each output an AVX2/FMA dot product whose
// order of additions is fixed: it does not depend on n, on the thread count or on which thread ran
// it -- a row's output is the same bits at batch 1 and batch 8, at one thread and at two. Weights fp32 or bf16
// (bf16 widened in registers: a shift, exact), activations and accumulation fp32. Beyond max_rows
// it is at::mm (the BLAS GEMM, which threads itself; bf16 on widened fp32 copies where the CPU has
// no bf16 arithmetic), so one call site covers every batch. The same kernel reads the lossy
// treatments' quantised expert matrices straight from their packed bytes (int8 with a per-row
// scale; int4 two a byte with a scale and zero point per group), so nothing the size of the matrix
// is written per call: the integer values are converted in registers, exactly, and multiplied with
// x; a scale multiplies a sum once -- the row's (int8) or each group's (int4) -- not each weight,
// and int4's zero points leave the weight loop altogether (each group's zero point times the group's
// sum of x, summed once a row), which is what makes the quantised kernel cheaper per weight than the
// dense one. So a row's output is the
// dequantised matrix's product up to fp32 rounding (not its bits), the same bits at any batch and
// thread count.
// Does not own: the helper threads (pool.h), which call sites use it, whether this CPU can run it,
// building it (engine/kernels/cpu.py).
//
// Dimension legend: n=rows of x, K=inputs, O=outputs (weight rows), E=experts, M=rows of all groups.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"
#include "pool.h"
#include "vec.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using moebench_kernels::cpu_has_avx512;
using moebench_kernels::hsum;
using moebench_kernels::load8;
using moebench_kernels::run_chunks;
using moebench_kernels::widen;

constexpr int64_t CHUNK_ROWS = 64;       // weight rows a thread claims at a time (a multiple of every block's rows)
constexpr int64_t PREFETCH_ROWS = 4;    // a quantised row prefetches the same bytes this many rows on: the next
                                         // block's (rows lie back to back and a block reads 4 at once; a shorter
                                         // distance lands in rows the block is reading already)


// The weight rows a kernel reads, as row readers: `row(o)` gives weight row o's reader, whose
// `load16(k, w0, w1)` yields 16 values of inputs k..k+7 and k+8..k+15 (k a multiple of 16) as two
// 8-lane vectors, `at(t)` input t's value for the scalar tail, and `finish(s)` turns a row's sum
// into its output (int8's multiplies by the row's scale, which stays out of the values). int4 has
// blocks of its own (Int4Blocks).
template <typename W>
struct DenseRows {                                             // fp32 or bf16, row stride ldw elements
  const W* w; int64_t ldw;
  struct Row {
    const W* p;
    inline void load16(int64_t k, __m256& w0, __m256& w1) const { w0 = load8(p + k); w1 = load8(p + k + 8); }
    inline float at(int64_t t) const { return widen(p[t]); }
    inline float finish(float s) const { return s; }
  };
  inline Row row(int64_t o) const { return {w + o * ldw}; }
};

struct Int8Rows {                                              // int8 [O, K], fp32 scale [O]: y = scale * sum(q x)
  const int8_t* q; const float* scale; int64_t K;
  struct Row {
    const int8_t* p; float sf; int64_t ahead;
    inline __m256 half(int64_t k) const {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + k))));
    }
    inline void load16(int64_t k, __m256& w0, __m256& w1) const {
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + k + ahead), _MM_HINT_T0);
      w0 = half(k); w1 = half(k + 8);
    }
    inline float at(int64_t t) const { return static_cast<float>(p[t]); }
    inline float finish(float s) const { return s * sf; }
  };
  inline Row row(int64_t o) const { return {q + o * K, scale[o], PREFETCH_ROWS * K}; }
};

// y[j * O + r] = dot(weight row o + r, x + j * K) for r < R weight rows and j < NB rows of x. Every
// (weight row, x row) pair runs the same instructions in the same order whatever R and NB are: two
// 8-lane accumulators over 16-wide steps, summed, reduced by hsum, then the tail one fma at a time,
// then `finish`.
// R > 1 reads R weight rows side by side: several memory streams per thread, which one core needs
// to reach its share of the bandwidth (one stream alone reads at about 3/4 of it here).
template <typename Rows, int64_t R, int64_t NB>
inline void dot_block(const Rows& rows, int64_t o, const float* x, int64_t K, float* y, int64_t O) {
  typename Rows::Row rr[R];
  for (int64_t r = 0; r < R; ++r) rr[r] = rows.row(o + r);
  __m256 a0[R][NB], a1[R][NB];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NB; ++j) a0[r][j] = a1[r][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    for (int64_t r = 0; r < R; ++r) {
      __m256 w0, w1;
      rr[r].load16(k, w0, w1);
      for (int64_t j = 0; j < NB; ++j) {
        a0[r][j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * K + k), a0[r][j]);
        a1[r][j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * K + k + 8), a1[r][j]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NB; ++j) {
      float s = hsum(_mm256_add_ps(a0[r][j], a1[r][j]));
      for (int64_t t = k; t < K; ++t) s = std::fma(rr[r].at(t), x[j * K + t], s);
      y[j * O + o + r] = rr[r].finish(s);
    }
}

// Weight rows [o0, o1) against all n rows of x, as `blocks.template block<R, NB>(o, j)` calls (R weight
// rows from o against NB rows of x from j): blocks of 4 weight rows at batch 1, of 2 weight rows x 2
// rows of x above it (8 accumulators either way), single weight rows for the last few. Every kernel
// computes each (weight row, x row) pair alike in any block, so the blocking never changes a bit.
template <typename Blocks>
void blocked_range(const Blocks& blocks, int64_t n, int64_t o0, int64_t o1) {
  int64_t o = o0;
  if (n == 1) {
    for (; o + 4 <= o1; o += 4) blocks.template block<4, 1>(o, 0);
  } else {
    for (; o + 2 <= o1; o += 2) {
      int64_t j = 0;
      for (; j + 2 <= n; j += 2) blocks.template block<2, 2>(o, j);
      if (j < n) blocks.template block<2, 1>(o, j);
    }
  }
  for (; o < o1; ++o) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) blocks.template block<1, 4>(o, j);
    switch (n - j) {
      case 3: blocks.template block<1, 3>(o, j); break;
      case 2: blocks.template block<1, 2>(o, j); break;
      case 1: blocks.template block<1, 1>(o, j); break;
      default: break;
    }
  }
}

// dot_block<DenseRows<float>, 4, 1> (4 fp32 weight rows against one row of x: a decode step's
// block) in 16-lane AVX-512 instructions, for a CPU that has them: lanes 0-7 of each accumulator are
// dot_block's a0 and lanes 8-15 its a1, each lane the same fma in the same order, and the two halves
// are added before the same hsum -- so the same bits as dot_block, in half the instructions (one
// 64-byte load and one fma per row and step), which on an AVX-512 host closes the gap to MKL's GEMV
// that the 8-lane block leaves (docs/cpu_experts.md).
MOEBENCH_AVX512 void dense4_avx512(const float* w, int64_t ldw, int64_t o, const float* x,
                                     int64_t K, float* y) {
  __m512 a[4];
  for (int r = 0; r < 4; ++r) a[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
    for (int r = 0; r < 4; ++r) a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + (o + r) * ldw + k), xv, a[r]);
  }
  for (int r = 0; r < 4; ++r) {
    float s = hsum(a[r]);
    for (int64_t t = k; t < K; ++t) s = std::fma(w[(o + r) * ldw + t], x[t], s);
    y[o + r] = s;
  }
}

// dot_block's blocks over x [n, K] and y [n, O] (row stride O); fp32 weights at batch 1 through
// dense4_avx512 where the CPU has AVX-512.
template <typename Rows>
struct FloatBlocks {
  const float* x; Rows w; int64_t O, K; float* y;
  bool avx512 = std::is_same_v<Rows, DenseRows<float>> && cpu_has_avx512();
  template <int64_t R, int64_t NB>
  void block(int64_t o, int64_t j) const {
    if constexpr (std::is_same_v<Rows, DenseRows<float>> && R == 4 && NB == 1) {
      if (avx512) return dense4_avx512(w.w, w.ldw, o, x + j * K, K, y + j * O);
    }
    dot_block<Rows, R, NB>(w, o, x + j * K, K, y + j * O, O);
  }
};


template <typename Rows>
void rows_kernel(const float* x, int64_t n, const Rows& w, int64_t O, int64_t K, float* y) {
  const FloatBlocks<Rows> blocks{x, w, O, K, y};
  run_chunks([blocks, n](int64_t o0, int64_t o1) { blocked_range(blocks, n, o0, o1); }, O, O * K * n, CHUNK_ROWS);
}

void check_weight(const at::Tensor& w, int64_t K, const char* what) {
  TORCH_CHECK(w.device().is_cpu(), what, ": the weight must be on the CPU, got ", w.device());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, what,
              ": the weight must be float32 or bfloat16, got ", w.scalar_type());
  TORCH_CHECK(w.size(-1) == K, what, ": the weight has ", w.size(-1), " inputs, x has ", K);
  TORCH_CHECK(w.stride(-1) == 1 && w.stride(-2) >= K, what, ": each weight row must be contiguous");
}

// out[n, O] (contiguous, the weight's dtype) = x[n, K] @ w[O, K]^T: the kernel up to max_rows rows,
// at::mm beyond -- in fp32 on widened copies for bf16 when `widen_bf16` (a CPU without bf16
// arithmetic, where torch's bf16 GEMM runs at a fraction of the fp32 one; the output is rounded
// to bf16 once, as that GEMM's is).
void linear_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, int64_t max_rows, bool widen_bf16) {
  const int64_t n = x.size(0), O = w.size(0), K = w.size(1);
  if (n == 0) return;
  if (n > max_rows) {
    if (widen_bf16 && w.scalar_type() == at::kBFloat16)
      out.copy_(at::mm(x.to(at::kFloat), w.to(at::kFloat).t()));
    else
      at::mm_out(out, x, w.t());
    return;
  }
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor yf = out.scalar_type() == at::kFloat ? out : at::empty({n, O}, x.options().dtype(at::kFloat));
  if (w.scalar_type() == at::kFloat)
    rows_kernel(xf.data_ptr<float>(), n, DenseRows<float>{w.data_ptr<float>(), w.stride(0)}, O, K, yf.data_ptr<float>());
  else
    rows_kernel(xf.data_ptr<float>(), n, DenseRows<c10::BFloat16>{w.data_ptr<c10::BFloat16>(), w.stride(0)}, O, K,
                yf.data_ptr<float>());
  if (!yf.is_same(out)) out.copy_(yf);
}

}  // namespace

// y[n, O] = x[n, K] @ w[O, K]^T, in x's dtype (which must be w's).
at::Tensor moebench_kernels::small_linear(const at::Tensor& x, const at::Tensor& w, int64_t max_rows, bool widen_bf16) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "small_linear: x [n, K] and w [O, K], got ", x.sizes(), " and ", w.sizes());
  check_weight(w, x.size(1), "small_linear");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "small_linear: x is ", x.scalar_type(), ", w is ", w.scalar_type());
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  linear_into(xc, w, out, max_rows, widen_bf16);
  return out;
}

namespace {

// F.linear(x, w, b) for x [..., K]: small_linear's kernel (then + b) up to max_rows rows, else
// at::linear itself -- what F.linear runs, so a prefill's numerics are torch's, bit for bit.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t max_rows,
                  bool widen_bf16) {
  const int64_t K = x.size(-1), rows = K ? x.numel() / K : 0;
  if (rows == 0 || rows > max_rows || w.dim() != 2) return at::linear(x, w, b);
  check_weight(w, K, "linear");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: x is ", x.scalar_type(), ", w is ", w.scalar_type());
  at::Tensor x2 = x.reshape({rows, K}).contiguous();
  at::Tensor out = at::empty({rows, w.size(0)}, x.options());
  linear_into(x2, w, out, max_rows, widen_bf16);
  if (b.has_value() && b->defined()) out.add_(*b);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  return out.view(shape);
}

// [linear(x, w) for w in ws] for x [..., K] and weights of x's dtype, their rows in one parallel job
// up to max_rows rows (one start and one wait for all, not one each: a layer's q, k and v
// projections, say); each output row the same dot product as `linear`'s, bit for bit.
template <typename W>
void rows_kernels(const float* x, int64_t n, int64_t K, at::TensorList ws, const std::vector<float*>& ys) {
  std::vector<FloatBlocks<DenseRows<W>>> blocks;
  std::vector<std::tuple<size_t, int64_t, int64_t>> chunks;          // (weight, first row, end row)
  int64_t elems = 0;
  for (size_t m = 0; m < ws.size(); ++m) {
    const int64_t O = ws[m].size(0);
    blocks.push_back({x, DenseRows<W>{ws[m].data_ptr<W>(), ws[m].stride(0)}, O, K, ys[m]});
    for (int64_t o = 0; o < O; o += CHUNK_ROWS) chunks.emplace_back(m, o, std::min(O, o + CHUNK_ROWS));
    elems += O * K * n;
  }
  run_chunks([&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const auto [m, o0, o1] = chunks[c];
      blocked_range(blocks[m], n, o0, o1);
    }
  }, static_cast<int64_t>(chunks.size()), elems, 1);
}

std::vector<at::Tensor> linears(const at::Tensor& x, at::TensorList ws, int64_t max_rows, bool widen_bf16) {
  const int64_t K = x.size(-1), rows = K ? x.numel() / K : 0;
  std::vector<at::Tensor> outs;
  if (rows == 0 || rows > max_rows) {
    for (const at::Tensor& w : ws) outs.push_back(linear(x, w, std::nullopt, max_rows, widen_bf16));
    return outs;
  }
  for (const at::Tensor& w : ws) {
    TORCH_CHECK(w.dim() == 2, "linears: each weight must be [O, K], got ", w.sizes());
    check_weight(w, K, "linears");
    TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linears: x is ", x.scalar_type(), ", a weight ", w.scalar_type());
  }
  const at::Tensor xf = x.reshape({rows, K}).to(at::kFloat).contiguous();
  std::vector<at::Tensor> yf;
  std::vector<float*> yp;
  for (const at::Tensor& w : ws) {
    yf.push_back(at::empty({rows, w.size(0)}, x.options().dtype(at::kFloat)));
    yp.push_back(yf.back().data_ptr<float>());
  }
  if (x.scalar_type() == at::kFloat)
    rows_kernels<float>(xf.data_ptr<float>(), rows, K, ws, yp);
  else
    rows_kernels<c10::BFloat16>(xf.data_ptr<float>(), rows, K, ws, yp);
  for (size_t m = 0; m < ws.size(); ++m) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = ws[m].size(0);
    outs.push_back(yf[m].to(x.scalar_type()).view(shape));       // bf16: rounded once, as linear_into rounds
  }
  return outs;
}

// Each expert's group of rows through small_linear's path: x [M, K] sorted by expert, w [E, O, K],
// offs [E] int32 end of each group in x -> [M, O]; a group equals small_linear on it, bit for bit.
// The group sizes are read here, on the CPU, where reading them is no device sync.
at::Tensor grouped_small_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, int64_t max_rows,
                                bool widen_bf16) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3, "grouped_small_linear: x [M, K] and w [E, O, K], got ", x.sizes(),
              " and ", w.sizes());
  check_weight(w, x.size(1), "grouped_small_linear");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "grouped_small_linear: x is ", x.scalar_type(), ", w is ",
              w.scalar_type());
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == w.size(0) && offs.scalar_type() == at::kInt && offs.device().is_cpu(),
              "grouped_small_linear: offs must be int32 [E] on the CPU, E = ", w.size(0));
  at::Tensor xc = x.contiguous(), oc = offs.contiguous();
  at::Tensor out = at::empty({x.size(0), w.size(1)}, x.options());
  const int32_t* ends = oc.data_ptr<int32_t>();
  int64_t start = 0;
  for (int64_t e = 0; e < w.size(0); ++e) {
    const int64_t end = ends[e];
    TORCH_CHECK(end >= start && end <= x.size(0), "grouped_small_linear: offs must ascend within [0, ",
                x.size(0), "], got ", end, " after ", start);
    if (end > start) {
      at::Tensor o = out.narrow(0, start, end - start);
      linear_into(xc.narrow(0, start, end - start), w.select(0, e), o, max_rows, widen_bf16);
    }
    start = end;
  }
  return out;
}

// The quantised matrix [O, K] of a packed expert buffer (uint8, engine/blocks/quant_experts.py):
// byte offsets of its values, its fp32 scales and (int4) its zero points, each checked to lie in
// the buffer, then y[n, O] fp32 = x[n, K] fp32 @ dequant(w)^T by the kernel, whatever n (the
// caller sends larger batches to the dequantise-and-GEMM path).
const uint8_t* packed_part(const at::Tensor& packed, int64_t at, int64_t bytes, int64_t align, const char* what) {
  TORCH_CHECK(at >= 0 && bytes >= 0 && at + bytes <= packed.numel(), what, ": bytes [", at, ", ", at + bytes,
              ") lie outside the packed buffer of ", packed.numel(), " bytes");
  const uint8_t* p = packed.data_ptr<uint8_t>() + at;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p) % align == 0, what, ": must be ", align, "-byte aligned, is at ",
              reinterpret_cast<uintptr_t>(p) % align, " past a multiple");
  return p;
}

// log2 of a power of two (a group size the callers have checked).
int log2_of(int64_t group) {
  int lg = 0;
  while ((int64_t{1} << lg) < group) ++lg;
  return lg;
}

at::Tensor quant_prologue(const at::Tensor& x, const at::Tensor& packed, int64_t K, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.device().is_cpu(), what,
              ": x must be float32 [n, ", K, "] on the CPU, got ", x.scalar_type(), " ", x.sizes(), " on ", x.device());
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.device().is_cpu(), what, ": packed must be a contiguous uint8 buffer on the CPU, got ",
              packed.scalar_type(), " ", packed.sizes(), " on ", packed.device());
  return x.contiguous();
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t q_at, int64_t scale_at, int64_t O,
                       int64_t K) {
  at::Tensor xc = quant_prologue(x, packed, K, "int8_linear");
  Int8Rows rows{reinterpret_cast<const int8_t*>(packed_part(packed, q_at, O * K, 1, "int8_linear values")),
                reinterpret_cast<const float*>(packed_part(packed, scale_at, 4 * O, 4, "int8_linear scales")), K};
  at::Tensor out = at::empty({xc.size(0), O}, xc.options());
  if (xc.size(0) > 0) rows_kernel(xc.data_ptr<float>(), xc.size(0), rows, O, K, out.data_ptr<float>());
  return out;
}

// --- int4 with fp32 activations ------------------------------------------------------------------
// int4: uint8 [O, K/2] (low nibble first), fp32 scale and uint8 zero [O, G], G = K / group, group =
// 1 << lg >= 8: y = sum over groups g of scale_g * sum over the group of q x  -  sum over groups of
// scale_g * zero_g * (the group's sum of x). The weights are read as 32-bit lanes of 8 nibbles
// (4 bytes, inputs 8L..8L+7 of a block) without widening: the lane's nibble c masked in place is
// q * 16^(c mod 4) (c >= 4 from the lane shifted down 16 bits), converted exactly, and meets x's
// input 8L + c pre-scaled by 16^-(c mod 4) (exact: a power of two), so a block of 8 * W inputs
// (W lanes) is one load, one shift and 8 masks, conversions and fmas -- no widening and no
// shuffle -- and every lane lies in one group (a group is >= 8 inputs), so the block's sum is
// folded into the row's total times a vector of its groups' scales. x is laid out per call to
// match (`int4_x`), with each group's sum of x; the zero points are one short dot product a row
// (`int4_tail`), outside the weight loop. W = 16 (AVX-512) where the CPU has it, else 8 (AVX2);
// one width for every block of a call, so a row's output is the same bits at any batch and thread
// count on a given CPU (not across the two widths).
struct Int4Args {
  const uint8_t* q; const float* scale; const uint8_t* zero; int64_t K, G; int lg;
  const float* xp; const float* xg;   // x laid out per block [n, K] and x's group sums [n, G] (int4_x)
  int64_t full;                       // inputs in whole blocks; the rest is the scalar tail
  int32_t sidx[16], smask[16];        // a block's scales: lane L's is scale[k >> lg + sidx[L]], loaded where smask
};

// Row o's output from the sum s of its whole blocks against x row j: the tail's inputs one fma at
// a time (each value's scale applied to it), then less the zero points' term, in a fixed order.
inline float int4_tail(const Int4Args& a, float s, int64_t o, int64_t j) {
  const uint8_t* p = a.q + o * (a.K / 2);
  const float* sc = a.scale + o * a.G;
  const uint8_t* z = a.zero + o * a.G;
  const float* x = a.xp + j * a.K;
  for (int64_t t = a.full; t < a.K; ++t)
    s = std::fma(static_cast<float>((p[t / 2] >> (4 * (t & 1))) & 0x0F) * sc[t >> a.lg], x[t], s);
  const float* xg = a.xg + j * a.G;
  __m256 zt = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= a.G; g += 8) {
    const __m256 zv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + g))));
    zt = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(sc + g), zv), _mm256_loadu_ps(xg + g), zt);
  }
  float zs = hsum(zt);
  for (; g < a.G; ++g) zs = std::fma(sc[g] * static_cast<float>(z[g]), xg[g], zs);
  return s - zs;
}

// The int4 block's vector operations in W lanes: V8 (AVX2) and V16 (AVX-512). Each is marked for
// its instruction set, so int4_block's one body compiles to either where its caller is.
struct V8 : moebench_kernels::Vec8 {
  using I = __m256i;
  static inline I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static inline I load_i(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static inline I srl16(I v) { return _mm256_srli_epi32(v, 16); }
  static inline F masked(I v, I m) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, m)); }
  struct Scales {                  // a block's groups' scales, lane L's from scale[sidx[L]] where smask
    I idx, mask;
    explicit Scales(const Int4Args& a) : idx(load_i(a.sidx)), mask(load_i(a.smask)) {}
    inline F at(const float* s) const { return _mm256_permutevar8x32_ps(_mm256_maskload_ps(s, mask), idx); }
  };
};

struct V16 : moebench_kernels::Vec16 {
  using I = __m512i;
  MOEBENCH_AVX512 static inline I set1(int32_t v) { return _mm512_set1_epi32(v); }
  MOEBENCH_AVX512 static inline I load_i(const void* p) { return _mm512_loadu_si512(p); }
  MOEBENCH_AVX512 static inline I srl16(I v) { return _mm512_srli_epi32(v, 16); }
  MOEBENCH_AVX512 static inline F masked(I v, I m) { return _mm512_cvtepi32_ps(_mm512_and_si512(v, m)); }
  struct Scales {
    I idx; __mmask16 mask;
    MOEBENCH_AVX512 explicit Scales(const Int4Args& a)
        : idx(load_i(a.sidx)), mask(_mm512_cmpneq_epi32_mask(load_i(a.smask), _mm512_setzero_si512())) {}
    MOEBENCH_AVX512 inline F at(const float* s) const { return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(mask, s)); }
  };
};

// R weight rows from o against NB rows of x from j0, in V::W lanes (blocks of 8 * W inputs). Always
// inlined into int4_block8 / int4_block16, which give it their instruction set.
template <typename V, int64_t R, int64_t NB>
__attribute__((always_inline)) inline void int4_block(const Int4Args& a, int64_t o, int64_t j0, float* y, int64_t O) {
  const typename V::I m0 = V::set1(0xF), m1 = V::set1(0xF0), m2 = V::set1(0xF00), m3 = V::set1(0xF000);
  const typename V::Scales scales(a);
  const int64_t ahead = PREFETCH_ROWS * (a.K / 2);
  typename V::F t[R][NB];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NB; ++j) t[r][j] = V::zero();
  for (int64_t k = 0; k < a.full; k += 8 * V::W) {
    for (int64_t r = 0; r < R; ++r) {
      const uint8_t* p = a.q + (o + r) * (a.K / 2) + k / 2;
      if ((k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
      const typename V::I d = V::load_i(p), h = V::srl16(d);
      const typename V::F w[8] = {V::masked(d, m0), V::masked(d, m1), V::masked(d, m2), V::masked(d, m3),
                                  V::masked(h, m0), V::masked(h, m1), V::masked(h, m2), V::masked(h, m3)};
      const typename V::F sc = scales.at(a.scale + (o + r) * a.G + (k >> a.lg));
      for (int64_t j = 0; j < NB; ++j) {
        const float* x = a.xp + (j0 + j) * a.K + k;
        typename V::F s = V::mul(w[0], V::load(x));
        for (int c = 1; c < 8; ++c) s = V::fma(w[c], V::load(x + V::W * c), s);
        t[r][j] = V::fma(s, sc, t[r][j]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NB; ++j) y[(j0 + j) * O + o + r] = int4_tail(a, hsum(t[r][j]), o + r, j0 + j);
}

template <int64_t R, int64_t NB>
void int4_block8(const Int4Args& a, int64_t o, int64_t j0, float* y, int64_t O) { int4_block<V8, R, NB>(a, o, j0, y, O); }

// 16 lanes for a CPU with AVX-512: half the instructions a weight, where the 8-lane block is bound
// by its conversions rather than its reads.
template <int64_t R, int64_t NB>
MOEBENCH_AVX512 void int4_block16(const Int4Args& a, int64_t o, int64_t j0, float* y, int64_t O) {
  int4_block<V16, R, NB>(a, o, j0, y, O);
}

template <bool kWide>
struct Int4Blocks {
  const Int4Args& a; float* y; int64_t O;
  template <int64_t R, int64_t NB>
  void block(int64_t o, int64_t j) const {
    if constexpr (kWide) int4_block16<R, NB>(a, o, j, y, O); else int4_block8<R, NB>(a, o, j, y, O);
  }
};

// x [n, K] laid out for blocks of `lanes` 32-bit weight lanes (8 * lanes inputs): block b's chunk
// c (c < 8), lane L holds input b + 8L + c times 16^-(c mod 4); the tail past the last whole block
// stays in place. And x's sums per group of 1 << lg inputs, in input order: [n, G].
std::tuple<at::Tensor, at::Tensor> int4_x(const at::Tensor& x, int64_t lanes, int lg) {
  const int64_t n = x.size(0), K = x.size(1), B = 8 * lanes, full = K / B * B, group = int64_t{1} << lg;
  at::Tensor xp = at::empty_like(x), xg = at::empty({n, K / group}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = xp.data_ptr<float>();
  float* sums = xg.data_ptr<float>();
  constexpr float kScale[4] = {1.0f, 1.0f / 16, 1.0f / 256, 1.0f / 4096};
  for (int64_t j = 0; j < n; ++j, src += K, dst += K) {
    for (int64_t b = 0; b < full; b += B)
      for (int64_t c = 0; c < 8; ++c)
        for (int64_t L = 0; L < lanes; ++L) dst[b + lanes * c + L] = src[b + 8 * L + c] * kScale[c % 4];
    for (int64_t t = full; t < K; ++t) dst[t] = src[t];
    for (int64_t g = 0; g < K / group; ++g, ++sums) {
      float acc = 0.0f;
      for (int64_t i = 0; i < group; ++i) acc += src[g * group + i];
      *sums = acc;
    }
  }
  return {xp, xg};
}

// lanes: 16 or 8, or 0 for the widest this CPU runs (a test runs the 8-lane blocks on an AVX-512 CPU too).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t q_at, int64_t scale_at, int64_t zero_at,
                       int64_t O, int64_t K, int64_t group, int64_t lanes) {
  TORCH_CHECK(group >= 8 && (group & (group - 1)) == 0 && K % group == 0, "int4_linear: the group size must be a "
              "power of two >= 8 dividing K = ", K, ", got ", group);
  TORCH_CHECK(lanes == 0 || lanes == 8 || (lanes == 16 && cpu_has_avx512()), "int4_linear: lanes must be 0, 8 or "
              "(on a CPU with AVX-512) 16, got ", lanes);
  at::Tensor xc = quant_prologue(x, packed, K, "int4_linear");
  const int64_t G = K / group, n = xc.size(0);
  const int lg = log2_of(group);
  const bool wide = lanes == 16 || (lanes == 0 && cpu_has_avx512());
  lanes = wide ? 16 : 8;
  Int4Args a{packed_part(packed, q_at, O * K / 2, 1, "int4_linear values"),
             reinterpret_cast<const float*>(packed_part(packed, scale_at, 4 * O * G, 4, "int4_linear scales")),
             packed_part(packed, zero_at, O * G, 1, "int4_linear zero points"), K, G, lg, nullptr, nullptr,
             K / (8 * lanes) * (8 * lanes), {}, {}};
  for (int64_t L = 0; L < lanes; ++L) {
    a.sidx[L] = static_cast<int32_t>((8 * L) >> lg);                       // 0 in every lane for a group >= a block
    a.smask[L] = L < std::max<int64_t>(1, (8 * lanes) >> lg) ? -1 : 0;     // the block's groups' scales
  }
  at::Tensor out = at::empty({n, O}, xc.options());
  if (n == 0) return out;
  auto [xp, xg] = int4_x(xc, lanes, lg);
  a.xp = xp.data_ptr<float>();
  a.xg = xg.data_ptr<float>();
  float* y = out.data_ptr<float>();
  auto run = [&](const auto& blocks) {
    run_chunks([&blocks, n](int64_t o0, int64_t o1) { blocked_range(blocks, n, o0, o1); }, O, O * K * n, CHUNK_ROWS);
  };
  if (wide) run(Int4Blocks<true>{a, y, O}); else run(Int4Blocks<false>{a, y, O});
  return out;
}


// --- int8 activations (experts.activations=int8: a lossy treatment of its own, labelled) ----------
// x rounded to int8 per block of QBLOCK inputs -- d = max|x| / 127, q = rint(x / d) as x * (1 / d),
// ties to even: engine.blocks.intquant.quantize_activations, bit for bit -- and each block's
// product with the weights' integer values an integer dot product (AVX2 maddubs: 32 weights in a
// few instructions, where the fp32 path converts each weight to float first), scaled once per block.
// int4: y = sum over blocks b of s_g d_b (sum q_w q_x - z_g sum q_x), the group g holding block b;
// int8: y = s_row sum over blocks of d_b (sum q_w q_x). The dequantised matrix times the rounded x up
// to fp32 rounding, in a fixed order: the same bits at any batch and thread count.
constexpr int64_t QBLOCK = 32;

struct QuantX {                      // x [n, K] rounded: values, block scales d and block sums of the values
  at::Tensor q, d, qs;
  int64_t K, B;
};

// nibble_order: each block's 32 values as its 16 even inputs, then its 16 odd ones (the order of
// int4's low and high nibbles); a block holding a NaN or an infinity gets d = NaN, so its outputs are.
QuantX quantize_x(const at::Tensor& x, bool nibble_order) {
  const int64_t n = x.size(0), K = x.size(1), B = K / QBLOCK;
  QuantX r{at::empty({n, K}, x.options().dtype(at::kChar)), at::empty({n, B}, x.options()),
           at::empty({n, B}, x.options().dtype(at::kInt)), K, B};
  const float* src = x.data_ptr<float>();
  int8_t* q = r.q.data_ptr<int8_t>();
  float* d = r.d.data_ptr<float>();
  int32_t* qs = r.qs.data_ptr<int32_t>();
  for (int64_t jb = 0; jb < n * B; ++jb) {
    const float* xb = src + jb * QBLOCK;
    int8_t* qb = q + jb * QBLOCK;
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < QBLOCK; ++i) {
      finite = finite && std::isfinite(xb[i]);
      amax = std::max(amax, std::fabs(xb[i]));
    }
    const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < QBLOCK; ++i) {
      const int v = finite ? static_cast<int>(std::nearbyint(xb[i] * id)) : 0;
      qb[nibble_order ? (i & 1) * (QBLOCK / 2) + i / 2 : i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[jb] = finite ? db : std::numeric_limits<float>::quiet_NaN();
    qs[jb] = sum;
  }
  return r;
}

struct Int4Q8 {
  const uint8_t* q; const float* scale; const uint8_t* zero; int64_t K, G; int lg;
  const int8_t* xq; const float* xd; const int32_t* xs; int64_t B;
  template <int64_t R, int64_t NB>
  void block(int64_t o, int64_t j0, float* y, int64_t O) const {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    __m256 acc[R][NB];
    float corr[R][NB];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < NB; ++j) { acc[r][j] = _mm256_setzero_ps(); corr[r][j] = 0.0f; }
    const int64_t ahead = PREFETCH_ROWS * (K / 2);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t g = (b * QBLOCK) >> lg;
      for (int64_t r = 0; r < R; ++r) {
        const uint8_t* p = q + (o + r) * (K / 2) + b * (QBLOCK / 2);
        if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
        const float s = scale[(o + r) * G + g], z = static_cast<float>(zero[(o + r) * G + g]);
        for (int64_t j = 0; j < NB; ++j) {
          const int64_t jb = (j0 + j) * B + b;
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (j0 + j) * K + b * QBLOCK));
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
          const float sd = s * xd[jb];
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sd), acc[r][j]);
          corr[r][j] = std::fma(sd * z, static_cast<float>(xs[jb]), corr[r][j]);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < NB; ++j) y[(j0 + j) * O + o + r] = hsum(acc[r][j]) - corr[r][j];
  }
};

struct Int8Q8 {
  const int8_t* q; const float* scale; int64_t K;
  const int8_t* xq; const float* xd; int64_t B;
  template <int64_t R, int64_t NB>
  void block(int64_t o, int64_t j0, float* y, int64_t O) const {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R][NB];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
    const int64_t ahead = PREFETCH_ROWS * K;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* p = q + (o + r) * K + b * QBLOCK;
        if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i aw = _mm256_sign_epi8(w, w);               // |w| as unsigned bytes (-128 -> 128)
        for (int64_t j = 0; j < NB; ++j) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (j0 + j) * K + b * QBLOCK));
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xd[(j0 + j) * B + b]), acc[r][j]);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < NB; ++j) y[(j0 + j) * O + o + r] = hsum(acc[r][j]) * scale[o + r];
  }
};

// A q8 kernel's blocks writing y [n, O].
template <typename Q>
struct Q8Blocks {
  const Q& w; float* y; int64_t O;
  template <int64_t R, int64_t NB>
  void block(int64_t o, int64_t j) const { w.template block<R, NB>(o, j, y, O); }
};

template <typename Q>
at::Tensor q8_run(const Q& w, const at::Tensor& xc, int64_t O) {
  const int64_t n = xc.size(0);
  at::Tensor out = at::empty({n, O}, xc.options());
  float* y = out.data_ptr<float>();
  const Q8Blocks<Q> blocks{w, y, O};
  if (n > 0)
    run_chunks([&blocks, n](int64_t o0, int64_t o1) { blocked_range(blocks, n, o0, o1); }, O, O * w.K * n, CHUNK_ROWS);
  return out;
}

at::Tensor int8_q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t q_at, int64_t scale_at, int64_t O,
                          int64_t K) {
  TORCH_CHECK(K % QBLOCK == 0, "int8_q8_linear: K = ", K, " must be a multiple of ", QBLOCK);
  at::Tensor xc = quant_prologue(x, packed, K, "int8_q8_linear");
  QuantX qx = quantize_x(xc, false);
  Int8Q8 w{reinterpret_cast<const int8_t*>(packed_part(packed, q_at, O * K, 1, "int8_q8_linear values")),
           reinterpret_cast<const float*>(packed_part(packed, scale_at, 4 * O, 4, "int8_q8_linear scales")), K,
           qx.q.data_ptr<int8_t>(), qx.d.data_ptr<float>(), qx.B};
  return q8_run(w, xc, O);
}

at::Tensor int4_q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t q_at, int64_t scale_at,
                          int64_t zero_at, int64_t O, int64_t K, int64_t group) {
  TORCH_CHECK(group >= QBLOCK && (group & (group - 1)) == 0 && K % group == 0, "int4_q8_linear: the group size must "
              "be a power of two >= ", QBLOCK, " dividing K = ", K, ", got ", group);
  at::Tensor xc = quant_prologue(x, packed, K, "int4_q8_linear");
  const int64_t G = K / group;
  const int lg = log2_of(group);
  QuantX qx = quantize_x(xc, true);
  Int4Q8 w{packed_part(packed, q_at, O * K / 2, 1, "int4_q8_linear values"),
           reinterpret_cast<const float*>(packed_part(packed, scale_at, 4 * O * G, 4, "int4_q8_linear scales")),
           packed_part(packed, zero_at, O * G, 1, "int4_q8_linear zero points"), K, G, lg,
           qx.q.data_ptr<int8_t>(), qx.d.data_ptr<float>(), qx.qs.data_ptr<int32_t>(), qx.B};
  return q8_run(w, xc, O);
}

// The rounded activations themselves (tests compare them with the torch definition): x [n, K] ->
// (q int8 [n, K] in input order, d fp32 [n, K/QBLOCK]).
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(1) % QBLOCK == 0,
              "quantize_activations: x must be float32 [n, K] on the CPU, K a multiple of ", QBLOCK);
  QuantX qx = quantize_x(x.contiguous(), false);
  return {qx.q, qx.d};
}

}  // namespace

TORCH_LIBRARY(moebench_cpu, m) {
  m.def("small_linear(Tensor x, Tensor w, int max_rows, bool widen_bf16) -> Tensor", &moebench_kernels::small_linear);
  m.def("linear(Tensor x, Tensor w, Tensor? b, int max_rows, bool widen_bf16) -> Tensor", &linear);
  m.def("linears(Tensor x, Tensor[] ws, int max_rows, bool widen_bf16) -> Tensor[]", &linears);
  m.def("grouped_small_linear(Tensor x, Tensor w, Tensor offs, int max_rows, bool widen_bf16) -> Tensor",
        &grouped_small_linear);
  m.def("int8_linear(Tensor x, Tensor packed, int q_at, int scale_at, int O, int K) -> Tensor", &int8_linear);
  m.def("int4_linear(Tensor x, Tensor packed, int q_at, int scale_at, int zero_at, int O, int K, int group, int lanes) "
        "-> Tensor", &int4_linear);
  m.def("int8_q8_linear(Tensor x, Tensor packed, int q_at, int scale_at, int O, int K) -> Tensor", &int8_q8_linear);
  m.def("int4_q8_linear(Tensor x, Tensor packed, int q_at, int scale_at, int zero_at, int O, int K, int group) -> "
        "Tensor", &int4_q8_linear);
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor)", &quantize_activations);
}
