"""Entry points: `python -m experiments.main` (one run; `--list`), `.bench` (benchmarks), `.report`,
`.prepare` (datasets).

Importing the package runs before any of its modules loads NumPy or JAX, so the process-wide
settings they all need are made once here; an explicit value in the environment is kept.

* One OpenBLAS thread. SOAP's and FedPAC's QR/eigh run SciPy's LAPACK on the host from inside
  XLA:CPU (`fedorth.optim.linalg`), and OpenBLAS's own threads spin against XLA's: 10-20x the CPU
  time on 2 cores, and lenet5 FedPAC_SOAP's 2-round period 145 ms against 109 ms with one thread
  (docs/PERFORMANCE.md). `OPENBLAS_NUM_THREADS=2 python -m experiments.main ...` opts out.
  The host LAPACK calls themselves run with `FEDORTH_LAPACK_THREADS` threads (default `auto`:
  the cores divided by the round's CPU devices, while the round waits for the call;
  `fedorth.optim.linalg.host_threads`); `FEDORTH_LAPACK_THREADS=1` keeps them on one thread.
* One JAX CPU device per core, up to 8 (`JAX_NUM_CPU_DEVICES`, unless `XLA_FLAGS` already sets
  `--xla_force_host_platform_device_count`). The round's `"auto"` strategy then lays clients over
  the devices (`fed.resolve_strategy`), each device running its clients one at a time: on the
  2-core machine 1.35-1.45x a one-device round for the CNN, 1.20x for ResNet-18 (convolutional
  models; docs/PERFORMANCE.md "CPU: rounds against the PyTorch peer"). The data and server
  state are replicated on every device used (host memory, once per device), which the cap of 8
  bounds. Accelerator backends are not affected. `JAX_NUM_CPU_DEVICES=1` opts out.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(min(len(os.sched_getaffinity(0)), 8)))
