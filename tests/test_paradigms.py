"""scripts/studies/paradigms.py: centralised, serverless, parameter-server and federated SGD.

The trainers run on live worlds of the backend under test (the `worlds` pool of
conftest.py) with a tiny synthetic set, and are compared with single-process SGD
computed here: the parameter server equals serverless SGD with as many gradient
workers, serverless equals centralised SGD on the concatenated batch, FedAvg with
one client and one local step equals one SGD step. The bytes the backend counts
(torch_ringreduce.traffic) equal the closed forms exactly (skipped where there
are no counters, e.g. on gloo). The client splits are checked in closed form.
One small torchrun job of the script checks its JSON and table end to end.
"""
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from scripts import module_env
from scripts.studies import _paradigms_bytes as pbytes
from scripts.studies import _paradigms_data as pdata
from scripts.studies import _paradigms_train as ptrain
from scripts.studies import _traffic_model as traffic_model
from scripts.studies import paradigms

MODULE = "scripts.studies.paradigms"

TIMEOUT_S = 240
# 240 samples -> 192 training; 2 epochs of 3 steps of 24; momentum and weight decay
# make the comparisons cover the optimizer state too. --hidden 127: P = 5471, above
# 16 KiB (the ring) and divisible by neither 2 nor 3 (uneven ring blocks).
TINY = ["--dataset", "synthetic", "--samples", "240", "--epochs", "2", "--batch-size", "24",
        "--max-steps", "3", "--lr", "0.2", "--momentum", "0.5", "--weight-decay", "0.001",
        "--hidden", "127"]
DIRECT = TINY + ["--model", "logreg"]  # 330 parameters: the direct all_reduce
# One client, one round, one local step on the client's whole data.
FED_ONE_STEP = TINY + ["--rounds", "1", "--local-epochs", "1", "--max-local-steps", "1",
                       "--local-batch-size", "100000"]
FED = TINY + ["--rounds", "2", "--local-epochs", "2", "--max-local-steps", "2",
              "--split", "dirichlet"]


def _setup(argv):
    args = paradigms.parse_args(argv)
    return args, pdata.load_dataset(args.dataset, args.seed, args.test_fraction, args.samples)


def train_remote(ctx, paradigm, argv):
    """Remote: train on the default group (the backend under test) with its counters reset;
    {'params' (rank 0), 'traffic', 'note'}."""
    args, data = _setup(argv)
    note = pbytes.reset()
    dist.barrier(group=ctx.oracle)  # every rank has reset before anyone sends
    if paradigm == "fedavg":
        parts = pdata.client_splits(data.y_train, ctx.world_size - 1, args.split[0], args.seed,
                                    args.alpha, args.shards_per_client)
        model, _ = ptrain.train_fedavg(args, data, ctx.rank, ctx.world_size, parts)
    else:
        model, _ = ptrain.TRAINERS[paradigm](args, data, ctx.rank, ctx.world_size)
    traffic = None if note else pbytes.measure()
    dist.barrier(group=ctx.oracle)
    return {"params": pdata.flat_params(model) if ctx.rank == 0 else None,
            "traffic": traffic, "note": note}


@pytest.fixture(scope="module")
def trained(worlds):
    """{(paradigm, world size, config): per-rank results}, each run once."""
    runs = {("serverless", 2, "tiny"): TINY, ("serverless", 3, "tiny"): TINY,
            ("serverless", 3, "direct"): DIRECT, ("ps", 3, "tiny"): TINY,
            ("ps", 2, "tiny"): TINY, ("fedavg", 2, "one-step"): FED_ONE_STEP,
            ("fedavg", 3, "fed"): FED}
    return {key: worlds.run(key[1], train_remote, key[0], argv, timeout=TIMEOUT_S)
            for key, argv in runs.items()}


def _centralised(argv):
    args, data = _setup(argv)
    model, _ = ptrain.train_centralised(args, data, 0, 1)
    return pdata.flat_params(model)


def _initial(argv):
    args, data = _setup(argv)
    return pdata.flat_params(pdata.build_model(args.model, data.features, data.classes,
                                               args.hidden, args.seed))


# ------------------------------------------------------------------ equivalences

