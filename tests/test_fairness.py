"""The presets of the methods a paper's tables compare share what that paper says they share.

A table of a paper compares methods under one experimental setting; a preset that quietly gives
one method another participation, batch, schedule or data split, or that gives one Muon-based
method better-converged Newton–Schulz iterations, a per-layer step scale or a faster fallback
optimizer than the Muon-based method it is compared with, tilts that comparison. For each paper:

* FedPAC (Liu et al.), Tables 1, 3, 12 and 13 (Tables 8 and 10 give the hyperparameters);
* FedMuon (Liu et al.), Table 2 and the ablations of Tables 5-7;
* FedMuon-LMO (bias-corrected LMO), Sec. 7.1 and Appendix G;
* FedMuon (Zhang & Gao), Sec. 7;
* Fed minimax (Zhang & Gao), Sec. 5;

every compared method's preset of one setting has the same setting (clients, participation,
K, batch, rounds, learning-rate schedule, dataset, data split, model), and the Muon-based
methods of one table share the orthogonalization (Newton–Schulz steps and coefficients, or the
exact SVD; the per-layer shape scaling), the momentum form of the paper's box and the rule for
the leaves Muon does not orthogonalize (docs/FIDELITY.md, "Muon-based methods"). The values
are read from the configs, with the code's defaults filled in from the signatures of the
direction factories, so a default that changes in the code is seen here.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import pathlib

import pytest

from fedorth.fed import local

# The package exports the function under the module's name: import the module itself.
fedmuon_bc_module = importlib.import_module("fedorth.fed.algorithms.fedmuon_bc")

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
_MODULES: dict[str, object] = {}


def load(name: str):
    """``configs/<name>.py``, imported by path as ``ml_collections.config_flags`` does."""
    if name not in _MODULES:
        spec = importlib.util.spec_from_file_location(
            f"_test_fairness_{name}", CONFIG_DIR / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[name] = module
    return _MODULES[name]


def presets_of(name: str) -> list[str]:
    return sorted(getattr(load(name), "PRESETS", ()))


def _defaults(fn) -> dict:
    return {
        p.name: p.default
        for p in inspect.signature(inspect.unwrap(fn)).parameters.values()
        if p.default is not inspect.Parameter.empty
    }


def setting(config) -> dict:
    """What a table holds fixed across its methods (not the methods' own hyperparameters)."""
    data = config.data
    schedule = {k: config.optim.get(k) for k in local.SCHEDULE_KEYS if k != "learning_rate"}
    return {
        "dataset": data.name,
        "partition": data.partition,
        "alpha": None if data.partition == "iid" else data.get("alpha"),
        "augment": data.get("augment"),
        "dataset_kwargs": data.get("dataset_kwargs").to_dict() if "dataset_kwargs" in data else {},
        "partition_kwargs": (
            data.get("partition_kwargs").to_dict() if "partition_kwargs" in data else {}
        ),
        "model": config.model.to_dict(),
        "clients": data.num_clients,
        "clients_per_round": config.fed.clients_per_round,
        "local_steps": config.fed.local_steps,
        "batch_size": config.fed.batch_size,
        "rounds": config.fed.rounds,
        "schedule": schedule,
        "seed": config.seed,
        "eval_every": config.eval_every,
    }


# ---------------------------------------------------------------- the Muon-based local steps


def orthogonalization(config) -> dict:
    """Newton–Schulz steps and coefficients, the orthogonalizer and the shape scaling."""
    optim = config.optim.to_dict()
    if optim["name"] == "muon":
        defaults = _defaults(local.DIRECTIONS["muon"])
    elif optim["name"] == "lmo":
        from fedorth.optim.muon import scale_by_lmo

        defaults = _defaults(scale_by_lmo)
    else:
        raise AssertionError(f"{config.fed.algorithm}: optim.name={optim['name']!r} is not Muon")
    fallback = {"orthogonalizer": "newton_schulz", "ns_dtype": "auto", "shape_scaling": "none"}
    keys = ("ns_steps", "ns_coeffs", "orthogonalizer", "shape_scaling", "ns_dtype")
    out = {k: optim.get(k, defaults.get(k, fallback.get(k))) for k in keys}
    if out["ns_dtype"] is None:
        out["ns_dtype"] = "auto"
    if out["orthogonalizer"] == "svd":  # exact UV^T: no Newton–Schulz to compare
        out["ns_steps"] = out["ns_coeffs"] = None
    return out


def momentum_form(config) -> dict:
    """The momentum of the box, as (beta, EMA or accumulation, Nesterov or not)."""
    optim = config.optim.to_dict()
    if config.fed.algorithm == "fedmuon_bc":  # M_i <- (1 - alpha) M_i + alpha grad (Alg. 1 l. 8)
        alpha = config.fed.options.get("alpha", _defaults(fedmuon_bc_module.fedmuon_bc)["alpha"])
        return {"beta": 1.0 - alpha, "ema": True, "nesterov": False}
    defaults = _defaults(local.DIRECTIONS["muon"])
    return {k: optim.get(k, defaults[k]) for k in ("beta", "ema", "nesterov")}


def fallback_rule(config) -> dict:
    """The optimizer of the leaves Muon does not orthogonalize (biases, norm scales)."""
    optim = config.optim.to_dict()
    if config.fed.algorithm == "fedmuon_bc":
        # fedorth.fed.algorithms.fedmuon_bc: the same EMA momentum, then momentum SGD.
        options = config.fed.options.to_dict()
        defaults = _defaults(fedmuon_bc_module.fedmuon_bc)
        ratio = options.get("other_lr_ratio", defaults["other_lr_ratio"])
        alpha = options.get("alpha", defaults["alpha"])
        return {
            "rule": "momentum_sgd",
            "learning_rate": optim["learning_rate"] * ratio,
            "momentum": 1.0 - alpha,
        }
    defaults = _defaults(local.DIRECTIONS["muon"])
    get = lambda key: optim.get(key, defaults.get(key))  # noqa: E731
    if get("fallback") == "momentum_sgd":  # the Muon leaves' own momentum, unorthogonalized
        if get("nesterov"):
            raise AssertionError("teach fallback_rule about the Nesterov momentum SGD fallback")
        return {
            "rule": "momentum_sgd",
            "learning_rate": optim["learning_rate"] * get("fallback_lr_ratio"),
            "momentum": get("beta") if get("ema") else None,  # None: M <- beta M + g
        }
    if get("fallback") not in (None, "adam", "adamw"):
        raise AssertionError(f"unknown fallback {get('fallback')!r}: teach fallback_rule about it")
    return {
        "rule": "adam",
        "learning_rate": optim["learning_rate"] * get("fallback_lr_ratio"),
        "b1": get("fallback_b1"),
        "b2": get("fallback_b2"),
        "eps": get("fallback_eps") if get("fallback_eps") is not None else 1e-8,
    }


def _rounded(d: dict) -> dict:
    """Learning rates as products of a ratio: compare them to 12 significant digits."""
    return {k: (float(f"{v:.12g}") if isinstance(v, float) else v) for k, v in d.items()}


def assert_same(what: str, values: dict[str, dict]) -> None:
    """Every entry of ``values`` (method -> descriptor) equals the first one."""
    (first, reference), *rest = values.items()
    for method, value in rest:
        assert _rounded(value) == _rounded(reference), (
            f"{what}: {method} has {value}, {first} has {reference}"
        )


def assert_settings_shared(methods: list[str], preset: str) -> None:
    configs = {m: load(m).get_config(preset) for m in methods if preset in presets_of(m)}
    assert len(configs) >= 2, (preset, sorted(configs))
    assert_same(f"setting of {preset}", {m: setting(c) for m, c in configs.items()})


# -------------------------------------------------------------------------- FedPAC (Liu et al.)

# Tables 1, 3, 12, 13 (and Table 11 for the light variants).
FEDPAC_COMPARED = [
    "fedavg",
    "local_sgd",
    "scaffold",
    "fedcm",
    "local_adamw",
    "local_sophia",
    "local_muon",
    "local_soap",
    "fedpac_sophia",
    "fedpac_muon",
    "fedpac_soap",
    "fedpac_sophia_light",
    "fedpac_muon_light",
    "fedpac_soap_light",
    "fed_sophia",
    "fedpm",
]
FEDPAC_MUON = ["local_muon", "fedpac_muon", "fedpac_muon_light"]
FEDPAC_SETTINGS = [
    f"{stem}{level}"
    for stem in ("cifar100_resnet18", "cifar100_vit", "tiny_imagenet_resnet18", "tiny_imagenet_vit")
    for level in ("_iid", "_dir0.5", "", "_dir0.05")
] + [f"c4_llama{size}" for size in ("60m", "130m", "350m")]


def test_fedpac_tables_have_every_setting():
    """Tables 12 and 13 add IID and Dir-0.5 to Table 1's Dir-0.1 and Dir-0.05 (all four models)."""
    for method in FEDPAC_COMPARED:
        have = set(presets_of(method))
        vision = [p for p in FEDPAC_SETTINGS if not p.startswith("c4_")]
        wanted = vision if method in ("fed_sophia", "fedpm") else FEDPAC_SETTINGS
        assert not set(wanted) - have, (method, sorted(set(wanted) - have))
    config = load("local_muon").get_config("tiny_imagenet_vit_iid")
    assert config.data.partition == "iid" and config.model.name == "vit_tiny"
    assert load("fedavg").get_config("cifar100_resnet18_dir0.5").data.alpha == 0.5


@pytest.mark.parametrize("preset", FEDPAC_SETTINGS)
def test_fedpac_compared_methods_share_the_setting(preset):
    assert_settings_shared(FEDPAC_COMPARED, preset)


# Baselines that join the CIFAR-100 Dir-0.1 tables of FedPAC (Liu et al.) Table 1 and FedMuon
# (Liu et al.) Table 2 without being in them.
JOINING_BASELINES = ["fedyogi", "fedadagrad", "diloco", "muloco", "feddyn", "fednova", "fedadamw"]


@pytest.mark.parametrize("preset", ["cifar100_resnet18", "cifar100_vit"])
def test_joining_baselines_share_the_cifar100_setting(preset):
    """100 clients, 10% participation, Dir-0.1, K = 50: the setting of the methods they join."""
    assert all(preset in presets_of(m) for m in JOINING_BASELINES)
    assert_settings_shared(["fedavg", *JOINING_BASELINES], preset)
    config = load("fedyogi").get_config(preset)
    federation = (config.data.num_clients, config.fed.clients_per_round, config.fed.local_steps)
    assert federation == (100, 10, 50) and config.data.alpha == 0.1


@pytest.mark.parametrize("preset", FEDPAC_SETTINGS)
def test_fedpac_muon_methods_run_alg6_alg7_alike(preset):
    """Local Muon (Alg. 6) and FedPAC_Muon (Alg. 7; light: Table 11) share one Muon.

    Alg. 6 line 7 / Alg. 7 line 6: ``M <- beta1 M + (1 - beta1) G`` (an EMA, no Nesterov),
    beta1 = 0.9 (Table 8); Alg. 6 line 29: Jordan's quintic coefficients (3.4445, -4.7750,
    2.0315), s = 5; the shape scaling gamma is "optional" (Alg. 7 line 9): none. Biases and
    norms: AdamW at Table 8's AdamW rate 3e-4 with the Muon rows' (beta1, beta2) = (0.9, 0.95)
    -- the rule of configs/presets.py, for every Muon-based method.
    """
    configs = {m: load(m).get_config(preset) for m in FEDPAC_MUON}
    adamw = load("local_adamw").get_config(preset).optim
    for method, config in configs.items():
        assert orthogonalization(config) == {
            "ns_steps": 5,
            "ns_coeffs": "jordan",
            "orthogonalizer": "newton_schulz",
            "shape_scaling": "none",
            "ns_dtype": "auto",
        }, method
        assert momentum_form(config) == {"beta": 0.9, "ema": True, "nesterov": False}, method
        rule = fallback_rule(config)
        assert math.isclose(rule["learning_rate"], adamw.learning_rate, rel_tol=1e-12), (
            f"{method}: fallback lr {rule['learning_rate']} is not the AdamW rate "
            f"{adamw.learning_rate} (Table 8)"
        )
        assert (rule["b1"], rule["b2"], rule["eps"]) == (0.9, 0.95, 1e-8), method
        assert config.optim.learning_rate == 3e-2 and config.optim.weight_decay == 0.01, method
    assert_same(
        f"{preset} orthogonalization", {m: orthogonalization(c) for m, c in configs.items()}
    )
    assert_same(f"{preset} fallback", {m: fallback_rule(c) for m, c in configs.items()})


def _run_rounds(algorithm, data, params, lr, *, rounds=4):
    """The server state after ``rounds`` rounds of 3 of 5 quadratic clients, K = 3
    (``fed_problems.run_rounds``)."""
    import fed_problems as fp

    settings = dict(num_clients=5, clients_per_round=3, local_steps=3, learning_rate=lr)
    # vmap: one small program to compile (auto would shard over 3 fake devices).
    server, _ = fp.run_rounds(
        algorithm, data, rounds=rounds, params=params, strategy="vmap", **settings
    )
    return server


def _preset_algorithm(name: str, preset: str):
    """The algorithm a preset builds, and its constant learning rate (schedule keys dropped)."""
    from fedorth import fed

    config = load(name).get_config(preset)
    optim = {k: v for k, v in config.optim.to_dict().items() if k not in local.SCHEDULE_KEYS}
    optim["name"] = config.optim.name
    algorithm = fed.get_algorithm(config.fed.algorithm, optim, **config.fed.options.to_dict())
    return algorithm, config


JORDAN = (3.4445, -4.7750, 2.0315)  # FedPAC (Liu et al.) Alg. 6 line 29


def test_fedpac_muon_preset_runs_alg7_round_for_round(x64):
    """The FedPAC_Muon preset's optimizer, run by the engine, is Alg. 7 (with Alg. 2's alignment).

    Float64 NumPy transcription, 4 rounds of 3 of 5 quadratic clients, K = 3, the preset's
    lr 3e-2, beta 0.5, beta1 0.9 and weight decay 0.01: M <- beta1 M + (1 - beta1) G (line 6),
    U = NS_5(M) with Alg. 6's quintic (line 8), no gamma (line 9), x <- x - eta [(1 - beta) U +
    beta Delta_G + lambda x] (line 11), Delta_G = -mean(dx) / (K eta) (line 15), clients start
    from the averaged momentum (Alg. 2 lines 3 and 16).
    """
    import fed_problems as fp
    import jax
    import jax.numpy as jnp
    import numpy as np

    algorithm, config = _preset_algorithm("fedpac_muon", "cifar100_vit")
    lr, beta1 = config.optim.learning_rate, config.optim.beta
    mix, wd = config.fed.options.beta, config.optim.weight_decay
    data = fp.quadratic_clients(5, seed=7)
    server = _run_rounds(algorithm, data, {"w": jnp.zeros((4, 3))}, lr)

    w, mbar, dg = np.zeros((4, 3)), np.zeros((4, 3)), np.zeros((4, 3))
    for r in range(4):
        deltas, moms = [], []
        for i in fp.sampled_ids(jax.random.key(0), r, 5, 3):
            x, m = w.copy(), mbar.copy()
            for _ in range(3):
                g = fp.np_grads(data, i, x, np.zeros(3))[0]
                m = beta1 * m + (1 - beta1) * g
                u = fp.np_newton_schulz(m, 5, JORDAN)
                x = x - lr * ((1 - mix) * u + mix * dg + wd * x)
            deltas.append(x - w)
            moms.append(m)
        dg = -np.mean(deltas, axis=0) / (3 * lr)
        w = w + np.mean(deltas, axis=0)
        mbar = np.mean(moms, axis=0)
    np.testing.assert_allclose(server.params["w"], w, rtol=1e-8, atol=1e-11)
    np.testing.assert_allclose(server.global_direction["w"], dg, rtol=1e-8, atol=1e-11)


def test_local_muon_preset_runs_alg6_and_adamw_at_the_adamw_rate_on_biases(x64):
    """The Local Muon preset (FedPAC Table 8 row): Alg. 6 on the matrix, AdamW on the bias.

    Float64 NumPy, 4 rounds of 3 of 5 clients, K = 3, state reset every round: the matrix as in
    Alg. 6 lines 7-13 (EMA momentum 0.9, Jordan's quintic, no gamma, weight decay 0.01); the
    bias with Adam (b1 0.9, b2 0.95, eps 1e-8, bias-corrected from a fresh state) at 3e-4 --
    Table 8's AdamW rate, not the Muon rate 3e-2 -- with the decoupled weight decay at that
    rate too, ``3e-4 * 0.01`` (each parameter group decays at its own rate, as the authors'
    ``SingleDeviceMuonWithAuxAdam`` groups do).
    """
    import fed_problems as fp
    import jax
    import jax.numpy as jnp
    import numpy as np

    algorithm, config = _preset_algorithm("local_muon", "cifar100_vit")
    lr, wd = config.optim.learning_rate, config.optim.weight_decay
    adamw_lr = load("local_adamw").get_config("cifar100_vit").optim.learning_rate
    data = fp.quadratic_clients(5, seed=8)
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    server = _run_rounds(algorithm, data, params, lr)

    w, b = np.zeros((4, 3)), np.zeros(3)
    for r in range(4):
        dws, dbs = [], []
        for i in fp.sampled_ids(jax.random.key(0), r, 5, 3):
            x, y = w.copy(), b.copy()
            m, mu, nu = np.zeros((4, 3)), np.zeros(3), np.zeros(3)
            for step in range(1, 4):
                gw, gb = fp.np_grads(data, i, x, y)
                m = 0.9 * m + 0.1 * gw
                x = x - lr * (fp.np_newton_schulz(m, 5, JORDAN) + wd * x)
                mu, nu = 0.9 * mu + 0.1 * gb, 0.95 * nu + 0.05 * gb**2
                adam = (mu / (1 - 0.9**step)) / (np.sqrt(nu / (1 - 0.95**step)) + 1e-8)
                y = y - adamw_lr * (adam + wd * y)
            dws.append(x - w)
            dbs.append(y - b)
        w, b = w + np.mean(dws, axis=0), b + np.mean(dbs, axis=0)
    np.testing.assert_allclose(server.params["w"], w, rtol=1e-8, atol=1e-11)
    np.testing.assert_allclose(server.params["b"], b, rtol=1e-8, atol=1e-11)


def test_llama_presets_state_the_tokenizer_size_mismatch():
    """Until a subword tokenizer lands, the byte-level LLaMA sizes are stated where they are set."""
    doc = inspect.getsource(load("presets").fedpac_c4)
    for figure in ("25.6M", "85.3M", "303M", "60M", "130M", "350M"):
        assert figure in doc, figure


# ------------------------------------------------------------------------- FedMuon (Liu et al.)

FEDMUON_COMPARED = [
    "fedavg",
    "scaffold",
    "fedcm",
    "fedlada",
    "local_adamw",
    "local_muon",
    "fedmuon",
]
FEDMUON_MUON = ["local_muon", "fedmuon", "fedmuon_svd"]
FEDMUON_SETTINGS = [
    f"fedmuon_liu_cifar100_{model}_dir{alpha}"
    for model in ("resnet18", "vit")
    for alpha in ("0.6", "0.1", "0.05")
]


@pytest.mark.parametrize("preset", FEDMUON_SETTINGS)
def test_fedmuon_table2_methods_share_the_setting(preset):
    assert_settings_shared(FEDMUON_COMPARED + ["fedmuon_svd"], preset)


@pytest.mark.parametrize("preset", FEDMUON_SETTINGS)
def test_fedmuon_muon_methods_run_alg2_alike(preset):
    """Local Muon, FedMuon and FedMuon_SVD share Alg. 2's Muon.

    Alg. 2 line 7: ``M = beta M + G`` (accumulation, beta = 0.98, no Nesterov); line 8: UV^T of
    M, no shape factor; Sec. 3: "five Newton-Schulz iterations" (Jordan et al.'s quintic);
    Sec. 7: "the learning rate of FedMuon and Local Muon" 3e-2 / 2e-2, weight decay 0.01.
    """
    configs = {m: load(m).get_config(preset) for m in FEDMUON_MUON}
    adamw = load("local_adamw").get_config(preset).optim
    for method, config in configs.items():
        assert orthogonalization(config)["shape_scaling"] == "none", method
        assert orthogonalization(config)["ns_coeffs"] == "jordan", method
        assert momentum_form(config) == {"beta": 0.98, "ema": False, "nesterov": False}, method
        rule = fallback_rule(config)
        assert math.isclose(rule["learning_rate"], adamw.learning_rate, rel_tol=1e-12), method
        assert (rule["b1"], rule["b2"], rule["eps"]) == (0.9, 0.95, 1e-8), method
    assert_same(
        f"{preset} orthogonalization", {m: orthogonalization(c) for m, c in configs.items()}
    )
    assert_same(f"{preset} momentum", {m: momentum_form(c) for m, c in configs.items()})
    assert_same(f"{preset} fallback", {m: fallback_rule(c) for m, c in configs.items()})
    assert_same(
        f"{preset} Muon lr and weight decay",
        {m: {"lr": c.optim.learning_rate, "wd": c.optim.weight_decay} for m, c in configs.items()},
    )


def test_fedmuon_ablations_are_named_presets_of_the_table_setting():
    """Tables 5-7 (CIFAR-100, Dir-0.1) as presets; each differs from FedMuon in its knob only."""
    fedmuon = load("fedmuon")
    for model in ("resnet18", "vit"):
        base_name = f"fedmuon_liu_cifar100_{model}_dir0.1"
        reference = fedmuon.get_config(base_name)
        expected = {
            f"fedmuon_liu_table5_{model}_no_mbar": {"momentum_aggregation": False},
            f"fedmuon_liu_table5_{model}_no_deltag": {"alpha": 0.0},
            f"fedmuon_liu_table7_{model}_noagg": {"momentum_aggregation": False},
            f"fedmuon_liu_table7_{model}_agg_m": {},
            **{
                f"fedmuon_liu_table6_{model}_alpha{a:g}": {"alpha": a}
                for a in (0.0, 0.25, 0.5, 0.75, 0.9)
            },
        }
        for name, changed in expected.items():
            config = fedmuon.get_config(name)
            assert setting(config) == setting(reference), name
            assert config.optim.to_dict() == reference.optim.to_dict(), name
            assert config.fed.options.to_dict() == {**reference.fed.options.to_dict(), **changed}
        for beta in (0.8, 0.9, 0.95, 0.98, 0.99):
            config = fedmuon.get_config(f"fedmuon_liu_table6_{model}_beta{beta:g}")
            assert setting(config) == setting(reference)
            assert config.optim.to_dict() == {**reference.optim.to_dict(), "beta": beta}
        # Table 5 right: SGD and AdamW with m-bar and Delta_G, FedMuon's structure.
        for optimizer in ("sgd", "adamw"):
            config = fedmuon.get_config(f"fedmuon_liu_table5_{model}_{optimizer}_mbar_deltag")
            assert setting(config) == setting(reference)
            assert config.fed.algorithm == "fedmuon" and config.optim.name == optimizer
            assert config.fed.options.to_dict() == reference.fed.options.to_dict()
        svd = load("fedmuon_svd").get_config(f"fedmuon_liu_table7_{model}_agg_m_svd")
        assert setting(svd) == setting(reference)
        assert svd.optim.to_dict() == reference.optim.to_dict()


def test_fedmuon_exact_svd_presets():
    """Alg. 2 line 8's exact SVD as a preset variant of FedMuon and Local Muon alike."""
    for method in ("fedmuon", "local_muon"):
        for preset in FEDMUON_SETTINGS:
            config = load(method).get_config(preset + "_exactsvd")
            reference = load(method).get_config(preset)
            assert config.optim.orthogonalizer == "svd"
            assert setting(config) == setting(reference)
            others = {k: v for k, v in config.optim.to_dict().items() if k != "orthogonalizer"}
            assert others == reference.optim.to_dict()
            assert orthogonalization(config)["ns_steps"] is None  # no Newton-Schulz to compare


def test_fedmuon_condition_number_presets():
    """Fig. 4's condition numbers: a flag on the ViT-Tiny Dir-0.1 setting, nothing else changed."""
    for method in ("fedavg", "local_adamw", "local_muon", "fedmuon"):
        config = load(method).get_config("fedmuon_liu_fig4_cifar100_vit_dir0.1")
        reference = load(method).get_config("fedmuon_liu_cifar100_vit_dir0.1")
        assert config.log_condition_number is True and config.model.name == "vit_tiny"
        assert reference.log_condition_number is False
        assert setting(config) == setting(reference)
        assert config.optim.to_dict() == reference.optim.to_dict()


# -------------------------------------------------------- FedMuon-LMO (bias-corrected LMO)

LMO_COMPARED = ["fedavg", "local_adamw", "scaffold", "local_muon", "fedmuon_bc"]
LMO_SETTINGS = [
    f"fedmuon_lmo_{s}_beta{b}" for s in ("fmnist_lenet5", "cifar10_resnet18") for b in ("10", "0.1")
]


@pytest.mark.parametrize("preset", LMO_SETTINGS)
def test_lmo_paper_compared_methods_share_the_setting(preset):
    assert_settings_shared(LMO_COMPARED, preset)
    # "SCAFFOLD (Adam)" (Sec. 7.1, method 4).
    assert setting(load("scaffold").get_config(preset + "_adam")) == setting(
        load("fedmuon_bc").get_config(preset)
    )


@pytest.mark.parametrize("preset", LMO_SETTINGS)
def test_lmo_paper_compared_methods_share_the_round_structure(preset):
    """Every method of Sec. 7.1 keeps its client state between the rounds a client joins and
    takes the partial server step X <- (n - S)/n X + 1/n sum_i X_i (Alg. 1 lines 6 and 18,
    Alg. 3 line 10, Alg. 4 lines 5 and 15): a plain average would take twice that step at
    S = n/2 for the baselines only."""
    from fedorth import fed

    structure = {}
    for method in LMO_COMPARED:
        for name in (preset, preset + "_adam"):
            if name not in presets_of(method):
                continue
            config = load(method).get_config(name)
            algorithm = fed.get_algorithm(
                config.fed.algorithm, config.optim.to_dict(), **config.fed.options.to_dict()
            )
            structure[f"{method}:{name}"] = {
                "client_state": algorithm.start.name,
                "server_rule": algorithm.server.rule.name,
            }
    assert len(structure) == 6, sorted(structure)
    assert_same(f"{preset} round structure", structure)
    assert next(iter(structure.values())) == {
        "client_state": "persistent",
        "server_rule": "partial",
    }


@pytest.mark.parametrize("preset", LMO_SETTINGS)
def test_lmo_paper_muon_methods_are_treated_alike(preset):
    """LocalMuon (Alg. 4) and FedMuon (Alg. 1) of Sec. 7.1 share one inexact LMO.

    Sec. 7.1: "Following the suggestion of Liu et al. (2025a), we changed the scale of the
    stepsize per layer, depending on the dimension" -- 0.2 sqrt(max(m, n)) ("moonlight") on both
    sides; the same Newton–Schulz coefficients and T; the same EMA momentum (alpha = 0.1 on the
    gradient: Alg. 1 line 8, Alg. 4 line 7); the same Muon step size 0.001 (Appendix G).
    """
    configs = {m: load(m).get_config(preset) for m in ("local_muon", "fedmuon_bc")}
    for method, config in configs.items():
        assert orthogonalization(config)["shape_scaling"] == "moonlight", method
        assert config.optim.learning_rate == 0.001, method
    assert_same(
        f"{preset} orthogonalization", {m: orthogonalization(c) for m, c in configs.items()}
    )
    assert_same(f"{preset} momentum", {m: momentum_form(c) for m, c in configs.items()})


@pytest.mark.parametrize("method", ["local_muon", "fedmuon_bc"])
def test_lmo_paper_presets_run_alg4_and_alg1_with_one_lmo(x64, method):
    """The LocalMuon (Alg. 4) and FedMuon (Alg. 1) presets, run by the engine, against float64
    NumPy: the same inexact LMO on the matrix, 0.2 sqrt(max(m, n)) NS_5(.) with Jordan's quintic
    (Sec. 7.1), the same EMA momentum (alpha = 0.1) kept per client, momentum SGD on the bias at
    the method's Appendix G rate, the same partial server step X <- (n - S)/n X + 1/n sum_i X_i;
    FedMuon adds the control variates C_i <- M_i, lmo(M_i - C_i + C). 3 rounds of 3 of 5
    quadratic clients, K = 3, the presets' step sizes."""
    import fed_problems as fp
    import jax
    import jax.numpy as jnp
    import numpy as np

    n, s, k = 5, 3, 3
    algorithm, config = _preset_algorithm(method, "fedmuon_lmo_fmnist_lenet5_beta0.1")
    lr = config.optim.learning_rate
    corrected = method == "fedmuon_bc"
    ratio = config.fed.options.other_lr_ratio if corrected else config.optim.fallback_lr_ratio
    data = fp.quadratic_clients(n, seed=9)
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    server = _run_rounds(algorithm, data, params, lr, rounds=3)

    scale = 0.2 * np.sqrt(4)  # moonlight: 0.2 sqrt(max(m, n)) of the 4 x 3 matrix
    zero = lambda: [np.zeros((4, 3)), np.zeros(3)]  # noqa: E731
    x_server, c = zero(), zero()
    m = [zero() for _ in range(n)]
    ci = [zero() for _ in range(n)]
    for r in range(3):
        xs, dcs = [], []
        for i in fp.sampled_ids(jax.random.key(0), r, n, s):
            (xw, xb), (mw, mb) = [a.copy() for a in x_server], m[i]
            for _ in range(k):
                gw, gb = fp.np_grads(data, i, xw, xb)
                mw, mb = 0.9 * mw + 0.1 * gw, 0.9 * mb + 0.1 * gb
                dw = mw - ci[i][0] + c[0] if corrected else mw
                db = mb - ci[i][1] + c[1] if corrected else mb
                xw = xw - lr * scale * fp.np_newton_schulz(dw, 5, JORDAN)
                xb = xb - lr * ratio * db
            m[i] = [mw, mb]
            dcs.append([mw - ci[i][0], mb - ci[i][1]])
            ci[i] = [mw, mb]
            xs.append([xw, xb])
        x_server = [(n - s) / n * x_server[j] + sum(x[j] for x in xs) / n for j in (0, 1)]
        c = [c[j] + sum(d[j] for d in dcs) / n for j in (0, 1)]
    np.testing.assert_allclose(server.params["w"], x_server[0], rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(server.params["b"], x_server[1], rtol=1e-8, atol=1e-12)


# Appendix G Tables 2-3: "Stepsize of Momentum SGD" (FedMuon's CIFAR-10 row is missing in the
# paper: configs/fedmuon_bc.py uses its FashionMNIST value there too).
APPENDIX_G_SGD_LR = {
    "local_muon": {"fmnist_lenet5": 0.1, "cifar10_resnet18": 0.01},
    "fedmuon_bc": {"fmnist_lenet5": 0.01, "cifar10_resnet18": 0.01},
}


@pytest.mark.parametrize("preset", LMO_SETTINGS)
def test_lmo_paper_non_matrix_leaves_follow_one_rule(preset):
    """Appendix G Table 1: both LocalMuon and FedMuon step their non-matrix leaves with momentum
    SGD at a tuned "Stepsize of Momentum SGD" (not Adam): the same rule (the same EMA momentum)
    on both sides, at each method's own tuned rate."""
    configs = {m: load(m).get_config(preset) for m in ("local_muon", "fedmuon_bc")}
    rules = {m: fallback_rule(c) for m, c in configs.items()}
    kinds = {m: {k: v for k, v in r.items() if k != "learning_rate"} for m, r in rules.items()}
    assert_same(f"{preset} non-matrix rule", kinds)
    assert kinds["fedmuon_bc"] == {"rule": "momentum_sgd", "momentum": 0.9}
    setting_name = preset.split("_beta")[0].removeprefix("fedmuon_lmo_")
    for method, rule in rules.items():
        expected = APPENDIX_G_SGD_LR[method][setting_name]
        assert math.isclose(rule["learning_rate"], expected, rel_tol=1e-12), (method, rule)


# ------------------------------------------------------------------ FedMuon (Zhang & Gao)

# Sec. 7, "Experiment Settings": FedAvg; SCAFFOLD, FedAvg-M/-VR, SCAFFOLD-M/-VR; PAdaMFed(-VR);
# FedAdam, FAFED, Adam-BiClip.
ZG_COMPARED = [
    "fedmuon_zg",
    "fedavg",
    "scaffold",
    "fedadam",
    "fedavg_m",
    "fedavg_vr",
    "scaffold_m",
    "scaffold_vr",
    "padamfed",
    "padamfed_vr",
    "fafed",
    "adam_biclip",
]


@pytest.mark.parametrize("preset", presets_of("fedmuon_zg"))
def test_zhang_gao_compared_methods_share_the_setting(preset):
    assert_settings_shared(ZG_COMPARED, preset)


# --------------------------------------------------------------- Fed minimax (Zhang & Gao)

MINIMAX_COMPARED = [
    "fed_nsgda_m",
    "fedmuon_da",
    "fedsgda_clip",
    "local_sgda",
    "local_sgdam",
    "fedsgda_m",
    "f_sagda",
    "fess_gda",
]


@pytest.mark.parametrize("preset", ["sentiment140_homo_p4", "sst2_hetero_p16", "yelp_homo_p8"])
def test_minimax_compared_methods_share_the_setting(preset):
    """Sec. 5: one preset function (configs/minimax_auc.py) for every minimax method."""
    assert preset in load("minimax_auc").PRESETS
    configs = {m: load(m).get_config(preset) for m in MINIMAX_COMPARED}
    assert_same(f"setting of {preset}", {m: setting(c) for m, c in configs.items()})


# ------------------------------------------------ fine-tuning tables (pretrained checkpoints)

# FedMuon (Liu et al.) Tables 3 (Swin-T) and 4 (RoBERTa-base + LoRA) compare FEDMUON_COMPARED.
FEDMUON_FINETUNE_SETTINGS = ["swin_t_cifar100", "swin_t_tiny_imagenet"] + [
    f"roberta_lora_{task}" for task in ("cola", "rte", "sst2", "qqp", "mrpc", "qnli", "mnli")
]
# FedPAC (Liu et al.) Table 2 / Table 9 (ViT-B/16).
FEDPAC_TABLE9 = [
    "fedavg",
    "scaffold",
    "fedcm",
    "local_adamw",
    "local_sophia",
    "local_muon",
    "local_soap",
    "fedpac_sophia",
    "fedpac_muon",
    "fedpac_soap",
]
FEDPAC_FINETUNE_SETTINGS = ["vit_base_cifar100", "vit_base_tiny_imagenet"]


@pytest.mark.parametrize("preset", FEDMUON_FINETUNE_SETTINGS)
def test_fedmuon_finetune_methods_share_the_setting_and_one_muon(preset):
    """Tables 3-4: one setting (checkpoint, LoRA, split, federation) for the seven methods;
    Local Muon and FedMuon run Alg. 2's Muon (``M = 0.98 M + G``, no shape factor, Jordan's
    quintic) at Sec. 7's fine-tuning rate 3e-3, non-matrix leaves AdamW at the AdamW rate of
    the same presets' Local AdamW (1e-4)."""
    assert_settings_shared(FEDMUON_COMPARED, preset)
    assert all(preset in presets_of(m) for m in FEDMUON_COMPARED), preset
    configs = {m: load(m).get_config(preset) for m in ("local_muon", "fedmuon")}
    adamw = load("local_adamw").get_config(preset).optim
    for method, config in configs.items():
        assert orthogonalization(config)["ns_coeffs"] == "jordan", method
        assert orthogonalization(config)["shape_scaling"] == "none", method
        assert momentum_form(config) == {"beta": 0.98, "ema": False, "nesterov": False}, method
        rule = fallback_rule(config)
        assert math.isclose(rule["learning_rate"], adamw.learning_rate, rel_tol=1e-12), method
        assert (rule["b1"], rule["b2"], rule["eps"]) == (0.9, 0.95, 1e-8), method
        assert (config.optim.learning_rate, config.optim.weight_decay) == (3e-3, 0.01), method
    assert adamw.learning_rate == 1e-4
    assert_same(
        f"{preset} orthogonalization", {m: orthogonalization(c) for m, c in configs.items()}
    )
    assert_same(f"{preset} fallback", {m: fallback_rule(c) for m, c in configs.items()})


@pytest.mark.parametrize("preset", FEDPAC_FINETUNE_SETTINGS)
def test_fedpac_table9_methods_share_the_setting_and_one_muon(preset):
    """Table 2 / Appendix D.5: one setting for Table 9's ten methods; Local Muon and
    FedPAC_Muon run Alg. 6/7's Muon (EMA 0.9, Jordan's quintic, no gamma) at Table 9's 1e-2,
    non-matrix leaves AdamW at Table 9's AdamW rate 1e-4."""
    assert all(preset in presets_of(m) for m in FEDPAC_TABLE9), preset
    assert_settings_shared(FEDPAC_TABLE9, preset)
    configs = {m: load(m).get_config(preset) for m in ("local_muon", "fedpac_muon")}
    adamw = load("local_adamw").get_config(preset).optim
    assert adamw.learning_rate == 1e-4
    for method, config in configs.items():
        assert momentum_form(config) == {"beta": 0.9, "ema": True, "nesterov": False}, method
        assert orthogonalization(config)["ns_coeffs"] == "jordan", method
        rule = fallback_rule(config)
        assert math.isclose(rule["learning_rate"], 1e-4, rel_tol=1e-12), method
        assert (rule["b1"], rule["b2"], rule["eps"]) == (0.9, 0.95, 1e-8), method
        assert (config.optim.learning_rate, config.optim.weight_decay) == (1e-2, 0.01), method
    assert_same(
        f"{preset} orthogonalization", {m: orthogonalization(c) for m, c in configs.items()}
    )
    assert_same(f"{preset} fallback", {m: fallback_rule(c) for m, c in configs.items()})


# ------------------------------------------- one Muon mask for every Muon-based method

# A lookup table (the leaf's name ends in "embedding"), a dense kernel, a bias, a degenerate
# (1, 1, d) token: Muon's default mask orthogonalizes the kernel only.
_MASK_SHAPES = {
    "embed": {"embedding": (7, 5)},
    "dense": {"kernel": (5, 4), "bias": (4,)},
    "cls": (1, 1, 4),
}


def _mask_tree(seed: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s)),
        _MASK_SHAPES,
        is_leaf=lambda s: isinstance(s, tuple),
    )


