#include "backend/coalesced_work.h"

#include <ATen/core/ivalue.h>

namespace ringreduce {

CoalescedWork::CoalescedWork(int rank, std::vector<c10::intrusive_ptr<ringreduce::Work>> works)
    : c10d::Work(rank, c10d::OpType::COALESCED), works_(std::move(works)) {}

bool CoalescedWork::isCompleted() {
  for (const auto& w : works_) {
    if (!w->isCompleted()) return false;
  }
  return true;
}

bool CoalescedWork::isSuccess() const {
  for (const auto& w : works_) {
    if (!w->isSuccess()) return false;
  }
  return true;
}

std::exception_ptr CoalescedWork::exception() const {
  for (const auto& w : works_) {
    if (std::exception_ptr e = w->exception()) return e;
  }
  return nullptr;
}

bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  if (timeout == kNoTimeout) {
    for (const auto& w : works_) w->wait();
    return true;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& w : works_) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    // At least 1 ms: a timeout of 0 is kNoTimeout, a wait without end.
    w->wait(std::max(left, std::chrono::milliseconds(1)));
  }
  return true;
}

void CoalescedWork::synchronize() {
  for (const auto& w : works_) w->synchronize();
}

void CoalescedWork::blockCurrentStream() {
  for (const auto& w : works_) w->blockCurrentStream();
}

std::vector<at::Tensor> CoalescedWork::result() {
  std::vector<at::Tensor> out;
  for (const auto& w : works_) {
    for (auto& t : w->result()) out.push_back(std::move(t));
  }
  return out;
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() {
  std::lock_guard<std::mutex> lock(futureMu_);
  if (future_) return future_;
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
      c10::FutureType::create(c10::ListType::ofTensors()));
  for (const auto& w : works_) futures.push_back(w->getFuture());
  future_ = c10::collectAll(futures)->then(
      [](c10::ivalue::Future& all) {
        std::vector<at::Tensor> out;
        for (const auto& f : all.value().toList()) {
          const auto& sub = f.get().toFuture();
          if (sub->hasError()) std::rethrow_exception(sub->exception_ptr());
          for (auto& t : sub->value().toTensorVector()) out.push_back(std::move(t));
        }
        return c10::IValue(out);
      },
      c10::ListType::ofTensors());
  return future_;
}

float CoalescedWork::getDuration() const {
  float longest = 0;
  for (const auto& w : works_) longest = std::max(longest, w->getDuration());
  return longest;
}

}  // namespace ringreduce
