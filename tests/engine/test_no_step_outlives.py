"""Nothing a step creates outlives the step (issue 42; DESIGN.md, "Invariants of a run").

After ``optimizer.step()`` + ``zero_grad()`` + ``gc.collect()``, a weak reference
to each step's model output, to its input and to a recorded activation (an
inner layer's input and output) is dead — in the plain ``PrivacyEngine`` loop
(MLP, LSTM, GRU, ``nn.MultiheadAttention``: the tapped layers), with
``BatchMemoryManager`` (skipped steps), views (``augmentation_multiplicity``),
empty Poisson batches, the first-batch check (a change of train/eval mode runs
it again), exceptions raised mid-step, forward passes no step follows
(evaluation with gradients enabled, a discarded loss: the recorder keeps at
most one such pass and warns once), and ``dpopt.training.train``. An engine and
optimizer deleted without ``detach()`` are freed and leave no hook on the model.

Before the fix every step's output stayed alive: the tensor hook on a recorded
output held ``partial(call.store, k)``, the ``Call`` held the output, whose
autograd node held the hook — a cycle through autograd's C++ side that ``gc``
cannot see (every test below that steps failed on the old code with all
outputs alive).
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine
from dpopt.utils.batch_memory_manager import BatchMemoryManager

N, D, C = 48, 6, 3


class Watch:
    """Weak references to tensors a step created; ``alive()`` counts those still reachable (after gc)."""

    def __init__(self):
        self.refs: list = []

    def add(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))

    def layer(self, module: nn.Module):
        """Watch every input and output of ``module``'s calls (a recorded activation)."""

        def hook(mod, args, out):
            self.add(*[a for a in args if isinstance(a, torch.Tensor)])
            self.add(*(out if isinstance(out, tuple) else (out,)))

        return module.register_forward_hook(hook)

    def alive(self) -> int:
        gc.collect()
        return sum(r() is not None for r in self.refs)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 16), nn.Linear(16, C)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Recurrent(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(D, 8, batch_first=True)
        self.fc2 = nn.Linear(8, C)

    def forward(self, x):
        return self.fc2(self.rnn(x.reshape(x.shape[0], 2, D // 2).repeat(1, 1, 2))[0][:, -1])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.fc2 = nn.Linear(D, C)

    def forward(self, x):
        s = x.unsqueeze(1).repeat(1, 3, 1)
        return self.fc2(self.attn(s, s, s, need_weights=False)[0].mean(1))


MODELS = {"mlp": MLP, "lstm": lambda: Recurrent("lstm"), "gru": lambda: Recurrent("gru"), "mha": Attention}


def _data(batch_size=12):
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)), batch_size=batch_size
    )


def _private(model, **kw):
    torch.manual_seed(0)
    engine = PrivacyEngine()
    kw.setdefault("poisson_sampling", False)  # the tests step on batches of their own (no Poisson batch tags)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=_data(kw.pop("batch_size", 12)),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        **kw,
    )
    return engine, model, opt, loader


def _step(model, opt, x, y, watch: Watch) -> None:
    x = x.clone()  # the model's input, the test's own (the loader's iterator holds its batch until the next)
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    watch.add(x, out, loss)
    opt.step()
    opt.zero_grad()


def _dpopt_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in m.__dict__) for m in model.modules())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plain_loop_keeps_nothing_of_a_step(name):
    engine, model, opt, loader = _private(MODELS[name]())
    watch = Watch()
    watch.layer(model.fc2)  # its input is the recorded activation of the last layer
    steps = 0
    for epoch in range(2):
        model.train(epoch == 0)  # eval() in epoch 2: the first-batch check runs again in that mode
        for x, y in loader:
            _step(model, opt, x, y, watch)
            del x, y
            steps += 1
            assert watch.alive() == 0, f"step {steps}: {watch.alive()} of {len(watch.refs)} tensors still alive"
    assert len(engine.ledger) == steps and len(watch.refs) >= 5 * steps
    assert opt._capture._rec.calls == []


