#include "transport/store_calls.h"

#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "common/errors.h"
#include "common/thread_name.h"

namespace ringreduce {
namespace {

// What a helper thread and its caller share; the helper may outlive the caller.
struct CallState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // guarded by mu
  std::exception_ptr error;  // guarded by mu
};

std::string errorText(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

std::chrono::milliseconds remaining(StoreCalls::Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                  StoreCalls::Clock::now());
  return std::max(ms, std::chrono::milliseconds(1));
}

// A store's own wait() reports its timeout a little after ours; this much
// longer the caller waits for the helper's answer before calling it late.
constexpr auto kAnswerGrace = std::chrono::milliseconds(200);
// Some stores report a wait's timeout much later than asked (FileStore polls
// in whole seconds): when the wait has not answered by its grace, one check()
// with this budget tells such a store from one that does not answer at all.
constexpr auto kLateCheckBudget = std::chrono::milliseconds(500);
// Waits this short poll the store's check() every kPollEvery (see waitImpl).
constexpr auto kPollBelow = std::chrono::milliseconds(1000);
constexpr auto kPollEvery = std::chrono::milliseconds(2);

// Starts fn on a detached helper thread; the state says when it is done.
std::shared_ptr<CallState> start(const c10::intrusive_ptr<c10d::Store>& store,
                                 std::function<void(c10d::Store&)> fn) {
  auto state = std::make_shared<CallState>();
  std::thread([state, store, fn = std::move(fn)] {
    nameThisThread("rr-store");
    std::exception_ptr error;
    try {
      fn(*store);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mu);
    state->done = true;
    state->error = error;
    state->cv.notify_all();
  }).detach();
  return state;
}

}  // namespace

bool StoreCalls::run(Clock::time_point deadline, std::function<void(c10d::Store&)> fn) {
  auto state = start(store_, std::move(fn));
  std::unique_lock<std::mutex> lock(state->mu);
  if (!state->cv.wait_until(lock, deadline, [&] { return state->done; })) return false;
  if (state->error) std::rethrow_exception(state->error);
  return true;
}

void StoreCalls::throwLate(const std::string& what, Clock::time_point deadline,
                           const std::string& missing) const {
  (void)deadline;
  if (!missing.empty()) {
    throwTransportError(prefix_ + " " + what + ": " + missing);
  }
  throwTransportError(prefix_ + " " + what +
                      ": the store did not answer in time (is the process hosting it, "
                      "usually rank 0, stopped or gone?)");
}

void StoreCalls::set(const std::string& key, const std::string& value,
                     Clock::time_point deadline, const std::string& what) {
  bool answered = false;
  try {
    answered = run(deadline, [key, value](c10d::Store& s) { s.set(key, value); });
  } catch (...) {
    throwTransportError(prefix_ + " " + what + ": the store failed: " +
                        errorText(std::current_exception()));
  }
  if (!answered) throwLate(what, deadline, "");
}

int64_t StoreCalls::add(const std::string& key, int64_t delta, Clock::time_point deadline,
                        const std::string& what) {
  auto result = std::make_shared<int64_t>(0);
  bool answered = false;
  try {
    answered = run(deadline, [key, delta, result](c10d::Store& s) { *result = s.add(key, delta); });
  } catch (...) {
    throwTransportError(prefix_ + " " + what + ": the store failed: " +
                        errorText(std::current_exception()));
  }
  if (!answered) throwLate(what, deadline, "");
  return *result;
}

bool StoreCalls::waitFor(const std::string& key, Clock::time_point deadline,
                         const std::string& what) {
  return waitImpl(key, deadline, what, {}, std::chrono::milliseconds(0));
}

bool StoreCalls::waitForUnless(const std::string& key, Clock::time_point deadline,
                               const std::string& what, const std::function<bool()>& stop,
                               std::chrono::milliseconds slice) {
  return waitImpl(key, deadline, what, stop, slice);
}

