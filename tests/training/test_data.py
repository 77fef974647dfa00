"""Datasets: bundled digits split, MNIST from npz / IDX (gzipped or not), clear errors."""

import gzip
import struct

import numpy as np
import pytest

from dpopt.data import DataError, load_dataset


def test_digits_fixed_public_split():
    a, b = load_dataset("digits"), load_dataset("digits")
    assert a.x_train.shape == (1437, 64) and a.x_test.shape == (360, 64)
    assert (a.y_train == b.y_train).all() and float(a.x_train.max()) <= 1.0


def _write_idx(path, arr, gz):
    header = struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_from_idx_files(tmp_path, gz):
    rng = np.random.default_rng(0)
    xtr, xte = rng.integers(0, 256, (20, 28, 28)), rng.integers(0, 256, (5, 28, 28))
    ytr, yte = rng.integers(0, 10, 20), rng.integers(0, 10, 5)
    for name, arr in [
        ("train-images-idx3-ubyte", xtr),
        ("train-labels-idx1-ubyte", ytr),
        ("t10k-images-idx3-ubyte", xte),
        ("t10k-labels-idx1-ubyte", yte),
    ]:
        _write_idx(tmp_path / name, arr, gz)
    ds = load_dataset("mnist", tmp_path)
    assert ds.x_train.shape == (20, 1, 28, 28) and ds.y_test.tolist() == yte.tolist()
    expected = (xtr[3, 5, 7] / 255.0 - 0.1307) / 0.3081
    assert float(ds.x_train[3, 0, 5, 7]) == pytest.approx(expected, rel=1e-5)


def test_mnist_from_npz(tmp_path):
    rng = np.random.default_rng(1)
    np.savez(
        tmp_path / "mnist.npz",
        x_train=rng.integers(0, 256, (8, 28, 28), dtype=np.uint8),
        y_train=np.arange(8, dtype=np.uint8),
        x_test=np.zeros((2, 28, 28), np.uint8),
        y_test=np.ones(2, np.uint8),
    )
    ds = load_dataset("mnist", tmp_path)
    assert ds.n_train == 8 and ds.y_train.tolist() == list(range(8))


def test_missing_mnist_names_paths_and_formats(tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset("mnist", tmp_path)
    msg = str(info.value)
    assert str(tmp_path / "mnist.npz") in msg and "train-images-idx3-ubyte" in msg and "IDX" in msg


def test_malformed_files(tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a valid .npz archive"):
        load_dataset("mnist", tmp_path)
    np.savez(tmp_path / "mnist.npz", x_train=np.zeros((2, 28, 28)))
    with pytest.raises(DataError, match="lacks arrays"):
        load_dataset("mnist", tmp_path)
    other = tmp_path / "idx"
    other.mkdir()
    for name in [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ]:
        (other / name).write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x09abc")
    with pytest.raises(DataError, match="header says"):
        load_dataset("mnist", other)


def _good_arrays():
    rng = np.random.default_rng(0)
    return dict(
        x_train=rng.integers(0, 256, (8, 28, 28), dtype=np.uint8),
        y_train=np.arange(8) % 10,
        x_test=rng.integers(0, 256, (4, 28, 28), dtype=np.uint8),
        y_test=np.arange(4),
    )


@pytest.mark.parametrize("damage", ["other bytes", "truncated", "zeroed member", "cifar10"])
def test_corrupt_npz_is_not_a_valid_archive_never_a_pickle(tmp_path, damage):
    """Issue 22: a corrupt mnist.npz got numpy's "Cannot load file containing pickled data when
    allow_pickle=False": the wrong cause, and a nudge towards unpickling a data file."""
    name = "cifar10.npz" if damage == "cifar10" else "mnist.npz"
    np.savez(tmp_path / name, **_good_arrays())
    full = (tmp_path / name).read_bytes()
    broken = {
        "other bytes": b"\x80\x04not an archive" * 40,
        "truncated": full[: len(full) // 2],
        "zeroed member": full[:200] + bytes(300) + full[500:],
        "cifar10": full[: len(full) // 3],
    }[damage]
    (tmp_path / name).write_bytes(broken)
    with pytest.raises(DataError) as err:
        load_dataset("cifar10" if damage == "cifar10" else "mnist", tmp_path)
    msg = str(err.value)
    assert f"{tmp_path / name} is not a valid .npz archive" in msg and "numpy.savez" in msg
    assert "pickle" not in msg.lower()


def test_npz_with_object_arrays_is_refused_without_unpickling(tmp_path):
    np.savez(tmp_path / "mnist.npz", **dict(_good_arrays(), y_test=np.array([0, "a", None, 3], dtype=object)))
    with pytest.raises(DataError, match="array 'y_test' holds Python objects, which dpopt does not load"):
        load_dataset("mnist", tmp_path)


def test_corrupt_npz_through_the_cli(tmp_path):
    from typer.testing import CliRunner

    from dpopt.cli import app

    (tmp_path / "mnist.npz").write_bytes(b"\x80\x04garbage" * 10)
    res = CliRunner().invoke(
        app, ["train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "run")]
    )
    assert res.exit_code == 2, res.output
    assert "is not a valid .npz archive" in res.stderr and "pickle" not in res.stderr.lower()
    assert "Traceback" not in res.output


def test_unknown_dataset_and_missing_dir():
    with pytest.raises(ValueError, match="unknown dataset 'svhn'"):
        load_dataset("svhn")
    with pytest.raises(ValueError, match="data_dir") as info:  # the argument; the CLI shows --data-dir
        load_dataset("mnist")
    assert info.value.arguments == ("data_dir",)


def test_float_images_and_bad_labels_are_refused(tmp_path):
    good = dict(
        x_train=np.zeros((4, 28, 28), np.uint8),
        y_train=np.arange(4, dtype=np.uint8),
        x_test=np.zeros((2, 28, 28), np.uint8),
        y_test=np.ones(2, np.uint8),
    )
    np.savez(tmp_path / "mnist.npz", **dict(good, x_train=np.zeros((4, 28, 28), np.float32)))
    with pytest.raises(DataError, match="dtype float32; expected uint8"):
        load_dataset("mnist", tmp_path)
    np.savez(tmp_path / "mnist.npz", **dict(good, y_train=np.array([0, 1, 15, 2], np.uint8)))
    with pytest.raises(DataError, match="labels 0..9.*0..15"):
        load_dataset("mnist", tmp_path)


def test_missing_files_say_where_to_put_them(tmp_path):
    """Issue 22: the configs read data/; every "not found" error says so (the CLI shows data_dir as --data-dir)."""
    for name, args in (
        ("mnist", (tmp_path,)),
        ("cifar10", (tmp_path,)),
        ("mnist", (tmp_path / "absent",)),
        ("mnist", ()),
    ):
        with pytest.raises(ValueError) as err:
            load_dataset(name, *args)
        msg = str(err.value)
        assert "experiments/*.toml) read data/" in msg and "mkdir data && cp" in msg, msg
        assert err.value.arguments == ("data_dir",)
        assert "shared" not in msg
