// A started c10d collective as a PendingCollective (executor/parallel): Wait() waits for it the
// stream-ordered way (ProcessGroup::WaitStreamOrdered), and destruction without Wait() waits too,
// logging instead of throwing (another error is then unwinding and is the one reported).
#pragma once

#include <c10/util/Logging.h>

#include <string_view>
#include <utility>

#include "executor/distributed/process_group.h"
#include "executor/parallel/tensor_parallel.h"

namespace dta {

class PendingWork final : public PendingCollective {
 public:
  // `what` names the collective in errors; it must outlive this object (a literal).
  PendingWork(const ProcessGroup& group, c10::intrusive_ptr<c10d::Work> work, std::string_view what)
      : group_(group), work_(std::move(work)), what_(what) {}
  ~PendingWork() override {
    if (work_ == nullptr) return;
    try {
      Wait();
    } catch (const std::exception& e) {
      LOG(ERROR) << e.what();
    }
  }
  void Wait() override {
    if (work_ == nullptr) return;
    const c10::intrusive_ptr<c10d::Work> work = std::move(work_);
    group_.WaitStreamOrdered(*work, what_);
  }

 private:
  const ProcessGroup& group_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::string_view what_;
};

}  // namespace dta
