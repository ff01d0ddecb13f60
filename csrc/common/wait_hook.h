// What a blocking wait calls first, on a thread that alone makes some
// transfers progress.
//
// The p2p engine's threads complete point-to-point Works and so run their
// Futures' callbacks. A callback that waits for another point-to-point Work
// would block the one thread that can complete it. The engine sets this hook
// on its threads; Work::wait() calls it before it blocks, and the engine
// then starts another thread if every one of its threads is in callbacks.
// torch's Future::wait() cannot call it: Work calls it before it runs
// the callbacks of a Future someone took (getFuture()).
#pragma once

namespace ringreduce {

struct BlockingHook {
  // certain: a wait is about to block (else: user callbacks that may block
  // are about to run).
  void (*fn)(void*, bool certain) = nullptr;
  void* arg = nullptr;
};

inline BlockingHook& blockingHook() {
  thread_local BlockingHook hook;
  return hook;
}

inline void beforeBlocking(bool certain = true) {
  const BlockingHook& hook = blockingHook();
  if (hook.fn != nullptr) hook.fn(hook.arg, certain);
}

}  // namespace ringreduce
