// One decode step of a Gated DeltaNet layer for B sequences, after its input projection and before its output
// projection, in one operator (torch: about 35 kernels per layer, which bound a small hybrid model's decode):
//
//   the causal depthwise convolution over each sequence's kept inputs and its new one, SiLU, the window moved on;
//   q and k L2-normalised per key head (q also scaled by dk^-0.5), each key head serving Hv / Hk value heads:
//   value head h reads key head h / (Hv / Hk) (Hugging Face's grouped order) or h % Hk (tiled: llama.cpp's GGUF);
//   beta = sigmoid(b), decay = exp(decay_rate * softplus(a + dt_bias));
//   the delta rule on the float32 state S [dk, dv]:  S = decay * S;  S += k (x) (v - k^T S) * beta;  o = q^T S;
//   the gated RMSNorm per value head:  o / sqrt(mean(o^2) + eps) * norm_weight * silu(z).
//
// Its arguments are what the layer holds, and the state pools with one slot per running request; the step's
// rows of the pools are read and written in place. Portable C++: the loops run over contiguous value dims, which
// the compiler vectorises for the baseline instruction set, so there is no ISA split to dispatch or test.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace pocketllm {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
float silu(float x) { return x * sigmoid(x); }
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim && t.is_contiguous(),
              "gated_delta_decode: ", name, " must be a contiguous ", dim, "-D float32 CPU tensor");
}

