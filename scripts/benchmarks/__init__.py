"""Benchmarks beside the installed collective benchmark (python -m torch_ringreduce.bench):
several hosts in network namespaces, fresh launches, latency against another build,
SyncBatchNorm, training throughput against gloo, and the every-collective demo."""
