"""A module hook added, removed or replaced after the first-batch check re-runs the check (every door).

The check's signature (:func:`dpopt.engine.check.signature`) is the train/eval
flags, the module-state fingerprint (:func:`~dpopt.engine.check.module_state`)
and the batch-size class. Before this test, ``module_state`` left out the
modules' hook tables: a forward hook that mixes examples, registered after the
first step (``model[0].register_forward_hook(lambda m, i, o: o + o.mean(0))``),
kept the old signature, the check did not run again, and the capture's
"per-example" gradients mixed examples: with σ = 0, removing one example moved
the clipped sum by 1.11-1.14 C (fast door, ``dpopt.optim``; forward, pre-,
full backward and global hooks alike), ``PrivacyEngine`` released the step,
and so did ``DPTrainer`` (``tests/hf/test_trainer.py``). Now the user's hooks (per module and torch's process-wide
ones: function identity, with-kwargs / always-call flags) are part of the
signature; dpopt's own hooks (capture, the loss-reduction watch) are not, so a
steady loop is checked once.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.engine import check as check_mod
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.check import module_state
from dpopt.methods import make_optimizer
from dpopt.types import ClipGeometry

ce = nn.functional.cross_entropy
C = 0.05  # below every per-example norm here: every example is clipped
N = 12  # 11 and 12 examples: one size class (8-15), so only the hook can change the signature


def _mix(m, i, o):
    return o + o.mean(0, keepdim=True).expand_as(o)


def _mix_pre(m, args):
    (x,) = args
    return (x + x.mean(0, keepdim=True),)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _data(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64) * 2, torch.randint(0, 3, (n,), generator=g)


def _full_backward_mix(m, gin, gout):
    (g,) = gin
    return (g + g.mean(0, keepdim=True),)


#: hooks that make a forward (or its backward) mix examples, added after the first check
ADD = {
    "forward": lambda m: m[0].register_forward_hook(_mix),
    "forward_prepend": lambda m: m[0].register_forward_hook(_mix, prepend=True),
    "forward_kwargs": lambda m: m[0].register_forward_hook(lambda mod, a, kw, o: _mix(mod, a, o), with_kwargs=True),
    "forward_pre": lambda m: m[2].register_forward_pre_hook(_mix_pre),
    "full_backward": lambda m: m[1].register_full_backward_hook(_full_backward_mix),
    "global_forward": lambda m: torch.nn.modules.module.register_module_forward_hook(
        lambda mod, a, o: _mix(mod, a, o) if mod is m[0] else None
    ),
}


def _clipped_sum(model, x, y):
    src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    geo, n = ClipGeometry(), src.num_params
    w = torch.clamp(C / src.sq_norms(geo, [0] * n, 1)[:, 0].sqrt(), max=1.0).unsqueeze(1)
    return torch.cat([s.flatten() for s in src.weighted_sum(w, geo, [0] * n)])


def _worst_move(fn, x, y):
    full = fn(x, y)
    worst = 0.0
    for j in range(len(y)):
        keep = torch.tensor([i for i in range(len(y)) if i != j])
        worst = max(worst, float((full - fn(x[keep], y[keep])).norm()) / C)
    return worst


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kind", list(ADD))
def test_fast_door_sensitivity_after_a_hook_is_added(kind):
    """σ = 0, ``iter_per_sample_sources``: after 5 steps, a mixing hook; removing one example moves ≤ C."""
    model = _model()
    x, y = _data()
    for _ in range(5):
        list(iter_per_sample_sources(model, ce, x, y))  # checked on the first, unchanged after
    handle = ADD[kind](model)
    try:
        worst = _worst_move(lambda a, b: _clipped_sum(model, a, b), x, y)
    finally:
        handle.remove()
    assert worst <= 1 + 1e-9  # was 1.11-1.14 C before the hooks were part of the signature


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_optim_door_sensitivity_after_a_hook_is_added():
    """σ = 0 through ``make_optimizer`` + ``iter_per_sample_sources`` (benchmarks/step_time.py's step), lr 1."""
    model = _model()
    params = [p for p in model.parameters()]
    x, y = _data()
    opt = make_optimizer(
        "dp-sgd", params, noise_multiplier=0.0, expected_batch_size=float(N), sample_rate=0.1, max_grad_norm=C, lr=1.0
    )

    def release(a, b):  # the released gradient × E[B], parameters restored after
        before = [p.detach().clone() for p in params]
        opt.step(iter_per_sample_sources(model, ce, a, b, None, opt.evaluation_points()))
        out = torch.cat([(b0 - p.detach()).flatten() for b0, p in zip(before, params)]) * N
        with torch.no_grad():
            for p, b0 in zip(params, before):
                p.copy_(b0)
        return out

    for _ in range(5):
        release(x, y)
    handle = model[0].register_forward_hook(_mix)
    try:
        worst = _worst_move(release, x, y)
    finally:
        handle.remove()
    assert worst <= 1 + 1e-9


def test_fast_door_checks_a_steady_loop_once_and_a_new_hook_once(monkeypatch):
    """``dpopt.optim`` steps (capture hooks attached and removed each step): one check; a hook: one more."""
    calls = []
    real = check_mod.ModeCheck.done
    monkeypatch.setattr(check_mod.ModeCheck, "done", lambda self, sig: (calls.append(sig), real(self, sig))[1])
    model = _model()
    x, y = _data()
    opt = make_optimizer(
        "dp-sgd", list(model.parameters()), noise_multiplier=0.0, expected_batch_size=float(N), sample_rate=0.1
    )
    for _ in range(6):
        opt.step(iter_per_sample_sources(model, ce, x, y, None, opt.evaluation_points()))
    assert len(calls) == 1
    h = model[0].register_forward_hook(lambda m, i, o: 3 * o)
    for _ in range(3):
        opt.step(iter_per_sample_sources(model, ce, x, y, None, opt.evaluation_points()))
    assert len(calls) == 2
    h.remove()
    opt.step(iter_per_sample_sources(model, ce, x, y, None, opt.evaluation_points()))
    assert len(calls) == 2  # the first signature again: checked before


def _private(model, x, y, lr=0.0):
    eng = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = eng.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=N),
            noise_multiplier=0.0,
            max_grad_norm=C,
            poisson_sampling=False,
        )
    return eng, model, opt