void normalise(float* x, int64_t n, float scale) {
  float ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float s = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

at::Tensor gated_delta_decode(const at::Tensor& proj, at::Tensor& conv_pool, at::Tensor& recurrent_pool,
                              const at::Tensor& slots, const at::Tensor& conv_weight, const at::Tensor& decay_rate,
                              const at::Tensor& dt_bias, const at::Tensor& norm_weight, int64_t num_k_heads,
                              bool tiled_heads, double eps) {
  check_float(proj, "proj", 2);
  check_float(conv_pool, "conv_pool", 3);
  check_float(recurrent_pool, "recurrent_pool", 4);
  check_float(conv_weight, "conv_weight", 2);
  check_float(decay_rate, "decay_rate", 1);
  check_float(dt_bias, "dt_bias", 1);
  check_float(norm_weight, "norm_weight", 1);
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "gated_delta_decode: slots must be a contiguous int64 vector");
  const int64_t batch = proj.size(0), num_slots = conv_pool.size(0), channels = conv_pool.size(1);
  const int64_t kept = conv_pool.size(2), hv = recurrent_pool.size(1), dk = recurrent_pool.size(2);
  const int64_t dv = recurrent_pool.size(3), hk = num_k_heads;
  TORCH_CHECK(slots.size(0) == batch, "gated_delta_decode: ", batch, " rows of proj but ", slots.size(0), " slots");
  TORCH_CHECK(recurrent_pool.size(0) == num_slots, "gated_delta_decode: the pools have different slot counts");
  TORCH_CHECK(hk > 0 && hv % hk == 0, "gated_delta_decode: ", hv, " value heads are not a multiple of ", hk,
              " key heads");
  TORCH_CHECK(channels == 2 * hk * dk + hv * dv, "gated_delta_decode: ", channels, " convolution channels, not q, k "
              "and v's ", 2 * hk * dk + hv * dv);
  TORCH_CHECK(proj.size(1) == channels + hv * dv + 2 * hv, "gated_delta_decode: proj has ", proj.size(1),
              " columns, not ", channels + hv * dv + 2 * hv, " (q, k, v, z, b, a)");
  TORCH_CHECK(conv_weight.size(0) == channels && conv_weight.size(1) == kept + 1,
              "gated_delta_decode: conv_weight must be [", channels, ", ", kept + 1, "]");
  TORCH_CHECK(decay_rate.size(0) == hv && dt_bias.size(0) == hv && norm_weight.size(0) == dv,
              "gated_delta_decode: decay_rate and dt_bias need ", hv, " elements, norm_weight ", dv);
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "gated_delta_decode: slot ", slot[b], " out of range");
    for (int64_t other = 0; other < b; ++other) {
      TORCH_CHECK(slot[other] != slot[b], "gated_delta_decode: slot ", slot[b], " given twice");
    }
  }

  at::Tensor out = at::empty({batch, hv * dv}, proj.options());
  const float *pp = proj.const_data_ptr<float>(), *cw = conv_weight.const_data_ptr<float>();
  const float *rate = decay_rate.const_data_ptr<float>(), *bias = dt_bias.const_data_ptr<float>();
  const float* nw = norm_weight.const_data_ptr<float>();
  float *cp = conv_pool.mutable_data_ptr<float>(), *rp = recurrent_pool.mutable_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  const auto feps = static_cast<float>(eps);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> mixed(channels), remembered(dv);
    for (int64_t b = begin; b < end; ++b) {
      const float* row = pp + b * proj.size(1);
      float* conv = cp + slot[b] * channels * kept;
      for (int64_t c = 0; c < channels; ++c) {
        float* window = conv + c * kept;
        const float* w = cw + c * (kept + 1);
        float acc = w[kept] * row[c];
        for (int64_t j = 0; j < kept; ++j) acc += w[j] * window[j];
        for (int64_t j = 0; j + 1 < kept; ++j) window[j] = window[j + 1];
        if (kept > 0) window[kept - 1] = row[c];
        mixed[c] = silu(acc);
      }
      float *q = mixed.data(), *k = q + hk * dk, *v = k + hk * dk;
      for (int64_t h = 0; h < hk; ++h) {
        normalise(q + h * dk, dk, q_scale);
        normalise(k + h * dk, dk, 1.0f);
      }
      const float *z = row + channels, *beta_logits = z + hv * dv, *decay_logits = beta_logits + hv;
      for (int64_t h = 0; h < hv; ++h) {
        const int64_t key_head = tiled_heads ? h % hk : h / (hv / hk);
        const float* qh = q + key_head * dk;
        const float* kh = k + key_head * dk;
        const float* vh = v + h * dv;
        const float beta = sigmoid(beta_logits[h]);
        const float decay = std::exp(rate[h] * softplus(decay_logits[h] + bias[h]));
        float* state = rp + ((slot[b] * hv + h) * dk) * dv;
        for (int64_t j = 0; j < dv; ++j) remembered[j] = 0;
        for (int64_t i = 0; i < dk; ++i) {
          const float* s = state + i * dv;
          for (int64_t j = 0; j < dv; ++j) remembered[j] += kh[i] * s[j];
        }
        for (int64_t j = 0; j < dv; ++j) remembered[j] = (vh[j] - decay * remembered[j]) * beta;  // the delta
        float* o = op + b * hv * dv + h * dv;
        for (int64_t j = 0; j < dv; ++j) o[j] = 0;
        for (int64_t i = 0; i < dk; ++i) {
          float* s = state + i * dv;
          for (int64_t j = 0; j < dv; ++j) {
            s[j] = decay * s[j] + kh[i] * remembered[j];
            o[j] += qh[i] * s[j];
          }
        }
        float ss = 0;
        for (int64_t j = 0; j < dv; ++j) ss += o[j] * o[j];
        const float inv = 1.0f / std::sqrt(ss / dv + feps);
        const float* zh = z + h * dv;
        for (int64_t j = 0; j < dv; ++j) o[j] = o[j] * inv * nw[j] * silu(zh[j]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pocketllm, m) {
  m.def("gated_delta_decode(Tensor proj, Tensor(a!) conv_pool, Tensor(b!) recurrent_pool, Tensor slots, "
        "Tensor conv_weight, Tensor decay_rate, Tensor dt_bias, Tensor norm_weight, int num_k_heads, "
        "bool tiled_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pocketllm, CPU, m) { m.impl("gated_delta_decode", gated_delta_decode); }

}  // namespace pocketllm
