"""The engine stand-in (specgate_sim.sglang_launch): the patched SGLang command line the
operator renders, served by one simulated pod."""

from __future__ import annotations

import pytest
import yaml

from specgate import api
from specgate_operator import render
from specgate_sim import sglang_launch

from .conftest import ROOT


def _rendered_args(**engine: object) -> list[str]:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-single-gpu.yaml").read_text())
    doc["spec"].setdefault("engine", {}).update(engine)
    return render.engine_args(api.SpecDecodeDeployment.model_validate(doc))


def test_the_rendered_command_line_becomes_one_pod_serving_the_resources_model() -> None:
    args = sglang_launch.parse(_rendered_args())
    assert (args.pods, args.host, args.port) == (1, "0.0.0.0", 30000)
    assert args.model == "llama-8b" and args.threshold == 8 and args.off_step_tokens == 4
    always = [a for a in _rendered_args() if a != "--speculative-disable-batch-threshold"]
    always.remove("8")
    assert sglang_launch.parse(always).threshold is None  # the flag absent: always speculate
    named = sglang_launch.parse(["--model-path", "/models/org/tiny/main/"])
    assert named.model == "main"  # SGLang's default: the path's last part


def test_a_bad_flag_value_names_the_sglang_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sglang_launch.parse(["--model-path", "/m", "--speculative-disable-batch-threshold", "x"])
    assert "--speculative-disable-batch-threshold" in capsys.readouterr().err
