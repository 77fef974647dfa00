"""Datasets: scikit-learn's bundled digits (default, no files), MNIST and CIFAR-10 from files.

Nothing is downloaded. MNIST is read from ``data_dir`` as either
``mnist.npz`` (keys ``x_train, y_train, x_test, y_test``) or the four standard
IDX files (``train-images-idx3-ubyte`` …, gzipped or not). CIFAR-10 is read as
``cifar10.npz`` (NHWC uint8) or the standard python-batch files
(``data_batch_1..5``, ``test_batch``, optionally inside ``cifar-10-batches-py/``).

A validation split (:func:`split_validation`) holds out a fixed fraction of the
TRAINING set for hyperparameter choice: those records are never trained on and,
like the test set, get no protection (their metrics are released as they are).

Errors are :class:`~dpopt.errors.ConfigError` (:class:`DataError` for files) and name the
argument to change (``data_dir``, ``validation_fraction``); the CLI shows it as its flag.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .errors import ConfigError

__all__ = [
    "Dataset",
    "DATASETS",
    "DEFAULT_DATA_DIR",
    "load_dataset",
    "DataError",
    "split_validation",
    "validation_indices",
    "validation_size",
    "check_validation_fraction",
    "VALIDATION_SPLIT_SEED",
]

DATASETS = ("digits", "mnist", "cifar10")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
#: Seed of the public permutation that picks the validation records (:func:`validation_indices`).
VALIDATION_SPLIT_SEED = 0
IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
#: Where the repository's experiment configs (experiments/*.toml) read the files: relative to the
#: directory dpopt runs in (the repository root); ignored by git.
DEFAULT_DATA_DIR = "data"
#: What every "not found" error says about where the files go.
WHERE_TO_PUT = (
    f"The experiment configs (experiments/*.toml) read {DEFAULT_DATA_DIR}/ in the directory dpopt runs "
    f"from (the repository root): mkdir {DEFAULT_DATA_DIR} && cp /path/to/mnist.npz /path/to/cifar10.npz "
    f"{DEFAULT_DATA_DIR}/ (README, 'Quick start: MNIST')"
)


class DataError(ConfigError):
    """A dataset could not be found or read; the message names paths and formats.

    A :class:`~dpopt.errors.ConfigError` (so a ``ValueError``); ``arguments``
    names ``data_dir`` where the directory is what to change.
    """


@dataclass(frozen=True)
class Dataset:
    """Normalised float32 tensors. x: ``[N, C, H, W]`` or ``[N, F]``; y: int64 ``[N]``.

    ``x_val``/``y_val`` (None unless a validation split was made, :func:`split_validation`)
    are records held out of training and evaluated like the test set: no protection.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int = 10
    x_val: Optional[torch.Tensor] = None
    y_val: Optional[torch.Tensor] = None

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])


def check_validation_fraction(fraction: float) -> float:
    """``fraction`` as a float if ``0 <= fraction < 1``.

    Raises:
        ConfigError: (naming ``validation_fraction``) not a number in [0, 1).
    """
    try:
        value = float(fraction)
    except (TypeError, ValueError):
        raise ConfigError(
            f"validation_fraction must be a number in [0, 1), got {fraction!r}", "validation_fraction"
        ) from None
    if isinstance(fraction, bool) or not (0.0 <= value < 1.0):
        raise ConfigError(
            f"validation_fraction must be in [0, 1) (the share of the training set held out), got {fraction!r}",
            "validation_fraction",
        )
    return value


def validation_size(n: int, fraction: float) -> int:
    """How many of ``n`` training records a ``fraction`` holds out: ``floor(fraction·n + 1/2)``.

    F·N rounded to the nearest integer, halves rounded up (not Python's
    round-half-to-even): 0.1 × 1437 = 143.7 → 144; 0.5 × 5 = 2.5 → 3.
    """
    return int(math.floor(check_validation_fraction(fraction) * n + 0.5))


