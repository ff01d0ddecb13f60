// CallbackThreads (callback_threads.h): starting the threads, the choice
// between a free thread and a new one, the watcher's loop, and ending them.
#include "common/callback_threads.h"

#include "common/thread_name.h"

namespace ringreduce {

void CallbackThreads::spawnLocked() {
  // The body holds the owner; nothing here touches this object once it runs
  // (a stop may have let the thread go, and the owner may be gone after it).
  threads_.emplace_back([name = threadName_, body = client_.threadBodyLocked()] {
    nameThisThread(name);
    body();
  });
  ++live_;
  if (detachNew_) {
    threads_.back().detach();
    threads_.pop_back();
  }
}

CallbackThreads::Runner CallbackThreads::ensureRunnerLocked(std::string* error) {
  if (!allInCallbacksLocked()) return Runner::kFree;
  try {
    spawnLocked();
    return Runner::kStarted;
  } catch (const std::exception& err) {
    if (error != nullptr) *error = err.what();
    return Runner::kNone;
  }
}

void CallbackThreads::armWatcherLocked() {
  if (armed_ || watcherFailed_ || client_.watcherDoneLocked()) return;
  armed_ = true;  // at most one wake-up until it idles again
  if (watcherStarted_) {
    watchCv_.notify_one();
    return;
  }
  try {
    watcher_ = std::thread([this, keep = client_.watcherKeepLocked()] {
      nameThisThread(watcherName_);
      watch();
    });
    watcherStarted_ = true;
    if (detachNew_) watcher_.detach();
  } catch (const std::exception& err) {
    armed_ = false;
    watcherFailed_ = !client_.retryWatcherLocked(err);
  }
}

void CallbackThreads::watch() {
  std::unique_lock<std::mutex> lock(mu_);
  const auto done = [this] { return client_.watcherDoneLocked(); };
  while (!done()) {
    if (!armed_) {
      watchCv_.wait(lock, [&] { return armed_ || done(); });
      continue;
    }
    const std::optional<std::chrono::milliseconds> period = client_.watchPeriodLocked();
    if (!period) {
      armed_ = false;
      continue;
    }
    // Sleeps the whole period: a wake-up at each bit of progress would cost a
    // context switch per op (DDP's bucket Futures are taken, so armed).
    watchCv_.wait_for(lock, *period, done);
    if (done()) break;
    switch (client_.lookLocked(*period)) {
      case Look::kAgain:
        break;
      case Look::kIdle:
        armed_ = false;
        break;
      case Look::kRescue:
        client_.rescueLocked(lock);
        break;
    }
  }
}

std::vector<std::thread> CallbackThreads::takeAllLocked() {
  std::vector<std::thread> all;
  all.swap(threads_);
  if (watcher_.joinable()) all.push_back(std::move(watcher_));
  return all;
}

void CallbackThreads::endAll(bool detach) {
  const auto end = [detach](std::thread& t) {
    if (detach) {
      t.detach();
    } else {
      t.join();
    }
  };
  while (true) {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      threads.swap(threads_);
    }
    if (threads.empty()) break;
    for (auto& t : threads) end(t);
  }
  // The watcher may start threads until the last one has left (the owner's
  // watcherDoneLocked); it only ever waits for mu_.
  std::thread watcher;
  {
    std::lock_guard<std::mutex> lock(mu_);
    watcher.swap(watcher_);
  }
  wakeWatcher();
  if (watcher.joinable()) end(watcher);
}

}  // namespace ringreduce
