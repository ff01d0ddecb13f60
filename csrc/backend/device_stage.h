// DeviceStage: how a collective on CUDA tensors runs over the CPU transports
// (host staging). The ring algorithms only ever see host memory; for a CUDA
// op the calling thread gives every CUDA tensor a pinned host twin:
//
//   caller thread   ready = event on the caller's current stream   (begin())
//   worker thread   internal stream waits for `ready`, copies device -> twin,
//                   staged = event on the internal stream; waits for it on
//                   the host                                     (beforeRun())
//                   (in op order: an earlier op's copies back come first)
//                   runs the CPU algorithm on the twins
//                   copies twin -> device on the internal stream,
//                   done = event on the internal stream           (afterRun())
//   Work.wait()     the caller's current stream waits for `done`: the host
//                   does not wait for the GPU (NCCL's semantics)
//
// Tensors the internal stream touches are held by the stage until their copies
// are queued and recorded on the stream (recordStream), so freeing them early
// cannot hand their memory to other work too soon; pinned
// twins are released through torch's host allocator, which waits for the
// copies that read them. A CPU-only op has an empty stage and pays nothing.
// In a build without CUDA the stage is always empty (CUDA tensors are
// rejected by validation first).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "common/errors.h"

namespace ringreduce {

class DeviceStage {
 public:
  DeviceStage() = default;
  // The stage of an op over `tensors`: empty when all are on the CPU. All of
  // an op's tensors must be on one device (a ValueError names the odd one).
  static DeviceStage begin(const OpContext& ctx, const std::vector<at::Tensor>& tensors);

  bool active() const { return impl_ != nullptr; }
  std::optional<c10::Device> device() const;

  // The host tensor the algorithm uses in place of t (t itself when inactive):
  // in: read by the op (copied to the host); out: written by the op (copied
  // back after); inout: both.
  at::Tensor in(const at::Tensor& t);
  at::Tensor out(const at::Tensor& t);
  at::Tensor inout(const at::Tensor& t);
  // The same for each tensor of a list, in order.
  std::vector<at::Tensor> in(const std::vector<at::Tensor>& ts) {
    return each(ts, &DeviceStage::in);
  }
  std::vector<at::Tensor> out(const std::vector<at::Tensor>& ts) {
    return each(ts, &DeviceStage::out);
  }
  std::vector<at::Tensor> inout(const std::vector<at::Tensor>& ts) {
    return each(ts, &DeviceStage::inout);
  }

  // When the op runs (worker thread, in op order): queues the copies to the
  // host, after what the caller queued before the op, and waits until they
  // are done, calling `check` meanwhile (it throws to give up: the op's
  // deadline, the group aborted). The GPU may be busy for long with work
  // queued before the op; a stalled stream must not hang the worker.
  void beforeRun(const std::function<void()>& check);
  // Queues the copies back to the device (after what the caller queued before
  // the op); only after a successful op.
  void afterRun();
  // Runs fn with the internal stream current (the Future records its events
  // on it).
  void onInternalStream(const std::function<void()>& fn);
  // The caller's current stream waits for the copies back (no host wait).
  void blockCurrentStream();
  // Whether the copies back have finished on the GPU.
  bool query() const;

 private:
  std::vector<at::Tensor> each(const std::vector<at::Tensor>& ts,
                               at::Tensor (DeviceStage::*one)(const at::Tensor&)) {
    std::vector<at::Tensor> hosts;
    hosts.reserve(ts.size());
    for (const auto& t : ts) hosts.push_back((this->*one)(t));
    return hosts;
  }
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// "host-staging" in a CUDA build, else "none": how CUDA tensors travel.
const char* cudaPathName();

}  // namespace ringreduce
