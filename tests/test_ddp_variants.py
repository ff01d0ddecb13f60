"""scripts/studies/bench_ddp_variants.py under torchrun: every gradient synchronisation strategy
reaches the parameters of single-process SGD on the concatenated batch, and on
ringreduce each rank moves exactly the bytes of our backend's closed forms.

One 3-rank torchrun job on the tiny preset (module fixture): every variant, the
bucketed one at 0.02 MiB (several buckets of the ~170 KB model) and 'all' (one).
Three ranks, not two: only for n > 2 does the direct all-reduce of buffers up to
16 KiB ((n-1) x the buffer) differ from the ring (2(n-1)/n x), and the tiny
model has both (biases and LayerNorm weights; 4096-element weights exactly at
16 KiB; larger matrices), and 42368 parameters, uneven ring blocks on 3 ranks.
The oracle is computed here, in this process, from the script's own model and
data (build_model, make_batch): the same seed, the ranks' shards concatenated.
"""
import json
import subprocess
import sys

import pytest
import torch

from scripts import module_env
from scripts.studies import _ddp_model as lm
from scripts.studies import _traffic_model as traffic_model

MODULE = "scripts.studies.bench_ddp_variants"

NPROC = 3
TIMEOUT_S = 180
# Two warm-up steps: torch DDP's second step broadcasts its rebuilt bucket order.
FLAGS = ["--preset", "tiny", "--warmup", "2", "--steps", "3", "--bucket-mb", "0.02", "all"]
SYNCED = ["naive", "flat", "overlapped", "bucketed_0.02MB", "bucketed_all", "torch_ddp"]


