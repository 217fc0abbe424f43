// The CUDA path of kernels/tree_attention.h: checks, device guard, current stream, workspace,
// launch, launch check. The kernels themselves are in tree_attention_kernel.cuh and, for Hopper,
// kernels/hopper/.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/tree_attention_internal.h"
#include "kernels/tree_attention_kernel.cuh"
#ifdef DTA_KERNELS_HAVE_HOPPER
#include "kernels/hopper/tree_attention_hopper.h"
#endif

namespace dta::kernels::internal {
namespace {

// The kernels read rows of contiguous heads with 16-byte cp.async: last two dims contiguous,
// 16-byte aligned base and row stride.
bool IsKernelOperand(const at::Tensor& t) {
  const int64_t elem = t.element_size();
  return t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)) &&
         (t.size(0) <= 1 || (t.stride(0) * elem) % 16 == 0) &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

at::Tensor AsKernelOperand(const at::Tensor& t) { return IsKernelOperand(t) ? t : t.contiguous(); }

const bf16* Bf16(const at::Tensor& t) {
  return reinterpret_cast<const bf16*>(t.data_ptr<at::BFloat16>());
}

bf16* MutableBf16(at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>()); }

int64_t RowStride(const at::Tensor& t) { return t.size(0) <= 1 ? 0 : t.stride(0); }

// The operands both directions share, and the workspace the prepare kernel fills.
struct Operands {
  at::Tensor q, k, v, prefix_k, prefix_v;
  // int32 [T + 2 * ceil(T / 64) + 1]: key_end, the tiles' max and min of it, and a counter the
  // prepare kernel zeroes (the Hopper forward's work counter).
  at::Tensor workspace;
  int32_t* zeroed_counter = nullptr;
  TreeAttentionParams params;
};

Operands Prepare(const TreeAttentionShape& shape, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                 const at::Tensor& key_end, double scale, cudaStream_t stream) {
  TORCH_CHECK(shape.tokens + shape.prefix < std::numeric_limits<int32_t>::max(),
              "tree attention: P + T must fit in int32");
  Operands o;
  o.q = AsKernelOperand(q);
  o.k = AsKernelOperand(k);
  o.v = AsKernelOperand(v);
  TreeAttentionParams& p = o.params;
  p.q = Bf16(o.q);
  p.q_row_stride = RowStride(o.q);
  p.k = Bf16(o.k);
  p.k_row_stride = RowStride(o.k);
  p.v = Bf16(o.v);
  p.v_row_stride = RowStride(o.v);
  if (shape.prefix > 0) {
    o.prefix_k = AsKernelOperand(prefix_k);
    o.prefix_v = AsKernelOperand(prefix_v);
    p.prefix_k = Bf16(o.prefix_k);
    p.prefix_k_row_stride = RowStride(o.prefix_k);
    p.prefix_v = Bf16(o.prefix_v);
    p.prefix_v_row_stride = RowStride(o.prefix_v);
  }
  p.tokens = static_cast<int>(shape.tokens);
  p.prefix = static_cast<int>(shape.prefix);
  p.q_heads = static_cast<int>(shape.q_heads);
  p.kv_heads = static_cast<int>(shape.kv_heads);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * M_LOG2E);

  const int64_t tiles =
      (shape.tokens + tree_attention_detail::kKeyTile - 1) / tree_attention_detail::kKeyTile;
  o.workspace = at::empty({shape.tokens + 2 * tiles + 1}, q.options().dtype(at::kInt));
  int32_t* ws = o.workspace.data_ptr<int32_t>();
  p.key_end = ws;
  p.tile_max_end = ws + shape.tokens;
  p.tile_min_end = ws + shape.tokens + tiles;
  o.zeroed_counter = ws + shape.tokens + 2 * tiles;
  const at::Tensor ends = key_end.is_contiguous() ? key_end : key_end.contiguous();
  C10_CUDA_CHECK(LaunchTreeAttentionPrepare(ends.data_ptr(), ends.scalar_type() == at::kLong,
                                            p.tokens, ws, ws + shape.tokens,
                                            ws + shape.tokens + tiles, o.zeroed_counter, stream));
  return o;
}

}  // namespace

int64_t KernelSmemBytes(int64_t head_dim) {
  return TreeAttentionKernelSmemBytes(static_cast<int>(head_dim));
}

TreeAttentionOutput ForwardCuda(const TreeAttentionShape& shape, const at::Tensor& q,
                                const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                const at::Tensor& key_end, double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  Operands o = Prepare(shape, q, k, v, prefix_k, prefix_v, key_end, scale, stream);
  at::Tensor out = at::empty({shape.tokens, shape.q_heads, shape.head_dim}, q.options());
  at::Tensor lse = at::empty({shape.q_heads, shape.tokens}, q.options().dtype(at::kFloat));
  TreeAttentionParams& p = o.params;
  p.out = MutableBf16(out);
  p.out_row_stride = RowStride(out);
  p.lse = lse.data_ptr<float>();
  const int head_dim = static_cast<int>(shape.head_dim);
#ifdef DTA_KERNELS_HAVE_HOPPER
  if (UsesHopperForward(shape, q)) {
    // Same params, workspace and outputs; the backward reads out and lse alike from either. The
    // persistent kernel's work counter is the workspace's, zeroed by the prepare kernel and alive
    // as long as the launch in stream order.
    C10_CUDA_CHECK(LaunchHopperTreeAttentionForward(p, head_dim, o.zeroed_counter, stream));
    return {out, lse};
  }
#endif
  C10_CUDA_CHECK(LaunchTreeAttentionForward(p, head_dim, stream));
  return {out, lse};
}