bool StoreCalls::waitImpl(const std::string& key, Clock::time_point deadline,
                          const std::string& what, const std::function<bool()>& stop,
                          std::chrono::milliseconds slice) {
  const auto budget = remaining(deadline);
  // A store's wait() may time out in whole seconds (FileStore's does): a
  // short wait polls check() instead, so it ends at its deadline (and past
  // the deadline it is one check). The key's absence then is a false wait.
  auto absent = std::make_shared<bool>(false);
  auto state = start(store_, [key, budget, deadline, absent](c10d::Store& s) {
    if (budget > kPollBelow) {
      s.wait({key}, budget);
      return;
    }
    while (!s.check({key})) {
      if (Clock::now() >= deadline) {
        *absent = true;
        return;
      }
      std::this_thread::sleep_for(kPollEvery);
    }
  });
  // Past the deadline the one call still gets its grace to answer.
  const auto answerBy = std::max(deadline, Clock::now()) + kAnswerGrace;
  std::unique_lock<std::mutex> lock(state->mu);
  while (!state->done) {
    const auto until = stop ? std::min(answerBy, Clock::now() + slice) : answerBy;
    if (state->cv.wait_until(lock, until, [&] { return state->done; })) break;
    if (Clock::now() >= answerBy) {
      lock.unlock();
      return lateCheck(key, what, deadline);
    }
    lock.unlock();
    const bool stopped = stop();
    lock.lock();
    if (stopped && !state->done) return false;
  }
  if (!state->error) return !*absent;
  // The store's own wait ran out: the key is missing, the store is fine.
  if (Clock::now() + std::chrono::milliseconds(50) >= deadline) return false;
  throwTransportError(prefix_ + " " + what + ": the store failed: " + errorText(state->error));
}

bool StoreCalls::lateCheck(const std::string& key, const std::string& what,
                           Clock::time_point deadline) {
  auto found = std::make_shared<bool>(false);
  bool answered = false;
  try {
    answered = run(Clock::now() + kLateCheckBudget,
                   [key, found](c10d::Store& s) { *found = s.check({key}); });
  } catch (...) {
    throwTransportError(prefix_ + " " + what + ": the store failed: " +
                        errorText(std::current_exception()));
  }
  if (!answered) throwLate(what, deadline, "");
  return *found;
}

std::string StoreCalls::get(const std::string& key, Clock::time_point deadline,
                            const std::string& what, const std::string& missing) {
  if (!waitFor(key, deadline, what)) throwLate(what, deadline, missing);
  auto result = std::make_shared<std::vector<uint8_t>>();
  bool answered = false;
  try {
    answered = run(std::max(deadline, Clock::now()) + kAnswerGrace,
                   [key, result](c10d::Store& s) { *result = s.get(key); });
  } catch (...) {
    throwTransportError(prefix_ + " " + what + ": the store failed: " +
                        errorText(std::current_exception()));
  }
  if (!answered) throwLate(what, deadline, "");
  return std::string(result->begin(), result->end());
}

namespace {

// The key's value, or nullopt when it is absent (no wait for it).
std::optional<std::string> readIfPresent(c10d::Store& s, const std::string& key) {
  if (!s.check({key})) return std::nullopt;
  auto v = s.get(key);
  return std::string(v.begin(), v.end());
}

}  // namespace

std::optional<std::string> StoreCalls::tryGet(const std::string& key, Clock::time_point deadline,
                                              bool* answered) {
  auto result = std::make_shared<std::optional<std::string>>();
  bool ok = false;
  try {
    ok = run(deadline, [key, result](c10d::Store& s) { *result = readIfPresent(s, key); });
  } catch (...) {
    ok = false;
  }
  if (answered != nullptr) *answered = ok;
  return ok ? *result : std::nullopt;
}

std::optional<std::string> StoreCalls::peek(const std::string& key, Clock::time_point deadline) {
  if (peeking_->exchange(true)) return std::nullopt;
  auto result = std::make_shared<std::optional<std::string>>();
  bool ok = false;
  try {
    ok = run(deadline, [key, result, busy = peeking_](c10d::Store& s) {
      auto done = c10::make_scope_exit([&busy] { busy->store(false); });
      *result = readIfPresent(s, key);
    });
  } catch (...) {
    // Also when no helper started (it would have cleared the flag).
    peeking_->store(false);
    ok = false;
  }
  return ok ? *result : std::nullopt;
}

bool StoreCalls::trySetFirst(const std::string& key, const std::string& value,
                             Clock::time_point deadline) {
  try {
    // compareSet with an empty expected value creates the key only if absent.
    return run(deadline, [key, value](c10d::Store& s) {
      std::vector<uint8_t> empty, desired(value.begin(), value.end());
      s.compareSet(key, empty, desired);
    });
  } catch (...) {
    return false;
  }
}

}  // namespace ringreduce