def _step(model, opt, x, y):
    opt.zero_grad()
    ce(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("kind", list(ADD))
def test_privacy_engine_refuses_a_mixing_hook_added_after_steps(kind):
    base = _model()
    x, y = _data()
    eng, model, opt = _private(base, x, y)
    for _ in range(5):
        _step(model, opt, x, y)
    assert len(eng.ledger) == 5
    handle = ADD[kind](base)
    try:
        with pytest.raises(ValueError, match="do not match single-example autograd") as err:
            _step(model, opt, x, y)
    finally:
        handle.remove()
    assert len(eng.ledger) == 5  # nothing released
    # the refusal says what changed since the earlier check and how to go on (a first-batch refusal does not)
    assert "something changed since then: a module hook added" in str(err.value)
    assert "handle.remove()" in str(err.value)
    _step(model, opt, x, y)  # the hook removed: this step is checked again and released
    assert len(eng.ledger) == 6


def test_privacy_engine_first_batch_refusal_does_not_speak_of_a_change():
    """A model that mixes from its first step gets the plain refusal (no earlier check to have changed from)."""
    base = _model()
    x, y = _data()
    handle = ADD["forward"](base)
    eng, model, opt = _private(base, x, y)
    try:
        with pytest.raises(ValueError, match="do not match single-example autograd") as err:
            _step(model, opt, x, y)
    finally:
        handle.remove()
    assert "changed since" not in str(err.value)
    assert len(eng.ledger) == 0


def test_privacy_engine_accepts_a_per_example_hook_and_rechecks_on_each_change():
    """A hook that scales a layer's output is per example: re-checked once, passes; removal/replacement re-check."""
    base = _model()
    x, y = _data()
    eng, model, opt = _private(base, x, y)
    calls = []
    real = opt._capture._modes.done

    def counting(sig):
        calls.append(sig)
        real(sig)

    opt._capture._modes.done = counting
    for _ in range(5):
        _step(model, opt, x[:4], y[:4])
    assert len(calls) == 1  # a steady loop: checked once (dpopt's own hooks are not in the signature)
    scale = base[0].register_forward_hook(lambda m, i, o: 3 * o)
    for _ in range(3):
        _step(model, opt, x[:4], y[:4])
    assert len(calls) == 2  # the hook: checked once more, agrees (per example), released
    scale.remove()
    _step(model, opt, x[:4], y[:4])
    assert len(calls) == 2  # back to the signature checked first
    h = base[0].register_forward_hook(lambda m, i, o: 3 * o)
    _step(model, opt, x[:4], y[:4])
    assert len(calls) == 3
    h.remove()
    h = base[0].register_forward_hook(lambda m, i, o: 2 * o)  # another function under the same table slot
    _step(model, opt, x[:4], y[:4])
    assert len(calls) == 4
    h.remove()
    assert len(eng.ledger) == 11  # every step released: each new signature agreed


def test_privacy_engine_rechecks_a_hook_whose_function_is_replaced():
    """The hook table's entry replaced in place (same key, another function): a new signature, refused."""
    base = _model()
    x, y = _data()
    eng, model, opt = _private(base, x, y)
    h = base[0].register_forward_hook(lambda m, i, o: 3 * o)
    for _ in range(3):
        _step(model, opt, x, y)
    base[0]._forward_hooks[h.id] = _mix
    with pytest.raises(ValueError, match="do not match single-example autograd"):
        _step(model, opt, x, y)
    assert len(eng.ledger) == 3
    h.remove()


def test_module_state_sees_user_hooks_not_dpopts():
    m = _model()
    before = module_state(m)
    h = m[0].register_forward_hook(_mix)
    assert module_state(m) != before
    h.remove()
    assert module_state(m) == before
    h = m[0].register_forward_hook(_mix, always_call=True)
    with_flag = module_state(m)
    h.remove()
    h = m[0].register_forward_hook(_mix)
    assert module_state(m) != with_flag  # the flags are part of it (same function)
    h.remove()
    g = torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, a: None)
    try:
        assert module_state(m) != before  # torch's process-wide hooks
    finally:
        g.remove()
    assert module_state(m) == before
    for reg in (m[1].register_full_backward_hook, m[1].register_full_backward_pre_hook):
        h = reg(lambda *a: None)
        assert module_state(m) != before
        h.remove()
    # dpopt's own hooks (capture, the loss-reduction watch) are not in it
    from dpopt.opacus_compat import LossReductionWatch

    watch = LossReductionWatch(m, "mean")
    assert module_state(m) == before
    del watch
    cap = dpopt.engine.hooks.HookCapture(m)
    assert module_state(m) == before
    del cap
    assert module_state(copy.deepcopy(m)) != before  # (identities: a copy is another model)
    assert check_mod.module_state(m) == before


