"""Data, client splits, model and evaluation of scripts/studies/paradigms.py.

    data = load_dataset("digits", seed=0)                 # standardized float32, int64
    parts = client_splits(data.y_train, clients=3, kind="dirichlet", seed=0, alpha=0.5)
    counts = label_counts(data.y_train, parts, data.classes)   # [[per label] per client]
    model = build_model("mlp", data.features, data.classes, hidden=64, seed=0)

Every rank builds the same arrays, splits and initial model from the seeds: no
communication is needed to agree on them, so the traffic each paradigm measures
is its training traffic only.

Datasets: `digits` is scikit-learn's handwritten digits (1797 8x8 images, 10
classes, bundled with scikit-learn: no download); `classification` is
scikit-learn's make_classification (10 classes, 20 features); `synthetic` is
Gaussian class prototypes plus noise made with torch alone. The train/test split
is stratified and seeded (--test-fraction of each label held out); features are
standardized with the training set's mean and standard deviation.

Client splits of the training set (K clients, every sample assigned exactly once):
  iid        each label's samples, shuffled, are dealt round-robin over the clients
             (one running deal over all labels), so client k holds floor or ceil of
             n_label / K of every label and the client sizes differ by at most one;
  dirichlet  label-skewed: for each label, proportions p ~ Dirichlet(alpha * 1_K)
             cut that label's shuffled samples among the clients (smaller alpha: more
             skew); redrawn until every client holds at least one sample;
  shards     label-skewed: the training set sorted by label is cut into
             K * shards_per_client contiguous shards, dealt at random, so a client
             sees only the few labels its shards span.
"""
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

DATASETS = ("digits", "classification", "synthetic")
SPLITS = ("iid", "dirichlet", "shards")
MODELS = ("mlp", "logreg")
DATA_SOURCES = {
    "digits": "sklearn.datasets.load_digits",
    "classification": "sklearn.datasets.make_classification",
    "synthetic": "torch: Gaussian class prototypes + noise",
}
_SYNTHETIC = {"samples": 1200, "features": 32, "classes": 10, "separation": 1.0}
_CLASSIFICATION = {"samples": 2000, "features": 20, "classes": 10}
_DIRICHLET_TRIES = 100