def validation_indices(n: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation) indices into a training set of ``n`` records, each sorted ascending.

    The validation records are the first :func:`validation_size` entries of a
    permutation drawn with ``numpy.random.RandomState(VALIDATION_SPLIT_SEED)``
    (the legacy generator, whose stream numpy keeps fixed across versions): a
    public choice that depends on ``n`` and ``fraction`` only — not on the run's
    ``seed`` and not on any record — so every run on the same data with the
    same fraction holds out the same records. The two sets are disjoint and
    cover ``range(n)``.

    Raises:
        ConfigError: (naming ``validation_fraction``) a fraction outside [0, 1),
            or one that leaves no validation record or no training record.
    """
    k = validation_size(n, fraction)
    if k == 0:
        return torch.arange(n), torch.arange(0)
    if k >= n:
        raise ConfigError(
            f"validation_fraction {fraction} holds out all {n} training records; use a smaller fraction",
            "validation_fraction",
        )
    perm = np.random.RandomState(VALIDATION_SPLIT_SEED).permutation(n)
    val = np.sort(perm[:k])
    train = np.sort(perm[k:])
    return torch.from_numpy(train.astype(np.int64)), torch.from_numpy(val.astype(np.int64))


def split_validation(data: Dataset, fraction: float) -> Dataset:
    """``data`` with a fraction of its training set moved to ``x_val``/``y_val`` (:func:`validation_indices`).

    The returned training set is the remaining ``N − floor(F·N + 1/2)`` records
    (in their original order); the test set is the same tensors. ``fraction = 0``
    returns ``data`` itself.

    Privacy: the held-out records are never trained on and get NO protection —
    like test records, metrics computed on them are released as they are. The
    DP guarantee of a run on the returned dataset covers its training records
    (neighbouring = one of them added or removed, the split held fixed).

    Raises:
        ConfigError: (naming ``validation_fraction``) a fraction outside [0, 1),
            one that holds out nothing (F·N < 1/2) or everything, or ``data``
            that already has a validation split.
    """
    if check_validation_fraction(fraction) == 0.0:
        return data
    if data.x_val is not None:
        raise ConfigError(
            "the dataset already has a validation split; give validation_fraction 0 to use it, "
            "or pass the dataset without one",
            "validation_fraction",
        )
    train, val = validation_indices(data.n_train, fraction)
    if len(val) == 0:
        raise ConfigError(
            f"validation_fraction {fraction} of {data.n_train} training records holds out none "
            f"(F·N < 1/2); use at least {0.5 / data.n_train:.2g}",
            "validation_fraction",
        )
    return dataclasses.replace(
        data, x_train=data.x_train[train], y_train=data.y_train[train], x_val=data.x_train[val], y_val=data.y_train[val]
    )


def _digits() -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    # A fixed, public split: 20% test, stratified, seed 0.
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    f = lambda a: torch.tensor(a / 16.0, dtype=torch.float32)  # noqa: E731
    g = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return Dataset("digits", f(x_tr), g(y_tr), f(x_te), g(y_te))


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    if len(data) < 8:
        raise DataError(f"{path} is too short to be an IDX file")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file (bad magic number)")
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} but holds {body.size} bytes")
    return body.reshape(dims)


def _find(base: Path, name: str) -> Optional[Path]:
    for cand in (
        base / name,
        base / (name + ".gz"),
        base / name.replace("-idx", ".idx"),
        base / (name.replace("-idx", ".idx") + ".gz"),
    ):
        if cand.exists():
            return cand
    return None


def _check_arrays(name: str, path: Path, arrays: tuple[np.ndarray, ...], classes: int = 10) -> None:
    """uint8 pixels and labels in range(classes); otherwise say what to change.

    Raises:
        DataError: float images (they would be rescaled twice) or out-of-range labels.
    """
    x_tr, y_tr, x_te, y_te = arrays
    for key, x in (("x_train", x_tr), ("x_test", x_te)):
        if x.dtype != np.uint8:
            raise DataError(
                f"{path}: {name} {key} has dtype {x.dtype}; expected uint8 pixels 0..255 (dpopt normalises them itself)"
            )
    for key, y in (("y_train", y_tr), ("y_test", y_te)):
        if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= classes):
            raise DataError(
                f"{path}: {name} {key} must hold integer labels 0..{classes - 1}, "
                f"got dtype {y.dtype}, range {y.min()}..{y.max()}"
            )


NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _npz_arrays(path: Path) -> tuple[np.ndarray, ...]:
    """The four arrays of a ``.npz`` archive, read without ever unpickling.

    A ``.npz`` file is a zip of ``.npy`` arrays (``numpy.savez``). The zip structure is
    checked first (:func:`zipfile.is_zipfile`): a truncated download or a file of other
    bytes is reported as "not a valid .npz archive" — before, ``numpy.load`` fell back to
    reading it as a pickle and its "allow_pickle=False" message pointed at unpickling,
    which dpopt never does (a pickle can run code). An array of Python objects inside a
    valid archive is refused for the same reason.

    Raises:
        DataError: not a zip archive, an unreadable or corrupt member, an object array,
            or one of x_train, y_train, x_test, y_test missing.
    """
    import zipfile

    def invalid(why: str) -> DataError:
        return DataError(
            f"{path} is not a valid .npz archive ({why}); it may be truncated or damaged: copy it "
            f"again, or write it with numpy.savez(path, x_train=..., y_train=..., x_test=..., "
            f"y_test=...) (uint8 images, integer labels)",
            "data_dir",
        )

    try:
        if not zipfile.is_zipfile(path):
            raise invalid("an .npz file is a zip of .npy arrays; this file is not a zip archive")
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in NPZ_KEYS if k not in npz]
            if missing:
                raise DataError(f"{path} lacks arrays {missing}; expected x_train, y_train, x_test, y_test")
            arrays = []
            for key in NPZ_KEYS:
                try:
                    arrays.append(npz[key])
                except ValueError as exc:
                    if "pickle" in str(exc):  # an object array: dpopt does not unpickle data files
                        raise DataError(
                            f"{path}: array {key!r} holds Python objects, which dpopt does not "
                            "load (unpickling can run code); save numeric arrays (uint8 images, "
                            "integer labels)"
                        ) from None
                    raise invalid(f"array {key!r} cannot be read: {exc}") from None
            return tuple(arrays)
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise invalid(f"{type(exc).__name__} while reading it: {exc}") from None


def _mnist(data_dir: Path) -> Dataset:
    npz = data_dir / "mnist.npz"
    tried = [str(npz)]
    if npz.exists():
        arrays = _npz_arrays(npz)
    else:
        paths = [_find(data_dir, n) for n in IDX_NAMES]
        tried += [str(data_dir / n) + "[.gz]" for n in IDX_NAMES]
        if any(p is None for p in paths):
            raise DataError(
                "MNIST not found. Tried: " + ", ".join(tried) + ". Accepted formats: mnist.npz with "
                "x_train, y_train, x_test, y_test; or the four IDX files (gzipped or not) in data_dir. "
                + WHERE_TO_PUT
                + ".",
                "data_dir",
            )
        arrays = tuple(_read_idx(p) for p in paths)  # type: ignore[arg-type]
    _check_arrays("MNIST", npz if npz.exists() else data_dir, arrays)
    x_tr, y_tr, x_te, y_te = arrays
    if x_tr.shape[1:] != (28, 28) or x_te.shape[1:] != (28, 28) or len(x_tr) != len(y_tr) or len(x_te) != len(y_te):
        raise DataError(
            f"MNIST arrays have unexpected shapes {x_tr.shape}, {y_tr.shape}, {x_te.shape}, "
            f"{y_te.shape}; expected [N, 28, 28] images and [N] labels"
        )
    f = lambda a: ((torch.tensor(a, dtype=torch.float32) / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)  # noqa
    g = lambda a: torch.tensor(a.astype(np.int64))  # noqa: E731
    return Dataset("mnist", f(x_tr), g(y_tr), f(x_te), g(y_te))


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as fh:
        return pickle.load(fh, encoding="bytes")


def _cifar10(data_dir: Path) -> Dataset:
    npz = data_dir / "cifar10.npz"
    tried = [str(npz)]
    if npz.exists():
        x_tr, y_tr, x_te, y_te = _npz_arrays(npz)
    else:
        base = data_dir / "cifar-10-batches-py" if (data_dir / "cifar-10-batches-py").exists() else data_dir
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        tried += [str(base / n) for n in names]
        if not all((base / n).exists() for n in names):
            raise DataError(
                "CIFAR-10 not found. Tried: " + ", ".join(tried) + ". Accepted formats: "
                "cifar10.npz (x_train NHWC uint8, y_train, x_test, y_test) or the python-batch "
                "files data_batch_1..5 and test_batch. " + WHERE_TO_PUT + ".",
                "data_dir",
            )
        batches = [_unpickle(base / n) for n in names]
        xs = [b[b"data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1) for b in batches]
        ys = [np.asarray(b[b"labels"]) for b in batches]
        x_tr, y_tr, x_te, y_te = np.concatenate(xs[:5]), np.concatenate(ys[:5]), xs[5], ys[5]
    _check_arrays("CIFAR-10", npz if npz.exists() else data_dir, (x_tr, y_tr, x_te, y_te))
    if x_tr.shape[1:] != (32, 32, 3):
        raise DataError(f"CIFAR-10 images have shape {x_tr.shape[1:]}, expected (32, 32, 3) (NHWC)")
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    f = lambda a: ((torch.tensor(a, dtype=torch.float32).permute(0, 3, 1, 2) / 255.0) - mean) / std  # noqa
    g = lambda a: torch.tensor(np.asarray(a).astype(np.int64))  # noqa: E731
    return Dataset("cifar10", f(x_tr), g(y_tr), f(x_te), g(y_te))


def load_dataset(name: str, data_dir: Optional[str | Path] = None) -> Dataset:
    """Load a dataset by name.

    Args:
        name: ``digits`` (bundled with scikit-learn; no files), ``mnist`` or ``cifar10``.
        data_dir: directory holding the files for mnist / cifar10 (the repository's configs use
            :data:`DEFAULT_DATA_DIR`, ``data/`` relative to the working directory; nothing is
            looked up without it).

    Raises:
        ConfigError: unknown name, or ``data_dir`` missing for a file-based set.
        DataError: files missing or malformed (message lists paths tried and formats).
    """
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if name == "digits":
        return _digits()
    if data_dir is None:
        raise ConfigError(
            f"dataset {name!r} is read from files: give data_dir, the directory holding them "
            f"(e.g. {DEFAULT_DATA_DIR}/). {WHERE_TO_PUT}",
            "data_dir",
        )
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise DataError(
            f"data_dir {path} is not a directory (looked for from {Path.cwd()}). {WHERE_TO_PUT}", "data_dir"
        )
    return _mnist(path) if name == "mnist" else _cifar10(path)