def _scaled_by(a):
    def hook(m, i, o):
        return a * o

    return hook


def test_a_remembered_signature_never_matches_a_hook_rebuilt_at_a_freed_address():
    """A hook rebuilt by a factory (same code, other closure values) must never take the old one's fingerprint.

    With ``id()`` alone, ``h.remove(); h = layer.register_forward_hook(make(a))`` put the new closure at the freed
    address in 13 of 20 trials (review of 2026-12-07) and the check did not run again. A signature names each hook
    weakly (``_Held``): once the hook is gone, the old signature matches nothing, whatever lands at its address;
    and the remembered signature does not keep the hook (or what it holds) alive.
    """
    import gc
    import pickle
    import weakref

    m = _model()
    hook = _scaled_by(1.0)
    alive = weakref.ref(hook)
    h = m[0].register_forward_hook(hook)
    state = module_state(m)
    assert module_state(m) == state  # the same live hook: the same signature
    h.remove()
    del hook, h
    gc.collect()
    assert alive() is None  # not kept alive by the remembered state
    for a in (1.0, 2.0, 3.0):
        h = m[0].register_forward_hook(_scaled_by(a))
        assert module_state(m) != state
        h.remove()
    held = check_mod._Held(_mix)
    assert held == check_mod._Held(_mix) and hash(held) == id(_mix)
    # a copy or pickle of a held object is a fresh object: a copied or restored signature is never taken as checked
    assert copy.deepcopy(held) != held and pickle.loads(pickle.dumps(held)) != held
    assert copy.deepcopy(module_state(m)) != module_state(m)


