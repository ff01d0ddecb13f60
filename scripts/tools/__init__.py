"""The Makefile's internals (check_deps, check_torch, check_install, build_ext: no
dependencies, run as plain files before torch is installed), the GPU check, and the
report: make_report runs the benchmarks and studies, run_notebooks executes the
notebooks, render_results writes the docs' results page."""
