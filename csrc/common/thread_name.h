// Names the calling thread ("rr-..."), so that `top -H`, gdb, a core dump and
// /proc/<pid>/task/*/comm tell our threads from torch's and gloo's.
#pragma once

#include <pthread.h>

namespace ringreduce {

// `name` has at most 15 characters (the kernel's limit); a longer one is
// left unset rather than cut.
inline void nameThisThread(const char* name) { pthread_setname_np(pthread_self(), name); }

}  // namespace ringreduce