def test_every_muon_method_orthogonalizes_the_leaves_of_one_mask(x64):
    """Local Muon, FedMuon (Liu et al.), FedPAC_Muon, FedMuon-LMO, FedMuon (Zhang & Gao) and
    FedMuon-DA orthogonalize the leaves of ``default_muon_mask`` and no other: lookup tables and
    degenerate views take each method's rule for the other leaves (docs/FIDELITY.md,
    "Muon-based methods"). Float64 NumPy: FedMuon (Zhang & Gao)'s first step is
    ``-eta (UV^T + lambda X)`` on the kernel and ``-eta (m / ||m||_F + lambda X)`` on the other
    leaves (``M_0`` = the gradient); FedMuon-DA's direction is ``NS(u)`` on the kernel and
    ``u / ||u||`` over the other primal leaves together."""
    import fed_problems as fp
    import jax
    import jax.numpy as jnp
    import numpy as np
    from helpers import fast_jit

    from fedorth import fed
    from fedorth.optim import minimax
    from fedorth.optim.muon import default_muon_mask

    mask = default_muon_mask(_mask_tree(0))
    expected = {
        "embed": {"embedding": False},
        "dense": {"kernel": True, "bias": False},
        "cls": False,
    }
    assert mask == expected
    assert jax.tree.map(lambda m: m == "matrix", local.matrix_labels(_mask_tree(0))) == expected
    params, grads = _mask_tree(1), _mask_tree(2)
    np_g = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
    # FedMuon (Zhang & Gao): obj = <G, X> has gradient G everywhere.
    lr, wd = 0.1, 0.01
    alg = fed.get_algorithm("fedmuon_zg", {"name": "muon", "weight_decay": wd})
    obj = lambda p: sum(  # noqa: E731
        jnp.sum(a * b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(grads), strict=True)
    )
    # One compiled program instead of op-by-op dispatch (far above rounding: rtol 1e-10).
    update = fast_jit(lambda g, s, p: alg.local_tx.update(g, s, p, obj_fn=obj, learning_rate=lr))
    step, _ = update(grads, alg.local_tx.init(params), params)
    kernel = np_g["dense"]["kernel"]
    jordan = (3.4445, -4.7750, 2.0315)
    np.testing.assert_allclose(
        step["dense"]["kernel"],
        -lr * (fp.np_newton_schulz(kernel, 5, jordan) + wd * np.asarray(params["dense"]["kernel"])),
        rtol=1e-10,
    )
    for path in (("embed", "embedding"), ("dense", "bias"), ("cls",)):
        g, p, s = np_g, params, step
        for key in path:
            g, p, s = g[key], p[key], s[key]
        np.testing.assert_allclose(
            s,
            -lr * (g / (np.linalg.norm(g) + 1e-7) + wd * np.asarray(p)),
            rtol=1e-10,
            err_msg=str(path),
        )
    # FedMuon-DA (Fed minimax (Zhang & Gao) Alg. 2/3): all leaves primal here.
    tx = minimax.scale_by_minimax_step(minimax.make_label_fn(), "muon", ns_coeffs="jordan")
    d, _ = fast_jit(tx.update)(grads, tx.init(params))
    np.testing.assert_allclose(
        d["dense"]["kernel"], fp.np_newton_schulz(kernel, 5, jordan), rtol=1e-10
    )
    others = [np_g["embed"]["embedding"], np_g["dense"]["bias"], np_g["cls"]]
    norm = np.sqrt(sum(np.sum(o**2) for o in others))
    for got, g in zip([d["embed"]["embedding"], d["dense"]["bias"], d["cls"]], others, strict=True):
        np.testing.assert_allclose(got, g / norm, rtol=1e-10)


