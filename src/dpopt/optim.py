"""DPOptimizer: a ``torch.optim.Optimizer`` = Privatizer + post-processing chain.

``step(per_sample)`` does, for one logical step::

    geometry = transform.geometry(state)          # released state only
    release  = privatizer.privatize(per_sample, geometry)   # the one read of private data
    updates  = transform.update(release.grads, state, ctx)  # post-processing
    p += update                                   # (updates already include −lr)

It calls ``super().__init__`` so LR schedulers, ``state_dict`` and hooks work;
learning rates are read from ``param_groups`` at every step.

Parameters are matched by IDENTITY: a per-sample source that lists the
parameters it covers (``source.params``, as the dpopt engines do) has its
norms, sums and geometry mapped to the optimizer's parameters whatever their
order; frozen parameters — ``nn.Parameter`` objects with ``requires_grad=False``
(a frozen backbone, LoRA-style fine-tuning) — are skipped and never changed
(plain tensors, as in hand-written examples, are always trained). A source built by hand without
``params`` is matched by position to the trainable parameters and must have
exactly as many.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .errors import ConfigError
from .privatizer import Privatizer, Release
from .transforms.base import StepContext, Transform
from .types import ClipGeometry, EvaluationPoint, PerSampleSource


class _Reordered:
    """A per-sample source seen in the optimizer's parameter order (``perm[j]`` = source index of param j)."""

    def __init__(self, source: PerSampleSource, perm: list[int]):
        self.source, self.perm = source, perm
        self.inverse = [0] * len(perm)
        for j, i in enumerate(perm):
            self.inverse[i] = j

    @property
    def num_params(self) -> int:
        return len(self.perm)

    @property
    def nonfinite(self):
        return getattr(self.source, "nonfinite", 0)

    @property
    def batch_size(self):
        return getattr(self.source, "batch_size", None)

    @property
    def params(self):
        covered = getattr(self.source, "params", None)
        return None if covered is None else tuple(covered[i] for i in self.perm)

    @property
    def points(self):
        return getattr(self.source, "points", None)

    def _geo(self, geometry: ClipGeometry) -> ClipGeometry:
        def order(ts):
            return None if ts is None else tuple(ts[j] for j in self.inverse)

        return ClipGeometry(order(geometry.shift), order(geometry.scale))

    def sq_norms(self, geometry: ClipGeometry, groups, num_groups: int) -> Tensor:
        return self.source.sq_norms(self._geo(geometry), [groups[j] for j in self.inverse], num_groups)

    def weighted_sum(self, weights: Tensor, geometry: ClipGeometry, groups) -> list[Tensor]:
        sums = self.source.weighted_sum(weights, self._geo(geometry), [groups[j] for j in self.inverse])
        return [sums[i] for i in self.perm]


def _same_points(a: list[EvaluationPoint], b) -> bool:
    """Do two lists of evaluation points have equal coefficients and offsets?"""
    if b is None or len(a) != len(b):
        return False
    for p, r in zip(a, b):
        if float(p.coef) != float(r.coef) or (p.offset is None) != (r.offset is None):
            return False
        if p.offset is not None and (
            len(p.offset) != len(r.offset) or not all(x is y or torch.equal(x, y) for x, y in zip(p.offset, r.offset))
        ):
            return False
    return True


__all__ = ["DPOptimizer", "is_frozen"]


def is_frozen(p: Tensor) -> bool:
    """True for a frozen model parameter: an ``nn.Parameter`` with ``requires_grad=False``."""
    return isinstance(p, torch.nn.Parameter) and not p.requires_grad


