#include "kernels/tree_attention_reference.h"

#include <limits>

#include "kernels/tree_attention_internal.h"

namespace dta::kernels {
namespace {

at::ScalarType ComputeType(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// On CPU key_end is cheap to check; elsewhere checking would synchronize the device.
void CheckKeyEnd(const at::Tensor& key_end) {
  if (!key_end.device().is_cpu()) return;
  const int64_t tokens = key_end.size(0);
  const at::Tensor ends = key_end.to(at::kLong);
  const at::Tensor rows = at::arange(tokens, ends.options());
  TORCH_CHECK(at::all(ends > rows).item<bool>() && at::all(ends <= tokens).item<bool>(),
              "tree attention: key_end[j] must satisfy j < key_end[j] <= T = ", tokens);
}

void CheckPrefixInputs(const at::Tensor& q, const at::Tensor& prefix_k,
                       const at::Tensor& prefix_v) {
  TORCH_CHECK(q.dim() == 3 && prefix_k.dim() == 3 && prefix_k.sizes() == prefix_v.sizes() &&
                  prefix_k.size(0) >= 1 && prefix_k.size(1) >= 1 &&
                  q.size(1) % prefix_k.size(1) == 0 && prefix_k.size(2) == q.size(2),
              "prefix attention: q must be [T, Hq, D] and prefix K/V [P >= 1, Hkv, D] with Hkv "
              "dividing Hq; got q ",
              q.sizes(), ", prefix_k ", prefix_k.sizes(), ", prefix_v ", prefix_v.sizes());
  TORCH_CHECK(prefix_k.scalar_type() == q.scalar_type() &&
                  prefix_v.scalar_type() == q.scalar_type() && prefix_k.device() == q.device() &&
                  prefix_v.device() == q.device(),
              "prefix attention: q and the prefix K/V must share a dtype and a device");
}

// Every key row in the compute dtype with the query heads' layout: [Hq, P + T, D].
at::Tensor AllKeysPerQueryHead(const at::Tensor& prefix, const at::Tensor& chunk, int64_t group,
                               at::ScalarType type) {
  at::Tensor rows =
      internal::HasPrefix(prefix) ? at::cat({prefix.to(type), chunk.to(type)}, 0) : chunk.to(type);
  if (group > 1) rows = rows.repeat_interleave(group, 1);
  return rows.permute({1, 0, 2});
}

// Scaled scores [Hq, T, L] of q against keys [Hq, L, D]; entries that `visible` ([T, L] bool, or
// undefined: all) hides are -inf.
at::Tensor Scores(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& visible,
                  double scale, at::ScalarType type) {
  const at::Tensor scores = at::matmul(q.to(type).permute({1, 0, 2}), keys.transpose(1, 2)) * scale;
  if (!visible.defined()) return scores;
  return scores.masked_fill(visible.to(scores.device()).logical_not().unsqueeze(0),
                            -std::numeric_limits<double>::infinity());
}

// [Hq, L, D] summed over each kv head's group of query heads -> [L, Hkv, D].
at::Tensor SumGroups(const at::Tensor& per_q_head, int64_t kv_heads) {
  const int64_t q_heads = per_q_head.size(0);
  return per_q_head.reshape({kv_heads, q_heads / kv_heads, per_q_head.size(1), per_q_head.size(2)})
      .sum(1)
      .permute({1, 0, 2});
}

// Softmax attention of q [T, Hq, D] over keys and values [Hq, L, D] with the `visible` mask.
TreeAttentionOutput Attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& visible, double scale) {
  const at::ScalarType type = ComputeType(q);
  const at::Tensor scores = Scores(q, keys, visible, scale, type);
  const at::Tensor lse = at::logsumexp(scores, -1);  // [Hq, T]
  const at::Tensor probs = at::exp(scores - lse.unsqueeze(-1));
  const at::Tensor out = at::matmul(probs, values).permute({1, 0, 2});  // [T, Hq, D]
  return {out.to(q.scalar_type()).contiguous(), lse.contiguous()};
}

// Attend's gradients in the compute dtype: dq [T, Hq, D], and dk, dv [L, Hkv, D]. out and lse may
// be those of attention over more keys than these (a log-sum-exp merge): each key set's gradients
// are then its share of the whole's.
struct AttendGrads {
  at::Tensor dq, dk, dv;
};
AttendGrads AttendBackward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& keys,
                           const at::Tensor& values, const at::Tensor& visible,
                           const at::Tensor& out, const at::Tensor& lse, double scale,
                           int64_t kv_heads) {
  const at::ScalarType type = ComputeType(q);
  const at::Tensor scores = Scores(q, keys, visible, scale, type);
  const at::Tensor probs = at::exp(scores - lse.to(type).unsqueeze(-1));  // [Hq, T, L]
  const at::Tensor d_out = grad_out.to(type).permute({1, 0, 2});          // [Hq, T, D]
  const at::Tensor row_dot = (d_out * out.to(type).permute({1, 0, 2})).sum(-1, true);
  const at::Tensor d_probs = at::matmul(d_out, values.transpose(1, 2));  // [Hq, T, L]
  const at::Tensor d_scores = probs * (d_probs - row_dot);
  return {
      .dq = (at::matmul(d_scores, keys) * scale).permute({1, 0, 2}),
      .dk = SumGroups(at::matmul(d_scores.transpose(1, 2), q.to(type).permute({1, 0, 2})) * scale,
                      kv_heads),
      .dv = SumGroups(at::matmul(probs.transpose(1, 2), d_out), kv_heads)};
}

}  // namespace

