"""DP-Muon-Auto: per layer and per step, orthogonalize only when the released momentum has a spike.

Post-processing of the DP-SGD release (no privacy cost): every quantity used
is a released value (the privatized gradient g̃ and its public noise std from
the :class:`~dpopt.transforms.base.StepContext`) or public configuration.

Why (the spectral paper (Shanmugam, Barnes, Taylor 2026; docs/algorithms.md); docs/algorithms.md "Spectral
diagnostics"): the polar factor of the noisy momentum helps only when the
layer's leading singular direction is recoverable, i.e. above the BBP
threshold σ₁(signal) > s_U (mn)^{1/4}. Below it the top singular value of the
noisy matrix sits at the Marchenko–Pastur edge s_U(√m + √n); above it it
separates (Benaych-Georges & Nadakuditi 2012, see
:mod:`dpopt.diagnostics.spectral`). The edge is known from public values, so
the released momentum's σ₁ tells, without any private read, which side a
layer is on.

Algorithm (per matrix W, rows × cols = m × n after flattening)::

    M ← β M + (1−β) g̃                         EMA momentum (as DP-Muon)
    v_M ← β² v_M + (1−β)² s_t²                 exact noise variance per entry of M
    U = (1−β) g̃ + β M,  v_U = (1−β)²(1+β)² s_t² + β⁴ v_M⁻   (Nesterov; else U = M, v_U = v_M)
    ρ = σ₁(U) / (√v_U (√m + √n))              top singular value over the noise edge
    on ← ρ > on_ratio        if currently off  (hysteresis: on_ratio > off_ratio)
    on ← ρ ≥ off_ratio       if currently on
    O = NS5(U) · √max(1, m/n)   if on          (DP-Muon's update, at lr)
    O = U · off_scale           if off         (plain momentum, at off_lr = lr · off_scale)

s_t² is the mean over the layer of the released per-coordinate noise
variance (``ctx.noise_std``: σ·C/B̄ for flat clipping); v_M⁻ is v_M before this
step's update. Noise across steps is independent (fresh Gaussian per
release), so v_U is exact, including the first steps (no stationary
approximation). σ = 0 gives v_U = 0, ρ = ∞: always on (DP-Muon exactly, with
the same Newton–Schulz). A large σ gives ρ → ≈1: plain momentum. Every layer
starts off (no evidence yet).

σ₁(U) comes from a warm-started power iteration (``power_iters`` steps per
update, one ``[cols]`` vector of state; a lower bound on σ₁, so errors lean
towards "off") or the exact SVD (``orthogonalizer="svd"``).

Mapping of ρ to the spike strength (square case c = 1, ρ_BBP = σ₁/(s(mn)^{1/4})):
ρ = (1 + ρ_BBP²)/(2ρ_BBP) above the threshold, so the default ``on_ratio`` 1.1
corresponds to ρ_BBP ≈ 1.56 (predicted |cos| ≈ 0.77 per side) and
``off_ratio`` 1.03 to ρ_BBP ≈ 1.28.

State per parameter: ``momentum_buffer``; ``noise_var`` (0-d float64, v_M);
``power_vector``; ``orthogonalize`` (0-d bool, the current decision);
``decisions`` (uint8 ``[t]``, 1 = orthogonalized at step t) and ``ratios``
(float32 ``[t]``, ρ at each step) — the per-layer history, saved with the
optimizer state in checkpoints; :func:`decision_history` and
:func:`write_history` read it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .base import StepContext, Transform
from .newton_schulz import NS_COEFFICIENTS, NS_EPS, ORTHOGONALIZERS, as_matrix, orthogonalize, top_singular_value

__all__ = ["ScaleByMuonAuto", "decision_history", "write_history", "HISTORY_FILE"]

HISTORY_FILE = "history.json"


class ScaleByMuonAuto(Transform):
    """Muon direction where the released momentum is above the noise edge, plain momentum elsewhere.

    Args:
        momentum: β ∈ [0, 1) (0.95).
        nesterov: Nesterov blend U = (1−β)g̃ + βM (True).
        ns_steps, ns_coefficients, eps: Newton–Schulz settings (as :class:`~dpopt.transforms.muon.ScaleByMuon`).
        orthogonalizer: ``"newton-schulz"`` or ``"svd"`` (exact polar factor and exact σ₁).
        on_ratio: switch on when ρ > on_ratio (1.1).
        off_ratio: switch off when ρ < off_ratio (1.03); 1 ≤ off_ratio ≤ on_ratio.
        off_scale: the off branch returns ``off_scale · U`` (the lr scaling that follows makes the step
            −lr·off_scale·U; methods set it to off_lr / lr).
        power_iters: power-iteration steps per update (≥ 1; 3).

    Raises:
        ValueError: invalid hyperparameters; a parameter with < 2 dims at ``init``.

    Source: the spectral paper (Shanmugam, Barnes, Taylor 2026) (phase transition; Table 15 for β, NS = 5);
    Benaych-Georges & Nadakuditi 2012 (the edge and the spike); docs/algorithms.md "Spectral diagnostics".
    """

    name = "scale_by_muon_auto"

    def __init__(
        self,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        orthogonalizer: str = "newton-schulz",
        on_ratio: float = 1.1,
        off_ratio: float = 1.03,
        off_scale: float = 1.0,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        power_iters: int = 3,
    ):
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if int(ns_steps) != ns_steps or int(ns_steps) < 1:
            raise ValueError(f"ns_steps must be an integer >= 1, got {ns_steps}")
        if orthogonalizer not in ORTHOGONALIZERS:
            raise ValueError(f"orthogonalizer must be one of {ORTHOGONALIZERS}, got {orthogonalizer!r}")
        if not 1.0 <= float(off_ratio) <= float(on_ratio):
            raise ValueError(
                f"need 1 <= off_ratio <= on_ratio (hysteresis), got off_ratio={off_ratio}, on_ratio={on_ratio}"
            )
        if not float(off_scale) > 0:
            raise ValueError(f"off_scale must be > 0, got {off_scale}")
        if int(power_iters) < 1:
            raise ValueError(f"power_iters must be >= 1, got {power_iters}")
        self.momentum, self.nesterov, self.ns_steps = float(momentum), bool(nesterov), int(ns_steps)
        self.orthogonalizer = orthogonalizer
        self.on_ratio, self.off_ratio, self.off_scale = float(on_ratio), float(off_ratio), float(off_scale)
        self.ns_coefficients = tuple(float(c) for c in ns_coefficients)
        self.eps, self.power_iters = float(eps), int(power_iters)

    def init(self, param: Tensor) -> dict:
        if param.dim() < 2:
            raise ValueError(
                f"ScaleByMuonAuto orthogonalizes matrices; got a parameter of shape "
                f"{tuple(param.shape)}. Route 1-D parameters elsewhere with a Partition"
            )
        cols = as_matrix(param).shape[1]
        gen = torch.Generator().manual_seed(0)  # public, data-independent start vector
        v = torch.randn(cols, generator=gen, dtype=torch.float64).to(param.dtype).to(param.device)
        return {
            "momentum_buffer": torch.zeros_like(param),
            "noise_var": torch.zeros((), dtype=torch.float64, device=param.device),
            "power_vector": v / v.norm(),
            "orthogonalize": torch.zeros((), dtype=torch.bool, device=param.device),
            "decisions": torch.zeros(0, dtype=torch.uint8, device=param.device),
            "ratios": torch.zeros(0, dtype=torch.float32, device=param.device),
        }

    @staticmethod
    def _noise_var(std: Tensor) -> float:
        """Mean per-entry noise variance of a release (0-d or param-shaped std)."""
        return float(std.double().pow(2).mean())

    def update(self, updates, states, params, ctx: StepContext):
        beta = self.momentum
        out = []
        for i, (g, st) in enumerate(zip(updates, states)):
            s2 = self._noise_var(ctx.noise_std[i]) if ctx.noise_std else 0.0
            prev_var = float(st["noise_var"])
            buf = st["momentum_buffer"]
            buf.mul_(beta).add_(g, alpha=1.0 - beta)
            var_m = beta * beta * prev_var + (1.0 - beta) ** 2 * s2
            st["noise_var"].fill_(var_m)
            if self.nesterov:
                u = (1.0 - beta) * g + beta * buf
                var_u = ((1.0 - beta) * (1.0 + beta)) ** 2 * s2 + beta**4 * prev_var
            else:
                u, var_u = buf, var_m
            mat = as_matrix(u)
            rows, cols = mat.shape
            if self.orthogonalizer == "svd":
                sigma1 = float(torch.linalg.matrix_norm(mat.double(), ord=2))
            else:
                sig, st["power_vector"] = top_singular_value(mat, st["power_vector"], self.power_iters)
                sigma1 = float(sig)
            edge = math.sqrt(var_u) * (math.sqrt(rows) + math.sqrt(cols))
            ratio = sigma1 / edge if edge > 0 else math.inf
            on = bool(st["orthogonalize"])
            on = ratio >= self.off_ratio if on else ratio > self.on_ratio
            st["orthogonalize"].fill_(on)
            st["decisions"] = torch.cat([st["decisions"], st["decisions"].new_tensor([int(on)])])
            st["ratios"] = torch.cat([st["ratios"], st["ratios"].new_tensor([min(ratio, 3.0e38)])])
            if on:
                o = orthogonalize(u, self.orthogonalizer, self.ns_steps, self.ns_coefficients, self.eps)  # type: ignore[arg-type]
                out.append(o * math.sqrt(max(1.0, rows / cols)))
            else:
                out.append(u * self.off_scale)
        return out


def _find_auto_states(state: dict) -> Optional[dict]:
    """The ScaleByMuonAuto state inside one parameter's (nested chain/partition) state, or None."""
    if "decisions" in state and "orthogonalize" in state:
        return state
    for value in state.values():
        if isinstance(value, dict):
            found = _find_auto_states(value)
            if found is not None:
                return found
    return None


