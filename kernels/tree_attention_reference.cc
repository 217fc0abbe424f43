#include "kernels/tree_attention_reference.h"

#include <algorithm>
#include <cstdint>
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

// Which keys the queries see: a tree mask over the prefix and the chunk (key_end defined, as
// kLong), or every key (undefined). Under a tree mask chunk key j is hidden from every query i < j,
// so query rows [r0, r1) see at most the first P + r1 keys.
struct Visibility {
  at::Tensor key_end;
  int64_t prefix = 0;
};

Visibility TreeVisibility(const at::Tensor& key_end, int64_t prefix) {
  return {.key_end = key_end.to(at::kLong), .prefix = prefix};
}

// The keys (of `keys` in all) that query rows [r0, r1) may see.
int64_t VisibleKeys(const Visibility& visibility, int64_t keys, int64_t r1) {
  return visibility.key_end.defined() ? visibility.prefix + r1 : keys;
}

// Which of the chunk's first r1 keys query rows [r0, r1) see (key j <= i < key_end[j]):
// [r1 - r0, r1] bool. Every query sees every prefix key.
at::Tensor ChunkMaskRows(const at::Tensor& ends, int64_t r0, int64_t r1) {
  const at::Tensor query = at::arange(r0, r1, ends.options()).unsqueeze(1);  // i
  const at::Tensor key = at::arange(r1, ends.options()).unsqueeze(0);        // j
  return key.le(query).logical_and(query.lt(ends.slice(0, 0, r1).unsqueeze(0)));
}

// Attention runs over blocks of query rows whose [Hq, rows, L] scores hold about kBlockScores
// values (at least kMinBlockRows rows), so memory is O(Hq * rows * L) instead of O(Hq * T * L)
// (a 10,000-token chain's full scores take gigabytes) and a tree mask's block skips the keys no row
// of it sees. A row's softmax never spans blocks; only dK and dV sum over them.
constexpr int64_t kBlockScores = int64_t{1} << 22;
constexpr int64_t kMinBlockRows = 64;

template <class Body>
void ForEachRowBlock(int64_t tokens, int64_t heads, int64_t keys, const Body& body) {
  const int64_t rows =
      std::max<int64_t>(kMinBlockRows, kBlockScores / std::max<int64_t>(1, heads * keys));
  for (int64_t r0 = 0; r0 < tokens; r0 += rows) body(r0, std::min(tokens, r0 + rows));
}

// Scaled scores [Hq, r1 - r0, l] of query rows [r0, r1) of q_heads [Hq, T, D] against the first l
// keys of keys [Hq, L, D]; entries the visibility hides are -inf.
at::Tensor BlockScores(const at::Tensor& q_heads, const at::Tensor& keys,
                       const Visibility& visibility, int64_t r0, int64_t r1, int64_t l,
                       double scale) {
  const at::Tensor scores =
      at::matmul(q_heads.slice(1, r0, r1), keys.slice(1, 0, l).transpose(1, 2)) * scale;
  if (!visibility.key_end.defined()) return scores;
  // Only the chunk's keys can be hidden: the prefix's columns are left as they are.
  const at::Tensor visible = ChunkMaskRows(visibility.key_end, r0, r1);
  scores.slice(2, visibility.prefix, l)
      .masked_fill_(visible.to(scores.device()).logical_not().unsqueeze(0),
                    -std::numeric_limits<double>::infinity());
  return scores;
}

// [Hq, L, D] summed over each kv head's group of query heads -> [L, Hkv, D].
at::Tensor SumGroups(const at::Tensor& per_q_head, int64_t kv_heads) {
  const int64_t q_heads = per_q_head.size(0);
  return per_q_head.reshape({kv_heads, q_heads / kv_heads, per_q_head.size(1), per_q_head.size(2)})
      .sum(1)
      .permute({1, 0, 2});
}

// Softmax attention of q [T, Hq, D] over keys and values [Hq, L, D] as `visibility` allows.
TreeAttentionOutput Attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const Visibility& visibility, double scale) {
  const at::ScalarType type = ComputeType(q);
  const at::Tensor q_heads = q.to(type).permute({1, 0, 2});  // [Hq, T, D]
  const int64_t heads = q_heads.size(0);
  const int64_t tokens = q_heads.size(1);
  at::Tensor out = at::empty({heads, tokens, values.size(2)}, q_heads.options());
  at::Tensor lse = at::empty({heads, tokens}, q_heads.options());
  ForEachRowBlock(tokens, heads, keys.size(1), [&](int64_t r0, int64_t r1) {
    const int64_t l = VisibleKeys(visibility, keys.size(1), r1);
    const at::Tensor scores = BlockScores(q_heads, keys, visibility, r0, r1, l, scale);
    const at::Tensor block_lse = at::logsumexp(scores, -1);  // [Hq, rows]
    lse.slice(1, r0, r1).copy_(block_lse);
    out.slice(1, r0, r1).copy_(
        at::matmul(at::exp(scores - block_lse.unsqueeze(-1)), values.slice(1, 0, l)));
  });
  return {out.permute({1, 0, 2}).to(q.scalar_type()).contiguous(), lse};
}