def test_a_model_whose_hook_refers_to_it_is_freed_after_training():
    """The fast door's engine cache is keyed weakly by the model; its remembered signatures must not hold the model
    through a hook that refers back to it (``self.register_forward_hook(self._hook)``)."""
    import gc
    import weakref

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
            self.register_forward_hook(self._hook)

        def _hook(self, m, i, o):
            return o * 1.0

        def forward(self, x):
            return self.body(x)

    net = Net()
    x, y = _data()
    for _ in range(3):
        src = next(iter(iter_per_sample_sources(net, ce, x, y)))
        src.free()
    alive = weakref.ref(net)
    del net, src
    gc.collect()
    assert alive() is None


def test_module_state_sees_a_class_forward_patched_after_the_check(monkeypatch):
    m = _model()
    before = module_state(m)
    original = nn.Tanh.forward
    monkeypatch.setattr(nn.Tanh, "forward", lambda self, x: original(self, x) + x.mean(0))
    assert module_state(m) != before
    monkeypatch.undo()
    assert module_state(m) == before


def test_a_user_hook_wrapped_to_look_like_dpopts_is_still_counted():
    """``functools.wraps(<a dpopt function>)`` copies ``__module__``; own_hook decides by the code's file."""
    import functools

    from dpopt.engine.check import own_hook

    @functools.wraps(check_mod.module_state)
    def disguised(m, i, o):
        return _mix(m, i, o)

    assert disguised.__module__ == "dpopt.engine.check"
    assert not own_hook(disguised)
    assert own_hook(check_mod.module_state)
    assert own_hook(functools.partial(check_mod.module_state))
    m = _model()
    before = module_state(m)
    h = m[0].register_forward_hook(disguised)
    assert module_state(m) != before
    h.remove()


def test_module_state_is_stable_for_forwards_built_per_access():
    """A class ``forward`` given by a descriptor that builds a new object per access (``partialmethod``) must not
    make every step a new signature: the class's raw attribute is read."""
    import functools

    class Scaled(nn.Module):
        def _scaled(self, x, a):
            return a * x

        forward = functools.partialmethod(_scaled, a=2.0)

    m = nn.Sequential(nn.Linear(4, 6), Scaled(), nn.Linear(6, 3))
    assert m[1].forward is not m[1].forward  # a new object per access
    assert module_state(m) == module_state(m)


def test_an_object_attribute_named_in_a_signature_is_never_matched_after_it_died():
    """Module attributes that are objects (a function assigned as ``m.forward``, a config) count by ``_Held`` too:
    once the object is gone, whatever comes to live at its address is another signature (the review found an
    instance ``forward`` rebuilt at the freed address kept the fingerprint in 19 of 20 trials with ``id()``)."""
    import gc

    m = _model()
    m[1].forward = lambda x: torch.tanh(x)
    state = module_state(m)
    assert module_state(m) == state  # the same live object: the same signature
    del m[1].forward
    gc.collect()
    for _ in range(5):
        m[1].forward = lambda x: torch.tanh(x) + x.mean(0)
        assert module_state(m) != state
        del m[1].forward
    unweak = {"a": 1}  # no weak references: by id, as before
    assert check_mod._attribute_key(unweak) == check_mod._attribute_key(unweak)