at::Tensor TreeAttentionMask(const at::Tensor& key_end, int64_t prefix_len) {
  const int64_t tokens = key_end.size(0);
  const at::Tensor ends = key_end.to(at::kLong);
  const at::Tensor idx = at::arange(tokens, ends.options());
  const at::Tensor query = idx.unsqueeze(1);  // i
  const at::Tensor key = idx.unsqueeze(0);    // j
  const at::Tensor chunk = key.le(query).logical_and(query.lt(ends.unsqueeze(0)));
  if (prefix_len == 0) return chunk;
  return at::cat({at::ones({tokens, prefix_len}, chunk.options()), chunk}, 1);
}

TreeAttentionOutput ReferenceTreeAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& prefix_k,
                                                  const at::Tensor& prefix_v,
                                                  const at::Tensor& key_end, double scale) {
  const internal::TreeAttentionShape s =
      internal::CheckForwardInputs(q, k, v, prefix_k, prefix_v, key_end);
  CheckKeyEnd(key_end);
  const at::ScalarType type = ComputeType(q);
  const int64_t group = s.q_heads / s.kv_heads;
  return Attend(q, AllKeysPerQueryHead(prefix_k, k, group, type),
                AllKeysPerQueryHead(prefix_v, v, group, type), TreeAttentionMask(key_end, s.prefix),
                scale);
}

TreeAttentionGrads ReferenceTreeAttentionBackward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& prefix_k, const at::Tensor& prefix_v, const at::Tensor& key_end,
    const at::Tensor& out, const at::Tensor& lse, double scale, at::Tensor& grad_prefix_k,
    at::Tensor& grad_prefix_v) {
  const internal::TreeAttentionShape s =
      internal::CheckForwardInputs(q, k, v, prefix_k, prefix_v, key_end);
  internal::CheckBackwardInputs(s, q, grad_out, out, lse, grad_prefix_k, grad_prefix_v);
  CheckKeyEnd(key_end);
  const at::ScalarType type = ComputeType(q);
  const int64_t group = s.q_heads / s.kv_heads;
  const AttendGrads g =
      AttendBackward(grad_out, q, AllKeysPerQueryHead(prefix_k, k, group, type),
                     AllKeysPerQueryHead(prefix_v, v, group, type),
                     TreeAttentionMask(key_end, s.prefix), out, lse, scale, s.kv_heads);
  if (s.prefix > 0) {
    grad_prefix_k.add_(g.dk.slice(0, 0, s.prefix).to(grad_prefix_k.scalar_type()));
    grad_prefix_v.add_(g.dv.slice(0, 0, s.prefix).to(grad_prefix_v.scalar_type()));
  }
  const at::ScalarType out_type = q.scalar_type();
  return {g.dq.to(out_type).contiguous(), g.dk.slice(0, s.prefix).to(out_type).contiguous(),
          g.dv.slice(0, s.prefix).to(out_type).contiguous()};
}

TreeAttentionOutput ReferencePrefixAttentionForward(const at::Tensor& q, const at::Tensor& prefix_k,
                                                    const at::Tensor& prefix_v, double scale) {
  CheckPrefixInputs(q, prefix_k, prefix_v);
  const at::ScalarType type = ComputeType(q);
  const int64_t group = q.size(1) / prefix_k.size(1);
  return Attend(q, AllKeysPerQueryHead(at::Tensor(), prefix_k, group, type),
                AllKeysPerQueryHead(at::Tensor(), prefix_v, group, type), at::Tensor(), scale);
}

at::Tensor ReferencePrefixAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                            const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                            const at::Tensor& out, const at::Tensor& lse,
                                            double scale, const at::Tensor& grad_prefix_k,
                                            const at::Tensor& grad_prefix_v) {
  CheckPrefixInputs(q, prefix_k, prefix_v);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes() &&
                  lse.sizes() == at::IntArrayRef({q.size(1), q.size(0)}),
              "prefix attention: grad_out and out must be ", q.sizes(), " and lse [Hq, T]");
  const at::ScalarType type = ComputeType(q);
  const int64_t group = q.size(1) / prefix_k.size(1);
  const AttendGrads g =
      AttendBackward(grad_out, q, AllKeysPerQueryHead(at::Tensor(), prefix_k, group, type),
                     AllKeysPerQueryHead(at::Tensor(), prefix_v, group, type), at::Tensor(), out,
                     lse, scale, prefix_k.size(1));
  if (grad_prefix_k.defined()) {
    at::Tensor(grad_prefix_k).add_(g.dk.to(grad_prefix_k.scalar_type()));
    at::Tensor(grad_prefix_v).add_(g.dv.to(grad_prefix_v.scalar_type()));
  }
  return g.dq.to(q.scalar_type()).contiguous();
}

}  // namespace dta::kernels