def test_parameter_server_equals_serverless_with_as_many_workers(trained):
    # ps on 3 ranks: 2 workers average 2 shard gradients, as serverless on 2 ranks does.
    ps = trained[("ps", 3, "tiny")][0]["params"]
    torch.testing.assert_close(ps, trained[("serverless", 2, "tiny")][0]["params"])
    assert (ps - _initial(TINY)).abs().max() > 1e-3, "the model did not train"


def test_serverless_equals_centralised_on_the_concatenated_batch(trained):
    want = _centralised(TINY)
    for n in (2, 3):
        torch.testing.assert_close(trained[("serverless", n, "tiny")][0]["params"], want)
    torch.testing.assert_close(trained[("ps", 2, "tiny")][0]["params"], want)  # one worker
    torch.testing.assert_close(trained[("serverless", 3, "direct")][0]["params"],
                               _centralised(DIRECT))


def test_fedavg_one_client_one_step_equals_one_sgd_step(trained):
    args, data = _setup(FED_ONE_STEP)
    model = pdata.build_model(args.model, data.features, data.classes, args.hidden, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    F.cross_entropy(model(data.x_train), data.y_train).backward()  # the client's whole data
    opt.step()
    torch.testing.assert_close(trained[("fedavg", 2, "one-step")][0]["params"],
                               pdata.flat_params(model))


def test_written_out_sgd_equals_torch_sgd():
    for momentum, decay in ((0.0, 0.0), (0.9, 0.0), (0.5, 0.01)):
        ours = pdata.build_model("mlp", 8, 3, hidden=5, seed=1)
        theirs = pdata.build_model("mlp", 8, 3, hidden=5, seed=1)
        opts = (ptrain.SGD(ours.parameters(), lr=0.1, momentum=momentum, weight_decay=decay),
                torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=momentum,
                                weight_decay=decay))
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 3, (6,), generator=gen)
            for model, opt in zip((ours, theirs), opts):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        torch.testing.assert_close(pdata.flat_params(ours), pdata.flat_params(theirs))


# ------------------------------------------------------------------ bytes

BYTE_CASES = [(("serverless", 2, "tiny"), TINY), (("serverless", 3, "tiny"), TINY),
              (("serverless", 3, "direct"), DIRECT), (("ps", 3, "tiny"), TINY),
              (("ps", 2, "tiny"), TINY), (("fedavg", 2, "one-step"), FED_ONE_STEP),
              (("fedavg", 3, "fed"), FED)]


@pytest.mark.parametrize("key,argv", BYTE_CASES, ids=lambda v: "-".join(map(str, v))
                         if isinstance(v, tuple) else None)
def test_measured_bytes_equal_closed_forms(trained, key, argv):
    results = trained[key]
    if results[0]["note"]:
        pytest.skip(f"no traffic counters on this backend: {results[0]['note']}")
    paradigm, n, _ = key
    args, data = _setup(argv)
    params = pdata.parameter_count(pdata.build_model(args.model, data.features, data.classes,
                                                     args.hidden, args.seed))
    steps = args.epochs * ptrain.steps_per_epoch(args, len(data.y_train))
    want = pbytes.formula(paradigm, params, 4, n, steps=steps, rounds=args.rounds)
    got = pbytes.gathered([r["traffic"] for r in results])
    assert got == want, f"{key}: measured {got} != closed form {want}"


def test_the_cases_cover_both_allreduce_algorithms():
    for argv, algorithm in ((TINY, "two_step"), (DIRECT, "direct")):
        args, data = _setup(argv)
        params = pdata.parameter_count(pdata.build_model(
            args.model, data.features, data.classes, args.hidden, args.seed))
        assert pbytes.allreduce_algorithm(4 * params, 3) == algorithm
        if algorithm == "two_step":
            assert params % 2 and params % 3, "uneven slices on 2 and 3 ranks"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("count", [0, 1, 7, 4096, 5471, 300001])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_and_two_step_bytes_sum_to_the_textbook_total(count, n, transport):
    blocks = traffic_model.even_blocks(count, n)
    assert sum(blocks) == count and max(blocks) - min(blocks) <= (1 if count else 0)
    if traffic_model.allreduce_algorithm(4 * count, n, transport) not in ("ring", "two_step"):
        return
    per_rank = [traffic_model.allreduce_bytes(count, 4, n, r, transport) for r in range(n)]
    total = 2 * (n - 1) * count * 4  # sum over ranks of 2(N-1)/N * P * e
    assert sum(s for s, _ in per_rank) == total == sum(r for _, r in per_rank)


