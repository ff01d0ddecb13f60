// The one Work endCoalescing returns for the ops issued between
// startCoalescing and endCoalescing (torch's _coalescing_manager with a
// device, batch_isend_irecv): it completes when every one of them has, and
// fails with the first one's error.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mutex>
#include <vector>

#include "backend/work.h"

namespace ringreduce {

class CoalescedWork : public c10d::Work {
 public:
  CoalescedWork(int rank, std::vector<c10::intrusive_ptr<ringreduce::Work>> works);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  // Waits for each op in issue order; `timeout` bounds the whole wait.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  void blockCurrentStream() override;
  // Every op's outputs, in issue order.
  std::vector<at::Tensor> result() override;
  // Completes with result() once every op's Future has, or with the first
  // error; built on the first call.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // The longest of the ops' durations (they may overlap).
  float getDuration() const override;
  size_t size() const { return works_.size(); }

 private:
  const std::vector<c10::intrusive_ptr<ringreduce::Work>> works_;
  std::mutex futureMu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // guarded by futureMu_
};

}  // namespace ringreduce
