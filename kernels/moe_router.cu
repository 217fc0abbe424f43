// The CUDA path of kernels/moe_router.h. The router kernels give each token one warp that holds
// the token's row of E values in registers, lane l the columns l, l + 32, ... (kPer of them: E / 32
// rounded up to a power of two); every lane walks a token's k slots itself, in slot order,
// so their sums are equal in all lanes without a broadcast. Elementwise arithmetic is explicitly
// rounded (__fadd_rn and friends, never contracted into FMAs) in ATen's order. The sort is a
// stable counting sort in three launches: per-segment counts, one exclusive scan, the placement.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/dependent_launch.cuh"
#include "kernels/float_access.cuh"
#include "kernels/moe_router.h"
#include "kernels/moe_router_internal.h"

namespace dta::kernels::internal {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;  // tokens (router) or segments (sort) per block
constexpr int kThreads = kWarpsPerBlock * kWarp;
constexpr int kScanThreads = 1024;

// The butterfly sum: both lanes of each exchange add the same two values, so every lane ends with
// the same, bitwise, in an order fixed by the lane numbers.
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Whether expert ia with probability a is taken before expert ib with b: the larger first, NaN
// the largest (as at::topk), ties to the lower index. A strict total order over distinct indices,
// so a warp's reduction ends at the same expert in every lane. The empty candidate (-inf, INT_MAX)
// comes after every expert.
__device__ __forceinline__ bool Before(float a, int ia, float b, int ib) {
  const bool a_nan = isnan(a), b_nan = isnan(b);
  if (a_nan != b_nan) return a_nan;
  if (a_nan || a == b) return ia < ib;
  return a > b;
}

// The lane's value of column slot i (a register array read at a run-time index, kept in
// registers by the unrolled selection).
template <int kPer>
__device__ __forceinline__ float Slot(const float (&values)[kPer], int i) {
  float v = 0.0f;
#pragma unroll
  for (int s = 0; s < kPer; ++s) {
    if (s == i) v = values[s];
  }
  return v;
}

// The router kernels' T tokens, each routed to top_k of E experts (renormalised with norm).
struct TokenRows {
  int64_t tokens;
  int experts, top_k;
  bool norm;
};

// The warp of a token: its lane, the token, and where the token's row [E] and slots [k] start.
struct TokenWarp {
  int lane;
  int64_t t, row, slots;
};
__device__ __forceinline__ TokenWarp TokenWarpOf(const TokenRows& rows) {
  const int64_t t = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarp;
  return {static_cast<int>(threadIdx.x % kWarp), t, t * rows.experts, t * rows.top_k};
}

struct RouteParams : TokenRows {
  In logits;              // [T, E]
  const int64_t* replay;  // [T, k] or null
  float* probs;           // [T, E]
  int64_t* own_index;     // [T, k]
  int64_t* index;         // [T, k]; null without replay
  float* weights;         // [T, k]
  unsigned long long* mismatches;
  Dtype weight_type;
};

template <int kPer>
__global__ void __launch_bounds__(kThreads) RouteKernel(const RouteParams p) {
  WaitForPreviousKernels();
  const auto [lane, t, row, slots] = TokenWarpOf(p);
  if (t >= p.tokens) return;  // the whole warp
  const int e = p.experts, k = p.top_k;

  // Softmax: exp(z - max) / sum, the sum in each lane's column order, then across the lanes.
  float v[kPer];
  float max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = i * kWarp + lane;
    v[i] = c < e ? Load(p.logits, row + c) : -INFINITY;
    max = fmaxf(max, v[i]);
  }
  max = WarpMax(max);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (i * kWarp + lane < e) {
      v[i] = expf(__fsub_rn(v[i], max));
      sum = __fadd_rn(sum, v[i]);
    }
  }
  sum = WarpSum(sum);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = i * kWarp + lane;
    if (c < e) {
      v[i] = __fdiv_rn(v[i], sum);
      p.probs[row + c] = v[i];
    }
  }

  const int64_t* replay = p.replay != nullptr ? p.replay + slots : nullptr;
  bool recorded = replay != nullptr;
  for (int j = 0; recorded && j < k; ++j) recorded = replay[j] >= 0;

  // The own top k: k rounds of a warp arg-max over the columns not yet taken. Rows routed by
  // themselves sum their top values in slot order as the rounds find them.
  unsigned taken = 0;  // bit i: this lane's column i * 32 + lane
  bool mismatch = false;
  float top_sum = 0.0f;
  for (int r = 0; r < k; ++r) {
    float best = -INFINITY;
    int best_index = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int c = i * kWarp + lane;
      if (c < e && !((taken >> i) & 1u) && Before(v[i], c, best, best_index)) {
        best = v[i];
        best_index = c;
      }
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(kFullMask, best, offset);
      const int other_index = __shfl_xor_sync(kFullMask, best_index, offset);
      if (Before(other, other_index, best, best_index)) {
        best = other;
        best_index = other_index;
      }
    }
    if (best_index % kWarp == lane) taken |= 1u << (best_index / kWarp);
    if (recorded) {
      // The replayed row holds k ids and the own top k are distinct: the sets are equal exactly
      // when every own id is replayed.
      bool found = false;
      for (int j = 0; j < k; ++j) found = found || replay[j] == best_index;
      mismatch = mismatch || !found;
    } else {
      top_sum = __fadd_rn(top_sum, best);
    }
    if (lane == r % kWarp) {
      p.own_index[slots + r] = best_index;
      if (!recorded) {
        if (p.index != nullptr) p.index[slots + r] = best_index;
        p.weights[slots + r] = best;  // normalised below, by this lane
      }
    }
  }
  if (recorded) {
    // The replayed ids' probabilities from the lanes that hold them, summed in slot order.
    for (int j = 0; j < k; ++j) {
      const int64_t id = replay[j];
      CUDA_KERNEL_ASSERT(id < e);
      const int column = static_cast<int>(id);
      const float top = __shfl_sync(kFullMask, Slot(v, column / kWarp), column % kWarp);
      top_sum = __fadd_rn(top_sum, top);
      if (lane == j % kWarp) {
        p.index[slots + j] = id;
        p.weights[slots + j] = top;
      }
    }
    if (mismatch && lane == 0) atomicAdd(p.mismatches, 1ull);  // an integer sum: any order
  }
  // Each lane rereads the slots it wrote itself.
  for (int j = lane; j < k; j += kWarp) {
    const float top = p.weights[slots + j];
    p.weights[slots + j] = Round(p.norm ? __fdiv_rn(top, top_sum) : top, p.weight_type);
  }
}

