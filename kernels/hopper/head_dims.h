// The head dims the Hopper tree-attention kernels are compiled for: the one list the launchers'
// switches (tree_attention_hopper*.cu) and the host-side dispatch (kernels/tree_attention.cc)
// share. Plain C++: includable from files compiled without nvcc or CUTLASS.
#ifndef DTA_KERNELS_HOPPER_HEAD_DIMS_H_
#define DTA_KERNELS_HOPPER_HEAD_DIMS_H_

namespace dta::kernels {

// True when LaunchHopperTreeAttentionForward is instantiated for head_dim.
constexpr bool HopperTreeAttentionForwardSupportsHeadDim(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// True when LaunchHopperTreeAttentionBackward is instantiated for head_dim.
constexpr bool HopperTreeAttentionBackwardSupportsHeadDim(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// True when LaunchHopperTreeAttentionFusedBackward is instantiated for head_dim (its dQ GEMM
// splits D between two warpgroups in whole 128-byte swizzle atoms, 64 columns each, at 128, the
// keys at 64, and at 256 the head-split kernel's halves of D).
constexpr bool HopperTreeAttentionFusedBackwardSupportsHeadDim(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

}  // namespace dta::kernels

#endif  // DTA_KERNELS_HOPPER_HEAD_DIMS_H_
