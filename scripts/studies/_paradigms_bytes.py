"""Bytes each rank moves in each paradigm: the closed forms, and the backend's count.

P parameters of e bytes (float32: e = 4), N processes, S optimizer steps of the
global model, R FedAvg rounds; payload bytes only (message headers not counted),
per rank, for the whole run:

  centralised  0 (one process, no communication).
  serverless   one dist.all_reduce of the P-element gradient per step; the bytes
               of one are _traffic_model.allreduce_bytes, for the algorithm our
               backend picks by size and transport (_traffic_model.allreduce_algorithm:
               direct, (N-1)*P*e; the ring, (2P - b_r - b_{r+1})*e sent and
               (2P - b_{r-1} - b_r)*e received, b_i the even split of P into N blocks;
               the two-step on shared memory, the same 2(N-1)/N*P*e when N divides P).
               Total: S times that.
  ps           per step each worker sends its gradient (P*e) to the server and
               receives the parameters (P*e); the server receives (N-1)*P*e and
               sends (N-1)*P*e. Total: S times that.
  fedavg       per round each client sends its model and its sample count as one
               (P+1)-element message ((P+1)*e) and receives the global model (P*e);
               the server receives (N-1)*(P+1)*e and sends (N-1)*P*e. Total: R
               times that.

`measure` reads torch_ringreduce.traffic() (None where the group is not
ringreduce or the extension has no traffic counters, with the reason).
"""
from scripts.studies._traffic_model import (allreduce_algorithm, allreduce_bytes,
                                             textbook_allreduce_bytes)

TEXT = {
    "centralised": "0: one process, no communication",
    "serverless": "per rank, S steps of one all_reduce of P*e bytes, by the algorithm the "
                  "backend picks for that size and transport: the ring sends "
                  "(2P - b_r - b_{r+1})*e and receives (2P - b_{r-1} - b_r)*e per step, b_i "
                  "the even split of P into N blocks (= 2(N-1)/N * P*e when N divides P, as "
                  "the two-step on shared memory); direct sends and receives (N-1)*P*e",
    "ps": "per step: each worker sends P*e and receives P*e; the server (rank 0) "
          "receives (N-1)*P*e and sends (N-1)*P*e; times S steps",
    "fedavg": "per round: each client sends (P+1)*e (its model and its sample count) and "
              "receives P*e; the server (rank 0) receives (N-1)*(P+1)*e and sends "
              "(N-1)*P*e; times R rounds",
}


def _serverless(p, e, n, steps):
    per_rank = [allreduce_bytes(p, e, n, r) for r in range(n)]
    return ([steps * s for s, _ in per_rank], [steps * r for _, r in per_rank],
            [{"all_reduce": steps} if steps else {} for _ in range(n)])


def _ps(p, e, n, steps):
    k = n - 1  # workers
    sent = [steps * k * p * e] + [steps * p * e] * k
    ops = [{"recv": steps * k, "send": steps * k}] + [{"recv": steps, "send": steps}] * k
    return sent, list(sent), [{} if not steps else o for o in ops]


def _fedavg(p, e, n, rounds):
    k = n - 1  # clients
    sent = [rounds * k * p * e] + [rounds * (p + 1) * e] * k
    received = [rounds * k * (p + 1) * e] + [rounds * p * e] * k
    ops = [{"recv": rounds * k, "send": rounds * k}] + [{"recv": rounds, "send": rounds}] * k
    return sent, received, [{} if not rounds else o for o in ops]


def formula(paradigm, params, elem, world_size, steps=0, rounds=0):
    """{'sent', 'received', 'ops'} per rank (lists indexed by rank) by the closed forms."""
    n = world_size
    if paradigm == "centralised":
        sent, received, ops = [0] * n, [0] * n, [{} for _ in range(n)]
    elif paradigm == "serverless":
        sent, received, ops = _serverless(params, elem, n, steps)
    elif paradigm == "ps":
        sent, received, ops = _ps(params, elem, n, steps)
    elif paradigm == "fedavg":
        sent, received, ops = _fedavg(params, elem, n, rounds)
    else:
        raise ValueError(f"unknown paradigm {paradigm!r}")
    return {"sent": sent, "received": received, "ops": ops}


def record(paradigm, params, elem, world_size, measured, note, steps=0, rounds=0):
    """The JSON's "bytes" block: measured and closed form side by side, per rank."""
    closed = formula(paradigm, params, elem, world_size, steps, rounds)
    algorithm = {"centralised": "none", "ps": "send/recv", "fedavg": "send/recv",
                 "serverless": allreduce_algorithm(params * elem, world_size)}[paradigm]
    matches = None
    if measured is not None:
        matches = all(measured[k] == closed[k] for k in ("sent", "received", "ops"))
    out = {"measured": measured, "formula": closed, "formula_text": TEXT[paradigm],
           "matches": matches, "algorithm": algorithm, "parameters": params,
           "bytes_per_element": elem, "world_size": world_size, "steps": steps,
           "rounds": rounds}
    if paradigm == "serverless":
        out["textbook_ring_per_rank"] = steps * textbook_allreduce_bytes(params, elem,
                                                                        world_size)
    if measured is None:
        out["measured_note"] = note
    return out


# ------------------------------------------------------------------ the backend's count

def traffic_api():
    """(traffic, reset_traffic) of torch_ringreduce, or (None, reason)."""
    try:
        import torch_ringreduce

        return (torch_ringreduce.traffic, torch_ringreduce.reset_traffic), ""
    except (ImportError, AttributeError) as err:
        return None, f"torch_ringreduce has no traffic counters ({type(err).__name__}: {err})"


def reset(group=None):
    """Zero this rank's counters on `group`; '' when counted, else why not."""
    api, note = traffic_api()
    if api is None:
        return note
    try:
        api[1](group)
    except (ValueError, AttributeError, RuntimeError) as err:
        return f"not counted: {type(err).__name__}: {str(err).splitlines()[0]}"
    return ""


def measure(group=None):
    """{'sent', 'received', 'ops'} of this rank since reset(), or None."""
    api, _ = traffic_api()
    if api is None:
        return None
    try:
        t = api[0](group)
    except (ValueError, AttributeError, RuntimeError):
        return None
    return {"sent": int(t["bytes_sent"]), "received": int(t["bytes_received"]),
            "ops": {k: int(v) for k, v in t.get("ops", {}).items()}}


def gathered(per_rank):
    """Per-rank measurements (rank order) as {'sent': [..], 'received': [..], 'ops': [..]},
    or None when any rank could not count."""
    if any(m is None for m in per_rank):
        return None
    return {k: [m[k] for m in per_rank] for k in ("sent", "received", "ops")}
