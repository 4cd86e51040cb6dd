"""Shared test settings: 8 fake CPU devices, strict rank promotion, GPU-safe defaults, XLA's
persistent compilation cache (a fresh folder per run).

On a GPU: ``JAX_PLATFORMS=cuda,cpu python -m pytest -n 2 tests`` (docs/PERFORMANCE.md).
"""

import os
import subprocess

import pytest

# Must be set before jax is imported anywhere: the sharded strategy is tested on 8 fake devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Host callbacks (jax.debug.callback: the tests counting Hessian-vector products) run on a CPU
# device; JAX_PLATFORMS=cuda alone leaves none ("failed to find a local CPU device").
# (An empty JAX_PLATFORMS means every platform found, the CPU included.)
if os.environ["JAX_PLATFORMS"] and "cpu" not in os.environ["JAX_PLATFORMS"].split(","):
    os.environ["JAX_PLATFORMS"] += ",cpu"
# By default every JAX process takes 75% of a GPU's memory up front: two xdist workers then
# abort (measured on an H100: 96 failures at -n 4). Allocate on demand instead.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# fedorth.optim.linalg runs LAPACK through NumPy on XLA:CPU; OpenBLAS's own threads spin while
# XLA's threads work (a measured 10-20x CPU overhead on 2 cores): one BLAS thread.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


_SHARED_CACHE = "FEDORTH_TEST_XLA_CACHE"


def _compilation_cache() -> None:
    """XLA's persistent compilation cache, one fresh folder per test session.

    Many tests run the same program several times through fresh closures (a stopped run and its
    resumption, the tiny reliability config in every test of its file): JAX's in-memory caches
    key on the function object and compile each again, the persistent cache keys on the
    program's text and hands back the executable already compiled, the same binary. With xdist
    the controller creates the folder before its workers start (``pytest_configure``) and the
    workers share it, so a program one worker compiled is not compiled again by the other; with
    a size limit set, JAX takes a file lock around every read and write of the folder, so the
    two never see a half-written entry. Set in the pytest processes only, never in the
    environment of the subprocesses the tests start (the CLI runs some tests kill with SIGKILL
    would leave a partial entry). Removed when the session ends.
    """
    if os.environ.get("FEDORTH_TEST_COMPILATION_CACHE", "1") == "0":
        return
    if jax.config.jax_compilation_cache_dir:  # the user's own cache: kept
        return
    folder = os.environ.get(_SHARED_CACHE)
    if folder is None:  # no xdist controller made one: this process's own
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="fedorth-xla-cache-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_compilation_cache_max_size", 2**36)  # a limit turns the lock on


def _share_the_cache_with_workers(config) -> None:
    """In an xdist controller: one cache folder for every worker, removed at the end."""
    if (
        getattr(config.option, "numprocesses", None)
        and not hasattr(config, "workerinput")
        and os.environ.get("FEDORTH_TEST_COMPILATION_CACHE", "1") != "0"
        and _SHARED_CACHE not in os.environ
    ):
        import tempfile

        os.environ[_SHARED_CACHE] = tempfile.mkdtemp(prefix="fedorth-xla-cache-")
        config._fedorth_shared_cache = os.environ[_SHARED_CACHE]


def pytest_unconfigure(config):
    folder = getattr(config, "_fedorth_shared_cache", None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


_compilation_cache()


def pytest_configure(config):
    _share_the_cache_with_workers(config)
    config.addinivalue_line(
        "markers",
        "cpu_devices: asserts what the CPU backend does with this file's 8 fake CPU devices; "
        "skipped on other backends (a GPU run has its own device count and rules).",
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run first (in their collected order), the rest after them.

    With ``-n 2 --dist worksteal`` (pyproject.toml) a worker that runs out of tests takes queued
    ones from the other, but not a test already running: a long test that starts last keeps one
    worker busy while the other idles (the wheel + notebooks test alone is over 2 minutes). Run
    first, the long tests overlap with the short ones the other worker goes through.
    """
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        ids = {id(item) for item in slow}
        items[:] = slow + [item for item in items if id(item) not in ids]


def pytest_runtest_setup(item):
    if item.get_closest_marker("cpu_devices") and (
        jax.default_backend() != "cpu" or jax.device_count() != 8
    ):
        pytest.skip(
            f"needs the CPU backend with 8 fake devices; here {jax.default_backend()} with "
            f"{jax.device_count()}"
        )


@pytest.fixture
def x64():
    """The test runs with 64-bit JAX types (``jax.enable_x64``): the float64 transcriptions of
    the papers' boxes follow the engine in double precision. Request it by name, or for a whole
    module with ``pytestmark = pytest.mark.usefixtures("x64")``."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(autouse=True)
def _float32_newton_schulz(monkeypatch):
    """Newton–Schulz's "auto" dtype is float32 in every test, on every platform.

    On a GPU "auto" means bfloat16 operands (fedorth.optim.newton_schulz.default_ns_dtype),
    about 3e-2 from the exact iteration, and the tests compare Muon-based rounds with float64
    NumPy at float32 round-off. The bfloat16 path is tested by name (ns_dtype="bfloat16") in
    tests/test_newton_schulz.py and tests/test_muon.py, at its own tolerance.
    """
    import sys

    import fedorth.optim.newton_schulz  # noqa: F401  (fedorth.optim re-exports the function)

    module = sys.modules["fedorth.optim.newton_schulz"]
    monkeypatch.setattr(module, "default_ns_dtype", lambda platform=None: "float32")


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs, for a full disk (needs root and mount permission; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no mount command")
    if done.returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)