@pytest.fixture(scope="module")
def run(backend, tmp_path_factory):
    """(JSON document, {variant: final flat parameters}) of one torchrun job."""
    folder = tmp_path_factory.mktemp("ddp_variants")
    out, params = folder / "ddp_variants.json", folder / "params.pt"
    # Our DDP wrapper needs the extension; a gloo-only run (RR_TEST_BACKEND=gloo) skips it.
    ours = ["ringreduce_ddp"] if "ringreduce" in backend else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(NPROC), "-m", MODULE, *FLAGS, "--backends", backend, "--json", str(out),
           "--save-params", str(params), "--variants", "naive", "flat", "overlapped",
           "bucketed", "torch_ddp", *ours, "local"]
    proc = subprocess.run(cmd, cwd=folder, env=module_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (f"torchrun exited with {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    with open(out) as f:
        doc = json.load(f)
    saved = torch.load(params, weights_only=True)
    return doc, saved["params"][backend]


def _rows(doc):
    (record,) = doc["backends"].values()
    return {r["variant"]: r for r in record["variants"]}


def _synced(backend):
    return SYNCED + (["ringreduce_ddp"] if "ringreduce" in backend else [])


def single_process_sgd(config):
    """The oracle: one model, SGD on every rank's shard of each step at once."""
    cfg, seed, n = config["model"], config["seed"], config["world_size"]
    model = lm.build_model(cfg, seed)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for step in range(config["warmup"] + config["steps"]):
        xs, ys = zip(*(lm.make_batch(cfg, seed, step * n + r) for r in range(n)))
        opt.zero_grad()
        lm.loss_of(model, torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
    return lm.flat_params(model), lm.flat_params(lm.build_model(cfg, seed))


def test_every_variant_equals_single_process_sgd(run, backend):
    doc, params = run
    want, initial = single_process_sgd(doc["config"])
    assert (want - initial).abs().max() > 1e-3, "the oracle did not train"
    for name in _synced(backend):
        torch.testing.assert_close(params[name], want, msg=lambda m, name=name: f"{name}: {m}")
    # Without synchronisation the ranks drift apart: the comparison can fail.
    assert (params["local"] - want).abs().max() > 1e-3


def test_json_reports_every_variant_matching_naive(run, backend):
    doc, _ = run
    rows = _rows(doc)
    assert doc["kind"] == "ddp_variants"
    assert list(rows) == _synced(backend) + ["local"]
    for name in _synced(backend):
        assert rows[name]["params_match"] is True, rows[name]
        assert rows[name]["max_abs_diff_vs_naive"] <= doc["args"]["atol"]
    assert rows["local"]["params_match"] is None and rows["local"]["overhead_ms"] is None


def test_json_records_setup_times_and_collectives(run, backend):
    doc, _ = run
    rows, config, env = _rows(doc), doc["config"], doc["environment"]
    assert env["world_size"] == NPROC and env["backends"] == [backend]
    assert env["torch"] == torch.__version__ and len(env["ranks"]) == NPROC
    assert config["model"]["preset"] == "tiny" and config["steps"] == 3
    tensors, nbytes = config["model"]["tensors"], config["model"]["parameter_bytes"]
    buckets = rows["bucketed_0.02MB"]["allreduces_per_step"]
    assert 2 < buckets < tensors, "0.02 MiB should cut the tiny model into several buckets"
    want = {"naive": tensors, "flat": 1, "overlapped": tensors, "bucketed_all": 1, "local": 0}
    assert {k: rows[k]["allreduces_per_step"] for k in want} == want
    for name in SYNCED:
        row = rows[name]
        assert row["payload_bytes_per_step"] == nbytes, name
        assert len(row["step_ms_per_step"]) == 3 and row["step_ms"]["mean"] > 0
        assert row["peak_memory_bytes"] > 0
        if name == "torch_ddp":  # waits inside backward: no separate comm time
            assert row["comm_ms"] is None and row["comm_fraction"] is None
        else:
            assert 0 < row["comm_ms"]["mean"] < row["step_ms"]["mean"], name
            assert 0 < row["comm_fraction"] < 1
            assert row["compute_ms"] > 0


def _closed_form(sizes, n):
    """Max over ranks of (sent, received) for all_reduces of `sizes` float32 elements."""
    per_rank = [traffic_model.allreduces_bytes([(c, 4) for c in sizes], n, r) for r in range(n)]
    return max(s for s, _ in per_rank), max(r for _, r in per_rank)


def test_closed_form_counts_each_call_by_its_size(run):
    doc, _ = run
    rows, config = _rows(doc), doc["config"]
    sizes = [p.numel() for p in lm.build_model(config["model"], config["seed"]).parameters()]
    per_param, one_buffer = _closed_form(sizes, NPROC), _closed_form([sum(sizes)], NPROC)
    for name, want in (("naive", per_param), ("overlapped", per_param),
                       ("flat", one_buffer), ("bucketed_all", one_buffer)):
        row = rows[name]
        got = row["bytes_sent_per_step_closed_form"], row["bytes_received_per_step_closed_form"]
        assert got == want, name
    # The direct path of the small gradients costs more than a ring would.
    assert per_param[0] > rows["naive"]["bytes_sent_per_step_textbook_ring"]
    assert rows["local"]["bytes_sent_per_step_closed_form"] == 0


def test_ringreduce_bytes_equal_the_closed_form(run, backend):
    if "ringreduce" not in backend:
        pytest.skip(f"traffic counters are ringreduce's; the backend under test is {backend}")
    import torch_ringreduce

    if not hasattr(torch_ringreduce, "traffic"):
        pytest.skip("torch_ringreduce has no traffic(): built before the traffic counters")
    rows = _rows(run[0])
    for name in _synced(backend) + ["local"]:
        row = rows[name]
        assert row["traffic_error"] is None, row["traffic_error"]
        assert row["bytes_match_closed_form"] is True, (name, row)  # every rank, exactly
        for k in ("sent", "received"):
            assert row[f"bytes_{k}_per_step_measured"] == \
                row[f"bytes_{k}_per_step_closed_form"], (name, k)
        want = {"all_reduce": row["allreduces_per_step"]} if name != "local" else {}
        assert row["traffic_ops_per_step"] == want, name
    assert rows["local"]["bytes_sent_per_step_measured"] == 0