# ----------------------------------------- the default (embedded-data) configs run the boxes

# Each default Muon config runs the Muon of the paper it comes from: FedPAC (Liu et al.) Alg. 6/7
# for Local Muon and FedPAC_Muon(_light), FedMuon (Liu et al.) Alg. 2 for FedMuon(_SVD); the
# previous form (Nesterov, Jordan's factor, Adam at the Muon rate) is the muon_reference preset.
DEFAULT_BOXES = {
    "local_muon": "cifar100_vit",
    "fedpac_muon": "cifar100_vit",
    "fedpac_muon_light": "cifar100_vit",
    "fedmuon": "fedmuon_liu_cifar100_vit_dir0.1",
    "fedmuon_svd": "fedmuon_liu_cifar100_vit_dir0.1",
}


@pytest.mark.parametrize("name", sorted(DEFAULT_BOXES))
def test_default_muon_configs_run_their_papers_box(name):
    """The default config's Muon has the momentum form, orthogonalization and weight decay of
    its paper's preset, and the fallback rule (AdamW (0.9, 0.999) at the AdamW rate of the
    default configs, configs/local_adamw.py); ``muon_reference`` keeps the previous form."""
    default, paper = load(name).get_config(), load(name).get_config(DEFAULT_BOXES[name])
    assert momentum_form(default) == momentum_form(paper)
    assert orthogonalization(default) == orthogonalization(paper)
    assert default.optim.weight_decay == paper.optim.weight_decay == 0.01
    adamw_lr = load("local_adamw").get_config().optim.learning_rate
    rule = fallback_rule(default)
    assert rule["rule"] == "adam" and (rule["b1"], rule["b2"], rule["eps"]) == (0.9, 0.999, 1e-8)
    assert math.isclose(rule["learning_rate"], adamw_lr, rel_tol=1e-12), rule
    reference = load(name).get_config("muon_reference")
    assert momentum_form(reference)["nesterov"] is True
    assert orthogonalization(reference)["shape_scaling"] == "jordan"
    assert fallback_rule(reference)["learning_rate"] == reference.optim.learning_rate
    assert reference.optim.weight_decay == 0.0
    assert momentum_form(reference)["beta"] == {"local_muon": 0.95, "fedmuon": 0.98}.get(name, 0.9)


