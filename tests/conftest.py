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
# A host LAPACK call's own threads (fedorth.optim.linalg.host_threads): multi-threaded OpenBLAS
# rounds differently, and tests/fixtures/fed_golden.json's bytes were made with one.
os.environ.setdefault("FEDORTH_LAPACK_THREADS", "1")

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


# The longest tests, in seconds (a test, or each test of a parametrized function, by its name:
# the names are unique across the files), from ``python -m pytest -n 2 -q --durations=60 tests``
# on a 2-core machine. Only the order of the tests depends on these figures: a test missing here
# counts as _SLOW_SECONDS if it is marked ``slow``, else as 0.
_LONGEST = {
    "test_wheel_runs_every_notebook": 130,
    "test_the_recipe_resumes_after_a_process_is_killed_and_equals_the_single_runs": 92,
    "test_two_jobs_share_a_workdir_and_each_resumes_alone": 88,
    "test_each_task_preset_runs_through_the_command_line": 69,
    "test_a_run_resumed_and_extended_is_one_mlflow_run_with_every_round": 61,
    "test_small_table_signals_resume_and_a_reduced_run_keeps_the_full_command": 58,
    "test_scaffold_on_2_x_2_devices_resumes_after_a_process_is_killed": 54,
    "test_sigkill_resume_equals_uninterrupted_sweep_and_single_runs": 53,
    "test_disk_run_killed_and_run_again_ends_as_an_uninterrupted_run": 51,
    "test_streamed_run_killed_during_a_prefetch_ends_as_an_uninterrupted_run": 50,
    "test_every_kind_of_config_on_two_processes_equals_one_process[fedpac_soap]": 49,
    "test_a_second_job_of_the_same_slice_is_refused_in_one_line": 39,
    "test_sigterm_and_ctrl_c_stop_every_process_at_one_saved_round": 36,
    "test_every_kind_of_config_on_two_processes_equals_one_process[local_sgda]": 36,
    "test_every_kind_of_config_on_two_processes_equals_one_process[fedpac_muon]": 33,
    "test_the_shipped_fedavg_config_runs_on_both_processes": 33,
    "test_every_kind_of_config_on_two_processes_equals_one_process[fedmuon]": 33,
    "test_target_epsilon_calibrates_sigma": 29,
    "test_quick_round_subcommand_writes_json_with_all_fields": 29,
    "test_ctrl_c_twice_during_a_checkpoint_save_exits_cleanly_and_resumes": 27,
    "test_sigterm_saves_the_sweeps_round_and_the_rerun_ends_as_an_uninterrupted_sweep": 26,
    "test_a_sweep_logs_each_replica_as_a_child_of_the_sweeps_run": 26,
    "test_a_full_disk_stops_a_sweep_with_one_line": 25,
    "test_a_single_run_in_a_replica_folder_is_refused_while_the_sweep_runs_and_after": 25,
    "test_a_second_run_on_a_workdir_is_refused_naming_the_holder": 25,
    "test_vmap_chunks_pad_the_last_chunk_and_keep_each_replica": 24,
    "test_one_round_of_a_lora_preset_on_the_fixture": 23,
    "test_sharded_sophia_round_of_a_conv_model_equals_the_sequential_round": 23,
    "test_cli_streamed_run_equals_the_run_loaded_whole": 22,
    "test_a_resume_reads_the_checkpoint_whatever_the_placement": 21,
    "test_each_replica_is_its_single_run[scaffold-sharded]": 21,
    "test_host_lapack_rounds_shard_and_equal_the_sequential_round[fedpac_soap]": 21,
    "test_traced_hyperparameters_compile_one_round_and_each_replica_is_its_single_run": 20,
    "test_normalized_methods_beat_sgda_under_heavy_tailed_noise": 20,
    "test_two_processes_of_the_cli_equal_one_process_over_two_devices": 20,
    "test_quick_start_compiles_little_outside_the_round": 19,
    "test_a_lost_process_stops_the_other_in_seconds_with_one_line[process_1_silent]": 18,
    "test_resume_maps_replicas_by_identity_and_a_grid_may_grow_or_shrink": 18,
    "test_auto_also_chooses_the_convolution_of_a_convolutional_model": 17,
    "test_shakespeare_accuracy_leaves_the_padding_out_and_the_loss_keeps_it": 17,
    "test_a_sweep_writes_each_replicas_dp_epsilon": 17,
}
_SLOW_SECONDS = 10


def _expected_seconds(item) -> float:
    name = item.nodeid.rpartition("::")[2]
    for key in (name, name.partition("[")[0]):
        if key in _LONGEST:
            return _LONGEST[key]
    return _SLOW_SECONDS if item.get_closest_marker("slow") else 0


def _shared_fixtures(item) -> set[str]:
    """The module-, class- and package-scoped fixtures ``item`` asks for, directly or through
    other fixtures (an autouse one, set up again cheaply, excluded)."""
    info = item._fixtureinfo
    autouse = set(info.initialnames) - set(info.argnames)
    return {
        name
        for name, defs in info.name2fixturedefs.items()
        if name not in autouse and defs and defs[-1].scope in ("module", "class", "package")
    }


def pytest_collection_modifyitems(config, items):
    """The longest tests first, longest to shortest, then the others in their collected order.

    With ``-n 2 --dist worksteal`` (pyproject.toml) a worker that runs out of tests takes queued
    ones from the other, but not a test already running: a long test that starts last keeps one
    worker busy while the other idles (the wheel + notebooks test alone is over 2 minutes). Run
    first, the long tests overlap with the short ones the other worker goes through, and the
    last tests are short. Tests of a module that share a module-scoped fixture move together
    (its setup, a whole run for some, is paid once), at the time of the longest of them.
    """
    parent = list(range(len(items)))  # union-find over the items: a unit is a set of them

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple[str, str], int] = {}  # (module, shared fixture) -> its first item
    for i, item in enumerate(items):
        for name in _shared_fixtures(item):
            j = first.setdefault((item.nodeid.partition("::")[0], name), i)
            parent[root(i)] = root(j)
    units: dict[int, list] = {}
    for i, item in enumerate(items):
        units.setdefault(root(i), []).append(item)
    order = sorted(units.values(), key=lambda unit: -max(map(_expected_seconds, unit)))
    items[:] = [item for unit in order for item in unit]


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


@pytest.fixture(scope="session")
def cli_compilation_cache(tmp_path_factory):
    """The persistent compilation cache folder of the tiny config's command-line runs, one per
    test process (tests/reliability_helpers.py's ``cli_env`` says who may write to it)."""
    return tmp_path_factory.mktemp("cli_compilation_cache")


@pytest.fixture(scope="session")
def tiny_reference_run(tmp_path_factory, cli_compilation_cache):
    """The tiny config's command run once per test process (its workdir), which fills
    ``cli_compilation_cache`` (tests/reliability_helpers.py's ``tiny_reference``)."""
    from reliability_helpers import compilation_cache_env, run_tiny_cli

    workdir = tmp_path_factory.mktemp("tiny_reference") / "w"
    env = compilation_cache_env(cli_compilation_cache)
    out = run_tiny_cli(workdir, "--config.fed.rounds=4", "--config.checkpoint_every=1", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir
