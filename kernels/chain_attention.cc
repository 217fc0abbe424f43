#include "kernels/chain_attention.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <tuple>

#include "core/base/env_switch.h"

namespace dta::kernels {
namespace {

std::atomic<bool> cudnn_failed{false};

bool CudnnAttentionEnabled() {
  static const bool enabled = EnvSwitchOn("DTA_CUDNN_ATTENTION");
  return enabled && !cudnn_failed.load(std::memory_order_relaxed);
}

// The first failure is said once; tree attention runs from then on.
void ReportUnavailable(const std::exception& e) {
  if (!cudnn_failed.exchange(true)) {
    std::fprintf(stderr,
                 "dta: cuDNN attention is unavailable here, tree attention runs instead: %s\n",
                 e.what());
  }
}

// [T, H, D] as cuDNN's [1, H, T, D] (a view: the heads' rows stay interleaved).
at::Tensor Bhsd(const at::Tensor& t) { return t.unsqueeze(0).transpose(1, 2); }

// K/V gradients with kv_heads heads, in `type`. cuDNN takes grouped K/V heads natively (kv head h
// serves query heads h * group .. + group - 1) and returns their gradients summed over each group;
// a gradient per query head (a backend that repeats the heads) is summed here, in float32.
at::Tensor SumGroups(const at::Tensor& grad, int64_t kv_heads, at::ScalarType type) {
  const int64_t group = grad.size(1) / kv_heads;
  if (group == 1) return grad.to(type);
  return grad.reshape({grad.size(0), kv_heads, group, grad.size(2)})
      .sum(2, /*keepdim=*/false, at::kFloat)
      .to(type);
}

}  // namespace

bool CudnnAttentionFailed() { return cudnn_failed.load(std::memory_order_relaxed); }

bool ChainAttentionSupports(const at::Tensor& q, const at::Tensor& k) {
  // cuDNN's backward refuses a single token (s_q = s_kv = 1).
  return q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) &&
         q.dim() == 3 && k.dim() == 3 && q.size(0) >= 2 && q.size(2) % 8 == 0 && q.size(2) <= 128 &&
         k.size(1) >= 1 && q.size(1) % k.size(1) == 0 && CudnnAttentionEnabled();
}

namespace {

// cuDNN's attention of q [T, Hq, D] over k, v [S, Hkv, D]: causal (top-left aligned, S = T) or
// every key for every query.
ChainAttentionOutput CudnnForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  double scale, bool causal) {
  try {
    auto [out, logsumexp, cum_q, cum_k, max_q, max_k, seed, offset, debug] =
        at::_scaled_dot_product_cudnn_attention(
            Bhsd(q.contiguous()), Bhsd(k.contiguous()), Bhsd(v.contiguous()),
            /*attn_bias=*/std::nullopt,
            /*compute_log_sumexp=*/true, /*dropout_p=*/0.0, causal,
            /*return_debug_mask=*/false, scale);
    return {.out = out.squeeze(0).transpose(0, 1).contiguous(),
            .out_bhsd = out,
            .logsumexp = logsumexp,
            .philox_seed = seed,
            .philox_offset = offset};
  } catch (const std::exception& e) {
    ReportUnavailable(e);
    throw;
  }
}

// dk and dv come back in key_grad_type.
TreeAttentionGrads CudnnBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v,
                                 const ChainAttentionOutput& forward, double scale, bool causal,
                                 at::ScalarType key_grad_type) {
  // The gradient in the output's own layout (cuDNN expects matching strides).
  const at::Tensor grad_bhsd = at::empty_like(forward.out_bhsd);
  grad_bhsd.copy_(Bhsd(grad_out));
  at::Tensor dq, dk, dv;
  try {
    std::tie(dq, dk, dv) = at::_scaled_dot_product_cudnn_attention_backward(
        grad_bhsd, Bhsd(q.contiguous()), Bhsd(k.contiguous()), Bhsd(v.contiguous()),
        forward.out_bhsd, forward.logsumexp, forward.philox_seed, forward.philox_offset,
        /*attn_bias=*/at::Tensor(),
        /*cum_seq_q=*/at::Tensor(), /*cum_seq_k=*/at::Tensor(), /*max_q=*/q.size(0),
        /*max_k=*/k.size(0), /*dropout_p=*/0.0, causal, scale);
  } catch (const std::exception& e) {
    ReportUnavailable(e);
    throw;
  }
  auto rows = [](const at::Tensor& g) { return g.squeeze(0).transpose(0, 1); };
  return {.dq = rows(dq).contiguous(),
          .dk = SumGroups(rows(dk), k.size(1), key_grad_type).contiguous(),
          .dv = SumGroups(rows(dv), v.size(1), key_grad_type).contiguous()};
}

void CheckKeys(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               bool same_length) {
  TORCH_CHECK(ChainAttentionSupports(q, k), what, ": unsupported inputs q ", q.sizes(), " ",
              q.scalar_type(), " on ", q.device(), ", k ", k.sizes());
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) >= 1 && k.size(2) == q.size(2) &&
                  k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  (!same_length || k.size(0) == q.size(0)),
              what, ": k ", k.sizes(), " and v ", v.sizes(), " must be [", same_length ? "T" : "S",
              ", Hkv, D] in q's dtype for q ", q.sizes());
}

}  // namespace

ChainAttentionOutput ChainAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, double scale) {
  CheckKeys("chain attention", q, k, v, /*same_length=*/true);
  return CudnnForward(q, k, v, scale, /*causal=*/true);
}

TreeAttentionGrads ChainAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v,
                                          const ChainAttentionOutput& forward, double scale) {
  return CudnnBackward(grad_out, q, k, v, forward, scale, /*causal=*/true, k.scalar_type());
}

ChainAttentionOutput PrefixAttentionForward(const at::Tensor& q, const at::Tensor& prefix_k,
                                            const at::Tensor& prefix_v, double scale) {
  CheckKeys("prefix attention", q, prefix_k, prefix_v, /*same_length=*/false);
  return CudnnForward(q, prefix_k, prefix_v, scale, /*causal=*/false);
}

TreeAttentionGrads PrefixAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                           const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                           const ChainAttentionOutput& forward, double scale) {
  return CudnnBackward(grad_out, q, prefix_k, prefix_v, forward, scale, /*causal=*/false,
                       at::kFloat);
}

ChainAttentionOutput WithMergedOutput(const ChainAttentionOutput& part, const at::Tensor& out,
                                      const at::Tensor& lse) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && lse.is_contiguous() &&
                  lse.scalar_type() == at::kFloat &&
                  lse.sizes() == at::IntArrayRef({out.size(1), out.size(0)}),
              "WithMergedOutput: out must be a contiguous [T, Hq, D] and lse [Hq, T] float32");
  ChainAttentionOutput merged = part;
  merged.out = out;
  merged.out_bhsd = Bhsd(out);
  merged.logsumexp = lse.view({1, out.size(1), out.size(0), 1});
  return merged;
}

}  // namespace dta::kernels
