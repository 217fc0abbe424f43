#include "kernels/batched_copy.h"

#include <c10/util/Exception.h>

#include <optional>
#include <vector>

#include "core/base/env_switch.h"
#include "kernels/batched_copy_internal.h"

namespace dta::kernels {
namespace {

using internal::CopyPiece;

#ifdef DTA_KERNELS_HAVE_CUDA
// t as rows of contiguous elements: [size(0), numel / size(0)] with row stride stride(0), when
// every dimension after the first is contiguous; a 0-d or 1-element-per-row tensor is rows of 1.
std::optional<CopyPiece> AsRows(const at::Tensor& t) {
  if (t.dim() == 0) return CopyPiece{.rows = 1, .cols = 1};
  // A contiguous vector is one row (a row per element would leave a block per element).
  if (t.dim() == 1 && t.stride(0) == 1) return CopyPiece{.rows = 1, .cols = t.size(0)};
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return std::nullopt;
    expected *= t.size(d);
  }
  return CopyPiece{.rows = t.size(0),
                   .cols = expected,
                   .source_row_stride = t.size(0) > 1 ? t.stride(0) : expected,
                   .destination_row_stride = t.size(0) > 1 ? t.stride(0) : expected};
}

// DTA_BATCHED_COPY=0 runs every piece through ATen (for before/after measurements in one build;
// read at every call, so that one process can alternate).
bool BatchedCopyEnabled() { return EnvSwitchOn("DTA_BATCHED_COPY"); }
#endif

// Batches of kernel pieces by dtype pair; whatever the kernel does not take runs through ATen.
class Batcher {
 public:
  void Add(const at::Tensor* source, const at::Tensor& destination) {
    if (destination.numel() == 0) return;
#ifdef DTA_KERNELS_HAVE_CUDA
    const std::optional<CopyPiece> to = AsRows(destination);
    const std::optional<CopyPiece> from = source ? AsRows(*source) : to;
    const at::ScalarType source_type = source ? source->scalar_type() : destination.scalar_type();
    if (destination.is_cuda() && BatchedCopyEnabled() && to && from &&
        (source == nullptr || source->device() == destination.device()) &&
        internal::BatchedCopySupports(source_type, destination.scalar_type())) {
      CopyPiece piece = *to;
      piece.source = source ? source->const_data_ptr() : nullptr;
      piece.destination = destination.data_ptr();
      // As ATen's in-place ops do, so that autograd notices a write into a tensor it saved.
      destination.unsafeGetTensorImpl()->bump_version();
      piece.source_row_stride = from->source_row_stride;
      Group& group = GroupOf(source_type, destination.scalar_type(), destination.device());
      group.pieces.push_back(piece);
      if (static_cast<int64_t>(group.pieces.size()) == kBatchedCopyMaxPieces) Flush(group);
      return;
    }
#endif
    if (source) {
      at::Tensor(destination).copy_(*source);
    } else {
      at::Tensor(destination).zero_();
    }
  }

  void FlushAll() {
    for (Group& group : groups_) Flush(group);
  }

 private:
  struct Group {
    at::ScalarType source_type;
    at::ScalarType destination_type;
    at::Device device;
    std::vector<CopyPiece> pieces;
  };

  Group& GroupOf(at::ScalarType source_type, at::ScalarType destination_type,
                 const at::Device& device) {
    for (Group& group : groups_) {
      if (group.source_type == source_type && group.destination_type == destination_type &&
          group.device == device)
        return group;
    }
    groups_.push_back({source_type, destination_type, device, {}});
    return groups_.back();
  }

  void Flush(Group& group) {
#ifdef DTA_KERNELS_HAVE_CUDA
    if (!group.pieces.empty())
      internal::BatchedCopyCuda(group.pieces, group.source_type, group.destination_type,
                                group.device);
#endif
    group.pieces.clear();
  }

  std::vector<Group> groups_;
};

}  // namespace

void CopyAll(absl::Span<const at::Tensor> sources, absl::Span<const at::Tensor> destinations) {
  TORCH_CHECK(sources.size() == destinations.size(), "CopyAll: ", sources.size(), " sources for ",
              destinations.size(), " destinations");
  Batcher batcher;
  for (size_t i = 0; i < sources.size(); ++i) {
    TORCH_CHECK(sources[i].sizes() == destinations[i].sizes(), "CopyAll: source ", i, " is ",
                sources[i].sizes(), ", its destination ", destinations[i].sizes());
    batcher.Add(&sources[i], destinations[i]);
  }
  batcher.FlushAll();
}

void ZeroAll(absl::Span<const at::Tensor> tensors) {
  Batcher batcher;
  for (const at::Tensor& t : tensors) batcher.Add(nullptr, t);
  batcher.FlushAll();
}

}  // namespace dta::kernels
