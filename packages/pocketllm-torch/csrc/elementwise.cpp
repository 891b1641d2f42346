// Fused elementwise steps of a decoder layer, float32 rows of any count:
//   rms_norm(x, w)          x / sqrt(mean(x^2) + eps) * w                      (torch: 5 kernels)
//   add_rms_norm(x, d, w)   (x + d, rms_norm(x + d, w)): a residual add and the next norm   (torch: 6)
//   silu_mul(gate_up)       silu(gate) * up, gate and up the two halves of each row        (torch: 2 + a view)
// A decode step of a small model is bound by its number of small ops as much as by its matmuls.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "isa.h"
#include "vec_math.h"

namespace pocketllm {
namespace {

constexpr int64_t kGrainElements = 16384;  // below this many elements, one thread: a fork costs more

float sum_squares_scalar(const float* x, int64_t n) {
  float ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return ss;
}

void scale_scalar(const float* x, const float* w, float s, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s * w[i];
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }

#ifdef POCKETLLM_X86
__attribute__((target("avx2,fma"))) float sum_squares_avx2(const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  float ss = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) ss += x[i] * x[i];
  return ss;
}

__attribute__((target("avx2,fma"))) void scale_avx2(const float* x, const float* w, float s, int64_t n, float* y) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), _mm256_loadu_ps(w + i)));
  }
  for (; i < n; ++i) y[i] = x[i] * s * w[i];
}

__attribute__((target("avx2,fma"))) void add_avx2(const float* a, const float* b, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  for (; i < n; ++i) y[i] = a[i] + b[i];
}

__attribute__((target("avx2,fma"))) void silu_mul_avx2(const float* g, const float* u, int64_t n, float* y) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 vg = _mm256_loadu_ps(g + i);
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), vg));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) y[i] = silu(g[i]) * u[i];
}
#endif

void check_rows(const char* op, const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), op, ": ",
              name, " must be a contiguous 2-D float32 CPU tensor");
}

void check_weight(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.is_contiguous() && weight.size(0) == x.size(1),
              op, ": weight must be a contiguous float32 vector of ", x.size(1), " elements");
}

// y = rms_norm(x) row by row; x may alias nothing y holds.
void norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y) {
  const bool avx2 = uses_avx2();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = x + r * n;
#ifdef POCKETLLM_X86
      if (avx2) {
        scale_avx2(xr, w, 1.0f / std::sqrt(sum_squares_avx2(xr, n) / n + eps), n, y + r * n);
        continue;
      }
#endif
      scale_scalar(xr, w, 1.0f / std::sqrt(sum_squares_scalar(xr, n) / n + eps), n, y + r * n);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows("rms_norm", x, "x");
  check_weight("rms_norm", x, weight);
  at::Tensor y = at::empty_like(x);
  norm_rows(x.const_data_ptr<float>(), weight.const_data_ptr<float>(), static_cast<float>(eps), x.size(0), x.size(1),
            y.mutable_data_ptr<float>());
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_rows("add_rms_norm", x, "x");
  check_rows("add_rms_norm", delta, "delta");
  TORCH_CHECK(x.sizes() == delta.sizes(), "add_rms_norm: x and delta differ in shape");
  check_weight("add_rms_norm", x, weight);
  at::Tensor sum = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  const float *xp = x.const_data_ptr<float>(), *dp = delta.const_data_ptr<float>();
  float* sp = sum.mutable_data_ptr<float>();
  const bool avx2 = uses_avx2();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
#ifdef POCKETLLM_X86
      if (avx2) {
        add_avx2(xp + r * n, dp + r * n, n, sp + r * n);
        continue;
      }
#endif
      for (int64_t i = r * n; i < (r + 1) * n; ++i) sp[i] = xp[i] + dp[i];
    }
  });
  at::Tensor normed = at::empty_like(x);
  norm_rows(sp, weight.const_data_ptr<float>(), static_cast<float>(eps), rows, n, normed.mutable_data_ptr<float>());
  return {sum, normed};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows("silu_mul", gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even number of columns");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor y = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  const bool avx2 = uses_avx2();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float *g = gp + r * 2 * n, *u = g + n;
#ifdef POCKETLLM_X86
      if (avx2) {
        silu_mul_avx2(g, u, n, yp + r * n);
        continue;
      }
#endif
      for (int64_t i = 0; i < n; ++i) yp[r * n + i] = silu(g[i]) * u[i];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pocketllm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pocketllm, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
}

}  // namespace pocketllm