def test_batch_memory_manager_skipped_steps_keep_nothing():
    engine, model, opt, loader = _private(MLP(), batch_size=24)
    watch = Watch()
    watch.layer(model.fc2)
    chunks = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=5, optimizer=opt) as small:
        for x, y in small:
            _step(model, opt, x, y, watch)
            del x, y
            chunks += 1
            assert watch.alive() == 0, f"chunk {chunks}: {watch.alive()} tensors alive"
    assert chunks > len(engine.ledger) >= 1  # skipped steps happened


def test_views_keep_nothing():
    engine, model, opt, loader = _private(
        MLP(), augmentation_multiplicity=2, augmentation=lambda x, g: x + 0.01 * torch.randn(x.shape, generator=g)
    )
    watch = Watch()
    watch.layer(model.fc2)
    for x, y in loader:
        _step(model, opt, x, y, watch)
        del x, y
        assert watch.alive() == 0
    assert len(engine.ledger) == len(loader)


def test_empty_poisson_batches_keep_nothing():
    engine, model, opt, loader = _private(MLP())
    watch = Watch()
    watch.layer(model.fc2)
    for b in (0, 5, 0, 3):
        x, y = torch.randn(b, D), torch.randint(0, C, (b,))
        _step(model, opt, x, y, watch)
        del x, y
        assert watch.alive() == 0
    assert len(engine.ledger) == 4


