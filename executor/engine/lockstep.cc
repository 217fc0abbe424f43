#include "executor/engine/lockstep.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/model/model_config.h"

namespace dta::engine {
namespace {

// Every EP rank's word: two all-gathers (the lengths, then the words padded to the longest), each
// read back to the host.
std::vector<std::vector<ModelCall>> ExchangeWords(const ExpertParallelGroup& ep,
                                                  const std::vector<ModelCall>& word,
                                                  const at::Device& device) {
  const at::TensorOptions on_device = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor lengths =
      ep.AllGather(at::full({1}, static_cast<int64_t>(word.size()), on_device)).cpu();
  const auto length = lengths.accessor<int64_t, 2>();
  int64_t longest = 1;
  for (int r = 0; r < ep.size(); ++r) longest = std::max(longest, length[r][0]);
  // (kind, tokens) per call, padded with zeros to the longest word.
  std::vector<int64_t> flat(2 * longest, 0);
  for (size_t i = 0; i < word.size(); ++i) {
    flat[2 * i] = static_cast<int64_t>(word[i].kind);
    flat[2 * i + 1] = word[i].tokens;
  }
  const at::Tensor mine = at::tensor(flat, at::kLong).view({longest, 2});
  const at::Tensor all = ep.AllGather(mine.to(device)).cpu();
  const auto a = all.accessor<int64_t, 3>();
  std::vector<std::vector<ModelCall>> words(ep.size());
  for (int r = 0; r < ep.size(); ++r) {
    for (int64_t i = 0; i < length[r][0]; ++i)
      words[r].push_back({static_cast<CallKind>(a[r][i][0]), a[r][i][1]});
  }
  return words;
}

// Backpropagates zeros from the empty call's result: every sparse layer's backward runs (and its
// collectives), last layer first, as in a real call.
void BackwardZeros(const at::Tensor& hidden) {
  if (!hidden.requires_grad()) return;  // no sparse layers
  torch::autograd::backward({hidden}, {at::zeros_like(hidden)});
}

}  // namespace

Lockstep::Lockstep(const Decoder& model, std::vector<ModelCall> word) : model_(model) {
  const ExpertParallelGroup* ep = model.expert_parallel();
  if (ep == nullptr || ep->size() == 1) {
    for (int64_t i = 0; i < static_cast<int64_t>(word.size()); ++i)
      slots_.push_back({.kind = word[i].kind, .calls = {i}});
    return;
  }
  rank_ = ep->rank();
  absl::StatusOr<std::vector<AlignedSlot>> slots =
      AlignCalls(ExchangeWords(*ep, word, model.options().device()));
  TORCH_CHECK(slots.ok(), "expert-parallel lockstep: ", std::string(slots.status().message()));
  slots_ = *std::move(slots);
}

void Lockstep::Run(const std::function<void(int64_t call)>& call) const {
  std::vector<at::Tensor> kept;  // the empty calls' graphs kept for a later kBackwardKept
  for (const AlignedSlot& slot : slots_) {
    if (slot.calls[rank_] >= 0) {
      call(slot.calls[rank_]);
      continue;
    }
    switch (slot.kind) {
      case CallKind::kForward: {
        torch::autograd::AutoGradMode no_grad(false);
        model_.ForwardSparseLayersOnEmpty();
        break;
      }
      case CallKind::kKeep: {
        torch::autograd::AutoGradMode grad_mode(true);
        kept.push_back(model_.ForwardSparseLayersOnEmpty());
        break;
      }
      case CallKind::kBackwardKept:
        TORCH_CHECK(!kept.empty(), "internal: expert-parallel lockstep: no empty graph kept");
        BackwardZeros(kept.back());
        kept.pop_back();
        break;
      case CallKind::kForwardBackward: {
        torch::autograd::AutoGradMode grad_mode(true);
        BackwardZeros(model_.ForwardSparseLayersOnEmpty());
        break;
      }
      case CallKind::kLayerReplay: {
        // As ForwardKeepingLayerInputs and BackwardThroughLayers: every layer forward, then each
        // recomputed and backpropagated, last first.
        {
          torch::autograd::AutoGradMode no_grad(false);
          model_.ForwardSparseLayersOnEmpty();
        }
        torch::autograd::AutoGradMode grad_mode(true);
        for (int64_t l = model_.config().num_hidden_layers - 1; l >= 0; --l) {
          if (IsSparseLayer(model_.config(), l))
            BackwardZeros(model_.ForwardSparseLayersOnEmpty(l));
        }
        break;
      }
    }
  }
  TORCH_CHECK(kept.empty(), "internal: expert-parallel lockstep: an empty graph was never used");
}

}  // namespace dta::engine
