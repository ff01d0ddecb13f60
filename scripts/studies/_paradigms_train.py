"""The four training paradigms of scripts/studies/paradigms.py, one function each.

    model, curve = TRAINERS["ps"](args, data, rank, world_size, progress=None)
    model, curve = train_fedavg(args, data, rank, world_size, parts, progress, "fedavg-iid")

Every rank calls the trainer; each returns its model (None on ranks that train
nothing) and, on rank 0, the curve: the global model's mean training loss, test
loss and test accuracy after each epoch (round for FedAvg), evaluated on rank 0
without communication (point 0: the initial model). They communicate over the
default process group only, and only for training, so its traffic counters see
exactly the paradigm's traffic.

Global batches (centralised, serverless, ps): each epoch permutes the training
set with a generator seeded by (--seed, epoch), identical on every rank, and cuts
it into batches of --batch-size (the last incomplete one is dropped; at most
--max-steps per epoch). A paradigm with k gradient workers splits each batch with
tensor_split into k shards, and worker i computes
    loss_i = (sum of the cross-entropy over shard i) * k / B,
so that the average of the k workers' gradients is exactly the gradient of the
batch's mean loss even when k does not divide B. All start from the same seeded
model and use the same SGD (--lr, --momentum, --weight-decay; torch.optim.SGD's
update, written out in `SGD`), so serverless and parameter-server SGD follow
centralised SGD up to float rounding.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from scripts.studies import _paradigms_data as pdata


class Curve:
    """Rank 0's evaluation of the global model after each epoch or round."""

    def __init__(self, data, enabled, unit):
        self.data, self.enabled, self.unit, self.points = data, enabled, unit, []

    def add(self, model, index, data_epochs, updates):
        if not self.enabled:
            return
        train_loss, train_acc = pdata.evaluate(model, self.data.x_train, self.data.y_train)
        test_loss, test_acc = pdata.evaluate(model, self.data.x_test, self.data.y_test)
        self.points.append({self.unit: index, "data_epochs": data_epochs, "updates": updates,
                            "train_loss": train_loss, "train_acc": train_acc,
                            "test_loss": test_loss, "test_acc": test_acc})


def _model(args, data):
    return pdata.build_model(args.model, data.features, data.classes, args.hidden, args.seed)


class SGD:
    """torch.optim.SGD's update (no dampening, no Nesterov), written out:

        d = grad + weight_decay * p;   buf = d on the first step, else momentum * buf + d;
        p -= lr * buf   (p -= lr * d without momentum)

    Written here because a process's first torch.optim optimizer imports
    torch._dynamo, seconds of CPU per rank that small runs on few cores feel;
    tests/test_paradigms.py checks it against torch.optim.SGD.
    """

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0):
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers = [None] * len(self.params)

    def zero_grad(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            d = p.grad.add(p, alpha=self.weight_decay) if self.weight_decay else p.grad
            if self.momentum:
                if self.buffers[i] is None:
                    self.buffers[i] = d.clone()
                else:
                    self.buffers[i].mul_(self.momentum).add_(d)
                d = self.buffers[i]
            p.add_(d, alpha=-self.lr)


def _sgd(args, model):
    return SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
               weight_decay=args.weight_decay)