// Attend's gradients in the compute dtype: dq [T, Hq, D], and dk, dv [L, Hkv, D]. out and lse may
// be those of attention over more keys than these (a log-sum-exp merge): each key set's gradients
// are then its share of the whole's.
struct AttendGrads {
  at::Tensor dq, dk, dv;
};
AttendGrads AttendBackward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& keys,
                           const at::Tensor& values, const Visibility& visibility,
                           const at::Tensor& out, const at::Tensor& lse, double scale,
                           int64_t kv_heads) {
  const at::ScalarType type = ComputeType(q);
  const at::Tensor q_heads = q.to(type).permute({1, 0, 2});       // [Hq, T, D]
  const at::Tensor d_out = grad_out.to(type).permute({1, 0, 2});  // [Hq, T, D]
  const at::Tensor out_heads = out.to(type).permute({1, 0, 2});   // [Hq, T, D]
  const at::Tensor lse_type = lse.to(type);                       // [Hq, T]
  const int64_t heads = q_heads.size(0);
  const int64_t tokens = q_heads.size(1);
  at::Tensor dq = at::empty({heads, tokens, q_heads.size(2)}, q_heads.options());
  at::Tensor dk = at::zeros({heads, keys.size(1), keys.size(2)}, q_heads.options());
  at::Tensor dv = at::zeros({heads, values.size(1), values.size(2)}, q_heads.options());
  ForEachRowBlock(tokens, heads, keys.size(1), [&](int64_t r0, int64_t r1) {
    const int64_t l = VisibleKeys(visibility, keys.size(1), r1);
    const at::Tensor block_keys = keys.slice(1, 0, l);
    const at::Tensor block_q = q_heads.slice(1, r0, r1);
    const at::Tensor block_d_out = d_out.slice(1, r0, r1);
    const at::Tensor scores = BlockScores(q_heads, keys, visibility, r0, r1, l, scale);
    const at::Tensor probs = at::exp(scores - lse_type.slice(1, r0, r1).unsqueeze(-1));
    const at::Tensor row_dot = (block_d_out * out_heads.slice(1, r0, r1)).sum(-1, true);
    const at::Tensor d_probs = at::matmul(block_d_out, values.slice(1, 0, l).transpose(1, 2));
    const at::Tensor d_scores = probs * (d_probs - row_dot);
    dq.slice(1, r0, r1).copy_(at::matmul(d_scores, block_keys) * scale);
    dk.slice(1, 0, l).add_(at::matmul(d_scores.transpose(1, 2), block_q) * scale);
    dv.slice(1, 0, l).add_(at::matmul(probs.transpose(1, 2), block_d_out));
  });
  return {
      .dq = dq.permute({1, 0, 2}), .dk = SumGroups(dk, kv_heads), .dv = SumGroups(dv, kv_heads)};
}

}  // namespace

at::Tensor TreeAttentionMask(const at::Tensor& key_end, int64_t prefix_len) {
  const int64_t tokens = key_end.size(0);
  const at::Tensor chunk = ChunkMaskRows(key_end.to(at::kLong), 0, tokens);
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
                AllKeysPerQueryHead(prefix_v, v, group, type), TreeVisibility(key_end, s.prefix),
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
                     TreeVisibility(key_end, s.prefix), out, lse, scale, s.kv_heads);
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
                AllKeysPerQueryHead(at::Tensor(), prefix_v, group, type), Visibility{}, scale);
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
                     AllKeysPerQueryHead(at::Tensor(), prefix_v, group, type), Visibility{}, out,
                     lse, scale, prefix_k.size(1));
  if (grad_prefix_k.defined()) {
    at::Tensor(grad_prefix_k).add_(g.dk.to(grad_prefix_k.scalar_type()));
    at::Tensor(grad_prefix_v).add_(g.dv.to(grad_prefix_v.scalar_type()));
  }
  return g.dq.to(q.scalar_type()).contiguous();
}

}  // namespace dta::kernels
