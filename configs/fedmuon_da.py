r"""FedMuon-DA (Fed minimax (Zhang & Gao) Alg. 2/3): Fed-NSGDA-M with Muon's orthogonalized local steps on the
matrix parameters of both the primal and the dual variable, for deep AUC maximization (Fed minimax (Zhang & Gao) §5).

    python -m experiments.main --config=configs/fedmuon_da.py --workdir=runs/fedmuon_da
    python -m experiments.main --config=configs/fedmuon_da.py:sentiment140_homo_p4 --workdir=...

Presets: (default) the embedded Zipf sentiment task on 2 CPU cores; ``{sentiment140,sst2,yelp}_
{homo,hetero}_p{4,8,16}`` (Fed minimax (Zhang & Gao) §5, see configs/minimax_auc.py). ``metrics.jsonl`` carries
``test_auc`` (exact ROC AUC on the test split).

Muon's step has Frobenius norm sqrt(min(m, n)) per matrix, so its learning rate is smaller than
Fed-NSGDA-M's (whose step has norm 1 over the whole variable). Muon orthogonalizes the leaves of
Muon's mask only (dense kernels, not the word embedding, a lookup table:
fedorth.fed.algorithms.minimax), which take the normalized step with the other non-matrix leaves.

Default preset: final test AUC 0.5712 (test accuracy 0.5290; seed 42, 150 rounds). It was 0.6074
(0.5470) while the 1000 x 16 word embedding was orthogonalized too: its step is now a share of
the normalized step of the non-matrix leaves (norm at most 1), where UV^T had norm sqrt(16) = 4.
"""

from configs import minimax_auc


def get_config(arg: str | None = None):
    options = {
        # Weight of the corrected gradient in U (Fed minimax (Zhang & Gao) Alg. 3 line 5):
        # 0.1: "beta is fixed at 0.9" (Fed minimax (Zhang & Gao) §5) read as the usual
        # momentum 0.9 on the old average, as for FedMuon (Zhang & Gao)
        # (fedorth.fed.algorithms.fedmuon_zg gives the reasons).
        "beta_x": 0.1,
        "beta_y": 0.1,  # the same for V
        "dual_lr_ratio": 1.0,  # eta_y / eta_x
        "norm_scope": "variable",  # non-matrix leaves: normalized jointly per variable
    }
    return minimax_auc.get_config(
        "fedmuon_da",
        arg,
        options=options,
        optim={"name": "muon", "learning_rate": 0.03, "ns_steps": 5, "ns_coeffs": "jordan"},
    )
