"""data.validation_fraction: a held-out split of the training data, evaluated like the test set."""

import numpy as np
import pytest

from configs import fedavg
from fedorth import data as data_lib
from fedorth.train import builders
from fedorth.train.validate import ConfigError, validate


def _rows(x) -> np.ndarray:
    x = np.asarray(x).reshape(len(x), -1)
    return x[np.lexsort(x.T[::-1])]


def test_held_out_examples_leave_the_clients_and_depend_on_the_seed():
    whole = data_lib.load_federated("digits", num_clients=5, partition="iid", seed=3)
    held = data_lib.load_federated(
        "digits", num_clients=5, partition="iid", seed=3, validation_fraction=0.25
    )
    total = whole.x_train.shape[0]
    assert held.x_val.shape[0] == round(0.25 * total)
    assert held.x_train.shape[0] + held.x_val.shape[0] == total
    # The two splits together are the training set (as a multiset of rows), the test set unchanged.
    joined = np.concatenate([np.asarray(held.x_train), np.asarray(held.x_val)])
    np.testing.assert_array_equal(_rows(joined), _rows(whole.x_train))
    np.testing.assert_array_equal(np.asarray(held.x_test), np.asarray(whole.x_test))
    # Every training example kept belongs to exactly one client; none of the validation ones.
    index = np.asarray(held.client_index)
    sizes = np.asarray(held.client_size)
    owned = np.concatenate([index[i, : sizes[i]] for i in range(len(sizes))])
    np.testing.assert_array_equal(np.sort(owned), np.arange(held.x_train.shape[0]))
    other = data_lib.load_federated(
        "digits", num_clients=5, partition="iid", seed=4, validation_fraction=0.25
    )
    assert not np.array_equal(np.asarray(other.x_val), np.asarray(held.x_val))


def test_validation_metrics_are_the_model_on_the_held_out_examples():
    config = fedavg.get_config()
    config.model.hidden_sizes = (16,)
    config.data.validation_fraction = 0.2
    experiment = builders.build(config)
    evaluate = builders.make_eval_fn(experiment)
    out = evaluate(experiment.init_params, experiment.init_model_state)
    x_val, y_val = np.asarray(experiment.data.x_val), np.asarray(experiment.data.y_val)
    logits = np.asarray(
        experiment.model.predict_fn(experiment.init_params, experiment.init_model_state, x_val),
        np.float64,
    )
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -log_softmax[np.arange(len(y_val)), y_val].mean()
    accuracy = (logits.argmax(axis=1) == y_val).mean()
    np.testing.assert_allclose(float(out["val_loss"]), loss, rtol=1e-5)
    np.testing.assert_allclose(float(out["val_accuracy"]), accuracy, rtol=1e-6)
    assert "test_accuracy" in out


@pytest.mark.parametrize("fraction", [1.0, -0.1])
def test_a_fraction_outside_zero_one_is_refused(fraction):
    config = fedavg.get_config()
    config.data.validation_fraction = fraction
    with pytest.raises(
        ConfigError, match=r"data\.validation_fraction=.* valid: a number in \[0, 1\)"
    ):
        validate(config)