struct BackwardParams : TokenRows {
  const float* probs;      // [T, E]
  const int64_t* index;    // [T, k]
  const float* dweights;   // [T k], sorted-pair order
  const int64_t* inverse;  // [T k]
  const float* extra;      // [T, E] or null
  Out dlogits;             // [T, E]
};

// ATen's arithmetic, term for term: dtop = dweights[inverse]; with the renormalisation
// dtop = (dtop - sum_j dtop_j (top_j / sum)) / sum; dprobs = scatter(dtop) + extra; dlogits =
// probs (dprobs - sum_c dprobs_c probs_c).
template <int kPer>
__global__ void __launch_bounds__(kThreads) RouterBackwardKernel(const BackwardParams p) {
  WaitForPreviousKernels();
  const auto [lane, t, row, slots] = TokenWarpOf(p);
  if (t >= p.tokens) return;  // the whole warp
  const int e = p.experts, k = p.top_k;
  const float* probs = p.probs + row;

  float top_sum = 0.0f, dot = 0.0f;
  if (p.norm) {
    for (int j = 0; j < k; ++j) top_sum = __fadd_rn(top_sum, probs[p.index[slots + j]]);
    for (int j = 0; j < k; ++j) {
      const float top = probs[p.index[slots + j]];
      dot = __fadd_rn(dot, __fmul_rn(p.dweights[p.inverse[slots + j]], __fdiv_rn(top, top_sum)));
    }
  }
  float prob[kPer], dprob[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = i * kWarp + lane;
    prob[i] = c < e ? probs[c] : 0.0f;
    dprob[i] = 0.0f;
  }
  for (int j = 0; j < k; ++j) {
    const int64_t id = p.index[slots + j];
    float dtop = p.dweights[p.inverse[slots + j]];
    if (p.norm) dtop = __fdiv_rn(__fsub_rn(dtop, dot), top_sum);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (i * kWarp + lane == id) dprob[i] = dtop;  // a repeated id: its last slot
    }
  }
  float inner = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = i * kWarp + lane;
    if (c < e) {
      if (p.extra != nullptr) dprob[i] = __fadd_rn(dprob[i], p.extra[row + c]);
      inner = __fadd_rn(inner, __fmul_rn(dprob[i], prob[i]));
    }
  }
  inner = WarpSum(inner);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = i * kWarp + lane;
    if (c < e) Store(p.dlogits, row + c, __fmul_rn(prob[i], __fsub_rn(dprob[i], inner)));
  }
}