@pytest.mark.parametrize("count", [0, 1, 7, 5471])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_traffic_model_blocks_are_the_backends(count, n):
    C = pytest.importorskip("torch_ringreduce._C")
    want = [C._even_block(count, n, i)[1] for i in range(n)]  # (offset, count)
    assert traffic_model.even_blocks(count, n) == want


@pytest.mark.parametrize("transport,n,limit_bytes", [
    ("tcp", 3, traffic_model.DIRECT_ALLREDUCE_BYTES),
    ("shm", 2, traffic_model.DIRECT_SHARED_2_BYTES),
    ("shm", 3, traffic_model.DIRECT_SHARED_BYTES)])
def test_direct_allreduce_up_to_its_limit_inclusive(transport, n, limit_bytes):
    limit = limit_bytes // 4
    assert traffic_model.allreduce_bytes(limit, 4, n, 0, transport) == ((n - 1) * 4 * limit,) * 2
    assert traffic_model.allreduce_algorithm(4 * (limit + 1), n, transport) != "direct"
    assert traffic_model.allreduce_bytes(limit + 1, 4, 1, 0, transport) == (0, 0)


def test_traffic_model_thresholds_are_the_backends():
    C = pytest.importorskip("torch_ringreduce._C")
    if not hasattr(C, "_choose_allreduce"):
        pytest.skip("this build has no _choose_allreduce")
    for transport in ("tcp", "shm"):
        for n in (2, 3, 4):
            for nbytes in (0, 4096, 4100, 16384, 16388, 131072, 131076, 1 << 22):
                want = traffic_model.allreduce_algorithm(nbytes, n, transport)
                got = C._choose_allreduce(nbytes, n, transport == "shm", "auto")
                assert got == want, (transport, n, nbytes, got)


# ------------------------------------------------------------------ client splits

def _labels():
    name = "digits" if importlib.util.find_spec("sklearn") else "synthetic"
    return pdata.load_dataset(name, seed=0).y_train.numpy()


@pytest.mark.parametrize("clients", [1, 3, 7])
@pytest.mark.parametrize("kind", pdata.SPLITS)
def test_every_sample_is_assigned_to_exactly_one_client(kind, clients):
    labels = _labels()
    parts = pdata.client_splits(labels, clients, kind, seed=0)
    assert len(parts) == clients
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    counts = np.array(pdata.label_counts(labels, parts, 10))
    assert np.array_equal(counts.sum(axis=0), np.bincount(labels, minlength=10))


@pytest.mark.parametrize("clients", [2, 3, 7])
def test_iid_split_is_near_uniform(clients):
    labels = _labels()
    parts = pdata.client_splits(labels, clients, "iid", seed=0)
    counts = np.array(pdata.label_counts(labels, parts, 10))
    per_label = np.bincount(labels, minlength=10) / clients
    assert np.all(np.abs(counts - per_label) < 1), counts  # floor or ceil of n_label / K
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def _max_total_variation(labels, parts):
    counts = np.array(pdata.label_counts(labels, parts, 10), dtype=float)
    mine = counts / counts.sum(axis=1, keepdims=True)
    overall = np.bincount(labels, minlength=10) / len(labels)
    return 0.5 * np.abs(mine - overall).sum(axis=1).max()


