// FunctionRef<R(Args...)>: a callable passed down a call, not kept. It refers
// to the caller's callable (a lambda, usually) without copying it, so a wait
// loop's callbacks cost no allocation per op, which a std::function holding a
// lambda with more than two captures does. The callable must outlive every
// call through the reference: pass it as an argument, never store it.
#pragma once

#include <type_traits>
#include <utility>

namespace ringreduce {

template <typename Signature>
class FunctionRef;

template <typename R, typename... Args>
class FunctionRef<R(Args...)> {
 public:
  template <typename F,
            typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef> &&
                                        std::is_invocable_r_v<R, F&, Args...>>>
  FunctionRef(F&& f)  // NOLINT(google-explicit-constructor): stands in for a callable
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* object, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(object))(
              std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace ringreduce