def global_batches(args, n_train, epoch):
    """Index tensors of the epoch's global batches, the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
    order = torch.randperm(n_train, generator=gen)
    b = args.batch_size
    return [order[s * b:(s + 1) * b] for s in range(steps_per_epoch(args, n_train))]


def steps_per_epoch(args, n_train):
    steps = n_train // args.batch_size
    return min(steps, args.max_steps) if args.max_steps else steps


def _shard_backward(model, data, batch, parts, part):
    """Backward of shard `part` of `batch`, scaled so the parts' mean gradient is the batch's."""
    idx = batch.tensor_split(parts)[part]
    model.zero_grad(set_to_none=False)
    out = model(data.x_train[idx])
    loss = F.cross_entropy(out, data.y_train[idx], reduction="sum") * (parts / len(batch))
    loss.backward()


def _tick(progress):
    if progress is not None:
        progress.update(1)


def _log(progress, curve, name):
    if progress is not None and curve.points:
        p = curve.points[-1]
        progress.write(f"{name} {curve.unit} {p[curve.unit]}: train loss {p['train_loss']:.4f}"
                       f", test loss {p['test_loss']:.4f}, test acc {100 * p['test_acc']:.2f}%")


# ------------------------------------------------------------------ centralised

def train_centralised(args, data, rank, world_size, progress=None):
    """SGD in one process (rank 0) on whole global batches; the other ranks wait."""
    curve = Curve(data, rank == 0, "epoch")
    if rank != 0:
        return None, curve.points
    model = _model(args, data)
    opt = _sgd(args, model)
    curve.add(model, 0, 0, 0)
    updates = 0
    for epoch in range(1, args.epochs + 1):
        for batch in global_batches(args, len(data.y_train), epoch):
            opt.zero_grad()
            F.cross_entropy(model(data.x_train[batch]), data.y_train[batch]).backward()
            opt.step()
            updates += 1
            _tick(progress)
        curve.add(model, epoch, epoch, updates)
        _log(progress, curve, "centralised")
    return model, curve.points


# ------------------------------------------------------------------ serverless

def train_serverless(args, data, rank, world_size, progress=None):
    """Data-parallel SGD: every rank computes the gradient of its shard of each global
    batch, one all_reduce(SUM) of the flattened gradient, divided by N, and the same
    optimizer step on every rank (no server, no initial broadcast: same seed)."""
    curve = Curve(data, rank == 0, "epoch")
    model = _model(args, data)
    opt = _sgd(args, model)
    curve.add(model, 0, 0, 0)
    updates = 0
    for epoch in range(1, args.epochs + 1):
        for batch in global_batches(args, len(data.y_train), epoch):
            _shard_backward(model, data, batch, world_size, rank)
            grad = pdata.flat_grads(model)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            grad /= world_size
            pdata.load_flat_grads(model, grad)
            opt.step()
            updates += 1
            _tick(progress)
        curve.add(model, epoch, epoch, updates)
        _log(progress, curve, "serverless")
    return model, curve.points


# ------------------------------------------------------------------ parameter server

def train_ps(args, data, rank, world_size, progress=None):
    """Parameter-server SGD: rank 0 is the server, ranks 1..N-1 the workers.

    Per step, worker w computes the gradient of shard w-1 of the global batch and
    dist.send()s it (flattened) to rank 0. The server dist.recv()s one gradient from
    each worker in rank order, averages them, takes the optimizer step on the global
    model, and dist.send()s the flattened parameters back to every worker, which
    loads them before its next step. Only the server has an optimizer.
    """
    curve = Curve(data, rank == 0, "epoch")
    model = _model(args, data)
    workers = list(range(1, world_size))
    params = pdata.parameter_count(model)
    opt = _sgd(args, model) if rank == 0 else None
    curve.add(model, 0, 0, 0)
    updates = 0
    for epoch in range(1, args.epochs + 1):
        for batch in global_batches(args, len(data.y_train), epoch):
            if rank == 0:
                _server_step(model, opt, workers, params)
            else:
                _worker_step(model, data, batch, len(workers), rank - 1, params)
            updates += 1
            _tick(progress)
        curve.add(model, epoch, epoch, updates)
        _log(progress, curve, "ps")
    return model, curve.points


def _server_step(model, opt, workers, params):
    total = torch.zeros(params)
    incoming = torch.empty(params)
    for w in workers:
        dist.recv(incoming, src=w)
        total += incoming
    pdata.load_flat_grads(model, total / len(workers))
    opt.step()
    outgoing = pdata.flat_params(model)
    for w in workers:
        dist.send(outgoing, dst=w)


def _worker_step(model, data, batch, parts, part, params):
    _shard_backward(model, data, batch, parts, part)
    dist.send(pdata.flat_grads(model), dst=0)
    incoming = torch.empty(params)
    dist.recv(incoming, src=0)
    pdata.load_flat_params(model, incoming)


# ------------------------------------------------------------------ federated averaging

def train_fedavg(args, data, rank, world_size, parts, progress=None, name="fedavg"):
    """FedAvg: rank 0 is the server, rank k (1..N-1) the client holding parts[k-1].

    Each of --rounds rounds: every client trains the global model for --local-epochs
    epochs over its own split (batches of --local-batch-size, shuffled per round,
    at most --max-local-steps per epoch, a fresh SGD each round) and dist.send()s
    [its parameters..., its sample count] to rank 0. The server dist.recv()s them in
    rank order, averages the models weighted by sample count (in float64), and
    dist.send()s the global model back to every client. Averaging is on the server
    with point-to-point messages, not an all-reduce.
    """
    curve = Curve(data, rank == 0, "round")
    model = _model(args, data)
    clients = list(range(1, world_size))
    params = pdata.parameter_count(model)
    curve.add(model, 0, 0, 0)
    for rnd in range(1, args.rounds + 1):
        if rank == 0:
            _server_round(model, clients, params)
        else:
            _client_round(args, model, data, torch.from_numpy(parts[rank - 1]), rnd, rank,
                          params)
        _tick(progress)
        curve.add(model, rnd, rnd * args.local_epochs, rnd)
        _log(progress, curve, name)
    return model, curve.points


def _server_round(model, clients, params):
    total = torch.zeros(params, dtype=torch.float64)
    samples = 0.0
    incoming = torch.empty(params + 1)
    for c in clients:
        dist.recv(incoming, src=c)
        weight = incoming[params].item()
        total += incoming[:params].double() * weight
        samples += weight
    pdata.load_flat_params(model, (total / samples).float())
    outgoing = pdata.flat_params(model)
    for c in clients:
        dist.send(outgoing, dst=c)


def _client_round(args, model, data, mine, rnd, rank, params):
    opt = _sgd(args, model)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rnd * 1009 + rank)
    for _ in range(args.local_epochs):
        order = mine[torch.randperm(len(mine), generator=gen)]
        batches = order.split(args.local_batch_size)
        if args.max_local_steps:
            batches = batches[:args.max_local_steps]
        for idx in batches:
            opt.zero_grad()
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
    message = torch.cat([pdata.flat_params(model), torch.tensor([float(len(mine))])])
    dist.send(message, dst=0)
    incoming = torch.empty(params)
    dist.recv(incoming, src=0)
    pdata.load_flat_params(model, incoming)


TRAINERS = {"centralised": train_centralised, "serverless": train_serverless,
            "ps": train_ps, "fedavg": train_fedavg}
