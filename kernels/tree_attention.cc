#include "kernels/tree_attention.h"

#ifdef DTA_KERNELS_HAVE_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include "core/base/env_switch.h"
#include "kernels/hopper/head_dims.h"
#include "kernels/tree_attention_internal.h"
#include "kernels/tree_attention_reference.h"

namespace dta::kernels {
namespace internal {
namespace {

void CheckRowsOfHeads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3, "tree attention: ", name, " must be 3-D [rows, heads, D], got ",
              t.sizes());
}

}  // namespace

bool HasPrefix(const at::Tensor& prefix_k) { return prefix_k.defined() && prefix_k.numel() > 0; }

TreeAttentionShape CheckForwardInputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                      const at::Tensor& key_end) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined() && key_end.defined(),
              "tree attention: q, k, v and key_end must be defined");
  CheckRowsOfHeads(q, "q");
  CheckRowsOfHeads(k, "k");
  CheckRowsOfHeads(v, "v");
  TreeAttentionShape s;
  s.tokens = q.size(0);
  s.q_heads = q.size(1);
  s.head_dim = q.size(2);
  s.kv_heads = k.size(1);
  TORCH_CHECK(s.tokens >= 1, "tree attention: the chunk needs at least one token");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "tree attention: q must be floating, got ",
              q.scalar_type());
  TORCH_CHECK(k.sizes() == v.sizes(), "tree attention: k ", k.sizes(), " and v ", v.sizes(),
              " must have the same shape");
  TORCH_CHECK(k.size(0) == s.tokens && k.size(2) == s.head_dim, "tree attention: k ", k.sizes(),
              " must be [T, Hkv, D] with T, D of q ", q.sizes());
  TORCH_CHECK(s.kv_heads >= 1 && s.q_heads % s.kv_heads == 0, "tree attention: Hq = ", s.q_heads,
              " must be a multiple of Hkv = ", s.kv_heads);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "tree attention: k and v must have q's dtype ",
                q.scalar_type(), ", got ", t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), "tree attention: k and v must be on q's device ",
                q.device(), ", got ", t->device());
  }
  if (HasPrefix(prefix_k)) {
    TORCH_CHECK(prefix_v.defined(), "tree attention: prefix_v must be defined with prefix_k");
    CheckRowsOfHeads(prefix_k, "prefix_k");
    CheckRowsOfHeads(prefix_v, "prefix_v");
    TORCH_CHECK(prefix_k.sizes() == prefix_v.sizes(), "tree attention: prefix_k ", prefix_k.sizes(),
                " and prefix_v ", prefix_v.sizes(), " must have the same shape");
    TORCH_CHECK(prefix_k.size(1) == s.kv_heads && prefix_k.size(2) == s.head_dim,
                "tree attention: prefix_k ", prefix_k.sizes(), " must be [P, Hkv, D] with k ",
                k.sizes());
    for (const at::Tensor* t : {&prefix_k, &prefix_v}) {
      TORCH_CHECK(t->scalar_type() == q.scalar_type(),
                  "tree attention: prefix_k and prefix_v must have q's dtype ", q.scalar_type(),
                  ", got ", t->scalar_type());
      TORCH_CHECK(t->device() == q.device(),
                  "tree attention: prefix_k and prefix_v must be on q's device ", q.device(),
                  ", got ", t->device());
    }
    s.prefix = prefix_k.size(0);
  } else {
    TORCH_CHECK(!prefix_v.defined() || prefix_v.numel() == 0,
                "tree attention: prefix_v has rows but prefix_k has none");
  }
  TORCH_CHECK(key_end.dim() == 1 && key_end.size(0) == s.tokens,
              "tree attention: key_end must be [T] = [", s.tokens, "], got ", key_end.sizes());
  TORCH_CHECK(key_end.scalar_type() == at::kLong || key_end.scalar_type() == at::kInt,
              "tree attention: key_end must be int64 or int32, got ", key_end.scalar_type());
  TORCH_CHECK(key_end.device() == q.device(), "tree attention: key_end must be on q's device ",
              q.device(), ", got ", key_end.device());
  return s;
}

void CheckBackwardInputs(const TreeAttentionShape& shape, const at::Tensor& q,
                         const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                         const at::Tensor& grad_prefix_k, const at::Tensor& grad_prefix_v) {
  TORCH_CHECK(grad_out.defined() && out.defined() && lse.defined(),
              "tree attention backward: grad_out, out and lse must be defined");
  for (const at::Tensor* t : {&grad_out, &out}) {
    TORCH_CHECK(t->sizes() == q.sizes(), "tree attention backward: grad_out and out must be ",
                q.sizes(), ", got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device(),
                "tree attention backward: grad_out and out must have q's dtype and device");
  }
  const at::ScalarType lse_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == shape.q_heads && lse.size(1) == shape.tokens,
              "tree attention backward: lse must be [Hq, T] = [", shape.q_heads, ", ", shape.tokens,
              "], got ", lse.sizes());
  TORCH_CHECK(lse.scalar_type() == lse_type && lse.device() == q.device(),
              "tree attention backward: lse must be ", lse_type, " on ", q.device(), ", got ",
              lse.scalar_type(), " on ", lse.device());
  if (shape.prefix == 0) return;
  for (const at::Tensor* t : {&grad_prefix_k, &grad_prefix_v}) {
    TORCH_CHECK(t->defined(), "tree attention backward: grad_prefix_k and grad_prefix_v must be ",
                "defined when P > 0");
    CheckRowsOfHeads(*t, "grad_prefix_k/grad_prefix_v");
    TORCH_CHECK(
        t->size(0) == shape.prefix && t->size(1) == shape.kv_heads && t->size(2) == shape.head_dim,
        "tree attention backward: grad_prefix_k/v must be [P, Hkv, D] = [", shape.prefix, ", ",
        shape.kv_heads, ", ", shape.head_dim, "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == lse_type && t->device() == q.device(),
                "tree attention backward: grad_prefix_k/v must be ", lse_type, " on ", q.device(),
                ", got ", t->scalar_type(), " on ", t->device());
  }
}

