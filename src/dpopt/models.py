"""The papers' models, and the check that a model is valid under DP.

* ``mlp`` (MNIST): 784-1000-10 ReLU, 795,010 parameters (arXiv:2606.05435 §IV).
* ``mlp-small`` (digits): 64-64-10 ReLU, 4,810 parameters.
* ``cnn5`` (CIFAR-10): 582,346 parameters; layer list fixed in docs/algorithms.md
  ("Models") since the paper's is not available.
* ``wrn16-4`` (CIFAR-10): Wide ResNet 16-4 (Zagoruyko & Komodakis 2016, pre-activation
  blocks, widths 16/64/128/256, 2 blocks per group, bias-free convolutions, 1×1
  projection shortcuts where the shape changes) with GroupNorm(16 groups) in place of
  BatchNorm, as in De et al. 2022 (arXiv:2204.13650): 2,748,890 parameters — the
  standard BatchNorm count, since GroupNorm has the same per-channel affine weight and bias.
* ``resnet18`` (CIFAR-10): ResNet-18 for 32×32 inputs (He et al. 2016; 3×3 stem, no
  max-pool, BasicBlocks 2-2-2-2 with widths 64/128/256/512, bias-free convolutions,
  1×1 projection shortcuts) with GroupNorm(32 groups): 11,173,962 parameters, again
  the BatchNorm count.
* ``cnn5-ws`` and ``wrn16-4-ws``: the same networks with every convolution a
  :class:`WSConv2d` (scaled weight standardization, Qiao et al. 2019, arXiv:1903.10520;
  Brock et al. 2021, arXiv:2101.08692), the GroupNorm + WS combination De et al. 2022
  use for DP training from scratch; same parameter counts.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .errors import ConfigError

__all__ = ["MODELS", "DEFAULT_MODEL", "WSConv2d", "build_model", "check_model", "num_parameters"]

MODELS = ("mlp-small", "mlp", "cnn5", "cnn5-ws", "wrn16-4", "wrn16-4-ws", "resnet18")
DEFAULT_MODEL = {"digits": "mlp-small", "mnist": "mlp", "cifar10": "cnn5"}
_INPUT = {"mlp-small": 64, "mlp": 784}


def _mlp(inputs: int, hidden: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, classes))


class WSConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose forward uses the scaled, standardized weight ŵ (weight standardization).

    Per output channel o, over its n = (C_in/groups)·kh·kw raw weights w_o
    (biased variance)::

        ŵ_o = (w_o − mean(w_o)) · r_o,   r_o = (n · var(w_o) + eps)^(−1/2)

    so ‖ŵ_o‖² ≈ 1 and the layer's output keeps its input's scale (the 1/√n of
    "scaled" WS, Brock et al. 2021, arXiv:2101.08692 eq. 2 without their learnable
    gain — every WS convolution of the zoo is followed by a GroupNorm whose affine
    weight plays that role; Qiao et al. 2019, arXiv:1903.10520). The trainable
    parameter is the RAW ``weight``; the standardization is part of the forward,
    so autograd (and dpopt's per-example engines, :mod:`dpopt.engine.ws`) give
    the gradient w.r.t. the raw weight, which is what DP clips:
    ∂L/∂w_o = r_o (g_o − mean(g_o) − ŵ_o ⟨g_o, ŵ_o⟩) with g_o = ∂L/∂ŵ_o.

    Args: those of ``nn.Conv2d``, plus ``eps`` (default 1e-4, added to n·var).
    Shapes: input ``[B, C_in, H, W]`` → output ``[B, C_out, H', W']`` as ``nn.Conv2d``.
    """

    def __init__(self, *args, eps: float = 1e-4, **kwargs):
        super().__init__(*args, **kwargs)
        if not eps > 0:
            raise ValueError(f"WSConv2d eps must be > 0, got {eps}")
        self.eps = float(eps)

    def standardized(self, weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(ŵ [C_out, C_in/groups, kh, kw], r [C_out, 1])`` of ``weight`` (default: ``self.weight``)."""
        w = self.weight if weight is None else weight
        flat = w.reshape(w.shape[0], -1)
        var, mean = torch.var_mean(flat, dim=1, unbiased=False, keepdim=True)
        r = torch.rsqrt(var * flat.shape[1] + self.eps)
        return ((flat - mean) * r).reshape(w.shape), r

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.standardized()[0], self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", eps={self.eps:g}"


def _cnn5(classes: int = 10, groups: int = 8, conv: type = nn.Conv2d) -> nn.Module:
    def block(cin: int, cout: int, pool: bool) -> list[nn.Module]:
        layers = [conv(cin, cout, 3, padding=1), nn.GroupNorm(groups, cout), nn.ReLU()]
        return layers + [nn.MaxPool2d(2)] if pool else layers

    return nn.Sequential(
        *block(3, 32, True),
        *block(32, 64, True),
        *block(64, 64, False),
        nn.Flatten(),
        nn.Linear(8 * 8 * 64, 128),
        nn.ReLU(),
        nn.Linear(128, classes),
    )


class _WideBlock(nn.Module):
    """Pre-activation wide-ResNet block: GN-ReLU-conv3×3-GN-ReLU-conv3×3, plus a 1×1 projection if needed."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int, conv: type = nn.Conv2d):
        super().__init__()
        self.gn1, self.conv1 = nn.GroupNorm(groups, cin), conv(cin, cout, 3, stride, 1, bias=False)
        self.gn2, self.conv2 = nn.GroupNorm(groups, cout), conv(cout, cout, 3, 1, 1, bias=False)
        self.shortcut = conv(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x: Tensor) -> Tensor:
        o = nn.functional.relu(self.gn1(x))
        short = x if self.shortcut is None else self.shortcut(o)
        out = self.conv1(o)
        out = self.conv2(nn.functional.relu(self.gn2(out)))
        return out + short


class WideResNet(nn.Module):
    """WRN-depth-k for 32×32 inputs with GroupNorm: (depth − 4)/6 blocks per group, widths 16, 16k, 32k, 64k.

    ``conv``: the convolution class (``nn.Conv2d``, or :class:`WSConv2d` for ``wrn16-4-ws``).
    """

    def __init__(self, depth: int = 16, width: int = 4, classes: int = 10, groups: int = 16, conv: type = nn.Conv2d):
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WRN depth must be 6n + 4, got {depth}")
        n, widths = (depth - 4) // 6, [16, 16 * width, 32 * width, 64 * width]
        self.conv = conv(3, widths[0], 3, 1, 1, bias=False)
        blocks, cin = [], widths[0]
        for i, cout in enumerate(widths[1:]):
            for j in range(n):
                blocks.append(_WideBlock(cin, cout, 2 if (i > 0 and j == 0) else 1, groups, conv))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.gn = nn.GroupNorm(groups, cin)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = nn.functional.relu(self.gn(self.blocks(self.conv(x))))
        return self.fc(h.mean(dim=(2, 3)))


class _BasicBlock(nn.Module):
    """ResNet BasicBlock: conv3×3-GN-ReLU-conv3×3-GN, + identity or 1×1 projection (conv + GN), ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1, self.gn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(groups, cout)
        self.conv2, self.gn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.GroupNorm(groups, cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(groups, cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        out = nn.functional.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return nn.functional.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class ResNet18(nn.Module):
    """ResNet-18 for 32×32 inputs (3×3 stem, no max-pool) with GroupNorm."""

    def __init__(self, classes: int = 10, groups: int = 32):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.GroupNorm(groups, 64)
        blocks, cin = [], 64
        for i, cout in enumerate((64, 128, 256, 512)):
            for j in range(2):
                blocks.append(_BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1, groups))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(nn.functional.relu(self.gn(self.conv(x))))
        return self.fc(h.mean(dim=(2, 3)))


def build_model(name: str, dataset: str | None = None) -> nn.Module:
    """Build a model by name (``mlp-small``, ``mlp``, ``cnn5``, ``cnn5-ws``, ``wrn16-4``, ``wrn16-4-ws``, ``resnet18``).

    Raises:
        ConfigError: unknown name, or a model that does not fit the dataset's inputs (argument ``model``).
    """
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    expected = {
        "digits": ("mlp-small",),
        "mnist": ("mlp",),
        "cifar10": ("cnn5", "cnn5-ws", "wrn16-4", "wrn16-4-ws", "resnet18"),
    }
    if dataset is not None and dataset in expected and name not in expected[dataset]:
        raise ConfigError(
            f"model {name!r} does not take {dataset} inputs; use model {' or '.join(expected[dataset])}", "model"
        )
    if name in ("cnn5", "cnn5-ws"):
        return _cnn5(conv=WSConv2d if name == "cnn5-ws" else nn.Conv2d)
    if name in ("wrn16-4", "wrn16-4-ws"):
        return WideResNet(16, 4, conv=WSConv2d if name == "wrn16-4-ws" else nn.Conv2d)
    if name == "resnet18":
        return ResNet18()
    return _mlp(_INPUT[name], 64 if name == "mlp-small" else 1000)


def num_parameters(model: nn.Module) -> int:
    """Number of trainable parameters d."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_model(model: nn.Module) -> None:
    """Refuse layers whose per-sample gradients (and with them the privacy claim) would be invalid.

    Static properties of the model only; what depends on the forward pass
    (an example axis that is not dim 0, examples mixed) is checked by the
    engines on the first batch.

    Raises:
        ValueError: naming the layer and the fix, for

            * BatchNorm: mixes the examples of a batch (use GroupNorm/LayerNorm);
            * InstanceNorm with ``track_running_stats=True``: its running
              statistics are un-noised functions of private batches, released
              with the model (use ``track_running_stats=False``). Any other
              buffer a forward pass changes is refused at run time
              (:func:`~dpopt.engine.inputs.buffers_unchanged`);
            * ``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm``: the forward
              renormalises the looked-up weight rows *in place*, so which rows
              change depends on private tokens — an un-noised change to the
              released weights (use ``max_norm=None``);
            * ``sparse=True`` embeddings: sparse gradients are not supported
              (use ``sparse=False``).
    """
    for name, module in model.named_modules():
        where = f"layer {name or '<root>'!r} is {type(module).__name__}"
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                f"{where}: batch normalisation mixes "
                "examples, so per-sample gradients (and the privacy claim) would be invalid. Replace it "
                "with nn.GroupNorm (or LayerNorm)."
            )
        if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            raise ValueError(
                f"{where} with track_running_stats=True: its running mean/variance are un-noised "
                "statistics of the private batches and would be released with the model. Use "
                "track_running_stats=False (or GroupNorm)."
            )
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            if module.max_norm is not None:
                raise ValueError(
                    f"{where} with max_norm={module.max_norm}: its forward renormalises the looked-up rows "
                    "of the weight in place, so the released weights would change depending on which private "
                    "tokens were seen, without noise. Use max_norm=None (clip or normalise the embedding "
                    "output in forward instead if needed)."
                )
            if module.sparse:
                raise ValueError(
                    f"{where} with sparse=True: sparse gradients are not supported by the "
                    "per-sample engines. Use sparse=False."
                )