class DPOptimizer(torch.optim.Optimizer):
    """Differentially private optimizer facade.

    Args:
        params: iterable of parameters or param-group dicts (each group needs
            ``lr``; extra keys are public hyperparameters visible to transforms).
        privatizer: the :class:`~dpopt.privatizer.Privatizer` (owns the ledger).
        transform: the post-processing chain; its output must already include
            the −lr scaling (e.g. end with ``scale_by_lr()``).
        lr: default learning rate (> 0).

    Raises:
        ValueError: lr ≤ 0; no trainable parameter; (at :meth:`step`) a
            per-sample source that does not cover exactly the optimizer's
            trainable parameters, or that was evaluated at other points than
            :meth:`evaluation_points` asks for (DiSK).
        TypeError: a closure passed to :meth:`step` (DP steps need per-sample
            gradients, not a loss closure).
    """

    def __init__(self, params, privatizer: Privatizer, transform: Transform, lr: float = 1e-3):
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise ConfigError(f"lr must be > 0, got {lr!r}; e.g. lr 1e-3 for Adam-type methods, 0.1 for SGD", "lr")
        super().__init__(params, {"lr": float(lr)})
        for group in self.param_groups:
            if not group["lr"] > 0:
                raise ValueError(f"lr must be > 0 in every param group, got {group['lr']}")
        if not self._params():
            raise ValueError("every parameter given to the optimizer is frozen (requires_grad=False); nothing to train")
        self.privatizer = privatizer
        self.transform = transform

    def __getstate__(self) -> dict:  # torch keeps only defaults/state/param_groups: a copy had no privatizer
        """Copies and pickles keep the whole optimizer; its secret noise re-seeds in the copy (dpopt.noise)."""
        return dict(self.__dict__)

    # -- helpers over all trainable params, in group order ------------------
    def _params(self) -> list[Tensor]:
        """Trainable parameters in param-group order; frozen ones (:func:`is_frozen`) are skipped."""
        return [p for g in self.param_groups for p in g["params"] if not is_frozen(p)]

    def _matched(self, source: PerSampleSource, params: list[Tensor], points: list[EvaluationPoint]):
        """``source`` seen in the order of ``params`` (matched by identity); checks coverage and points."""
        covered = getattr(source, "params", None)
        if covered is None:
            if source.num_params != len(params):
                raise ValueError(
                    f"the per-sample source has {source.num_params} parameters but the optimizer "
                    f"trains {len(params)}; build sources with dpopt's engines (which record the "
                    "parameters they cover) or give one gradient per trainable parameter, in order"
                )
            perm = list(range(len(params)))
        else:
            where = {id(p): i for i, p in enumerate(covered)}
            missing = [j for j, p in enumerate(params) if id(p) not in where]
            extra = len(covered) - (len(params) - len(missing))
            if missing or extra:
                shapes = [tuple(params[j].shape) for j in missing]
                raise ValueError(
                    f"the per-sample source and the optimizer cover different parameters "
                    f"({len(missing)} optimizer parameters missing from the source, shapes "
                    f"{shapes}; {extra} source parameters not in the optimizer): give the "
                    "optimizer exactly the model's trainable parameters"
                )
            perm = [where[id(p)] for p in params]
        default = len(points) == 1 and points[0].offset is None and float(points[0].coef) == 1.0
        if not default:
            if not _same_points(points, getattr(source, "points", None)):
                raise ValueError(
                    "this optimizer (DiSK) needs per-sample gradients at its evaluation points: "
                    "pass points=opt.evaluation_points() to iter_per_sample_sources / "
                    "per_sample_gradients, computed just before this step"
                )
            if perm != list(range(len(params))):
                raise ValueError(
                    "evaluation-point offsets follow the optimizer's parameter order: give the "
                    "optimizer the model's trainable parameters in model order"
                )
        return source if perm == list(range(len(params))) else _Reordered(source, perm)

    def _sources(self, per_sample, params: list[Tensor]):
        """Yield each micro-batch source matched to ``params`` (lazily: engines free the previous one)."""
        points = self._evaluation_points(params)
        if hasattr(per_sample, "sq_norms"):
            yield self._matched(per_sample, params, points)
            return
        for src in per_sample:
            yield self._matched(src, params, points)

    def _states(self, params: Optional[list[Tensor]] = None) -> list[dict]:
        """Each trainable parameter's transform state (initialised on first use), in ``params`` order
        (default: :meth:`_params`, walked now)."""
        states = []
        for p in self._params() if params is None else params:
            if not self.state[p]:
                self.state[p].update(self.transform.init(p))
            states.append(self.state[p])
        return states

    def geometry(self) -> ClipGeometry:
        """The clip geometry for the next step (identity unless a transform provides one)."""
        return self._transform_geometry(self._params())

    def _geometry(self, params: list[Tensor]) -> ClipGeometry:
        """:meth:`geometry` for ``params``, the trainable parameters (:meth:`_params`) walked by the caller; a
        subclass's override of :meth:`geometry` is called instead (it decides the step's geometry)."""
        if type(self).geometry is not DPOptimizer.geometry:
            return self.geometry()
        return self._transform_geometry(params)

    def _transform_geometry(self, params: list[Tensor]) -> ClipGeometry:
        """The transform's geometry for ``params`` (identity when it gives none)."""
        with torch.no_grad():
            geo = self.transform.geometry(self._states(params), params)
        return geo if geo is not None else ClipGeometry()

    def evaluation_points(self) -> list[EvaluationPoint]:
        """Where the next per-sample gradients must be evaluated (default: at θ)."""
        return self._transform_points(self._params())

    def _evaluation_points(self, params: list[Tensor]) -> list[EvaluationPoint]:
        """:meth:`evaluation_points` for ``params``, the trainable parameters (:meth:`_params`) walked by the caller;
        a subclass's override of :meth:`evaluation_points` is called instead."""
        if type(self).evaluation_points is not DPOptimizer.evaluation_points:
            return self.evaluation_points()
        return self._transform_points(params)

    def _transform_points(self, params: list[Tensor]) -> list[EvaluationPoint]:
        """The transform's evaluation points for ``params`` (at θ when it gives none)."""
        with torch.no_grad():
            pts = self.transform.evaluation_points(self._states(params), params)
        return pts if pts is not None else [EvaluationPoint(1.0)]

    # -- checkpoints --------------------------------------------------------
    def state_dict(self, *, include_ledger: bool = True) -> dict:
        """torch's optimizer state (every transform's state: Adam/MacAdam moments and geometry, DiSK/DOPPLER
        filters, momentum) plus ``"privatizer"``: :meth:`Privatizer.state_dict` (step counter, clip bounds,
        the ledger with ``include_ledger``; never the secret noise generator's state)."""
        state = super().state_dict()
        state["privatizer"] = self.privatizer.state_dict(include_ledger=include_ledger)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`, the Privatizer's part (and ledger) included.

        Raises:
            ValueError: a state without its ``"privatizer"`` part (a plain torch
                optimizer state: the releases that produced it are in no
                ledger, so loading it would restart ε from zero), or a
                Privatizer part that would forget releases
                (:meth:`Privatizer.load_state_dict`).
        """
        state_dict = dict(state_dict)
        privatizer = state_dict.pop("privatizer", None)
        if privatizer is None:
            raise ValueError(
                "this optimizer state has no 'privatizer' part (a plain torch optimizer state_dict): "
                "the releases that produced it are recorded in no ledger, so loading it would "
                "restart epsilon from zero. Load a state saved by DPOptimizer.state_dict() (it "
                "carries the Privatizer and its ledger)"
            )
        self.privatizer.load_state_dict(privatizer)  # first: a refused ledger leaves the optimizer untouched
        super().load_state_dict(state_dict)
        self._restore_strings(state_dict)

    def _restore_strings(self, state_dict: dict) -> None:
        """Put back the strings of the saved per-parameter state (e.g. a Partition's ``"label"``).

        torch's ``Optimizer.load_state_dict`` casts every non-dict iterable value
        element by element, which turns a string into the text of a generator
        object; a partitioned method (DP-Muon, …) then failed its first step after
        a resume. The saved state maps to the parameters in param-group order, as
        torch maps it.
        """
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for key, p in zip(saved_ids, params):
            if key in state_dict["state"] and p in self.state:
                self.state[p] = _with_strings(state_dict["state"][key], self.state[p])

    @torch.no_grad()
    def step(self, per_sample=None, closure=None) -> Release:  # type: ignore[override]
        """One DP step from per-sample gradients of the trainable parameters.

        Args:
            per_sample: a per-sample source (:class:`~dpopt.types.PerSampleSource`,
                e.g. ``PerSampleGrads``) or an iterable of them (micro-batches of one logical batch), covering exactly
                the optimizer's trainable parameters (matched by identity).

        Returns:
            The step's :class:`~dpopt.privatizer.Release`.

        Raises:
            LedgerWriteError: the release's ledger entry could not be written
                (:class:`dpopt.errors.LedgerWriteError`): nothing released, parameters unchanged.

        A step whose release raises is discarded (:meth:`Privatizer.release
        <dpopt.privatizer.Privatizer.release>`: nothing applied, the next ``step()`` is a new one).
        """
        if closure is not None or callable(per_sample):
            raise TypeError("DPOptimizer.step does not take a closure; pass per-sample gradients")
        if per_sample is None:
            raise TypeError("DPOptimizer.step needs per-sample gradients (see dpopt.engine)")
        params = self._params()
        try:
            release = self.privatizer.privatize(
                self._sources(per_sample, params), self._geometry(params), params_like=params
            )
        except BaseException:
            self.privatizer._reset()  # a failed release: the open step goes (never "begin() called twice")
            raise
        self.apply_release(release)
        return release

    @torch.no_grad()
    def apply_release(self, release: Release) -> None:
        """Post-process a release of this optimizer's Privatizer: the transform chain, then ``p += update``.

        :meth:`step` = privatize + this; a caller that drives the Privatizer's
        ``begin``/``accumulate``/``release`` itself (micro-batches of one
        logical batch, :class:`~dpopt.private_optimizer.PrivateOptimizer`) calls
        it with that release (its step opened with ``privatizer.begin(self.geometry())``).
        """
        params: list[Tensor] = []
        groups: list[dict] = []
        for g in self.param_groups:  # one walk: the trainable parameters (_params) and each one's group
            for p in g["params"]:
                if not is_frozen(p):
                    params.append(p)
                    groups.append(g)
        states = self._states(params)
        lrs = [g["lr"] for g in groups]
        ctx = StepContext(
            step=release.step + 1,
            noise_std=release.noise_std,
            lrs=lrs,
            groups=groups,
            noise_multiplier=release.noise_multiplier,
            expected_batch_size=release.expected_batch_size,
        )
        self.transform.apply(list(release.grads), states, params, ctx)  # p += update, in place (Transform.apply)


def _with_strings(saved, loaded):
    """``loaded`` with every string of ``saved`` at the same place put back (dicts, lists and tuples walked)."""
    if isinstance(saved, str):
        return saved
    if isinstance(saved, dict) and isinstance(loaded, dict):
        return {k: _with_strings(saved[k], v) if k in saved else v for k, v in loaded.items()}
    if isinstance(saved, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(saved) == len(loaded):
        return type(loaded)(_with_strings(a, b) for a, b in zip(saved, loaded))
    return loaded