def decision_history(optimizer, names: Optional[Sequence[str]] = None) -> dict:
    """Per-layer on/off history of every :class:`ScaleByMuonAuto` parameter of an optimizer.

    Args:
        optimizer: a :class:`~dpopt.optim.DPOptimizer` (anything with ``param_groups`` and ``state``).
        names: a name per parameter in param-group order (e.g. from ``model.named_parameters()``);
            default ``"param{i}"``.

    Returns:
        ``{"format": "dpopt.muon_auto.history/1", "layers": [{"name", "shape", "decisions": [0/1 per step],
        "ratios": [ρ per step], "fraction_on"}]}`` — released-value functions only (public).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
    if len(names) != len(params):
        raise ValueError(f"names has {len(names)} entries for {len(params)} parameters")
    layers = []
    for name, p in zip(names, params):
        st = _find_auto_states(optimizer.state.get(p, {}))
        if st is None:
            continue
        dec = [int(x) for x in st["decisions"].tolist()]
        layers.append(
            {
                "name": name,
                "shape": list(p.shape),
                "decisions": dec,
                "ratios": [round(float(x), 5) for x in st["ratios"].tolist()],
                "fraction_on": (sum(dec) / len(dec)) if dec else None,
            }
        )
    return {"format": "dpopt.muon_auto.history/1", "layers": layers}


def write_history(run_dir: Union[str, Path], optimizer, names: Optional[Sequence[str]] = None) -> Optional[Path]:
    """Write :func:`decision_history` to ``run_dir/history.json``; nothing (None) if no layer has one.

    For the training loop's run directory: ``write_history(run_dir, run.optimizer,
    [n for n, p in run.model.named_parameters() if p.requires_grad])``.
    """
    hist = decision_history(optimizer, names)
    if not hist["layers"]:
        return None
    path = Path(run_dir) / HISTORY_FILE
    path.write_text(json.dumps(hist))
    return path
