"""The shapes of Opacus's examples cifar10.py and char-lstm-classification.py, against dpopt only (CI).

Opacus is not installed in CI, so the examples themselves run in
``benchmarks/opacus_examples.py`` (next to real Opacus). Here the same script
shapes are written out in our own words, on small synthetic data, and run
with ``dpopt.PrivacyEngine``:

* cifar10: a conv net (Conv-ReLU-AvgPool blocks, adaptive pooling, Flatten,
  Linear), SGD with momentum, a cosine LR set through ``optimizer.param_groups``
  each epoch, ``optimizer.step()`` BEFORE ``optimizer.zero_grad()``, flat or
  per-layer clipping (``[C/√n] * n``), ``grad_sample_mode``,
  ``accountant.get_epsilon`` mid-epoch, ``torch.save`` of a dict holding
  ``model.state_dict()`` and ``optimizer.state_dict()`` every epoch;
* char-lstm: byte-encoded sequences of different lengths padded by a
  ``pad_sequence`` collate_fn to one fixed length (Opacus's script pads to the
  batch's longest, which makes each example's input depend on the others:
  refused by dpopt's check; Poisson batches may be empty), Embedding →
  recurrent layer (``batch_first=True``) → last step → Linear; the recurrent
  layer is ``nn.LSTM`` or an LSTM written as cells of two ``nn.Linear`` called
  at every time step (the structure of Opacus's ``DPLSTM``).

Values checked: ε equals the closed form for the steps run; every epoch is
len(loader) releases; per-layer bounds are recorded; with σ = 0 and a bound no
gradient reaches, the release is the plain gradient of the summed loss over
the batch divided by the expected batch size (reference: ordinary autograd on
a copy of the model).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dpopt
from dpopt.accounting.accountant import dpsgd_epsilon

DELTA = 1e-5


def _reproducible(**kw):
    kw["noise_generator"] = torch.Generator().manual_seed(kw.pop("noise_seed", 0))
    return kw


# -- cifar10.py's shape ---------------------------------------------------------------------------
def _convnet(classes=4):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


def _images(n=96, classes=4, seed=0):
    """Class c's images are a fixed 3x8x8 pattern (the same for every seed) plus noise drawn from ``seed``."""
    pattern = torch.randn(classes, 3, 8, 8, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(pattern[y] + 0.5 * torch.randn(n, 3, 8, 8, generator=g), y)


@pytest.mark.parametrize("clip_per_layer, mode", [(False, "hooks"), (True, "functorch")])
def test_cifar10_script_shape(tmp_path, clip_per_layer, mode):
    torch.manual_seed(0)
    model = _convnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0, momentum=0.9, weight_decay=0)
    loader = DataLoader(_images(), batch_size=24)  # q = 1/4
    n_layers = len([p for p in model.parameters() if p.requires_grad])
    max_grad_norm = [1.0 / math.sqrt(n_layers)] * n_layers if clip_per_layer else 1.0
    engine = dpopt.PrivacyEngine(secure_mode=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reproducible noise; the grad_sample_mode note
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=0.8,
            max_grad_norm=max_grad_norm,
            clipping="per_layer" if clip_per_layer else "flat",
            grad_sample_mode=mode,
            **_reproducible(),
        )
    epochs, criterion, eps_seen = 3, nn.CrossEntropyLoss(), []
    for epoch in range(1, epochs + 1):
        lr = 2.0 * 0.5 * (1 + math.cos(math.pi * epoch / (epochs + 1)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.train()
        for i, (images, target) in enumerate(loader):
            loss = criterion(model(images), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if i % 2 == 0:
                eps_seen.append(engine.accountant.get_epsilon(delta=DELTA))
        assert optimizer.original_optimizer.param_groups[0]["lr"] == lr
        torch.save(
            {"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()},
            tmp_path / "checkpoint.tar",
        )
    assert len(engine.ledger) == epochs * len(loader) == 12
    assert engine.accountant.get_epsilon(delta=DELTA) == pytest.approx(
        dpsgd_epsilon(0.8, 0.25, 12, DELTA, "pld"), rel=1e-9
    )
    assert eps_seen == sorted(eps_seen)  # grows with every release
    saved = torch.load(tmp_path / "checkpoint.tar", weights_only=True)
    assert saved["optimizer"]["privatizer"]["ledger_length"] == 12  # the checkpoint carries the ledger
    bounds = engine.ledger.entries[-1].meta["max_grad_norm"]
    assert bounds == pytest.approx([1.0 / math.sqrt(n_layers)] * n_layers if clip_per_layer else [1.0])
    model.eval()
    x, y = _images(seed=1).tensors
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    assert accuracy > 0.5  # 4 classes (chance 0.25); the noise is seeded: this run is fixed


# -- char-lstm-classification.py's shape ------------------------------------------------------------
class _Names(Dataset):
    """Byte sequences of lengths 3-9 (start/end tokens), label = a class whose byte range they come from."""

    def __init__(self, n=80, classes=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            c = int(torch.randint(0, classes, (1,), generator=g))
            length = int(torch.randint(3, 10, (1,), generator=g))
            body = torch.randint(c * 20, c * 20 + 30, (length,), generator=g)
            self.items.append((torch.cat([torch.tensor([256]), body, torch.tensor([257])]), torch.tensor(c)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


MAX_LEN = 11  # the longest name (9 bytes) with its start and end tokens


def _padded_collate(batch, padding_idx=0):
    """Pad to ONE fixed length (issue 33): padding to the batch's longest made each example's input (and
    the LSTM's h[:, -1]) depend on the other examples of the batch: refused by the first-batch check."""
    x = pad_sequence([b[0] for b in batch], batch_first=True, padding_value=padding_idx)
    x = nn.functional.pad(x, (0, MAX_LEN - x.shape[1]), value=padding_idx) if len(batch) else x
    return x, torch.stack([b[1] for b in batch]).long()


class _CellLSTM(nn.Module):
    """An LSTM as Opacus's DPLSTM computes it: two Linear maps (ih, hh) called at every time step."""

    def __init__(self, input_size, hidden_size, batch_first=True):
        super().__init__()
        self.hidden_size, self.batch_first = hidden_size, batch_first
        self.ih = nn.Linear(input_size, 4 * hidden_size)
        self.hh = nn.Linear(hidden_size, 4 * hidden_size)

    def forward(self, x, state=None):
        if self.batch_first:
            x = x.transpose(0, 1)  # [T, B, D]
        h = x.new_zeros(x.shape[1], self.hidden_size)
        c = torch.zeros_like(h)
        outs = []
        for t in range(x.shape[0]):
            i, f, g, o = torch.split(self.ih(x[t]) + self.hh(h), self.hidden_size, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        out = torch.stack(outs, 1 if self.batch_first else 0)
        return out, (h, c)


class _CharClassifier(nn.Module):
    def __init__(self, rnn, classes=3, vocab=259, emb=8, hidden=12):
        super().__init__()
        self.embedding = nn.Embedding(vocab, emb)
        self.rnn = rnn(emb, hidden, batch_first=True)
        self.out_layer = nn.Linear(hidden, classes)

    def forward(self, x, hidden=None):
        x, _ = self.rnn(self.embedding(x), hidden)
        return self.out_layer(x[:, -1, :])


@pytest.mark.parametrize("rnn", [nn.LSTM, _CellLSTM], ids=["nn.LSTM", "DPLSTM-shaped"])
def test_char_lstm_script_shape_release_is_the_summed_gradient_at_sigma_0(rnn):
    torch.manual_seed(0)
    model = _CharClassifier(rnn)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(_Names(), batch_size=10, collate_fn=_padded_collate)  # q = 1/8, expected batch 10
    engine = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=1e6,
            **_reproducible(),
        )
    checked = 0
    for x, y in loader:
        reference = copy.deepcopy(model) if len(x) else None  # the parameters before this step
        logits = model(x)
        loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        if reference is not None:
            ref_params = [p for p in reference.parameters() if p.requires_grad]
            for p in ref_params:
                p.grad = None
            # sigma 0 and no clipping: the release is sum_i grad l_i / (q N) = mean-loss gradient * B / 10
            (nn.functional.cross_entropy(reference(x), y, reduction="sum") / 10.0).backward()
            for p, r in zip(model.parameters(), ref_params):
                torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6)
            checked += 1
        optimizer.zero_grad()
    assert checked >= 5 and len(engine.ledger) == len(loader) == 8


@pytest.mark.parametrize("rnn", [nn.LSTM, _CellLSTM], ids=["nn.LSTM", "DPLSTM-shaped"])
def test_char_lstm_script_shape_trains_and_accounts(rnn):
    torch.manual_seed(1)
    model = _CharClassifier(rnn)
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    loader = DataLoader(_Names(), batch_size=16, collate_fn=_padded_collate)  # q = 1/5
    engine = dpopt.PrivacyEngine(secure_mode=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.5,
            **_reproducible(),
        )
    criterion = nn.CrossEntropyLoss()
    for _ in range(2):
        model.train()
        for x, y in loader:
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    eps = engine.accountant.get_epsilon(delta=8e-5)
    assert eps == pytest.approx(dpsgd_epsilon(1.0, 0.2, 10, 8e-5, "pld"), rel=1e-9)
    assert len(engine.ledger) == 10
