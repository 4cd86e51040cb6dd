"""``fed.strategy="auto"`` on CPU weighs the host LAPACK work of the local state.

SOAP refreshes its eigenbases with ``eigh``/``qr`` on the host (``fedorth.optim.linalg``). On a CPU
split into devices, a sharded round runs one one-thread call per device side by side, a sequential
round one call at a time on every core. From n = 2048 on, the one-thread calls side by side are
the slower (``fed.execution.resolve_strategy``'s docstring has the figures), so "auto" keeps a
convolutional model on one device when its local state factorizes matrices that large, and shards
it otherwise.
"""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from reliability_helpers import REPO, cli_env  # noqa: F401 -- a fixture

from configs import fedpac_muon, fedpac_soap
from fedorth import fed, models
from fedorth.fed import execution
from fedorth.optim import linalg
from fedorth.train import builders


def test_resolve_strategy_keeps_large_host_factorizations_on_one_device(monkeypatch):
    monkeypatch.setattr(execution, "_dividing_devices", lambda clients_per_round: 2)
    limit = execution.SEQUENTIAL_HOST_MATRIX
    assert limit == 2048
    conv = {"convolutional": True}
    assert execution.resolve_strategy("auto", 4, **conv, host_matrix=limit - 1) == "sharded"
    assert execution.resolve_strategy("auto", 4, **conv, host_matrix=limit) == "sequential"
    assert execution.resolve_strategy("auto", 4, **conv) == "sharded", "work unknown: sharded"
    assert execution.resolve_strategy("auto", 4, host_matrix=limit) == "sequential", "dense"
    assert execution.resolve_strategy("sharded", 4, **conv, host_matrix=limit) == "sharded"
    # Off the CPU the calls are the accelerator's own kernels: the rule does not apply.
    monkeypatch.setattr(execution, "_backend", lambda: "gpu")
    assert execution.resolve_strategy("auto", 4, **conv, host_matrix=limit) == "sharded"


def _soap_cnn_config(dense: int):
    config = fedpac_soap.get_config()
    config.model = {"name": "cnn", "features": (4, 8), "dense_sizes": (dense,), "dtype": "float32"}
    config.fed.clients_per_round = 2
    return config


@pytest.mark.cpu_devices
def test_auto_sizes_the_host_lapack_work_from_the_models_parameters():
    """A CNN's dense layer of width n is a SOAP factor n x n: "auto" runs its FedPAC_SOAP round
    sequential from n = 2048 on, sharded below; the same model under FedPAC_Muon (no host LAPACK)
    is sharded at any width. Only the parameters' shapes are needed (``dry_build``)."""
    for dense, expected in [(2047, "sharded"), (2048, "sequential")]:
        dry = builders.dry_build(_soap_cnn_config(dense))
        assert execution.host_matrix_size(dry.algorithm, dry.params) == dense
        assert dry.round_fn.strategy == expected, dense
    config = fedpac_muon.get_config()
    config.model = _soap_cnn_config(4096).model
    config.fed.clients_per_round = 2
    dry = builders.dry_build(config)
    assert execution.host_matrix_size(dry.algorithm, dry.params) == 0
    assert dry.round_fn.strategy == "sharded"


def test_host_matrix_size_reads_the_marked_states_square_matrices():
    params = {"dense": {"kernel": jax.ShapeDtypeStruct((300, 20), "float32")}}
    soap = fed.get_algorithm("fedpac", {"name": "soap", "learning_rate": 0.1}, beta=0.5)
    adam = fed.get_algorithm("fedavg", {"name": "adamw", "learning_rate": 0.1})
    assert execution.host_matrix_size(soap, params) == 300  # L: 300 x 300, R: 20 x 20
    assert execution.host_matrix_size(adam, params) == 0
    assert execution.host_matrix_size(soap, None) == 0
    state = jax.eval_shape(soap.local_tx.init, params)
    assert linalg.host_matrix_size(state) == 300 and linalg.host_matrix_size({}) == 0
    model = models.get_model("cnn", num_classes=3)
    assert model.convolutional


def test_the_run_command_records_the_sequential_round_of_a_large_soap_factor(tmp_path, cli_env):  # noqa: F811
    """What a user runs: ``experiments.main`` with a config file of their own (a CNN whose dense
    layer is 2048 wide, FedPAC_SOAP, S = 2 on this file's 8 CPU devices): the run is sequential
    and ``run_info.json`` says so."""
    config_file = tmp_path / "soap_cnn.py"
    config_file.write_text(
        "from configs import fedpac_soap\n\n\n"
        "def get_config(arg=None):\n"
        "    config = fedpac_soap.get_config()\n"
        "    config.model = {'name': 'cnn', 'features': (4, 8), 'dense_sizes': (2048,),\n"
        "                    'dtype': 'float32'}\n"
        "    return config\n"
    )
    workdir = tmp_path / "w"
    args = [
        f"--config={config_file}",
        "--config.fed.rounds=1",
        "--config.fed.clients_per_round=2",
        "--config.fed.local_steps=2",
        f"--workdir={workdir}",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.main", *args],
        cwd=REPO,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads((workdir / "run_info.json").read_text())
    assert info["strategy"] == "sequential", info


def test_the_benchs_host_eigh_pairs_time_the_same_decompositions_both_ways():
    """``python -m experiments.bench round --micro`` times two host ``eigh`` in turn (every
    core's thread each) and side by side (one thread each), the measurement behind
    ``SEQUENTIAL_HOST_MATRIX``. Both ways compute the matrices' eigenvalues (float64 NumPy)."""
    from experiments.bench.sections import host_eigh_pairs

    rows = host_eigh_pairs((64, 96), repeats=1, keep_values=True)
    assert [row["n"] for row in rows] == [64, 96]
    for row in rows:
        assert row["in_turn_s"] > 0 and row["side_by_side_s"] > 0
        assert row["side_by_side_over_in_turn"] == row["side_by_side_s"] / row["in_turn_s"]
        for i, m in enumerate(row["matrices"]):
            assert m.dtype == np.float32 and np.array_equal(m, m.T)
            expected = np.linalg.eigvalsh(m.astype(np.float64))
            for values in row["eigenvalues"]:
                np.testing.assert_allclose(values[i], expected, rtol=1e-5, atol=1e-5)
