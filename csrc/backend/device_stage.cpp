#include "backend/device_stage.h"

#ifdef RINGREDUCE_WITH_CUDA
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <map>
#include <mutex>
#include <thread>
#endif

namespace ringreduce {

#ifdef RINGREDUCE_WITH_CUDA

namespace {

// One internal stream per device for the copies of every group in the
// process: the copies of one op are ordered by events, never by the stream.
// Our own (created once, never destroyed), not one of torch's pool: the pool
// hands the same streams round-robin to others (ProcessGroupNCCL, Future
// callbacks), whose work would then queue between our copies, and an NCCL
// collective waiting there for its peers could hold up an op they wait for.
// Called with the device guard of `index` set.
c10::cuda::CUDAStream internalStream(c10::DeviceIndex index) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(index);
  if (it == streams.end()) {
    cudaStream_t raw = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
    it = streams.emplace(index, c10::cuda::getStreamFromExternal(raw, index)).first;
  }
  return it->second;
}

}  // namespace

struct DeviceStage::Impl {
  Impl(c10::Device d, c10::cuda::CUDAStream s) : device(d), stream(s) {}

  c10::Device device;
  c10::cuda::CUDAStream stream;
  // c10's device-generic event (ATen's CUDAEvent would need the CUDA math
  // libraries' headers to compile).
  c10::Event ready{c10::DeviceType::CUDA};   // what the caller queued before the op
  bool readyAwaited = false;                 // the internal stream waits for it
  c10::Event staged{c10::DeviceType::CUDA};  // the copies to the host are done
  c10::Event done{c10::DeviceType::CUDA};    // the copies back are done
  // (caller's tensor, its host twin) pairs to copy to the host when the op
  // runs, and back after it. Held until then: the caller may free a tensor
  // before the copy is queued, and recordStream only covers work queued on
  // the stream by the time of the free.
  std::vector<std::pair<at::Tensor, at::Tensor>> ins;
  std::vector<std::pair<at::Tensor, at::Tensor>> back;

  // With the device guard set.
  void awaitReady() {
    if (readyAwaited) return;
    ready.block(stream);
    readyAwaited = true;
  }

  at::Tensor twin(const at::Tensor& t) const {
    return at::empty(t.sizes(), at::TensorOptions()
                                    .dtype(t.scalar_type())
                                    .device(at::kCPU)
                                    .pinned_memory(true));
  }
  // The internal stream uses t: its memory is not reused before that is done.
  void record(const at::Tensor& t) const {
    if (t.numel() > 0 && t.storage().data_ptr().get() != nullptr) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
    }
  }
};

DeviceStage DeviceStage::begin(const OpContext& ctx, const std::vector<at::Tensor>& tensors) {
  const at::Tensor* first = nullptr;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda()) {
      first = &t;
      break;
    }
  }
  if (first == nullptr) return {};
  for (const auto& t : tensors) {
    RR_CHECK_VALUE(!t.defined() || t.device() == first->device(), ctx,
                   "all tensors of one op must be on one device, got ", describe(*first),
                   " and ", describe(t));
  }
  const c10::Device device = first->device();
  c10::cuda::CUDAGuard guard(device);
  // Host staging runs on the CPU, which a graph cannot replay: refused at the
  // call (a ValueError every rank hears of), not a CUDA error on our stream
  // once it waits on the capturing stream.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(
      c10::cuda::getCurrentCUDAStream(device.index()).stream(), &capture));
  RR_CHECK_VALUE(capture == cudaStreamCaptureStatusNone, ctx,
                 "cannot be captured in a CUDA graph (ringreduce stages CUDA tensors through "
                 "host memory, which a graph cannot replay): ", describe(*first));
  DeviceStage stage;
  stage.impl_ = std::make_shared<Impl>(device, internalStream(device.index()));
  // The copies start after everything the caller queued before the op (the
  // internal stream waits for it when they are queued).
  stage.impl_->ready.record(c10::cuda::getCurrentCUDAStream(device.index()));
  return stage;
}

std::optional<c10::Device> DeviceStage::device() const {
  if (!impl_) return std::nullopt;
  return impl_->device;
}