namespace {

// The Hopper kernels run for bf16 CUDA inputs at a head dim they are compiled for
// (`compiled_for`) on compute capability 9.x in builds with the CUTLASS headers, unless the
// environment variable `env` is "0" (read at every call).
bool UsesHopper(const at::Tensor& q, bool compiled_for, const char* env) {
#ifdef DTA_KERNELS_HAVE_HOPPER
  if (!q.is_cuda() || q.scalar_type() != at::kBFloat16 || !compiled_for) return false;
  if (!EnvSwitchOn(env)) return false;
  return at::cuda::getDeviceProperties(q.get_device())->major == 9;
#else
  (void)q;
  (void)compiled_for;
  (void)env;
  return false;
#endif
}

}  // namespace

bool UsesHopperForward(const TreeAttentionShape& shape, const at::Tensor& q) {
  return UsesHopper(q, HopperTreeAttentionForwardSupportsHeadDim(static_cast<int>(shape.head_dim)),
                    "DTA_HOPPER_ATTENTION");
}

bool UsesHopperBackward(const TreeAttentionShape& shape, const at::Tensor& q) {
  return UsesHopper(q, HopperTreeAttentionBackwardSupportsHeadDim(static_cast<int>(shape.head_dim)),
                    "DTA_HOPPER_ATTENTION_BACKWARD");
}

bool UsesHopperFusedBackward(const TreeAttentionShape& shape, const at::Tensor& q) {
  return UsesHopperBackward(shape, q) &&
         HopperTreeAttentionFusedBackwardSupportsHeadDim(static_cast<int>(shape.head_dim)) &&
         EnvSwitchOptIn("DTA_HOPPER_ATTENTION_BACKWARD_FUSED");
}

}  // namespace internal

bool TreeAttentionKernelSupports(const at::Tensor& q, const at::Tensor& k) {
#ifdef DTA_KERNELS_HAVE_CUDA
  if (!q.defined() || !k.defined() || !q.is_cuda() || !k.is_cuda()) return false;
  if (q.scalar_type() != at::kBFloat16 || k.scalar_type() != at::kBFloat16) return false;
  if (q.dim() != 3 || k.dim() != 3 || q.size(2) != k.size(2)) return false;
  const int64_t smem = internal::KernelSmemBytes(q.size(2));
  if (smem == 0 || k.size(1) < 1 || q.size(1) % k.size(1) != 0) return false;
  // D = 256 takes up to 193 KiB of shared memory per block: more than sm_80 has (163 KiB).
  return static_cast<int64_t>(
             at::cuda::getDeviceProperties(q.get_device())->sharedMemPerBlockOptin) >= smem;
#else
  (void)q;
  (void)k;
  return false;
#endif
}

TreeAttentionOutput TreeAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& prefix_k,
                                         const at::Tensor& prefix_v, const at::Tensor& key_end,
                                         double scale) {
#ifdef DTA_KERNELS_HAVE_CUDA
  if (TreeAttentionKernelSupports(q, k)) {
    const internal::TreeAttentionShape shape =
        internal::CheckForwardInputs(q, k, v, prefix_k, prefix_v, key_end);
    return internal::ForwardCuda(shape, q, k, v, prefix_k, prefix_v, key_end, scale);
  }
#endif
  return ReferenceTreeAttentionForward(q, k, v, prefix_k, prefix_v, key_end, scale);
}

TreeAttentionGrads TreeAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                         const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                         const at::Tensor& key_end, const at::Tensor& out,
                                         const at::Tensor& lse, double scale,
                                         at::Tensor& grad_prefix_k, at::Tensor& grad_prefix_v) {
#ifdef DTA_KERNELS_HAVE_CUDA
  if (TreeAttentionKernelSupports(q, k)) {
    const internal::TreeAttentionShape shape =
        internal::CheckForwardInputs(q, k, v, prefix_k, prefix_v, key_end);
    internal::CheckBackwardInputs(shape, q, grad_out, out, lse, grad_prefix_k, grad_prefix_v);
    return internal::BackwardCuda(shape, grad_out, q, k, v, prefix_k, prefix_v, key_end, out, lse,
                                  scale, grad_prefix_k, grad_prefix_v);
  }
#endif
  return ReferenceTreeAttentionBackward(grad_out, q, k, v, prefix_k, prefix_v, key_end, out, lse,
                                        scale, grad_prefix_k, grad_prefix_v);
}

}  // namespace dta::kernels