# ------------------------------------------------------------ the papers' Dirichlet split


def test_every_dirichlet_preset_of_the_papers_is_hsu_et_al():
    """All four papers follow "the Dirichlet partitioning scheme (Hsu et al., 2019)": each client
    draws its class mix ``q_i ~ Dir(alpha 1_C)`` (``dirichlet_hsu``, also what the released code
    of FedMuon (Liu et al.) and FedPAC runs). Every preset of every config that splits by a
    Dirichlet law uses it; the default (embedded-data) configs keep the per-class split."""
    base = load("base")
    seen = 0
    for path in sorted(CONFIG_DIR.glob("*.py")):
        module = load(path.stem)
        get_config = getattr(module, "get_config", None)
        if get_config is None or any(
            p.default is inspect.Parameter.empty
            for p in inspect.signature(get_config).parameters.values()
        ):
            continue  # base, presets, and minimax_auc (shared by the minimax configs)
        default = module.get_config().data.partition
        assert not default.startswith("dirichlet") or default == "dirichlet_label_split", path.stem
        for preset in presets_of(path.stem):
            partition = module.get_config(preset).data.partition
            if partition.startswith("dirichlet") and preset != "muon_reference":
                assert partition == base.PAPER_DIRICHLET == "dirichlet_hsu", (path.stem, preset)
                seen += 1
    assert seen > 300, seen