def test_exceptions_mid_step_keep_nothing():
    engine, model, opt, loader = _private(MLP())
    watch = Watch()
    watch.layer(model.fc2)
    x, y = torch.randn(6, D), torch.randint(0, C, (6,))

    # 1. a forward that raises half-way (fc1 recorded, fc2 raises)
    def fail(module, args):
        watch.add(*args)
        raise RuntimeError("mid-forward")

    handle = model.fc2.register_forward_pre_hook(fail)
    bad = torch.randn(6, D)
    watch.add(bad)
    with pytest.raises(RuntimeError, match="mid-forward"):
        model(bad)
    handle.remove()
    assert len(opt._capture._rec.calls) == 1  # fc1's call of the failed pass
    del bad
    # 2. a step refused: the forward's rows are not the examples (loss reduction / layout refusal) -> here a
    #    backward with a graph the step rejects: two passes that both received gradients
    a, b = model(x), model(x)
    watch.add(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        (a.sum() + b.sum()).backward()
    with pytest.raises(ValueError, match="forward passes"):
        opt.step()
    opt.zero_grad()
    del a, b
    # 3. then ordinary steps
    for _ in range(2):
        _step(model, opt, x, y, watch)
    del x, y
    assert watch.alive() == 0, f"{watch.alive()} tensors alive"
    assert len(engine.ledger) == 2


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_forwards_no_step_follows_are_dropped_and_warned_once(mode):
    engine, model, opt, loader = _private(MLP())
    x, y = next(iter(loader))
    _step(model, opt, x, y, Watch())
    getattr(model, mode)()
    watch = Watch()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(20):  # an evaluation loop without torch.no_grad(); the loss discarded
            xe = torch.randn(7, D)
            out = model(xe)
            nn.functional.cross_entropy(out, torch.zeros(7, dtype=torch.long))
            watch.add(xe, out)
            del xe, out
    dropped = [w for w in seen if "no backward pass followed it" in str(w.message)]
    assert len(dropped) == 1  # said once
    rec = opt._capture._rec
    assert {id(c.pass_) for c in rec.calls} == {id(rec.calls[-1].pass_)} and len(rec.calls) == 2  # one pass
    assert watch.alive() <= 2  # at most the last pass's input and output (a step could still use it)
    model.train()
    _step(model, opt, x, y, watch)  # its step uses its own pass; the evaluation passes are gone
    del x, y
    assert watch.alive() == 0
    assert rec.calls == []


def test_backward_of_a_dropped_pass_is_refused():
    engine, model, opt, loader = _private(MLP())
    x, y = next(iter(loader))
    first = model(x)
    with pytest.warns(RuntimeWarning, match="no backward pass followed it"):
        model(x)  # drops the first pass
    nn.functional.cross_entropy(first, y).backward()
    with pytest.raises(ValueError, match="after another forward pass had started"):
        opt.step()
    assert len(engine.ledger) == 0


def test_deleted_engine_frees_itself_and_its_hooks():
    model = MLP()
    assert _dpopt_hooks(model) == 0
    for _ in range(3):  # a sweep: engines made and dropped on one model
        engine, private, opt, loader = _private(model)
        assert _dpopt_hooks(model) > 0
        watch = Watch()
        for x, y in loader:
            _step(private, opt, x, y, watch)
        refs = [weakref.ref(engine), weakref.ref(opt), weakref.ref(opt._capture), weakref.ref(opt._capture._rec)]
        del engine, private, opt, loader, x, y
        gc.collect()
        assert [r() for r in refs] == [None] * 4
        assert _dpopt_hooks(model) == 0 and watch.alive() == 0
    out = model(torch.randn(4, D))  # the model is the user's again: plain autograd, no recording
    out.sum().backward()
    assert model.fc1.weight.grad is not None


@pytest.mark.parametrize("rows", [None, 0, 1], ids=["loader-batch", "empty", "one-row"])
def test_detached_engine_leaves_no_hook(rows):
    """Also after a first step of 0 or 1 rows (an empty Poisson batch, forced here): the first-batch loss check
    keeps its hooks until a step of >= 2 rows, and detach() left them (a forward hook on the model and a
    process-wide module forward hook) — the loader's first batch, Binomial(48, 1/4), is empty with
    probability 1e-6 and has one row with 1.6e-5."""
    model = MLP()
    engine, private, opt, loader = _private(model)
    x, y = next(iter(loader))
    x, y = (x, y) if rows is None else (x[:rows], y[:rows])
    check = opt._loss_watch
    _step(private, opt, x, y, Watch())
    engine.detach()
    assert _dpopt_hooks(model) == 0
    hooks = torch.nn.modules.module._global_forward_hooks.values()
    assert not [h for h in hooks if getattr(h, "ref", None) is not None and h.ref() is check]  # this engine's
    watch = Watch()
    out = model(x)
    watch.add(out)
    del out
    assert watch.alive() == 0


def test_dpopt_train_keeps_nothing_of_a_step(tmp_path):
    from dpopt.training import TrainConfig, train

    watch, seen = Watch(), []

    def hook(module, args, out):  # every module's output and inputs, in every step
        if torch.is_grad_enabled():
            watch.add(*[a for a in args if isinstance(a, torch.Tensor)])
            watch.add(*(out if isinstance(out, tuple) else (out,)))

    def on_step(row):
        seen.append((row["step"], len(watch.refs), watch.alive()))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        train(
            TrainConfig(method="dp-sgd", batch_size=128, epochs=1, out=str(tmp_path / "run"), seed=0, accountant="rdp"),
            on_step=on_step,
        )
    finally:
        handle.remove()
    assert len(seen) >= 5 and seen[-1][1] > 0
    assert [alive for _, _, alive in seen] == [0] * len(seen)


def test_a_dropped_loss_reduction_watch_leaves_no_process_wide_hook():
    """The loss-reduction watch's process-wide forward hook is removed when the watch is collected, not at the
    next forward of some module: a stale one (dead weakref) stayed in torch's global hook dict, where a later
    torch.compile in the same process built a guard on it and failed (InternalTorchDynamoError)."""
    import gc

    from dpopt.opacus_compat import LossReductionWatch

    before = len(torch.nn.modules.module._global_forward_hooks)
    watch = LossReductionWatch(nn.Linear(2, 2), "mean")
    assert len(torch.nn.modules.module._global_forward_hooks) == before + 1
    del watch
    gc.collect()
    assert len(torch.nn.modules.module._global_forward_hooks) == before
