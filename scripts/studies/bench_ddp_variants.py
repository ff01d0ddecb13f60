"""Gradient synchronisation for data parallelism, written out plainly and timed side by side.

    torchrun --nproc_per_node 2 -m scripts.studies.bench_ddp_variants  # small preset, both backends
    python -m scripts.studies.bench_ddp_variants --nproc 2 --preset tiny --bucket-mb 0.05 all
    torchrun --nproc_per_node 2 -m scripts.studies.bench_ddp_variants --device cuda --preset medium

Every variant trains the same decoder-only Transformer language model (token and
position embeddings, pre-norm causal self-attention blocks, a linear head) from
the same seed (--seed) on the same synthetic tokens (rank r's batch of step s is
shard s * world + r), with plain SGD, and averages the gradients its own way
(scripts/studies/_ddp_sync.py, one class each):

    naive           after backward, one blocking all_reduce per parameter gradient
    flat            after backward, one all_reduce of every gradient copied into one buffer
    overlapped      each gradient's async all_reduce launched by its post-accumulate-grad
                    hook while backward goes on; all waited before optimizer.step()
    bucketed_<X>MB  overlapped, but gradients copied (reverse parameter order) into
                    buckets of at most X MiB; a bucket's async all_reduce starts once it
                    is full (--bucket-mb; 'all': one bucket)
    torch_ddp       torch.nn.parallel.DistributedDataParallel (reference)
    ringreduce_ddp  torch_ringreduce.DistributedDataParallel (reference)
    local           no synchronisation: the compute-only floor (its parameters differ)

Each backend of --backends gets its own group (dist.new_group); the default
group (gloo) only holds barriers and gathers results. Per variant, --warmup
steps, then --steps measured steps, each after a barrier. Definitions (also in
the JSON under "definitions"):
"""
import argparse
import ctypes
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from scripts.studies import _ddp_model as lm
from scripts.studies import _ddp_sync as sync
from scripts.studies import _traffic_model as traffic_model
from scripts.training import _train_util as tu
from torch_ringreduce.bench import harness as bu

KIND = "ddp_variants"
DEFAULT_JSON = os.path.join("results", "ddp_variants.json")
MIB = 1 << 20
DEFINITIONS = {
    "step_ms": "zero_grad + forward + backward + gradient synchronisation + optimizer step "
               "(the batch is made before the clock starts); per step the slowest rank",
    "comm_ms": "time the training thread spends inside torch.distributed calls: blocking "
               "all_reduce calls whole, async ones until they return, plus Work.wait() after "
               "backward. naive/flat: the whole collective; overlapped/bucketed: launch cost "
               "plus the communication backward did not hide. Packing, unpacking and dividing "
               "by the world size are compute. Same rank as step_ms. On CUDA the device is "
               "synchronised around blocking calls and after each wait (an upper bound). "
               "null for the DDP references: they wait inside loss.backward() (an autograd "
               "engine callback), not separable from backward",
    "compute_ms": "step_ms - comm_ms (means)",
    "comm_fraction": "comm_ms / step_ms (means)",
    "overhead_ms": "step_ms - the local variant's step_ms: what synchronising costs a step, "
                   "the only split the DDP references have (noisy, may be < 0)",
    "payload_bytes_per_step": "bytes handed to all_reduce per step (DDP references: from a "
                              "comm hook, or from the bucket buffers)",
    "bytes_sent_per_step_closed_form": "our backend's bytes of each all_reduce call of a "
                                       "step by its own size and the algorithm the backend "
                                       "picks for it (scripts/studies/_traffic_model.py: "
                                       "direct, (n-1) x the buffer; the ring's 2*count - b_r "
                                       "- b_(r+1) elements; the two-step's), summed, "
                                       "per rank; max over ranks (bytes_received_per_step_"
                                       "closed_form: the same for bytes received)",
    "bytes_sent_per_step_textbook_ring": "2(n-1)/n of the payload: a ring for every call",
    "bytes_sent_per_step_measured": "ringreduce groups only: torch_ringreduce.traffic(group) "
                                    "bytes_sent delta over the measured steps / steps, max "
                                    "over ranks (and bytes_received); null on other backends",
    "bytes_match_closed_form": "every rank's measured bytes sent and received equal its own "
                               "closed form exactly; null where not measured",
    "peak_memory_bytes": "CPU: peak RSS of the process over the measured steps (VmHWM "
                         "reset through /proc/self/clear_refs: torch_ringreduce.bench.harness."
                         "PeakRss), max "
                         "over ranks; CUDA: torch.cuda.max_memory_allocated",
    "peak_rss_above_start_bytes": "peak RSS over the measured steps minus the RSS before "
                                  "the variant built its model (after freeing what earlier "
                                  "variants left, malloc_trim): model, gradients, buffers "
                                  "and activations; max over ranks",
    "max_abs_diff_vs_naive": "final parameters against the naive variant's on the same "
                             "backend, max over elements and ranks; params_match: "
                             "torch.testing.assert_close(rtol, atol) passes on every rank",
}
__doc__ += "".join(f"\n    {k}: {v}." for k, v in DEFINITIONS.items())