def test_fidelity_tables_name_every_registered_algorithm():
    """docs/FIDELITY.md says, per algorithm, which box it runs, where, which test checks it and
    which choices it makes: every name of the registry stands (as `name`) in a row of its tables."""
    from fedorth import fed

    doc = CONFIG_DIR.parent / "docs" / "FIDELITY.md"
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| ")]
    missing = [name for name in sorted(fed.ALGORITHMS) if not any(f"`{name}`" in r for r in rows)]
    assert not missing, f"docs/FIDELITY.md has no table row naming {missing}"


def test_citations_follow_the_papers():
    """The papers' identifiers and FedPAC (Liu et al.)'s algorithm numbers, one way everywhere:
    Alg. 1 FedSOA, 2/3 FedPAC, 4/5 Local SOAP / FedPAC_SOAP, 6/7 Local Muon / FedPAC_Muon, 8/9
    Local Sophia / FedPAC_Sophia (the paper's appendix); the LMO paper by its authors."""
    from fedorth import catalog

    papers = (CONFIG_DIR.parent / "docs" / "PAPERS.md").read_text()
    for arxiv in ("2510.27403", "2509.26337", "2510.03866", "2511.04456", "2602.19271"):
        assert f"arXiv:{arxiv}" in papers and f"eprint        = {{{arxiv}}}" in papers, arxiv
    assert "Takezawa" in papers and "Anonymous" not in papers
    assert "Local SOAP / FedPAC_SOAP (Algs. 4 / 5)" in papers
    assert "Local Muon / FedPAC_Muon (Algs. 6 / 7)" in papers
    assert "Local Sophia / FedPAC_Sophia (Algs. 8 / 9)" in papers
    listed = catalog.OPTIMIZER_PAPERS
    assert listed["soap"].endswith("FedPAC (Liu et al.) Alg. 4-5"), listed["soap"]
    assert listed["muon"].endswith("FedPAC (Liu et al.) Alg. 6-7"), listed["muon"]
    assert listed["sophia"].endswith("FedPAC (Liu et al.) Alg. 8-9"), listed["sophia"]