def test_non_iid_splits_are_label_skewed():
    labels = _labels()
    iid = _max_total_variation(labels, pdata.client_splits(labels, 3, "iid", seed=0))
    assert iid < 3 * 10 / len(labels)  # each count within one of n_label / K
    for alpha in (0.1, 0.5):
        parts = pdata.client_splits(labels, 3, "dirichlet", seed=0, alpha=alpha)
        assert _max_total_variation(labels, parts) > 0.2
    # Shards are contiguous in label order: a shard of s samples spans at most
    # floor((s - 2) / m) + 2 labels (m: the rarest label's count).
    for per_client in (1, 2):
        parts = pdata.client_splits(labels, 3, "shards", seed=0, shards_per_client=per_client)
        shard = -(-len(labels) // (3 * per_client))
        bound = per_client * ((shard - 2) // np.bincount(labels).min() + 2)
        spans = [len(np.unique(labels[p])) for p in parts]
        assert max(spans) <= min(bound, 9), (spans, bound)


def test_dirichlet_split_needs_every_client_to_get_data():
    with pytest.raises(ValueError, match="some client got no sample"):  # 2 samples, 3 clients
        pdata.client_splits(np.zeros(2, dtype=np.int64), 3, "dirichlet", seed=0)


# ------------------------------------------------------------------ launch and script

def test_mpirun_variables_give_the_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    world, launcher = paradigms.launcher_world()
    assert (world.rank, world.size, world.local_rank, launcher) == (2, 4, 0, "mpirun")


@pytest.fixture(scope="module")
def script_run(backend, tmp_path_factory):
    """One 3-rank torchrun job of the script on every paradigm; (JSON doc, stdout).
    Synthetic data: scikit-learn's import would cost each rank seconds (digits is
    loaded in this process by the split tests)."""
    folder = tmp_path_factory.mktemp("paradigms")
    out = folder / "paradigms.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "3", "-m", MODULE, "--backend", backend, "--dataset", "synthetic", "--epochs", "2",
           "--max-steps", "3", "--rounds", "2", "--max-local-steps", "2", "--split", "iid",
           "shards", "--no-progress", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=module_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (f"torchrun exited with {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text()), proc.stdout


def test_script_writes_every_paradigm_with_curves_and_bytes(script_run, backend):
    doc, stdout = script_run
    assert doc["kind"] == "paradigms"
    env = doc["environment"]
    assert (env["backend"], env["world_size"], env["launcher"]) == (backend, 3, "torchrun")
    assert env["torch"] == torch.__version__ and env["cpu_count"] and env["hostname"]
    runs = doc["paradigms"]
    assert list(runs) == ["centralised", "serverless", "ps", "fedavg-iid", "fedavg-shards"]
    for name, rec in runs.items():
        unit, count = ("round", 2) if rec["paradigm"] == "fedavg" else ("epoch", 2)
        assert [p[unit] for p in rec["curve"]] == list(range(count + 1)), name
        assert 0 <= rec["accuracy"] <= 1 and rec["accuracy"] == rec["curve"][-1]["test_acc"]
        b = rec["bytes"]
        assert b["formula_text"] and len(b["formula"]["sent"]) == 3
        if b["measured"] is None:
            assert backend != "ringreduce" or "traffic" in b["measured_note"], b
        else:
            assert b["matches"] is True, (name, b)
    for label in ("metric", "test accuracy (%)", "bytes match formula"):
        assert label in stdout


def test_script_records_label_distributions(script_run):
    doc, _ = script_run
    dist_ = doc["label_distribution"]
    assert set(dist_) == set(pdata.SPLITS)
    for kind, counts in dist_.items():
        assert len(counts) == 2 and all(len(c) == doc["data"]["classes"] for c in counts)
        assert np.array_equal(np.sum(counts, axis=0), doc["data"]["train_label_counts"]), kind
        assert [sum(c) for c in counts] == doc["clients"]["sizes"][kind]


def _describe_run(tmp_path, *extra):
    cmd = [sys.executable, "-m", MODULE, "--nproc", "3", "--dataset", "synthetic",
           "--samples", "100", "--shards-per-client", "50", "--epochs", "1", "--max-steps", "2",
           "--rounds", "1", "--max-local-steps", "1", "--no-progress",
           "--json", str(tmp_path / "p.json"), *extra]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=module_env(OMP_NUM_THREADS="1"))


def test_a_split_no_run_trains_on_need_not_fit(tmp_path):
    """The JSON describes every split; one whose settings do not fit the data
    stopped runs that never train on it (--paradigm serverless with too many
    shards per client; found by review). It is left out with its reason; a
    split a run trains on still raises."""
    proc = _describe_run(tmp_path, "--paradigm", "serverless")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "p.json").read_text())
    assert set(doc["label_distribution"]) == {"iid", "dirichlet"}
    assert "lower --shards-per-client" in doc["clients"]["splits_not_built"]["shards"]
    proc = _describe_run(tmp_path, "--paradigm", "fedavg", "--split", "shards")
    assert proc.returncode != 0 and "lower --shards-per-client" in proc.stderr, proc.stderr[-3000:]