// Calls launch(std::integral_constant<int, kPer>{}) with kPer, the columns per lane, the power of
// two >= E / 32.
template <typename Launch>
void WithColumnsPerLane(int64_t experts, Launch&& launch) {
  if (experts <= 32) return launch(std::integral_constant<int, 1>{});
  if (experts <= 64) return launch(std::integral_constant<int, 2>{});
  if (experts <= 128) return launch(std::integral_constant<int, 4>{});
  if (experts <= 256) return launch(std::integral_constant<int, 8>{});
  if (experts <= 512) return launch(std::integral_constant<int, 16>{});
  TORCH_CHECK(experts <= kRouterMaxExperts, "moe router: no kernel for ", experts, " experts");
  return launch(std::integral_constant<int, 32>{});
}

unsigned TokenBlocks(int64_t tokens) {
  return static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// The sort. The T k pairs are cut into segments of `steps` x 32, one warp each, which walks its
// segment 32 pairs at a time; __match_any_sync groups a step's pairs by expert, so a pair's place
// among its expert's pairs of the step is the number of its group's lanes below it: stable.
// counts [E][S] (expert-major) is each segment's count per expert, then, scanned in that order,
// each segment's first place for each expert.
struct SortParams {
  const int64_t* index;  // [T k]
  int* counts;           // [E, S]
  int pairs, experts, segments, steps, top_k;
};

// This step's pair for the lane (-1 past the end or for an id outside [0, E)), its expert's lanes
// in the step, and its leader: the lowest of them.
struct Step {
  int pair, expert;
  unsigned peers;
  bool leader;
};

__device__ __forceinline__ Step StepOf(const SortParams& p, int segment, int step, int lane) {
  Step s;
  s.pair = (segment * p.steps + step) * kWarp + lane;
  s.expert = -1;
  if (s.pair < p.pairs) {
    const int64_t id = p.index[s.pair];
    CUDA_KERNEL_ASSERT(id >= 0 && id < p.experts);
    if (id >= 0 && id < p.experts) s.expert = static_cast<int>(id);
  }
  s.peers = __match_any_sync(kFullMask, s.expert);
  s.leader = s.expert >= 0 && lane == __ffs(s.peers) - 1;
  return s;
}

__global__ void __launch_bounds__(kThreads) CountPairsKernel(const SortParams p) {
  WaitForPreviousKernels();
  extern __shared__ int shared_counters[];  // [kWarpsPerBlock, E]
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int segment = blockIdx.x * kWarpsPerBlock + warp;
  if (segment >= p.segments) return;  // the whole warp (no block barriers below)
  int* counter = shared_counters + warp * p.experts;
  for (int e = lane; e < p.experts; e += kWarp) counter[e] = 0;
  __syncwarp();
  for (int step = 0; step < p.steps && (segment * p.steps + step) * kWarp < p.pairs; ++step) {
    const Step s = StepOf(p, segment, step, lane);
    if (s.leader) counter[s.expert] += __popc(s.peers);
    __syncwarp();
  }
  for (int e = lane; e < p.experts; e += kWarp)
    p.counts[int64_t{e} * p.segments + segment] = counter[e];
}

// The exclusive scan of counts in place (one block), and each expert's end: the inclusive sum at
// its last segment.
__global__ void __launch_bounds__(kScanThreads)
    ScanCountsKernel(const SortParams p, int64_t* __restrict__ ends) {
  WaitForPreviousKernels();
  __shared__ int warp_sums[kScanThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int total = p.experts * p.segments;
  const int per_thread = (total + kScanThreads - 1) / kScanThreads;
  const int begin = min(static_cast<int>(threadIdx.x) * per_thread, total);
  const int end = min(begin + per_thread, total);
  int sum = 0;
  for (int i = begin; i < end; ++i) sum += p.counts[i];
  int inclusive = sum;
#pragma unroll
  for (int offset = 1; offset < kWarp; offset *= 2) {
    const int below = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += below;
  }
  if (lane == kWarp - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int warp_inclusive = warp_sums[lane];
#pragma unroll
    for (int offset = 1; offset < kWarp; offset *= 2) {
      const int below = __shfl_up_sync(kFullMask, warp_inclusive, offset);
      if (lane >= offset) warp_inclusive += below;
    }
    warp_sums[lane] = warp_inclusive;
  }
  __syncthreads();
  int running = inclusive - sum + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int i = begin; i < end; ++i) {
    const int count = p.counts[i];
    p.counts[i] = running;
    running += count;
    if (i % p.segments == p.segments - 1) ends[i / p.segments] = running;
  }
}

__global__ void __launch_bounds__(kThreads)
    PlacePairsKernel(const SortParams p, int64_t* __restrict__ order, int64_t* __restrict__ inverse,
                     int64_t* __restrict__ token) {
  WaitForPreviousKernels();
  extern __shared__ int shared_counters[];  // [kWarpsPerBlock, E]: each expert's next place
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int segment = blockIdx.x * kWarpsPerBlock + warp;
  if (segment >= p.segments) return;  // the whole warp (no block barriers below)
  int* next = shared_counters + warp * p.experts;
  for (int e = lane; e < p.experts; e += kWarp)
    next[e] = p.counts[int64_t{e} * p.segments + segment];
  __syncwarp();
  const unsigned below = (1u << lane) - 1u;
  for (int step = 0; step < p.steps && (segment * p.steps + step) * kWarp < p.pairs; ++step) {
    const Step s = StepOf(p, segment, step, lane);
    if (s.expert >= 0) {
      const int place = next[s.expert] + __popc(s.peers & below);
      order[place] = s.pair;
      inverse[s.pair] = place;
      token[place] = s.pair / p.top_k;
    }
    __syncwarp();
    if (s.leader) next[s.expert] += __popc(s.peers);
    __syncwarp();
  }
}

}  // namespace

