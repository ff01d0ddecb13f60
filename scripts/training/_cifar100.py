"""CIFAR-100 without torchvision, a synthetic stand-in, and a small ResNet for CPU runs.

    data = load_dataset(data_dir, "train", limit=None, synthetic=False, seed=0)
    x, y = data.batch(indices, device, augment=False)   # normalized float32, int64
    model = build_model("resnet", width=16, depth=1)

Real data is the standard python archive (`<data_dir>/cifar-100-python/train`
and `test`: pickled dicts with b'data' uint8 [N, 3072] and b'fine_labels').
The synthetic set has the same shapes (3x32x32 uint8 images, 100 classes): each
class has a smooth random prototype (a 3x4x4 pattern upsampled to 32x32),
and an image is its class prototype plus pixel noise, so a small CNN learns it
in a few hundred steps while it is far from trivial at the start (1% chance).
Every rank builds the same arrays from the seed: no communication needed.
"""
import dataclasses
import os
import pickle

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 100
ARCHIVE = "cifar-100-python"
SPLIT_FILES = {"train": "train", "val": "test"}
FULL_SIZES = {"train": 50000, "val": 10000}
# Channel statistics of the CIFAR-100 training set, as torchvision users normalize.
CIFAR_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR_STD = (0.2673, 0.2564, 0.2762)
SYNTHETIC_MEAN = (0.5, 0.5, 0.5)
SYNTHETIC_STD = (0.25, 0.25, 0.25)
# Synthetic images: 128 + AMPLITUDE * prototype + NOISE * N(0, 1), clamped to uint8.
SYNTHETIC_AMPLITUDE = 28.0
SYNTHETIC_NOISE = 64.0
_CHUNK = 4096


@dataclasses.dataclass
class Dataset:
    images: torch.Tensor  # uint8 [N, 3, 32, 32]
    labels: torch.Tensor  # int64 [N]
    source: str           # "cifar-100-python" or "synthetic"
    path: str             # the archive file, or "" for synthetic data
    mean: tuple
    std: tuple

    def __len__(self):
        return self.labels.numel()

    @property
    def synthetic(self):
        return self.source == "synthetic"

    def batch(self, indices, device, augment=False, generator=None):
        """Images at `indices` as normalized float32 on `device`, and their labels."""
        x = self.images[indices].to(device=device, dtype=torch.float32).div_(255)
        mean = torch.tensor(self.mean, device=device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=device).view(1, 3, 1, 1)
        x = (x - mean) / std
        if augment:
            x = random_crop_flip(x, generator)
        return x, self.labels[indices].to(device)


def random_crop_flip(x, generator=None, pad=4):
    """The usual CIFAR augmentation, batched: random crop after zero padding, random flip."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    rows = (dy.view(n, 1) + torch.arange(h)).to(x.device)  # [n, h]
    cols = (dx.view(n, 1) + torch.arange(w)).to(x.device)  # [n, w]
    out = padded[torch.arange(n, device=x.device).view(n, 1, 1, 1),
                 torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1),
                 rows.view(n, 1, h, 1), cols.view(n, 1, 1, w)]
    flip = (torch.rand(n, generator=generator) < 0.5).to(x.device)
    return torch.where(flip.view(n, 1, 1, 1), out.flip(3), out)


def archive_path(data_dir, split):
    return os.path.join(data_dir, ARCHIVE, SPLIT_FILES[split])


def has_cifar100(data_dir):
    return all(os.path.isfile(archive_path(data_dir, s)) for s in SPLIT_FILES)


def load_dataset(data_dir, split, limit=None, synthetic=False, seed=0):
    """The `split` ("train" or "val") of CIFAR-100, or of the synthetic set when
    `synthetic` is true; at most `limit` samples (the first ones)."""
    if synthetic:
        size = FULL_SIZES[split] if limit is None else min(limit, FULL_SIZES[split])
        return synthetic_cifar100(split, size, seed)
    path = archive_path(data_dir, split)
    with open(path, "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    data, labels = raw[b"data"], raw[b"fine_labels"]
    if limit is not None:
        data, labels = data[:limit], labels[:limit]
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    return Dataset(images, torch.tensor(labels, dtype=torch.int64), ARCHIVE, path,
                   CIFAR_MEAN, CIFAR_STD)


def synthetic_cifar100(split, size, seed=0):
    """SYNTHETIC CIFAR-100-shaped data: class prototypes plus noise (see the module doc).

    The prototypes depend on `seed` only, so train and val share them; the noise and
    the label order differ between splits.
    """
    gen = torch.Generator().manual_seed(1_000_003 * seed + 17)
    prototypes = F.interpolate(torch.randn(NUM_CLASSES, 3, 4, 4, generator=gen),
                               size=(32, 32), mode="bilinear", align_corners=False)
    prototypes /= prototypes.flatten(1).std(dim=1).view(-1, 1, 1, 1)
    gen.manual_seed(1_000_003 * seed + (101 if split == "train" else 202))
    labels = torch.arange(size, dtype=torch.int64) % NUM_CLASSES
    labels = labels[torch.randperm(size, generator=gen)]
    images = torch.empty(size, 3, 32, 32, dtype=torch.uint8)
    for start in range(0, size, _CHUNK):  # bounded float memory for 50,000 images
        part = labels[start:start + _CHUNK]
        noise = torch.randn(part.numel(), 3, 32, 32, generator=gen)
        pixels = 128 + SYNTHETIC_AMPLITUDE * prototypes[part] + SYNTHETIC_NOISE * noise
        images[start:start + _CHUNK] = pixels.round_().clamp_(0, 255).to(torch.uint8)
    return Dataset(images, labels, "synthetic", "", SYNTHETIC_MEAN, SYNTHETIC_STD)


# ------------------------------------------------------------------ model

class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the (projected) input, then ReLU: ResNet's basic block."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """A CIFAR ResNet cut down for CPUs: a stem, three stages of `depth` basic blocks
    at widths w, 2w, 4w (strides 1, 2, 2), global average pooling, a linear head."""

    def __init__(self, width=16, depth=1, num_classes=NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        blocks, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(depth):
                blocks.append(BasicBlock(cin, cout, 2 if stage and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


MODELS = {"resnet": SmallResNet}


def build_model(name="resnet", width=16, depth=1):
    return MODELS[name](width=width, depth=depth)


def count_parameters(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)