at::Tensor DeviceStage::in(const at::Tensor& t) {
  if (!impl_) return t;
  at::Tensor host = impl_->twin(t);
  impl_->ins.emplace_back(t, host);  // copied when the op runs (beforeRun)
  impl_->record(t);
  return host;
}

at::Tensor DeviceStage::out(const at::Tensor& t) {
  if (!impl_) return t;
  at::Tensor host = impl_->twin(t);
  impl_->back.emplace_back(t, host);
  impl_->record(t);
  return host;
}

at::Tensor DeviceStage::inout(const at::Tensor& t) {
  if (!impl_) return t;
  at::Tensor host = in(t);
  impl_->back.emplace_back(t, host);
  return host;
}

void DeviceStage::beforeRun(const std::function<void()>& check) {
  if (!impl_) return;
  // Queued here, in op order, not when the op was issued: an op queued behind
  // an unfinished one on the same tensor (`all_reduce(x, async_op=True)`, then
  // `all_reduce(x)`) reads the earlier op's result, whose copy back that op
  // queued on this stream when it ran. Copied at issue, it read the tensor
  // from before the earlier op (found by review).
  c10::cuda::CUDAGuard guard(impl_->device);
  impl_->awaitReady();
  {
    c10::cuda::CUDAStreamGuard onStream(impl_->stream);
    for (auto& [deviceTensor, host] : impl_->ins) host.copy_(deviceTensor, /*non_blocking=*/true);
  }
  impl_->staged.record(impl_->stream);
  // Polled, not synchronize(): that cannot be given up. Spins briefly (a
  // small op's copies take microseconds), then sleeps between polls.
  const auto spinUntil = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
  while (!impl_->staged.query()) {
    check();
    if (std::chrono::steady_clock::now() < spinUntil) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  impl_->ins.clear();  // copied and recorded: the caller's tensors are free to go
}

void DeviceStage::afterRun() {
  if (!impl_) return;
  c10::cuda::CUDAGuard guard(impl_->device);
  impl_->awaitReady();  // a receive has no copies to the host
  c10::cuda::CUDAStreamGuard onStream(impl_->stream);
  // The callers hold AutoDispatchBelowADInplaceOrView (Backend::runOp):
  // an inference tensor may be written from this thread.
  for (auto& [deviceTensor, host] : impl_->back) {
    deviceTensor.copy_(host, /*non_blocking=*/true);
  }
  impl_->done.record(impl_->stream);
}

void DeviceStage::onInternalStream(const std::function<void()>& fn) {
  if (!impl_) {
    fn();
    return;
  }
  c10::cuda::CUDAGuard guard(impl_->device);
  c10::cuda::CUDAStreamGuard onStream(impl_->stream);
  fn();
}

void DeviceStage::blockCurrentStream() {
  if (!impl_) return;
  c10::cuda::CUDAGuard guard(impl_->device);
  impl_->done.block(c10::cuda::getCurrentCUDAStream(impl_->device.index()));
}

bool DeviceStage::query() const {
  return !impl_ || impl_->done.query();
}

const char* cudaPathName() {
  return "host-staging";
}

#else  // no CUDA in this build: every stage is empty

struct DeviceStage::Impl {};

DeviceStage DeviceStage::begin(const OpContext&, const std::vector<at::Tensor>&) {
  return {};
}
std::optional<c10::Device> DeviceStage::device() const {
  return std::nullopt;
}
at::Tensor DeviceStage::in(const at::Tensor& t) {
  return t;
}
at::Tensor DeviceStage::out(const at::Tensor& t) {
  return t;
}
at::Tensor DeviceStage::inout(const at::Tensor& t) {
  return t;
}
void DeviceStage::beforeRun(const std::function<void()>&) {}
void DeviceStage::afterRun() {}
void DeviceStage::onInternalStream(const std::function<void()>& fn) {
  fn();
}
void DeviceStage::blockCurrentStream() {}
bool DeviceStage::query() const {
  return true;
}
const char* cudaPathName() {
  return "none";
}

#endif

}  // namespace ringreduce
