r"""Prepares a dataset of the paper presets once, where fedorth reads it.

    python -m experiments.prepare cifar100 [--data_dir=DIR]
    python -m experiments.prepare tiny_imagenet [--data_dir=DIR]
    python -m experiments.prepare emnist [--data_dir=DIR]   # or shakespeare, stackoverflow,
                                                           # cifar100_pachinko
    python -m experiments.prepare --list

fedorth reads TFDS datasets from their prepared ``array_record`` files without TensorFlow
(``fedorth.data.tfds``), but *preparing* one (download, then TFDS's encoding of the examples)
runs TFDS's builders, which encode images with TensorFlow. This command therefore needs the
``prepare`` extra for TFDS datasets::

    pip install -e '.[prepare]'        # adds tensorflow-cpu

and, without TensorFlow, stops with one line saying so (exit 2). Tiny ImageNet is not a TFDS
dataset: its zip is downloaded and extracted with the standard library (no extra needed). The
datasets with natural clients (``emnist``, ``shakespeare``, ``stackoverflow``,
``cifar100_pachinko``; ``fedorth.data.natural``) are TFF's ``.tar.bz2`` archives of HDF5 files
(``fed_emnist_train.h5``, ...), downloaded and unpacked into ``DIR`` with the standard library
(``stackoverflow`` also fetches ``stackoverflow.word_count`` and ``stackoverflow.tag_count``,
which ``stackoverflow_tags`` reads); runs then read them offline (with the ``tff`` extra, h5py).
The embedded datasets (``digits``, ``synthetic``, ``zipf_sentiment``) need nothing.

``DIR`` defaults to ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``, where runs look
(``config.data.data_dir``). A dataset already prepared there is left alone. A download that fails
(no network, a proxy, a moved file) ends with one line naming the dataset, the address and the
reason (exit 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Sequence

EMBEDDED = ("digits", "synthetic", "zipf_sentiment")
TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"


class PrepareError(RuntimeError):
    """A dataset could not be prepared; the message says why and what to do."""

    exit_code = 1


class NeedsTensorFlowError(PrepareError):
    """Preparing a TFDS dataset needs TensorFlow (the ``prepare`` extra)."""

    exit_code = 2


def tfds_datasets() -> list[str]:
    """The datasets of ``fedorth.data`` that TFDS prepares."""
    from fedorth.data import tfds as fedorth_tfds

    return sorted(fedorth_tfds._SPECS)  # noqa: SLF001 -- the loaders' own table


NATURAL = ("emnist", "shakespeare", "stackoverflow", "cifar100_pachinko")


def datasets() -> list[str]:
    """Every name this command accepts."""
    return sorted([*EMBEDDED, *tfds_datasets(), "tiny_imagenet", *NATURAL])


def have_tensorflow() -> bool:
    return importlib.util.find_spec("tensorflow") is not None


def _tfds_prepared(name: str, data_dir: pathlib.Path) -> bool:
    from fedorth.data import tfds as fedorth_tfds

    try:
        fedorth_tfds.open_data_source(name, "train[:1]", data_dir=data_dir)
    except fedorth_tfds.DatasetNotPreparedError:
        return False
    return True


def _tfds_download_and_prepare(name: str, data_dir: pathlib.Path) -> None:
    import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare()


def prepare_tfds(name: str, data_dir: pathlib.Path) -> str:
    """Downloads and prepares TFDS dataset ``name`` as ``array_record`` in ``data_dir``."""
    if _tfds_prepared(name, data_dir):
        return f"{name} is already prepared in {data_dir}."
    if not have_tensorflow():
        raise NeedsTensorFlowError(
            f"preparing {name!r} runs TFDS's builder, which encodes the examples with "
            "TensorFlow, and TensorFlow is not installed: pip install -e '.[prepare]' (or pip "
            f"install tensorflow-cpu), then rerun; or prepare it on another machine and copy "
            f"the folder to {data_dir} (runs read it without TensorFlow)."
        )
    try:
        _tfds_download_and_prepare(name, data_dir)
    except (OSError, urllib.error.URLError, ConnectionError) as e:
        raise PrepareError(
            f"could not download {name!r} into {data_dir}: {type(e).__name__}: {e}. Check the "
            "network (or a proxy); nothing usable was written, rerun to retry."
        ) from e
    return f"{name} prepared in {data_dir}."


def prepare_tiny_imagenet(data_dir: pathlib.Path, url: str = TINY_IMAGENET_URL) -> str:
    """Downloads Tiny ImageNet's zip from ``url`` and extracts ``tiny-imagenet-200/`` into
    ``data_dir`` (what ``fedorth.data.tfds.load_tiny_imagenet`` reads)."""
    target = data_dir / "tiny-imagenet-200"
    if (target / "train").is_dir() and (target / "val" / "val_annotations.txt").is_file():
        return f"tiny_imagenet is already prepared in {target}."
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        archive = pathlib.Path(tmp) / "tiny-imagenet-200.zip"
        try:
            with urllib.request.urlopen(url, timeout=30) as response, archive.open("wb") as f:
                shutil.copyfileobj(response, f)
        except (OSError, urllib.error.URLError) as e:
            reason = getattr(e, "reason", e)
            raise PrepareError(
                f"could not download tiny_imagenet from {url}: {reason}. Check the network (or "
                f"a proxy), or download the zip elsewhere and unzip it into {data_dir}."
            ) from e
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        shutil.move(str(pathlib.Path(tmp) / "tiny-imagenet-200"), target)
    return f"tiny_imagenet prepared in {target}."


def _download(name: str, url: str, target: pathlib.Path, data_dir: pathlib.Path) -> None:
    try:
        with urllib.request.urlopen(url, timeout=30) as response, target.open("wb") as f:
            shutil.copyfileobj(response, f)
    except (OSError, urllib.error.URLError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise PrepareError(
            f"could not download {name} from {url}: {reason}. Check the network (or a proxy), "
            f"or fetch {url} by hand and unpack it into {data_dir} (runs read the files there "
            "offline)."
        ) from e


def prepare_natural(name: str, data_dir: pathlib.Path, url: str | None = None) -> str:
    """Downloads TFF's archive of dataset ``name`` (``url``: a mirror or a ``file://`` copy)
    and unpacks its HDF5 files into ``data_dir``, where ``fedorth.data.natural`` reads them;
    for ``stackoverflow`` also ``stackoverflow.word_count.tar.bz2`` and
    ``stackoverflow.tag_count.tar.bz2`` (tag prediction's labels) from the same folder."""
    from fedorth.data import natural

    source = natural.SOURCES[name]
    files = [data_dir / f for f in source.tff_files]
    extras = []
    if name == "stackoverflow":
        extras = [f for f in natural.STACKOVERFLOW_COUNT_FILES if not (data_dir / f).is_file()]
    if all(f.is_file() for f in files) and not extras:
        return f"{name} is already prepared in {data_dir}."
    data_dir.mkdir(parents=True, exist_ok=True)
    archives = [url or source.tff_url] if not all(f.is_file() for f in files) else []
    beside = (url or source.tff_url).rsplit("/", 1)[0]  # TFF's bucket, or a mirror of it
    archives += [f"{beside}/{extra}.tar.bz2" for extra in extras]
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        for address in archives:
            archive = pathlib.Path(tmp) / address.rsplit("/", 1)[-1]
            _download(name, address, archive, data_dir)
            try:
                with tarfile.open(archive) as tar:
                    members = [m for m in tar.getmembers() if m.isfile()]
                    for member in members:
                        member.name = pathlib.PurePath(member.name).name  # flat, inside tmp
                        tar.extract(member, tmp, filter="data")
                        shutil.move(str(pathlib.Path(tmp) / member.name), data_dir / member.name)
            except tarfile.TarError as e:
                raise PrepareError(
                    f"{address} is not the tar archive of {name} ({e}); fetch it again."
                ) from e
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        address = url or source.tff_url
        raise PrepareError(f"{address} held no {', '.join(missing)}; fetch TFF's archive.")
    return f"{name} prepared in {data_dir}."


def prepare(name: str, data_dir: str | pathlib.Path | None = None, **kwargs) -> str:
    """Prepares dataset ``name``; returns the line to print.

    Raises:
      PrepareError: an unknown name, a missing TensorFlow (:class:`NeedsTensorFlowError`) or a
        failed download.
    """
    from fedorth.data import tfds as fedorth_tfds

    directory = fedorth_tfds.resolve_data_dir(data_dir)
    if name in EMBEDDED:
        return f"{name} is embedded in fedorth: nothing to prepare."
    if name == "tiny_imagenet":
        return prepare_tiny_imagenet(directory, **kwargs)
    if name in NATURAL:
        return prepare_natural(name, directory, **kwargs)
    if name in tfds_datasets():
        return prepare_tfds(name, directory)
    error = PrepareError(f"unknown dataset {name!r}; valid: {', '.join(datasets())}.")
    error.exit_code = 2
    raise error


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.prepare", description=__doc__.splitlines()[0]
    )
    parser.add_argument("name", nargs="?", help="a dataset of fedorth.data.DATASETS")
    parser.add_argument(
        "--data_dir", default=None, help="default: $TFDS_DATA_DIR or ~/tensorflow_datasets"
    )
    parser.add_argument("--list", action="store_true", help="print the dataset names")
    parser.add_argument(
        "--url",
        default=None,
        help="the archive to fetch: a mirror or a local file:// (default: tiny_imagenet's zip, "
        "TFF's archive of a natural-client dataset; stackoverflow's word and tag counts are "
        "fetched from beside it)",
    )
    args = parser.parse_args(argv)
    from absl import logging

    # TFDS warns about the folder it is about to create ("Variant folder ... has no
    # dataset_info.json") when it looks for a prepared copy first: misleading here.
    logging.set_verbosity(logging.ERROR)
    if args.list or not args.name:
        print("\n".join(datasets()))
        return 0
    try:
        kwargs = {}
        if args.name == "tiny_imagenet":
            kwargs = {"url": args.url or TINY_IMAGENET_URL}
        elif args.name in NATURAL:
            kwargs = {"url": args.url}
        print(prepare(args.name, args.data_dir, **kwargs))
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