void LaunchRouteTokens(const at::Tensor& logits, const at::Tensor& replay, int64_t top_k,
                       bool norm_topk, at::ScalarType weight_type, at::Tensor& probs,
                       at::Tensor& own_index, at::Tensor& index, at::Tensor& weights,
                       at::Tensor& mismatches) {
  const c10::cuda::CUDAGuard guard(logits.device());
  RouteParams params;
  params.logits = InOf(logits);
  params.replay = replay.defined() ? replay.const_data_ptr<int64_t>() : nullptr;
  params.probs = probs.data_ptr<float>();
  params.own_index = own_index.data_ptr<int64_t>();
  params.index = replay.defined() ? index.data_ptr<int64_t>() : nullptr;
  params.weights = weights.data_ptr<float>();
  params.mismatches = mismatches.defined()
                          ? reinterpret_cast<unsigned long long*>(mismatches.data_ptr<int64_t>())
                          : nullptr;
  params.weight_type = DtypeOf(weight_type);
  params.tokens = logits.size(0);
  params.experts = static_cast<int>(logits.size(1));
  params.top_k = static_cast<int>(top_k);
  params.norm = norm_topk;
  WithColumnsPerLane(params.experts, [&](auto per) {
    C10_CUDA_CHECK(LaunchAfterPrevious(RouteKernel<decltype(per)::value>,
                                       TokenBlocks(params.tokens), kThreads, 0,
                                       at::cuda::getCurrentCUDAStream(), params));
  });
}

