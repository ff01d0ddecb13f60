"""python -m torch_ringreduce.bench: the collective benchmark (cli.py; --help)."""
import sys

from torch_ringreduce.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
