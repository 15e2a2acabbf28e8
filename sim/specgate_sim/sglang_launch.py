"""`python3 -m sglang.launch_server ...` in the engine stand-in image: one simulated pod that
takes the patched SGLang's command line as the operator renders it, so an engine pod behaves
like a patched SGLang pod (its API, metrics, threshold control, health) without a GPU or
weights.

It reads the flags that shape what the pod serves: `--host`, `--port`, `--served-model-name`
(else the model path's last part, as SGLang does), `--speculative-disable-batch-threshold`
(absent: speculate at every batch), `--speculative-off-step-tokens`, `--max-running-requests`;
the API key from SGLANG_API_KEY, as the patched engine takes it. Every other SGLang flag
(model paths, dtype, parallelism, memory, metrics, tracing) is accepted and has no effect:
the simulator's profile stands for the model and the GPU. SPECGATE_SIM_PROFILE and
SPECGATE_SIM_TIME_SCALE choose the profile and the speed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from specgate_sim import cli

PROFILE_ENV = "SPECGATE_SIM_PROFILE"
TIME_SCALE_ENV = "SPECGATE_SIM_TIME_SCALE"


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """`specgate sim`'s arguments for one pod, from SGLang's command line."""
    sglang = argparse.ArgumentParser(prog="sglang.launch_server (specgate stand-in)")
    sglang.add_argument("--model-path", required=True)
    sglang.add_argument("--served-model-name")
    sglang.add_argument("--host", default="127.0.0.1")
    sglang.add_argument("--port", default="30000")
    sglang.add_argument("--speculative-disable-batch-threshold", type=cli.threshold_arg)
    sglang.add_argument("--speculative-off-step-tokens", type=cli.off_step_tokens_arg, default=1)
    sglang.add_argument("--max-running-requests", type=int)
    known, _ = sglang.parse_known_args(list(argv))
    threshold = known.speculative_disable_batch_threshold
    model = known.served_model_name or known.model_path.rstrip("/").rsplit("/", 1)[-1]
    sim = argparse.ArgumentParser(prog="sglang.launch_server (specgate stand-in)")
    cli.add_arguments(sim)
    args = [
        "--pods=1",
        f"--host={known.host}",
        f"--port={known.port}",
        f"--model={model}",
        f"--threshold={'none' if threshold is None else threshold}",
        f"--off-step-tokens={known.speculative_off_step_tokens}",
        f"--profile={os.environ.get(PROFILE_ENV) or 'rtx-pro-6000-x8'}",
        f"--time-scale={os.environ.get(TIME_SCALE_ENV) or '1'}",
    ]
    if known.max_running_requests is not None:
        args.append(f"--max-running-requests={known.max_running_requests}")
    return sim.parse_args(args)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(parse(sys.argv[1:] if argv is None else argv))


__all__ = ["PROFILE_ENV", "TIME_SCALE_ENV", "main", "parse"]