TreeAttentionGrads BackwardCuda(const TreeAttentionShape& shape, const at::Tensor& grad_out,
                                const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                const at::Tensor& key_end, const at::Tensor& out,
                                const at::Tensor& lse, double scale, at::Tensor& grad_prefix_k,
                                at::Tensor& grad_prefix_v) {
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  Operands o = Prepare(shape, q, k, v, prefix_k, prefix_v, key_end, scale, stream);
  const at::Tensor d_out = AsKernelOperand(grad_out);
  const at::Tensor out_k = AsKernelOperand(out);
  const at::Tensor lse_k = lse.contiguous();
  at::Tensor row_dot = at::empty({shape.q_heads, shape.tokens}, q.options().dtype(at::kFloat));
  at::Tensor dq = at::empty({shape.tokens, shape.q_heads, shape.head_dim}, q.options());
  at::Tensor dk = at::empty({shape.tokens, shape.kv_heads, shape.head_dim}, q.options());
  at::Tensor dv = at::empty({shape.tokens, shape.kv_heads, shape.head_dim}, q.options());
  TreeAttentionParams& p = o.params;
  p.out = const_cast<bf16*>(Bf16(out_k));
  p.out_row_stride = RowStride(out_k);
  p.lse = const_cast<float*>(lse_k.data_ptr<float>());
  p.grad_out = Bf16(d_out);
  p.grad_out_row_stride = RowStride(d_out);
  p.row_dot = row_dot.data_ptr<float>();
  p.dq = MutableBf16(dq);
  p.dq_row_stride = RowStride(dq);
  p.dk = MutableBf16(dk);
  p.dk_row_stride = RowStride(dk);
  p.dv = MutableBf16(dv);
  p.dv_row_stride = RowStride(dv);
  if (shape.prefix > 0) {
    for (const at::Tensor* t : {&grad_prefix_k, &grad_prefix_v}) {
      TORCH_CHECK(t->stride(2) == 1 && (t->size(1) <= 1 || t->stride(1) == t->size(2)) &&
                      (t->size(0) <= 1 || t->stride(0) % 2 == 0) &&
                      reinterpret_cast<uintptr_t>(t->data_ptr()) % 8 == 0,
                  "tree attention backward (CUDA): grad_prefix_k/v need contiguous last two dims, "
                  "an even row stride and an 8-byte aligned start, got strides ",
                  t->strides());
    }
    p.grad_prefix_k = grad_prefix_k.data_ptr<float>();
    p.grad_prefix_k_row_stride = RowStride(grad_prefix_k);
    p.grad_prefix_v = grad_prefix_v.data_ptr<float>();
    p.grad_prefix_v_row_stride = RowStride(grad_prefix_v);
  }
  // dK/dV and dQ are independent once row_dot is written: dK/dV runs on a side stream so that each
  // kernel's tail fills with the other's blocks. The caller's stream waits for both, so every
  // tensor used here is released in stream order.
  const int head_dim = static_cast<int>(shape.head_dim);
  const bool hopper = UsesHopperBackward(shape, q);
  at::Tensor row_stats;
#ifdef DTA_KERNELS_HAVE_HOPPER
  if (hopper) {
    row_stats = at::empty({HopperBackwardRowStatsFloats(shape.tokens, shape.q_heads)},
                          q.options().dtype(at::kFloat));
    p.row_stats = row_stats.data_ptr<float>();
  }
#endif
  C10_CUDA_CHECK(
      LaunchTreeAttentionBackward(p, head_dim, TreeAttentionBackwardPart::kRowDot, stream));
#ifdef DTA_KERNELS_HAVE_HOPPER
  // The single kernel (opt-in): one launch after row_dot, its workspace released in stream order.
  if (UsesHopperFusedBackward(shape, q)) {
    const at::Tensor dq_accum =
        at::empty({HopperFusedBackwardDqAccumFloats(shape.tokens, shape.q_heads, shape.head_dim)},
                  q.options().dtype(at::kFloat));
    const at::Tensor semaphores = at::empty(
        {HopperFusedBackwardSemaphores(shape.tokens, shape.q_heads)}, q.options().dtype(at::kInt));
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq_semaphore = semaphores.data_ptr<int32_t>();
    C10_CUDA_CHECK(LaunchHopperTreeAttentionFusedBackward(p, head_dim, stream));
    return {dq, dk, dv};
  }
#endif
  const at::cuda::CUDAStream side = at::cuda::getStreamFromPool(false, q.device().index());
  at::cuda::CUDAEvent row_dot_ready;
  row_dot_ready.record(at::cuda::getCurrentCUDAStream());
  row_dot_ready.block(side);
  // The Hopper kernels take the same params and the same row_dot, and keep the same split.
  auto launch = [&](TreeAttentionBackwardPart part, cudaStream_t on) {
#ifdef DTA_KERNELS_HAVE_HOPPER
    if (hopper) return LaunchHopperTreeAttentionBackward(p, head_dim, part, on);
#endif
    return LaunchTreeAttentionBackward(p, head_dim, part, on);
  };
  C10_CUDA_CHECK(launch(TreeAttentionBackwardPart::kDkDv, side));
  C10_CUDA_CHECK(launch(TreeAttentionBackwardPart::kDq, stream));
  at::cuda::CUDAEvent dkdv_done;
  dkdv_done.record(side);
  dkdv_done.block(at::cuda::getCurrentCUDAStream());
  return {dq, dk, dv};
}

}  // namespace dta::kernels::internal
