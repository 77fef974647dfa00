"""The papers' models, and the check that a model is valid under DP.

* ``mlp`` (MNIST): 784-1000-10 ReLU, 795,010 parameters (arXiv:2606.05435 §IV).
* ``mlp-small`` (digits): 64-64-10 ReLU, 4,810 parameters.
* ``cnn5`` (CIFAR-10): 582,346 parameters; layer list fixed in docs/algorithms.md
  ("Models") since the paper's is not available.
"""

from __future__ import annotations

from torch import nn

from .errors import ConfigError

__all__ = ["MODELS", "DEFAULT_MODEL", "build_model", "check_model", "num_parameters"]

MODELS = ("mlp-small", "mlp", "cnn5")
DEFAULT_MODEL = {"digits": "mlp-small", "mnist": "mlp", "cifar10": "cnn5"}
_INPUT = {"mlp-small": 64, "mlp": 784}


def _mlp(inputs: int, hidden: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def _cnn5(classes: int = 10, groups: int = 8) -> nn.Module:
    def block(cin: int, cout: int, pool: bool) -> list[nn.Module]:
        layers = [nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(groups, cout), nn.ReLU()]
        return layers + [nn.MaxPool2d(2)] if pool else layers

    return nn.Sequential(*block(3, 32, True), *block(32, 64, True), *block(64, 64, False),
                         nn.Flatten(), nn.Linear(8 * 8 * 64, 128), nn.ReLU(), nn.Linear(128, classes))


def build_model(name: str, dataset: str | None = None) -> nn.Module:
    """Build a model by name (``mlp-small``, ``mlp``, ``cnn5``).

    Raises:
        ConfigError: unknown name, or a model that does not fit the dataset's inputs (argument ``model``).
    """
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    expected = {"digits": ("mlp-small",), "mnist": ("mlp",), "cifar10": ("cnn5",)}
    if dataset is not None and dataset in expected and name not in expected[dataset]:
        raise ConfigError(f"model {name!r} does not take {dataset} inputs; use model "
                          f"{' or '.join(expected[dataset])}", "model")
    if name == "cnn5":
        return _cnn5()
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
                "with nn.GroupNorm (or LayerNorm).")
        if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            raise ValueError(
                f"{where} with track_running_stats=True: its running mean/variance are un-noised "
                "statistics of the private batches and would be released with the model. Use "
                "track_running_stats=False (or GroupNorm).")
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            if module.max_norm is not None:
                raise ValueError(
                    f"{where} with max_norm={module.max_norm}: its forward renormalises the looked-up rows "
                    "of the weight in place, so the released weights would change depending on which private "
                    "tokens were seen, without noise. Use max_norm=None (clip or normalise the embedding "
                    "output in forward instead if needed).")
            if module.sparse:
                raise ValueError(f"{where} with sparse=True: sparse gradients are not supported by the "
                                 "per-sample engines. Use sparse=False.")