@dataclasses.dataclass
class Data:
    """Standardized float32 features and int64 labels of the train and test sets."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int

    @property
    def features(self):
        return self.x_train.shape[1]

    def record(self, test_fraction, seed):
        """What the JSON says about the data."""
        return {"dataset": self.name, "source": DATA_SOURCES[self.name],
                "train_size": len(self.y_train), "test_size": len(self.y_test),
                "features": self.features, "classes": self.classes,
                "test_fraction": test_fraction, "seed": seed, "standardized": True,
                "train_label_counts": np.bincount(self.y_train.numpy(),
                                                  minlength=self.classes).tolist(),
                "test_label_counts": np.bincount(self.y_test.numpy(),
                                                 minlength=self.classes).tolist()}


# ------------------------------------------------------------------ datasets

def _raw(name, samples, seed):
    """(x float64 [N, F], y int64 [N], classes) of the whole data set."""
    if name == "synthetic":
        cfg = _SYNTHETIC
        gen = torch.Generator().manual_seed(seed)
        n = samples or cfg["samples"]
        y = torch.arange(n) % cfg["classes"]
        protos = torch.randn(cfg["classes"], cfg["features"], generator=gen) * cfg["separation"]
        x = protos[y] + torch.randn(n, cfg["features"], generator=gen)
        return x.double().numpy(), y.numpy(), cfg["classes"]
    try:
        from sklearn import datasets
    except ImportError as err:
        raise SystemExit(f"paradigms: --dataset {name} needs scikit-learn ({err}); "
                         "pip install scikit-learn, or use --dataset synthetic") from None
    if name == "digits":
        x, y = datasets.load_digits(return_X_y=True)
        if samples:  # a seeded subsample
            keep = np.sort(np.random.default_rng(seed).permutation(len(y))[:samples])
            x, y = x[keep], y[keep]
        return x.astype(np.float64), y.astype(np.int64), 10
    cfg = _CLASSIFICATION
    x, y = datasets.make_classification(
        n_samples=samples or cfg["samples"], n_features=cfg["features"], n_informative=10,
        n_redundant=4, n_classes=cfg["classes"], n_clusters_per_class=1, class_sep=1.5,
        random_state=seed)
    return x.astype(np.float64), y.astype(np.int64), cfg["classes"]


def stratified_split(y, test_fraction, seed):
    """(train indices, test indices): round(test_fraction * n_label) of each label held out."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        cut = int(round(test_fraction * len(idx)))
        test.append(idx[:cut])
        train.append(idx[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_dataset(name, seed=0, test_fraction=0.2, samples=None):
    """The seeded, stratified, standardized train/test split of data set `name`."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    x, y, classes = _raw(name, samples, seed)
    train, test = stratified_split(y, test_fraction, seed)
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0)
    std[std == 0] = 1.0  # constant pixels (digits' borders) stay 0
    x = (x - mean) / std

    def tensors(idx):
        return (torch.from_numpy(x[idx]).float(), torch.from_numpy(y[idx]).long())

    return Data(name, *tensors(train), *tensors(test), classes)


# ------------------------------------------------------------------ client splits

def _iid(labels, clients, rng):
    order = np.concatenate([rng.permutation(np.flatnonzero(labels == c))
                            for c in np.unique(labels)])
    return [order[k::clients] for k in range(clients)]


def _dirichlet(labels, clients, rng, alpha):
    for _ in range(_DIRICHLET_TRIES):
        parts = [[] for _ in range(clients)]
        for label in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == label))
            cuts = (np.cumsum(rng.dirichlet([alpha] * clients))[:-1] * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) > 0:
            return [np.array(p, dtype=np.int64) for p in parts]
    raise ValueError(f"dirichlet split: some client got no sample in {_DIRICHLET_TRIES} "
                     f"draws ({clients} clients, {len(labels)} samples, alpha {alpha}); "
                     "raise --alpha or use fewer clients")


def _shards(labels, clients, rng, per_client):
    count = clients * per_client
    if count > len(labels):
        raise ValueError(f"shards split: {count} shards ({clients} clients x {per_client}) "
                         f"of {len(labels)} samples; lower --shards-per-client")
    shuffled = rng.permutation(len(labels))
    order = shuffled[np.argsort(labels[shuffled], kind="stable")]  # by label, random within
    shards = np.array_split(order, count)
    deal = rng.permutation(count)
    return [np.concatenate([shards[s] for s in deal[k * per_client:(k + 1) * per_client]])
            for k in range(clients)]


def client_splits(labels, clients, kind, seed, alpha=0.5, shards_per_client=2):
    """K sorted int64 index arrays into `labels` (a tensor or array), one per client."""
    if clients < 1:
        raise ValueError(f"client splits need at least one client, got {clients}")
    labels = np.asarray(labels)
    rng = np.random.default_rng([seed, SPLITS.index(kind)])  # each kind its own stream
    if kind == "iid":
        parts = _iid(labels, clients, rng)
    elif kind == "dirichlet":
        parts = _dirichlet(labels, clients, rng, alpha)
    elif kind == "shards":
        parts = _shards(labels, clients, rng, shards_per_client)
    else:
        raise ValueError(f"unknown split {kind!r}; choose from {', '.join(SPLITS)}")
    return [np.sort(p).astype(np.int64) for p in parts]


def label_counts(labels, parts, classes):
    """[[samples of each label] for each client]: plot-ready, JSON-ready ints."""
    labels = np.asarray(labels)
    return [np.bincount(labels[p], minlength=classes).tolist() for p in parts]


# ------------------------------------------------------------------ model

def build_model(name, features, classes, hidden=64, seed=0):
    """The same initial weights on every rank (seeded), without touching torch's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "mlp":
            return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))
        if name == "logreg":
            return nn.Sequential(nn.Linear(features, classes))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


def flat_params(model):
    """All parameters in one new float32 vector, in model.parameters() order."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def flat_grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@torch.no_grad()
def load_flat_params(model, flat):
    offset = 0
    for p in model.parameters():
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


@torch.no_grad()
def load_flat_grads(model, flat):
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


@torch.no_grad()
def evaluate(model, x, y):
    """(mean cross-entropy, accuracy) of `model` on (x, y)."""
    out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).double().mean().item()
