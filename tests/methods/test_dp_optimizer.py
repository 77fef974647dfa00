"""DPOptimizer is a torch.optim.Optimizer: schedulers, state_dict, closures refused."""

import pytest
import torch
from torch import nn

from dpopt.engine.reference import PerSampleGrads, per_sample_gradients
from dpopt.methods import list_methods, make_optimizer

pytestmark = pytest.mark.usefixtures("float64")  # see conftest.py


def _problem(seed=0, n=16):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(n, 4)
    y = torch.randint(0, 3, (n,))
    return model, x, y


LOSS = nn.functional.cross_entropy


def test_dp_optimizer_is_a_torch_optimizer():
    model, x, y = _problem()
    opt = make_optimizer(
        "dp-adam", model.parameters(), noise_multiplier=1.0, expected_batch_size=16, sample_rate=0.5, lr=0.1
    )
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step(per_sample_gradients(model, LOSS, x, y))
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    with pytest.raises(TypeError, match="closure"):
        opt.step(per_sample_gradients(model, LOSS, x, y), closure=lambda: 0.0)
    with pytest.raises(TypeError, match="closure"):
        opt.step(lambda: 0.0)  # a closure passed positionally
    state = opt.state_dict()
    assert state["state"]  # Adam moments are in optimizer.state, torch-style
    assert len(opt.privatizer.ledger) == 1


def test_lr_schedule_changes_the_update():
    """The −lr scaling reads the param group at every step (so schedulers really act)."""
    p = torch.zeros(2, requires_grad=True)
    opt = make_optimizer("dp-sgd", [p], noise_multiplier=0.0, expected_batch_size=1.0, sample_rate=1.0, lr=1.0)
    opt.step(PerSampleGrads([torch.tensor([[0.3, 0.4]])]))
    assert torch.allclose(p.detach(), torch.tensor([-0.3, -0.4]))
    opt.param_groups[0]["lr"] = 0.5
    opt.step(PerSampleGrads([torch.tensor([[0.3, 0.4]])]))
    assert torch.allclose(p.detach(), torch.tensor([-0.45, -0.6]))


@pytest.mark.parametrize("name", [s.name for s in list_methods()])
def test_every_method_resumes_from_its_state_dict(name):
    """A resumed optimizer steps exactly as the uninterrupted one (same seeded noise from there).

    torch's load_state_dict turns string state (a Partition's label: DP-Muon and every partitioned
    method) into a generator's text; the first step after a resume then raised KeyError.
    """

    def run(resume: bool):
        model, x, y = _problem()
        gen = torch.Generator().manual_seed(7)

        def make(m):
            return make_optimizer(
                name,
                m.parameters(),
                noise_multiplier=1.0,
                expected_batch_size=16,
                sample_rate=0.5,
                generator=gen,
                model=m,
            )

        opt = make(model)
        opt.step(per_sample_gradients(model, LOSS, x, y, points=opt.evaluation_points()))
        if resume:
            state = opt.state_dict()
            opt = make(model)
            opt.load_state_dict(state)
        opt.step(per_sample_gradients(model, LOSS, x, y, points=opt.evaluation_points()))
        return [p.detach().clone() for p in model.parameters()], len(opt.privatizer.ledger)

    straight, n_straight = run(False)
    resumed, n_resumed = run(True)
    assert n_straight == n_resumed == 2
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
