"""The data-parallel studies of ML-systems courses (docs/studies.md): tree against ring,
DDP variants, training paradigms, ordered printing."""
