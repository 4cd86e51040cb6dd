"""``python -m experiments.bench startup``: what a job spends before its rounds.

Runs the quick start job (README's ``python -m experiments.main --config=configs/fedpac_soap.py``,
embedded digits data) as a real process and reports:

* the XLA compilations of the job, those of the round and those outside it (the model's and
  the server state's set-up, the evaluation, the finiteness check), with their seconds;
* the start-up: wall seconds from the process's start to its first round's call (imports, data,
  model, server state, the round-0 evaluation), and its share of the job's wall time.

The job runs under a probe (this module run as ``python -m experiments.bench.startup OUT.json
ARGS...``) that counts ``/jax/core/compile/backend_compile_duration`` events and marks those
made inside the round's call (``fed.RoundFn``, ``fed.MeasuredRoundFn``).

    python -m experiments.bench startup                # the 30 rounds of the quick start
    python -m experiments.bench startup --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from experiments.bench.output import project_commit, write_json

QUICK_START = "configs/fedpac_soap.py"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def probe(out: str, argv: list[str]) -> None:
    """Runs ``experiments.main`` with ``argv``, writing its compilations and the wall clock
    (``time.time()``) of the first round's call to ``out`` at exit."""
    import atexit

    import jax
    from absl import app

    from experiments import main as main_lib
    from fedorth import fed

    events: list[dict[str, Any]] = []
    state = {"in_round": 0, "first_round_t": None}

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            events.append(
                {
                    "fun": str(kwargs.get("fun_name", "")),
                    "s": duration,
                    "in_round": state["in_round"] > 0,
                }
            )

    jax.monitoring.register_event_duration_secs_listener(on_event)

    def marked(call):
        def wrapper(self, *args, **kwargs):
            if state["first_round_t"] is None:
                state["first_round_t"] = time.time()
            state["in_round"] += 1
            try:
                return call(self, *args, **kwargs)
            finally:
                state["in_round"] -= 1

        return wrapper

    for cls in (fed.RoundFn, fed.MeasuredRoundFn):
        cls.__call__ = marked(cls.__call__)

    def dump() -> None:
        with open(out, "w") as f:
            json.dump({"compilations": events, "first_round_t": state["first_round_t"]}, f)

    atexit.register(dump)
    sys.argv = ["experiments.main", *argv]
    app.run(main_lib.main, flags_parser=main_lib.flags_parser)


def measure(rounds: int | None = None, config: str = QUICK_START) -> dict[str, Any]:
    """The figures of one run of the job (``rounds``: ``fed.rounds``, the config's if None)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        argv = [f"--config={config}", f"--workdir={os.path.join(tmp, 'run')}"]
        if rounds is not None:
            argv.append(f"--config.fed.rounds={rounds}")
        start = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "experiments.bench.startup", out, *argv],
            capture_output=True,
            text=True,
        )
        job_s = time.time() - start
        if done.returncode != 0:
            raise RuntimeError(f"the job failed ({done.returncode}): {done.stderr[-2000:]}")
        with open(out) as f:
            probed = json.load(f)
    events = probed["compilations"]
    outside = [e for e in events if not e["in_round"]]
    startup_s = probed["first_round_t"] - start
    return {
        "config": config,
        "rounds": rounds,
        "job_s": job_s,
        "startup_s": startup_s,
        "startup_share": startup_s / job_s,
        "compilations": len(events),
        "compilations_outside_round": len(outside),
        "compile_s_outside_round": sum(e["s"] for e in outside),
        "compile_s_round": sum(e["s"] for e in events if e["in_round"]),
        "outside_round": sorted({e["fun"] for e in outside}),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``python -m experiments.bench startup``."""
    parser = argparse.ArgumentParser(prog="python -m experiments.bench startup")
    parser.add_argument("--config", default=QUICK_START, help="the job's --config")
    parser.add_argument("--rounds", type=int, default=None, help="fed.rounds (config's)")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result = measure(args.rounds, args.config)
    print("| figure | value |\n| --- | --- |")
    print(f"| job wall s | {result['job_s']:.1f} |")
    print(f"| start-up s (to the first round's call) | {result['startup_s']:.1f} |")
    print(f"| start-up share of the job | {result['startup_share']:.0%} |")
    print(f"| compilations | {result['compilations']} |")
    print(
        f"| compilations outside the round | {result['compilations_outside_round']} "
        f"({result['compile_s_outside_round']:.1f} s: {', '.join(result['outside_round'])}) |"
    )
    print(f"| compile s of the round | {result['compile_s_round']:.1f} |")
    if args.json:
        write_json(args.json, {**result, "commit": project_commit()})
    return 0


if __name__ == "__main__":
    probe(sys.argv[1], sys.argv[2:])
