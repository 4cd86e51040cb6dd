"""Optax transforms: Newton–Schulz/Muon and the LMO family, SOAP, Sophia, federated, minimax."""

from fedorth.optim.biclip import biclip, scale_by_biclip  # noqa: F401
from fedorth.optim.compress import low_rank, low_rank_factors, low_rank_num_floats  # noqa: F401
from fedorth.optim.fafed import FafedState, scale_by_fafed  # noqa: F401
from fedorth.optim.fedmuon_zg import zg_muon_step  # noqa: F401
from fedorth.optim.minimax import (  # noqa: F401
    GradientMeanState,
    ascend_dual,
    gradient_mean,
    make_label_fn,
    minimax_labels,
    minimax_momentum,
    minimax_server_tx,
    scale_by_minimax_step,
    track_gradient_mean,
)
from fedorth.optim.minimax_baselines import (  # noqa: F401
    MomentumState,
    sampled_control_variate,
    smooth_toward_anchor,
    storm_estimator,
    variable_momentum,
)
from fedorth.optim.momentum_vr import (  # noqa: F401
    global_momentum,
    normalize_by_global_norm,
    running_mean,
)
from fedorth.optim.muon import (  # noqa: F401
    MuonState,
    default_muon_mask,
    is_lookup_table,
    is_muon_matrix,
    lmo,
    muon,
    orthogonalize_tree,
    scale_by_lmo,
    scale_by_muon,
)
from fedorth.optim.newton_schulz import (  # noqa: F401
    default_ns_dtype,
    newton_schulz,
    ns_coefficients,
    polar_factor_svd,
)
from fedorth.optim.soap import SoapState, average_soap_states, scale_by_soap, soap  # noqa: F401
from fedorth.optim.sophia import SophiaState, scale_by_sophia, sophia  # noqa: F401
from fedorth.optim.storm import StormState, scale_by_storm  # noqa: F401

# The public API at ``fedorth.optim``, in the order the API reference shows it: the optimizers,
# their directions, orthogonalization, the baselines' transforms, compression, then the states.
__all__ = [
    "muon",
    "soap",
    "sophia",
    "lmo",
    "scale_by_muon",
    "scale_by_soap",
    "scale_by_sophia",
    "scale_by_lmo",
    "newton_schulz",
    "ns_coefficients",
    "polar_factor_svd",
    "orthogonalize_tree",
    "default_ns_dtype",
    "default_muon_mask",
    "is_muon_matrix",
    "is_lookup_table",
    "biclip",
    "scale_by_biclip",
    "scale_by_fafed",
    "scale_by_storm",
    "global_momentum",
    "normalize_by_global_norm",
    "running_mean",
    "zg_muon_step",
    "scale_by_minimax_step",
    "minimax_momentum",
    "track_gradient_mean",
    "gradient_mean",
    "ascend_dual",
    "minimax_server_tx",
    "minimax_labels",
    "make_label_fn",
    "variable_momentum",
    "storm_estimator",
    "sampled_control_variate",
    "smooth_toward_anchor",
    "average_soap_states",
    "low_rank",
    "low_rank_factors",
    "low_rank_num_floats",
    "MuonState",
    "SoapState",
    "SophiaState",
    "FafedState",
    "StormState",
    "GradientMeanState",
    "MomentumState",
]