void LaunchSortPairs(const at::Tensor& index, int64_t experts, at::Tensor& order,
                     at::Tensor& inverse, at::Tensor& token, at::Tensor& ends) {
  const c10::cuda::CUDAGuard guard(index.device());
  const int pairs = static_cast<int>(index.numel());
  // Segments of at least 512 pairs, and at most about 256 of them (the scan is one block).
  const int steps = std::max(16, (pairs + 256 * kWarp - 1) / (256 * kWarp));
  const int segments = (pairs + steps * kWarp - 1) / (steps * kWarp);
  at::Tensor counts = at::empty({experts * segments}, index.options().dtype(at::kInt));
  SortParams params;
  params.index = index.const_data_ptr<int64_t>();
  params.counts = counts.data_ptr<int>();
  params.pairs = pairs;
  params.experts = static_cast<int>(experts);
  params.segments = segments;
  params.steps = steps;
  params.top_k = static_cast<int>(index.size(1));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const unsigned blocks = static_cast<unsigned>((segments + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const size_t shared = sizeof(int) * kWarpsPerBlock * static_cast<size_t>(experts);
  C10_CUDA_CHECK(LaunchAfterPrevious(CountPairsKernel, blocks, kThreads, shared, stream, params));
  C10_CUDA_CHECK(LaunchAfterPrevious(ScanCountsKernel, 1, kScanThreads, 0, stream, params,
                                     ends.data_ptr<int64_t>()));
  C10_CUDA_CHECK(LaunchAfterPrevious(PlacePairsKernel, blocks, kThreads, shared, stream, params,
                                     order.data_ptr<int64_t>(), inverse.data_ptr<int64_t>(),
                                     token.data_ptr<int64_t>()));
}

void LaunchRouterBackward(const at::Tensor& probs, const at::Tensor& index,
                          const at::Tensor& dweights_sorted, const at::Tensor& inverse,
                          bool norm_topk, const at::Tensor& extra, at::Tensor& dlogits) {
  const c10::cuda::CUDAGuard guard(probs.device());
  BackwardParams params;
  params.probs = probs.const_data_ptr<float>();
  params.index = index.const_data_ptr<int64_t>();
  params.dweights = dweights_sorted.const_data_ptr<float>();
  params.inverse = inverse.const_data_ptr<int64_t>();
  params.extra = extra.defined() ? extra.const_data_ptr<float>() : nullptr;
  params.dlogits = OutOf(dlogits);
  params.tokens = probs.size(0);
  params.experts = static_cast<int>(probs.size(1));
  params.top_k = static_cast<int>(index.size(1));
  params.norm = norm_topk;
  WithColumnsPerLane(params.experts, [&](auto per) {
    C10_CUDA_CHECK(LaunchAfterPrevious(RouterBackwardKernel<decltype(per)::value>,
                                       TokenBlocks(params.tokens), kThreads, 0,
                                       at::cuda::getCurrentCUDAStream(), params));
  });
}

}  // namespace dta::kernels::internal