class _Recurrent(nn.Module):
    """A recurrent layer (``kind``: LSTM, GRU or RNN), its last step, a head."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = getattr(nn, kind)(3, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_a_recurrent_layer_is_checked_once_in_a_steady_loop(monkeypatch, kind):
    """torch's recurrent forward rebuilds its ``_flat_weights`` / ``_flat_weight_refs`` lists whenever the
    parameters it sees were swapped (the check's and the capture's passes swap them): keyed by the lists'
    identity, every step was a new signature and ran the whole first-batch check again (2026-12-08: the
    LSTM benchmark's ``dp-sgd`` step at 53× the non-private one instead of ≈ 5×). Keyed by their elements: once."""
    calls = []
    real = check_mod.ModeCheck.done
    monkeypatch.setattr(check_mod.ModeCheck, "done", lambda self, sig: (calls.append(sig), real(self, sig))[1])
    model = _Recurrent(kind)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(N, 4, 3, generator=g), torch.randint(0, 3, (N,), generator=g)
    opt = make_optimizer(
        "dp-sgd", list(model.parameters()), noise_multiplier=0.0, expected_batch_size=float(N), sample_rate=0.1
    )
    state = module_state(model)
    for _ in range(4):
        opt.step(iter_per_sample_sources(model, ce, x, y, None, opt.evaluation_points()))
    assert len(calls) == 1
    assert module_state(model) == state


def test_a_short_list_attribute_counts_by_its_elements():
    """A tuple or list attribute is keyed by its elements (a function by identity, a tensor by shape, a weak
    reference by its referent): a rebuilt list with the same elements is the same state, and an element replaced
    in place (which the list's identity never showed) is a new one."""
    m = _model()
    m[1].fns = [torch.tanh]
    m[1].refs = [check_mod.weakref.ref(m[0].weight)]
    state = module_state(m)
    m[1].fns = [torch.tanh]
    m[1].refs = [check_mod.weakref.ref(m[0].weight)]
    assert module_state(m) == state
    m[1].fns[0] = lambda h: h - h.mean(0)
    assert module_state(m) != state
    m[1].fns[0] = torch.tanh
    assert module_state(m) == state
    m[1].refs[0] = check_mod.weakref.ref(m[2].weight)  # another shape
    assert module_state(m) != state
    long = list(range(check_mod._SEQ_BUDGET + 1))
    assert check_mod._attribute_key(long) == ("obj", check_mod._Held(long))  # past the budget: by identity
    assert check_mod._attribute_key(list(long[:-1])) == check_mod._attribute_key(list(long[:-1]))


def test_sequence_keys_at_their_edges():
    """The review's cases: a list subclass carrying state, namedtuples of two classes, a dead weak reference, a
    list that contains itself, ``weakref.WeakMethod`` (a new bound method per call), nesting past the budget."""
    import collections
    import gc

    key = check_mod._attribute_key

    class Cfg(list):  # a subclass with instance attributes: by identity, never by its elements
        pass

    a, b = Cfg([1]), Cfg([1])
    a.mix, b.mix = False, True
    assert key(a) != key(b) and key(a) == key(a)
    p1, p2 = collections.namedtuple("P", "x"), collections.namedtuple("P", "x")  # same name, other classes
    assert key(p1(1)) == key(p1(1)) and key(p1(1)) != key(p2(1))
    t = torch.zeros(2)
    ref = check_mod.weakref.ref(t)
    alive = key([ref])
    del t
    gc.collect()
    assert key([ref]) == ("list", ("weakref", None)) != alive
    loop: list = [1]
    loop.append(loop)
    assert key(loop) == key(loop)  # stops at the depth limit
    m = _model()
    wm = check_mod.weakref.WeakMethod(m.forward)
    assert module_state(m) == module_state(m)
    m.hooks = [wm]
    assert module_state(m) == module_state(m)  # by the WeakMethod's identity: stable
    eight_layers = [torch.zeros(3)] * 72  # a 9-layer bidirectional LSTM's _flat_weights: by its elements
    assert key(list(eight_layers)) == key(list(eight_layers))
