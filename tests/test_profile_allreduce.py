"""scripts/benchmarks/profile_allreduce.py: reading perf's report and turning
shares of samples into microseconds per op (the perf run itself needs perf and
a minute; run it by hand: python -m scripts.benchmarks.profile_allreduce)."""
import pytest

from scripts.benchmarks.profile_allreduce import parse_report, per_op_us

# As `perf report --no-children --sort dso,symbol --stdio -g none` prints it
# (perf 6.1), header lines and the trailing IPC columns included.
REPORT = """\
# To display the perf.data header info, please use --header/--header-only options.
#
# Samples: 8K of event 'cpu-clock:ppp'
#
# Overhead  Shared Object                      Symbol                            IPC   [IPC Coverage]
# ........  .................................  ................................  ....................
#
    17.19%  [vdso]                             [.] __vdso_clock_gettime          -      -
     7.87%  _C.cpython-311-x86_64-linux-gnu.so  [.] ringreduce::shm::PeerWait::idle   -      -
     1.48%  _C.cpython-311-x86_64-linux-gnu.so  [.] ringreduce::(anonymous namespace)::apply<float, ringreduce::(anonymous namespace)::Sum>  -      -
     0.07%  [kernel.kallsyms]                  [k] finish_task_switch.isra.0     -      -


#
# (Tip: ...)
#
"""

BY_DSO = """\
# Overhead  Shared Object
#
    32.25%  libpython3.11.so.1.0
    12.23%  _C.cpython-311-x86_64-linux-gnu.so
"""


def test_rows_by_symbol_keep_the_whole_name_and_drop_the_ipc_columns():
    rows = parse_report(REPORT)
    assert rows == [
        (17.19, "[vdso]", "__vdso_clock_gettime"),
        (7.87, "_C.cpython-311-x86_64-linux-gnu.so", "ringreduce::shm::PeerWait::idle"),
        (1.48, "_C.cpython-311-x86_64-linux-gnu.so",
         "ringreduce::(anonymous namespace)::apply<float, ringreduce::(anonymous namespace)::Sum>"),
        (0.07, "[kernel.kallsyms]", "finish_task_switch.isra.0"),
    ]


def test_rows_by_library_have_no_symbol():
    assert parse_report(BY_DSO) == [(32.25, "libpython3.11.so.1.0", None),
                                    (12.23, "_C.cpython-311-x86_64-linux-gnu.so", None)]


def test_shares_become_microseconds_per_op_and_add_up_per_name():
    rows = [(50.0, "a.so", None), (25.0, "b.so", "f"), (25.0, "b.so", "f")]
    out = per_op_us(rows, op_us=8.0)
    assert out == pytest.approx({"a.so": 4.0, "b.so f": 4.0})