# ------------------------------------------------------------ measuring

def train(spec, ctx, progress):
    """Run one variant; this rank's measurements and final parameters."""
    args, device, world = ctx["args"], ctx["device"], ctx["world"]
    release_memory()
    start_kib = bu.status_kib("VmRSS")  # before the model: what the variant adds shows
    clock = sync.CommClock(device)
    model = lm.build_model(ctx["cfg"], args.seed, device)
    variant = spec[3](model, ctx["group"], clock)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    times = []

    def step(i):
        x, y = lm.make_batch(ctx["cfg"], args.seed, i * world.size + world.rank, device)
        dist.barrier()  # on the control group: every step starts together
        bu.synchronize(device)
        clock.seconds = 0.0
        begin = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lm.loss_of(variant.module, x, y).backward()
        variant.after_backward()
        opt.step()
        bu.synchronize(device)
        times.append((time.perf_counter() - begin, clock.seconds))
        progress.update()

    for i in range(args.warmup):
        step(i)
    meter, first_call = traffic_model.TrafficMeter(ctx["backend"], ctx["group"]), len(clock.calls)
    traffic, times = meter.sample(), []
    tu.reset_peak_memory(device)
    with bu.PeakRss() as rss:  # host memory, on CUDA too
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
    calls = clock.calls[first_call:]
    group = ctx["group"]  # this rank's closed form: the ring's blocks differ by rank
    backend = group._get_backend(torch.device("cpu"))
    transport = backend.transport_kind() if hasattr(backend, "transport_kind") else "shm"
    sent, received = traffic_model.allreduces_bytes(calls, dist.get_world_size(group),
                                                    dist.get_rank(group), transport)
    mine = {"step": [t for t, _ in times], "comm": [c for _, c in times],
            "memory": tu.peak_memory(device),
            "rss_rise": None if rss.peak_kib is None or start_kib is None else
            (rss.peak_kib - start_kib) * 1024,
            "traffic": meter.delta(traffic, meter.sample()), "traffic_error": meter.error,
            "allreduces": len(calls), "payload": sum(c * e for c, e in calls),
            "formula": {"bytes_sent": sent, "bytes_received": received},
            "reference": variant.reference}
    variant.close()
    return mine, lm.flat_params(model)


