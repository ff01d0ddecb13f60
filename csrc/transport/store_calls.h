// c10d::Store calls with a deadline.
//
// A store call blocks for the store's own timeout (30 minutes by default, and
// forever in practice when the process hosting a TCPStore is stopped), which
// knows nothing of the group's timeout. Every call the transports make goes
// through StoreCalls instead: it runs on a helper thread and the caller waits
// only until its deadline, derived from the group timeout (set-up) or a short
// fixed budget (the error path, which must never delay a raise). A call that
// misses its deadline is left to finish or fail on its own; it holds a
// reference to the store, never to the caller.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace ringreduce {

class StoreCalls {
 public:
  using Clock = std::chrono::steady_clock;

  // `prefix` starts every error message ("[ringreduce rank 1/4]").
  StoreCalls(c10::intrusive_ptr<c10d::Store> store, std::string prefix)
      : store_(std::move(store)), prefix_(std::move(prefix)) {}

  // Each throws a DistBackendError naming `what` when the store does not answer
  // before `deadline` or fails.
  void set(const std::string& key, const std::string& value, Clock::time_point deadline,
           const std::string& what);
  int64_t add(const std::string& key, int64_t delta, Clock::time_point deadline,
              const std::string& what);
  // Waits until `key` exists (another rank sets it), then reads it. On timeout
  // the error says `missing` (e.g. "rank 2 never published its address").
  std::string get(const std::string& key, Clock::time_point deadline, const std::string& what,
                  const std::string& missing);
  // True once `key` exists, false if it does not by the deadline (no throw for
  // that); throws only if the store fails or stops answering.
  bool waitFor(const std::string& key, Clock::time_point deadline, const std::string& what);
  // waitFor that also calls `stop()` every `slice` while the store has not
  // answered; stop() returning true ends the wait at once (false is returned;
  // the one store call finishes on its own thread). A store that is merely
  // slow to answer is not an error before `deadline`.
  bool waitForUnless(const std::string& key, Clock::time_point deadline, const std::string& what,
                     const std::function<bool()>& stop, std::chrono::milliseconds slice);

  // Best effort, for the error path: never throw. nullopt when the key is
  // absent or the store did not answer in time (*answered says which).
  std::optional<std::string> tryGet(const std::string& key, Clock::time_point deadline,
                                    bool* answered = nullptr);
  // Sets `key` unless it exists already (the first writer wins); false when the
  // store did not answer in time.
  bool trySetFirst(const std::string& key, const std::string& value,
                   Clock::time_point deadline);
  // tryGet for a periodic look: while the previous peek's store call has not
  // returned (a store that stopped answering), returns nullopt at once
  // instead of starting another, so looks never pile up helper threads.
  std::optional<std::string> peek(const std::string& key, Clock::time_point deadline);

  c10d::Store& raw() { return *store_; }
  const c10::intrusive_ptr<c10d::Store>& ptr() const { return store_; }

 private:
  // Runs fn on a helper thread; true when it finished before the deadline
  // (rethrowing what it threw), false when the deadline passed first.
  bool run(Clock::time_point deadline, std::function<void(c10d::Store&)> fn);
  // waitFor's body: `stop` (may be empty) is asked every `slice`.
  bool waitImpl(const std::string& key, Clock::time_point deadline, const std::string& what,
                const std::function<bool()>& stop, std::chrono::milliseconds slice);
  // The wait for `key` did not answer in its grace: one quick check() decides
  // (the key's presence), or throws when the store does not answer that either.
  bool lateCheck(const std::string& key, const std::string& what, Clock::time_point deadline);
  [[noreturn]] void throwLate(const std::string& what, Clock::time_point deadline,
                              const std::string& missing) const;

  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  // A peek's store call is running (shared with its helper thread).
  std::shared_ptr<std::atomic<bool>> peeking_ = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace ringreduce
