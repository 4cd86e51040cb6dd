"""Entry points: `python -m experiments.main` (one run), `.bench` (benchmarks), `.report`.

Importing the package runs before any of its modules loads NumPy, so the process-wide setting
they all need is made once here: one OpenBLAS thread. SOAP's and FedPAC's QR/eigh run SciPy's
LAPACK on the host from inside XLA:CPU (`fedorth.optim.linalg`), and OpenBLAS's own threads spin
against XLA's: 10-20x the CPU time on 2 cores, and lenet5 FedPAC_SOAP's 2-round period 145 ms
against 109 ms with one thread (docs/PERFORMANCE.md). An explicit `OPENBLAS_NUM_THREADS` is kept
(`OPENBLAS_NUM_THREADS=2 python -m experiments.main ...` opts in on a dedicated machine).
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