def release_memory():
    """Free what earlier variants left, back to the kernel where glibc allows it, so
    every variant's peak RSS starts from the same floor."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def check(params, ref, args):
    """(max abs diff, assert_close passes) of this rank's parameters against naive's."""
    if ref is None:
        return None, None
    try:
        torch.testing.assert_close(params, ref, rtol=args.rtol, atol=args.atol)
        ok = True
    except AssertionError:
        ok = False
    return (params - ref).abs().max().item(), ok


def stats(values):
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values),
            "median": statistics.median(values), "min": min(values), "max": max(values)}


def make_row(spec, ranks, ctx):
    """One variant's record from every rank's measurements (gathered)."""
    name, label, bucket_mb, _ = spec
    args, n = ctx["args"], ctx["world"].size
    slowest = [max(range(n), key=lambda r: ranks[r]["step"][s]) for s in range(args.steps)]
    step = [1e3 * ranks[r]["step"][s] for s, r in enumerate(slowest)]
    comm = [1e3 * ranks[r]["comm"][s] for s, r in enumerate(slowest)]
    first, ref = ranks[0], ranks[0]["reference"]
    payload = first["payload"] / args.steps
    ok = None if first["match"] is None else all(r["match"] for r in ranks)
    row = {"variant": name, "label": label, "reference": ref, "bucket_mb": bucket_mb,
           "step_ms": stats(step), "comm_ms": None if ref else stats(comm),
           "compute_ms": None if ref else statistics.fmean(step) - statistics.fmean(comm),
           "comm_fraction": None if ref else statistics.fmean(comm) / statistics.fmean(step),
           "overhead_ms": None, "step_ms_per_step": step,
           "comm_ms_per_step": None if ref else comm,
           "allreduces_per_step": first["allreduces"] / args.steps,
           "payload_bytes_per_step": payload,
           **traffic_fields(ranks, args.steps),
           "bytes_sent_per_step_textbook_ring": 2 * (n - 1) / n * payload,
           "traffic_error": first["traffic_error"],
           "peak_memory_bytes": max(r["memory"][0] for r in ranks),
           "memory_kind": first["memory"][1],
           "peak_rss_above_start_bytes": None if first["rss_rise"] is None else
           max(r["rss_rise"] for r in ranks),
           "max_abs_diff_vs_naive": None if ok is None else max(r["diff"] for r in ranks),
           "params_match": ok}
    if bucket_mb is not None:  # the bucket's size for plotting: 'all' is the whole model
        row["bucket_cap_mib"] = ctx["param_bytes"] / MIB if bucket_mb == "all" else bucket_mb
    return row


def traffic_fields(ranks, steps):
    """Bytes per step by the closed form and as counted, each the max over ranks (the
    busiest rank); they match when every rank's count equals its own closed form."""
    formula, measured = [r["formula"] for r in ranks], [r["traffic"] for r in ranks]
    out = {f"bytes_{k}_per_step_closed_form": max(f[f"bytes_{k}"] for f in formula) / steps
           for k in ("sent", "received")}
    out.update(bytes_sent_per_step_measured=None, bytes_received_per_step_measured=None,
               traffic_ops_per_step=None, bytes_match_closed_form=None)
    if all(m is not None for m in measured):
        for k in ("sent", "received"):
            out[f"bytes_{k}_per_step_measured"] = max(m[f"bytes_{k}"] for m in measured) / steps
        out["traffic_ops_per_step"] = {k: v / steps for k, v in measured[0]["ops"].items()}
        out["bytes_match_closed_form"] = all(
            m[f"bytes_{k}"] == f[f"bytes_{k}"] for m, f in zip(measured, formula)
            for k in ("sent", "received"))
    return out


