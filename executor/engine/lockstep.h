// Internal to executor/engine: the lockstep of expert-parallel ranks (docs/expert_parallelism.md,
// "The push/pop executor"). Every sparse layer's all-to-all pairs the n-th call of every rank of
// the expert-parallel (EP) group, but the ranks train different rollouts, so their methods make
// different model calls. Each method therefore lists its model calls (its word, core/tree/
// call_alignment.h) before the first kernel; the ranks exchange their words and align them into
// one sequence of slots, and each rank runs its own call in a slot where it has one and an empty
// call of the slot's kind (zero tokens through the same code path: its experts still serve the
// other ranks' tokens) where it has none.
//
// Example (dense: one forward and backward per rollout):
//   std::vector<ModelCall> word;
//   for (const Rollout& r : rollouts) word.push_back(ForwardBackwardCall(r.tokens.size()));
//   Lockstep(model, std::move(word)).Run([&](int64_t call) { TrainOn(rollouts[call]); });
//
// Without expert parallelism (or an EP group of one) the slots are this rank's calls in order and
// nothing is exchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/tree/call_alignment.h"
#include "executor/model/decoder.h"

namespace dta::engine {

// Words weigh calls by work: forward tokens, their backward counting twice.
inline ModelCall ForwardCall(int64_t tokens) { return {CallKind::kForward, tokens}; }
inline ModelCall KeepCall(int64_t tokens) { return {CallKind::kKeep, tokens}; }
inline ModelCall BackwardKeptCall(int64_t tokens) { return {CallKind::kBackwardKept, 2 * tokens}; }
inline ModelCall ForwardBackwardCall(int64_t tokens) {
  return {CallKind::kForwardBackward, 3 * tokens};
}
// Layer replay forwards twice.
inline ModelCall LayerReplayCall(int64_t tokens) { return {CallKind::kLayerReplay, 4 * tokens}; }

class Lockstep {
 public:
  // This rank's `word` aligned with those of the other ranks of `model`'s EP group: collective
  // over that group (every rank constructs its Lockstep at the same point).
  Lockstep(const Decoder& model, std::vector<ModelCall> word);

  // Runs every slot in order: `call(i)` where this rank runs its call i (each exactly once, in
  // order), an empty call of the slot's kind elsewhere.
  void Run(const std::function<void(int64_t call)>& call) const;

 private:
  const Decoder& model_;
  int rank_ = 0;
  std::vector<AlignedSlot> slots_;
};

}  // namespace dta::engine
