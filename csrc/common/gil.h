// Releasing the GIL around blocking waits that may run with it held.
//
// A backend is destroyed from Python (`del pg`, garbage collection) with the
// GIL held, and its destructor joins the worker and transport threads. Those
// threads may drop the last reference to a caller's tensor, and freeing a
// tensor that has a Python object needs the GIL: joining them with the GIL
// held can deadlock. Hold a ReleaseGilIfHeld across such joins.
#pragma once

#include <Python.h>

namespace ringreduce {

class ReleaseGilIfHeld {
 public:
  ReleaseGilIfHeld() {
    if (Py_IsInitialized() && PyGILState_Check()) state_ = PyEval_SaveThread();
  }
  ~ReleaseGilIfHeld() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  ReleaseGilIfHeld(const ReleaseGilIfHeld&) = delete;
  ReleaseGilIfHeld& operator=(const ReleaseGilIfHeld&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

}  // namespace ringreduce