def run_backend(backend, specs, ctx, progress):
    """Every variant on a new group of `backend`; (rows, {variant: state}) on rank 0."""
    group = dist.new_group(backend=backend)
    ctx = dict(ctx, backend=backend, group=group)
    # One all_reduce of the gradients' size first: the group's one-off set-up
    # (connections, transport buffers) is not charged to the first variant.
    dist.all_reduce(torch.zeros(ctx["param_bytes"] // 4, device=ctx["device"]), group=group)
    rows, saved, ref = [], {}, None
    for spec in specs:
        mine, params = train(spec, ctx, progress)
        if spec[0] == "naive":
            ref = params
        mine["diff"], mine["match"] = check(params, None if spec[0] == "local" else ref,
                                            ctx["args"])
        ranks = [None] * ctx["world"].size
        dist.all_gather_object(ranks, mine)
        row = make_row(spec, ranks, ctx)
        rows.append(row)
        if ctx["args"].save_params:
            saved[spec[0]] = params
        progress.write(f"# {backend} {spec[0]}: step {row['step_ms']['mean']:.1f} ms"
                       + ("" if row["comm_ms"] is None else
                          f", comm {row['comm_ms']['mean']:.1f} ms") +
                       f", params {_verdict(row['params_match'])}")
    local = next((r for r in rows if r["variant"] == "local"), None)
    for row in rows:
        if local and row is not local:
            row["overhead_ms"] = row["step_ms"]["mean"] - local["step_ms"]["mean"]
    dist.destroy_process_group(group)
    return rows, saved


# ------------------------------------------------------------ output

def _verdict(ok):
    return {None: "n/a", True: "pass", False: "FAIL"}[ok]


def _ms(value, spec=".2f"):
    return "n/a" if value is None else format(value, spec)


def _mib(value):
    return "n/a" if value is None else f"{value / MIB:.3f}"


METRICS = [  # (row label, cell of a row)
    ("step ms (mean)", lambda r: _ms(r["step_ms"]["mean"])),
    ("step ms (std)", lambda r: _ms(r["step_ms"]["std"])),
    ("comm ms (mean)", lambda r: _ms(r["comm_ms"] and r["comm_ms"]["mean"])),
    ("comm ms (std)", lambda r: _ms(r["comm_ms"] and r["comm_ms"]["std"])),
    ("compute ms", lambda r: _ms(r["compute_ms"])),
    ("comm fraction", lambda r: _ms(r["comm_fraction"], ".3f")),
    ("overhead vs local ms", lambda r: _ms(r["overhead_ms"])),
    ("all-reduces/step", lambda r: f"{r['allreduces_per_step']:g}"),
    ("payload MiB/step", lambda r: _mib(r["payload_bytes_per_step"])),
    ("sent MiB/step formula", lambda r: _mib(r["bytes_sent_per_step_closed_form"])),
    ("sent MiB/step measured", lambda r: _mib(r["bytes_sent_per_step_measured"])),
    ("bytes = formula", lambda r: _verdict(r["bytes_match_closed_form"])),
    ("peak memory MiB", lambda r: f"{r['peak_memory_bytes'] / MIB:.0f}"),
    ("peak RSS - start MiB", lambda r: _ms(r["peak_rss_above_start_bytes"] and
                                           r["peak_rss_above_start_bytes"] / MIB, ".1f")),
    ("max |diff| vs naive", lambda r: _ms(r["max_abs_diff_vs_naive"], ".1e")),
    ("params match naive", lambda r: _verdict(r["params_match"])),
]


def table(backend, rows, doc):
    """A row per metric, a column per variant."""
    width = max(9, *(len(r["label"]) + 1 for r in rows))
    first = 24
    lines = [f"# {backend}: {doc['label']}; times per step, slowest rank; comm n/a: not "
             "separable (DDP references); 'local' syncs nothing",
             f"{'metric':<{first}}" + "".join(f"{r['label']:>{width}}" for r in rows)]
    for label, cell in METRICS:
        lines.append(f"{label:<{first}}" + "".join(f"{cell(r):>{width}}" for r in rows))
    errors = sorted({r["traffic_error"] for r in rows if r["traffic_error"]})
    lines += [f"# traffic not measured: {e}" for e in errors]
    return "\n".join(lines)


def environment(world, args, device):
    env = bu.environment(world)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else tu._cpu_model()
    ranks = [None] * world.size
    dist.all_gather_object(ranks, {"rank": world.rank, "hostname": env["hostname"],
                                   "device": str(device), "device_name": name})
    env.update(backends=args.backends, device=args.device, ranks=ranks,
               device_names=sorted({r["device_name"] for r in ranks}),
               hosts=sorted({r["hostname"] for r in ranks}))
    return env


def model_config(args):
    return {k: getattr(args, k) for k in lm.MODEL_KEYS}


# ------------------------------------------------------------ driver

def describe(world, args, device, sample):
    """The JSON document, before any result: environment, arguments, configuration."""
    cfg, count = model_config(args), sum(p.numel() for p in sample.parameters())
    doc = {"kind": KIND, "environment": environment(world, args, device), "args": vars(args),
           "definitions": DEFINITIONS,
           "config": {"model": {**cfg, "preset": args.preset, "parameters": count,
                                "parameter_bytes": 4 * count,
                                "tensors": len(list(sample.parameters()))},
                      "world_size": world.size, "tokens_per_step": world.size * cfg["batch"] *
                      cfg["seq_len"], "seed": args.seed, "lr": args.lr,
                      "warmup": args.warmup, "steps": args.steps,
                      "bucket_mb": args.bucket_mb, "ddp_bucket_mb": args.ddp_bucket_mb},
           "backends": {}}
    doc["label"] = (f"{args.preset}{'' if args.preset_exact else ' (modified)'} LM, "
                    f"{count / 1e6:.2f} M parameters, {world.size} ranks, {args.device}")
    return doc


def worker(world, args):
    hint = bu.import_ringreduce()
    if hint and ("ringreduce" in args.backends or "ringreduce_ddp" in args.variants):
        raise SystemExit(f"{KIND}: {hint}; run `make build`")
    torch.set_num_threads(args.threads)
    bu.init_default_group(world, "gloo", args.timeout, args.device)
    device, cfg = bu.tensor_device(args.device), model_config(args)
    sample = lm.build_model(cfg, args.seed)
    doc = describe(world, args, device, sample)
    # One untimed step first: the process's one-off costs (thread pools, kernel caches,
    # the optimizer's first-use imports, ~70 MiB) would otherwise go to the first variant.
    sample = sample.to(device)
    lm.loss_of(sample, *lm.make_batch(cfg, args.seed, 0, device)).backward()
    torch.optim.SGD(sample.parameters(), lr=args.lr).step()
    del sample
    specs = sync.variant_specs(args.variants, args.bucket_mb, args.ddp_bucket_mb, device)
    progress = bu.Progress(len(args.backends) * len(specs) * (args.warmup + args.steps),
                           KIND, enabled=world.rank == 0)
    progress.write(f"# {KIND}: {doc['label']}, batch {cfg['batch']} x {cfg['seq_len']} tokens "
                   f"per rank, {args.warmup} + {args.steps} steps per variant")
    ctx = {"args": args, "world": world, "device": device, "cfg": cfg,
           "param_bytes": doc["config"]["model"]["parameter_bytes"]}
    saved = {}
    for backend in args.backends:
        rows, saved[backend] = run_backend(backend, specs, ctx, progress)
        doc["backends"][backend] = {"variants": rows}
    progress.close()
    failed = any(r["params_match"] is False for b in doc["backends"].values()
                 for r in b["variants"])
    if world.rank == 0:
        for backend, record in doc["backends"].items():
            print(table(backend, record["variants"], doc), flush=True)
        if args.json:
            tu.write_json(args.json, doc)
            print(f"# results written to {args.json}", flush=True)
        if args.save_params:
            torch.save({"config": doc["config"], "params": saved}, args.save_params)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


def _bucket_mb(text):
    if text == "all":
        return text
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"bucket size must be > 0 MiB or 'all', got {text}")
    return int(value) if value.is_integer() else value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="default: ringreduce gloo; with --device cuda: nccl ringreduce gloo")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--variants", nargs="+", default=list(sync.VARIANTS), choices=sync.VARIANTS,
                   help="scripts/studies/_ddp_sync.py has one class per variant")
    p.add_argument("--bucket-mb", nargs="+", type=_bucket_mb, default=[1, 10, 100, 1000, "all"],
                   help="bucket sizes of the bucketed variant, MiB, or 'all' (one bucket)")
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0, help="bucket_cap_mb of the DDPs")
    p.add_argument("--preset", choices=list(lm.PRESETS), default="small",
                   help="model size; the flags below override it")
    for key in lm.MODEL_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help="per rank" if key == "batch" else None)
    p.add_argument("--warmup", type=int, default=3,
                   help="unmeasured steps; >= 2 lets torch DDP settle (its second step "
                        "rebuilds the buckets and broadcasts their order)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per variant")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=1.3e-6, help="parameter check")
    p.add_argument("--atol", type=float, default=1e-5, help="parameter check")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=300, help="group timeout in seconds")
    p.add_argument("--json", default=DEFAULT_JSON, help="results file ('' for none)")
    p.add_argument("--save-params", default="", metavar="PATH",
                   help="rank 0 saves every variant's final parameters (flat, per backend)")
    args = p.parse_args(argv)
    preset = lm.PRESETS[args.preset]
    args.preset_exact = all(getattr(args, k) in (None, preset[k]) for k in lm.MODEL_KEYS)
    for key in lm.MODEL_KEYS:
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1, --warmup >= 0")
    if args.backends is None:
        args.backends = (["nccl"] if args.device == "cuda" else []) + ["ringreduce", "gloo"]
    if "nccl" in args.backends and args.device != "cuda":
        p.error("--backends nccl needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if "naive" in args.variants:  # the reference of the parameter check runs first
        args.variants = ["naive"] + [v for v in args.variants if v != "naive"]
    return args


def main(argv=None):
    args = parse_args(argv)
    return bu.run_ranks(worker, args, 0 if bu.launched_by_torchrun() else args.nproc)


if __name__ == "__main__":
    sys.exit(main())
