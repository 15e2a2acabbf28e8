"""The worker-image patch, checked on the CPU: it applies cleanly to the pinned SGLang 0.5.17
wheel and compiles, and the pure logic it adds agrees with specgate's control contract.

The GPU half (runtime control, output identity, speed) is lab/gpu/, run on a GPU
machine; its results are in lab/GPU-NOTEBOOK.md.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from specgate import contract

from .conftest import ROOT, load_module

WHEELS = ROOT / ".tools" / "wheels"
PATCH_DIR = ROOT / "worker-image" / "patches"


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned SGLang wheel, unpacked and patched with worker-image/apply-patch.sh."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    if not list(WHEELS.glob("sglang-0.5.17-*.whl")):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "sglang==0.5.17",
                "-d",
                str(WHEELS),
            ],
            check=True,
            timeout=600,
        )
    (wheel,) = WHEELS.glob("sglang-0.5.17-*.whl")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    result = subprocess.run(
        ["bash", str(ROOT / "worker-image" / "apply-patch.sh"), str(site)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "patched and compiled" in result.stdout
    return site


def test_patch_does_not_apply_twice(patched_site: Path) -> None:
    apply = str(ROOT / "worker-image" / "apply-patch.sh")
    result = subprocess.run(
        ["bash", apply, str(patched_site)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0


def test_apply_refuses_another_version(tmp_path: Path) -> None:
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "_version.py").write_text("__version__ = version = '0.5.16'\n")
    apply = str(ROOT / "worker-image" / "apply-patch.sh")
    result = subprocess.run(
        ["bash", apply, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "0.5.17" in result.stderr


def _module(site: Path) -> ModuleType:
    # spec_threshold.py imports nothing from SGLang at module level.
    path = site / "sglang" / "srt" / "speculative" / "spec_threshold.py"
    return load_module(path, "spec_threshold_under_test")


CASES: list[tuple[Any, Any]] = [
    (None, None),
    (0, 0),
    (3, 3),
    (4096, 4096),
    (-1, "error"),
    (2.5, "error"),
    (4.0, "error"),
    ("3", "error"),
    (True, "error"),
    (False, "error"),
    ([4], "error"),
    (1 << 21, "error"),
]


@pytest.mark.parametrize(("value", "expected"), CASES)
def test_patch_validates_like_the_contract(value: Any, expected: Any, patched_site: Path) -> None:
    module = _module(patched_site)
    for parse, error in (
        (module.parse_threshold, module.ThresholdError),
        (contract.parse_threshold, contract.ThresholdError),
    ):
        if expected == "error":
            with pytest.raises(error):
                parse(value)
        else:
            assert parse(value) == expected


def test_patch_decides_the_mode_like_the_contract(patched_site: Path) -> None:
    module = _module(patched_site)
    for threshold in (None, 0, 1, 8):
        for batch in (0, 1, 2, 8, 9, 64):
            assert module.speculates(batch, threshold) == contract.speculates(batch, threshold)


def test_controller_switches_states_by_batch(patched_site: Path) -> None:
    module = _module(patched_site)

    class Worker:
        speculative_num_steps = 3
        applied: list[int] = []

        def build_adaptive_runtime_state(self, **kw: Any) -> Any:
            # The zero-step state must run the target as a plain decode, not a one-token verify.
            assert kw["plain_decode_target"] is True and kw["speculative_num_draft_tokens"] == 1
            return type("State", (), {"speculative_num_steps": kw["speculative_num_steps"]})()

        def apply_runtime_state(self, state: Any) -> None:
            self.applied.append(state.speculative_num_steps)
            self.speculative_num_steps = state.speculative_num_steps

    worker = Worker()
    ctrl = module.ThresholdController(worker, 4)
    ctrl.register(type("State", (), {"speculative_num_steps": 3})())
    ctrl.init_states(cuda_graph_bs=[1, 2, 4])
    assert [ctrl.activate_step_by_batch(b) for b in (2, 4, 5, 8, 3)] == [
        True,
        True,
        False,
        False,
        True,
    ]
    assert worker.applied == [0, 3]  # switched only when the mode changed
    assert (ctrl.decode_steps_on, ctrl.decode_steps_off) == (3, 2)
    ctrl.set_threshold(None)
    assert ctrl.activate_step_by_batch(1000) is True
    with pytest.raises(module.ThresholdError):
        ctrl.set_threshold(-3)
    assert ctrl.threshold is None


OFF_STEP_TOKEN_CASES: list[tuple[Any, Any]] = [
    (1, 1),
    (2, 2),
    (4, 4),
    (0, "error"),
    (5, "error"),
    (-1, "error"),
    (2.0, "error"),
    ("2", "error"),
    (True, "error"),
    (None, "error"),
]


@pytest.mark.parametrize(("value", "expected"), OFF_STEP_TOKEN_CASES)
def test_off_step_tokens_are_bounded_by_what_a_speculating_step_commits(
    value: Any, expected: Any, patched_site: Path
) -> None:
    """3 draft steps and 4 draft tokens: a verify step commits up to 4 tokens a request, so
    spec-v2 keeps a KV reserve for 4 (twice, for the overlap scheduler's lag); an off step of
    more would write past it."""
    module = _module(patched_site)
    if expected == "error":
        with pytest.raises(module.ThresholdError, match="speculative_off_step_tokens"):
            module.parse_off_step_tokens(value, num_steps=3, num_draft_tokens=4)
    else:
        assert module.parse_off_step_tokens(value, num_steps=3, num_draft_tokens=4) == expected
    assert module.off_step_tokens_limit(5, 4) == 5  # num_steps * topk 1 can be the larger


def test_an_off_step_decodes_several_tokens_only_where_nothing_needs_each_one_first(
    patched_site: Path,
) -> None:
    module = _module(patched_site)
    free = {
        "lagged_off": True,
        "penalties": False,
        "custom_logit_processor": False,
        "return_hidden_states": False,
    }
    assert module.off_step_tokens(4, **free) == 4
    assert module.off_step_tokens(1, **free) == 1
    blockers = (
        ("lagged_off", False),
        ("penalties", True),
        ("custom_logit_processor", True),
        ("return_hidden_states", True),
    )
    for blocker, value in blockers:
        assert module.off_step_tokens(4, **{**free, blocker: value}) == 1, blocker


def test_an_off_step_of_several_tokens_hands_the_scheduler_a_verify_shaped_result(
    patched_site: Path,
) -> None:
    """The worker's k forwards: each after the first reads the token just sampled at the next
    position and slot; the result has stride k, accept lengths k and the last token as the
    next bonus token. The result processor commits k a request and counts no drafts for it,
    and the generated-token count takes in all k."""
    srt = patched_site / "sglang" / "srt"
    worker = srt / "speculative" / "eagle_worker_v2.py"
    plain = _function(worker, "EAGLEWorkerV2._forward_plain_decode")
    (loop,) = [n for n in ast.walk(plain) if isinstance(n, ast.For)]
    assert ast.unparse(loop.iter) == "range(tokens)"
    stepped = {
        ast.unparse(n.targets[0]): ast.unparse(n.value)
        for n in ast.walk(loop)
        if isinstance(n, ast.Assign)
    }
    assert stepped["forward_batch.input_ids"] == "sampled[-1]"
    assert stepped["forward_batch.positions"] == "forward_batch.positions + 1"
    assert stepped["forward_batch.seq_lens"] == "forward_batch.seq_lens + 1"
    assert stepped["forward_batch.out_cache_loc"] == "slots[i]"
    after = {
        ast.unparse(n.targets[0]): ast.unparse(n.value)
        for n in plain.body
        if isinstance(n, ast.Assign)
    }
    assert after["result.speculative_num_draft_tokens"] == "tokens"
    assert after["result.accept_lens"] == "self._int32_constant(tokens, bs)"
    assert after["result.new_seq_lens"] == "forward_batch.seq_lens"
    assert "next_token_ids[tokens - 1::tokens]" in after["result.next_draft_input"]
    off = _function(worker, "EAGLEWorkerV2._forward_plain_decode_and_extend")
    (decided,) = _calls(off, "off_step_tokens")
    assert ast.unparse(decided.args[0]) == "self._off_step_tokens"
    processor = srt / "managers" / "scheduler_components" / "batch_result_processor.py"
    resolve = _function(processor, "SchedulerBatchResultProcessor._resolve_spec_v2_tokens")
    (fast,) = [
        n
        for n in resolve.body
        if isinstance(n, ast.If)
        and "result.speculating is False" in ast.unparse(n.test)
        and "stride == 1" in ast.unparse(n.test)
    ]
    assert "req.kv_committed_len += stride" in ast.unparse(fast)
    (uncounted,) = [
        n
        for n in resolve.body
        if isinstance(n, ast.If) and ast.unparse(n.test) == "result.speculating is False"
    ]
    assert "result.num_correct_drafts = 0" in ast.unparse(uncounted.body)
    assert "result.num_off_step_extra_tokens = (stride - 1) * len(batch.reqs)" in ast.unparse(fast)


def test_an_off_step_of_several_tokens_counts_every_token_it_generated(
    patched_site: Path,
) -> None:
    """The router learns each mode's speed from the engine's generated-token count
    (/v1/loads decode_moments): an off step of K tokens that counted one a request would look
    K times slower than it is. Upstream counts one a request plus the accepted drafts; an off
    step's other K - 1 tokens a request are counted beside them, in each of the three counts
    (decode moments, the realtime token metric, the logged throughput), and not as drafts."""
    srt = patched_site / "sglang" / "srt"
    processor = srt / "managers" / "scheduler_components" / "batch_result_processor.py"
    decode = _function(processor, "SchedulerBatchResultProcessor.process_batch_result_decode")
    assert "len(batch.reqs) + result.num_off_step_extra_tokens" in ast.unparse(decode)
    (stats,) = _calls(decode, "report_decode_stats")
    counted = {kw.arg: ast.unparse(kw.value) for kw in stats.keywords}
    assert counted["num_correct_drafts"] == (
        "result.num_correct_drafts + result.num_off_step_extra_tokens"
    )
    counters = _function(srt / "managers" / "scheduler.py", "Scheduler._record_step_counters")
    (moment,) = _calls(counters, "_accumulate_decode_moment")
    assert ast.unparse(moment.args[3]) == (
        "batch_size + result.num_correct_drafts + result.num_off_step_extra_tokens"
    )


def test_the_engine_times_decode_steps_without_the_prefills_between_them(
    patched_site: Path,
) -> None:
    """The scheduler's step bookkeeping, run on a sequence of steps: a decode step launched
    right after a decode step adds its launch interval to the controller's uninterrupted-step
    counters (contract.STEP_TIME_COUNTERS); one launched after a prefill does not, while
    SGLang's decode moments keep counting it. The router's parser reads the result."""
    from specgate_router import control

    scheduler = patched_site / "sglang" / "srt" / "managers" / "scheduler.py"
    moments: list[int] = []
    namespace: dict[str, Any] = {
        "time": __import__("time"),
        "DECODE_STEP_MAX_US": 2_000_000,
        "_accumulate_decode_moment": lambda totals, batch, step_us, generated: moments.append(
            step_us
        ),
        "is_health_check_generate_req": lambda req: False,
    }
    for name in ("_record_step_counters", "_count_uninterrupted_step"):
        func = _function(scheduler, f"Scheduler.{name}")
        exec(compile(ast.Module(body=[func], type_ignores=[]), str(scheduler), "exec"), namespace)

    class Controller:
        profile = None
        uninterrupted_decode_steps = 0
        uninterrupted_decode_us = 0

    class Mode:
        def __init__(self, prefill: bool) -> None:
            self.prefill = prefill

        def is_extend_without_speculative(self) -> bool:
            return self.prefill

        def is_decode(self) -> bool:
            return not self.prefill

        def is_target_verify(self) -> bool:
            return False

    class Scheduler:
        _record_step_counters = namespace["_record_step_counters"]
        _count_uninterrupted_step = namespace["_count_uninterrupted_step"]

        def __init__(self) -> None:
            self.draft_worker = type("Draft", (), {"threshold_controller": Controller()})()
            self._prev_decode_launch_ts = None
            self._uninterrupted_prev_launch_ts = None
            self._profile_prev_step = None
            self.decode_moment_totals = [0.0] * 6
            self.total_prefill_busy_us = 0
            self.total_prefill_uncached_tokens = 0

        def _observe_step_profile(self, *args: Any) -> None:
            pass

    sched = Scheduler()
    result = type("Result", (), {"num_correct_drafts": 0, "num_off_step_extra_tokens": 0})()
    # Launch times (s): decode 0.000, 0.010, 0.020; a prefill at 0.025; decode 0.040, 0.050.
    for launch, prefill in ((0.0, False), (0.01, False), (0.02, False), (0.025, True),
                            (0.04, False), (0.05, False)):  # fmt: skip
        batch = type("Batch", (), {})()
        batch.forward_mode, batch.reqs, batch.launch_ts = Mode(prefill), [object()] * 4, launch
        batch.extend_num_tokens = 32
        sched._record_step_counters(batch, result)
    ctrl = sched.draft_worker.threshold_controller
    assert moments == pytest.approx([10_000, 10_000, 20_000, 10_000], abs=2)
    assert ctrl.uninterrupted_decode_steps == 3  # 0.01, 0.02 and 0.05: not 0.04's
    assert ctrl.uninterrupted_decode_us == pytest.approx(30_000, abs=3)
    before = dict.fromkeys(contract.STEP_TIME_COUNTERS, 0)
    after = {
        "uninterrupted_decode_steps": ctrl.uninterrupted_decode_steps,
        "uninterrupted_decode_us": ctrl.uninterrupted_decode_us,
    }
    assert control.uninterrupted_step_seconds(before, after) == pytest.approx(0.010, rel=1e-3)


def test_the_engine_takes_its_key_from_the_environment_and_never_logs_it(
    patched_site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator passes the engine key in SGLANG_API_KEY, not --api-key (a command line
    any user of the node can read); the server args' repr, which the start-up log prints,
    masks both keys. Run on the patched methods, bound to a dataclass with the same fields."""
    import dataclasses
    import os

    from specgate_operator import render

    server_args = patched_site / "sglang" / "srt" / "server_args.py"
    tree = ast.parse(server_args.read_text())
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in ("API_KEY_ENV", "SECRET_SERVER_ARGS")
    }
    assert constants["API_KEY_ENV"] == render.ENGINE_SERVER_KEY_ENV
    namespace: dict[str, Any] = {"os": os, "dataclasses": dataclasses, **constants}
    for name in ("__repr__", "_handle_api_key_from_env"):
        func = _function(server_args, f"ServerArgs.{name}")
        exec(compile(ast.Module(body=[func], type_ignores=[]), str(server_args), "exec"), namespace)
    post_init = ast.unparse(_function(server_args, "ServerArgs.__post_init__"))
    assert post_init.index("_handle_api_key_from_env") < post_init.index("if self.model_path")

    @dataclasses.dataclass(repr=False)
    class Args:
        model_path: str = "m"
        api_key: str | None = None
        admin_api_key: str | None = None

    Args.__repr__ = namespace["__repr__"]  # type: ignore[method-assign]
    Args._handle_api_key_from_env = namespace["_handle_api_key_from_env"]  # type: ignore[attr-defined]
    monkeypatch.setenv(render.ENGINE_SERVER_KEY_ENV, " s3cret\n")
    args = Args()
    args._handle_api_key_from_env()  # type: ignore[attr-defined]
    assert args.api_key == "s3cret"
    flagged = Args(api_key="from-flag", admin_api_key="admin")
    flagged._handle_api_key_from_env()  # type: ignore[attr-defined]
    assert flagged.api_key == "from-flag"  # an explicit flag wins
    shown = repr(flagged)
    assert "from-flag" not in shown and "admin" not in shown.replace("admin_api_key", "")
    assert "api_key=<redacted>" in shown and "model_path='m'" in shown
    monkeypatch.delenv(render.ENGINE_SERVER_KEY_ENV)
    none = Args()
    none._handle_api_key_from_env()  # type: ignore[attr-defined]
    assert none.api_key is None and "api_key=None" in repr(none)


def test_every_flag_the_operator_renders_is_one_the_engine_has(patched_site: Path) -> None:
    """Each `--flag` of a resource that sets every engine option (tracing included) is a
    field of the patched SGLang's ServerArgs, the dataclass its parser is built from: a flag
    renamed upstream fails here, not in a pod's start-up."""
    from specgate import api
    from specgate_operator import render

    from .conftest import minimal_resource

    source = (patched_site / "sglang" / "srt" / "server_args.py").read_text()
    (server_args,) = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and node.name == "ServerArgs"
    ]
    fields = {
        node.target.id
        for node in server_args.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    resource = minimal_resource(
        model={"path": "/models/t", "revision": "v1", "contextLength": 8192,
               "trustRemoteCode": True},
        speculative={"draftModel": {"path": "/models/d", "revision": "v2"}, "offStepTokens": 4},
        engine={"memFractionStatic": 0.8, "maxRunningRequests": 64, "cudaGraphMaxBs": 32},
        router={"tracing": {"otlpEndpoint": "http://collector:4318/v1/traces"}},
    )  # fmt: skip
    args = render.engine_args(api.SpecDecodeDeployment.model_validate(resource))
    flags = [a[2:].replace("-", "_") for a in args if a.startswith("--")]
    assert len(flags) >= 20 and "enable_trace" in flags
    assert [f for f in flags if f not in fields] == []


def test_the_image_has_what_engine_tracing_imports() -> None:
    """SGLang refuses --enable-trace without its `tracing` extra: the worker image installs it."""
    dockerfile = (ROOT / "worker-image" / "Dockerfile").read_text()
    for package in ("opentelemetry-sdk", "opentelemetry-exporter-otlp"):
        assert re.search(rf"\b{package}==\d", dockerfile), package


def test_off_step_tokens_are_checked_at_start_up_after_the_algorithm_defaults(
    patched_site: Path,
) -> None:
    srt = patched_site / "sglang" / "srt"
    hook = srt / "arg_groups" / "speculative_hook.py"
    handle = _function(hook, "handle_speculative_decoding")
    (check,) = _calls(handle, "_check_off_step_tokens")
    (defaults,) = _calls(handle, "handle_server_args")
    assert check.lineno > defaults.lineno
    checker = ast.unparse(_function(hook, "_check_off_step_tokens"))
    assert "speculative_disable_batch_threshold is None" in checker
    assert "parse_off_step_tokens(" in checker
    args = (srt / "server_args.py").read_text()
    assert "    speculative_off_step_tokens: A[\n        int," in args


def _function(source: Path, qualname: str) -> ast.FunctionDef:
    """A method (Class.method) or a module-level function in a patched file."""
    cls_name, _, func_name = qualname.rpartition(".")
    tree = ast.parse(source.read_text())
    if not cls_name:
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == func_name:
                return node
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == func_name:
                    return item
    raise AssertionError(f"{qualname} not found in {source}")


def _function_args(source: Path, qualname: str) -> list[str]:
    """Parameter names of a method in a patched file."""
    args = _function(source, qualname).args
    return [a.arg for a in (*args.args, *args.kwonlyargs)]


def test_speculation_off_runs_a_plain_decode(patched_site: Path) -> None:
    """The fast "off" path is wired through: the zero-step state captures plain-decode target
    graphs, the worker has the plain-decode forward, and the draft-extend graph is captured at
    the width the zero-step draft extend runs (upstream read the startup width and never
    replayed it). What it costs is measured on the GPU (GPU-RESULTS.md)."""
    srt = patched_site / "sglang" / "srt"
    worker = srt / "speculative" / "eagle_worker_v2.py"
    assert "plain_decode_target" in _function_args(
        worker, "EAGLEWorkerV2.build_adaptive_runtime_state"
    )
    assert "batch" in _function_args(worker, "EAGLEWorkerV2._forward_plain_decode")
    assert "target_batch" in _function_args(worker, "EAGLEWorkerV2._lean_draft_extend")
    runner = srt / "model_executor" / "runner" / "decode_cuda_graph_runner.py"
    assert "plain_decode_for_spec" in _function_args(runner, "DecodeCudaGraphRunner.__init__")
    extend = (srt / "speculative" / "eagle_draft_extend_cuda_graph_runner.py").read_text()
    assert "self.captured_req_width = get_spec().speculative_num_draft_tokens" in extend


def test_patch_touches_the_expected_files() -> None:
    text = (PATCH_DIR / "0001-speculative-disable-batch-threshold.patch").read_text()
    touched = {line[6:] for line in text.splitlines() if line.startswith("+++ b/")}
    assert "sglang/srt/speculative/spec_threshold.py" in touched
    assert "sglang/srt/speculative/eagle_worker_v2.py" in touched
    assert "sglang/srt/entrypoints/http_server.py" in touched
    assert all(path.startswith("sglang/srt/") for path in touched)


def test_the_patch_holds_source_only() -> None:
    """Every file the patch names is Python source: a stanza for anything else (a byte-compiled
    file left in the tree the diff was taken from) has `patch` create an empty file beside the
    source, and it changes the checksum GPU runs are pooled by."""
    text = (PATCH_DIR / "0001-speculative-disable-batch-threshold.patch").read_text()
    named = [line.split(" b/")[-1] for line in text.splitlines() if line.startswith("diff --git")]
    assert named and all(path.endswith(".py") for path in named), [
        path for path in named if not path.endswith(".py")
    ]
    assert "Binary files" not in text and "GIT binary patch" not in text


def test_dockerfile_pins_the_base_and_applies_the_patch() -> None:
    dockerfile = (ROOT / "worker-image" / "Dockerfile").read_text()
    assert "ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.17" in dockerfile
    assert "apply-patch.sh" in dockerfile and "COPY patches/" in dockerfile
    assert 'ENTRYPOINT ["python3", "-m", "sglang.launch_server"]' in dockerfile


def _gputest_module(name: str) -> ModuleType:
    return load_module(ROOT / "lab" / "gpu" / f"{name}.py", name)


def test_server_flags_set_weights_memory_and_caps() -> None:
    """The one place the GPU scripts turn verify.COMMON into a server's flags."""
    verify = _gputest_module("verify")
    dummy = verify.server_flags(Path("/m/target"), mem_fraction=0.25)
    assert dummy[dummy.index("--load-format") + 1] == "dummy"
    assert dummy[dummy.index("--model-path") + 1] == "/m/target"
    assert dummy[dummy.index("--mem-fraction-static") + 1] == "0.25"
    assert dummy[dummy.index("--cuda-graph-max-bs-decode") + 1] == "16"  # COMMON's default
    assert "--max-running-requests" not in dummy
    real = verify.server_flags(
        Path("/m/target"),
        mem_fraction=0.3,
        max_running=128,
        max_graph_batch=128,
        dummy_weights=False,
    )
    assert "--load-format" not in real and "dummy" not in real
    assert real[real.index("--cuda-graph-max-bs-decode") + 1] == "128"
    assert real[real.index("--max-running-requests") + 1] == "128"
    assert real.count("--mem-fraction-static") == 1
    assert verify.COMMON[verify.COMMON.index("--mem-fraction-static") + 1] == "0.35"  # unchanged
    # Idle schedulers sleep only where asked (the benchmarks that run servers side by side).
    assert "--sleep-on-idle" not in dummy and "--sleep-on-idle" not in verify.COMMON
    assert "--sleep-on-idle" in verify.server_flags(
        Path("/m"), mem_fraction=0.2, sleep_on_idle=True
    )


def test_synthetic_pair_acceptance_by_construction() -> None:
    """The synthetic pair's predicted acceptance (its weights need torch and a GPU; this is the
    arithmetic the GPU run is compared against)."""
    synthetic = _gputest_module("synthetic")
    assert synthetic.acceptance(12.0, 0.0, steps=3) == (1.0, 4.0)  # greedy: always accepted
    p, length = synthetic.acceptance(11.8, 1.0, steps=3)
    assert p == pytest.approx(1 / (1 + 31999 * math.exp(-11.8)))
    share = p / (p + 1 - p**4)  # rounds that start after a repeated bonus token
    assert length == pytest.approx(share * (1 + p + p**2 + p**3) + (1 - share))
    # What the H200 measured with the 3B pair (c = 12): 2.22-2.36 at T = 1.0, 3.15-3.37 at 0.9.
    assert synthetic.acceptance(12.0, 1.0, steps=3)[1] == pytest.approx(2.31, abs=0.01)
    assert synthetic.acceptance(12.0, 0.9, steps=3)[1] == pytest.approx(3.28, abs=0.01)
    lengths = [synthetic.acceptance(12.0, t, steps=3)[1] for t in (0.8, 0.9, 1.0, 1.2)]
    assert lengths == sorted(lengths, reverse=True)  # hotter sampling, fewer accepted
    target, draft = synthetic.configs(3072, 28, 24, 8, 8192)
    assert target["head_dim"] * target["num_attention_heads"] == target["hidden_size"]
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"]
    assert draft["num_hidden_layers"] == 1
    assert draft["draft_vocab_size"] == target["vocab_size"] == synthetic.VOCAB


def test_recovery_judge_on_the_recorded_gpu_run() -> None:
    """Check 3 as judged from the H200 run's log (both draft-extend paths, three temperatures),
    and the judge failing a draft that came back 10% worse."""
    for sibling in ("verify", "synthetic", "speed"):  # what recovery.py imports beside it
        _gputest_module(sibling)
    recovery = _gputest_module("recovery")
    log = (ROOT / "lab" / "gpu" / "results" / "recovery-2026-11-30-2xh200.log").read_text()
    runs = recovery.windows_from_log(log)
    assert len(runs) == 6  # two servers x three temperatures
    for windows in runs.values():
        assert recovery.judge(windows)["passed"]
    windows = [dict(w) for w in runs[(32100, 0.0)]]
    for w in windows[2:]:
        if w["threshold"] is None:
            w["accept_length"] *= 0.9
    assert not recovery.judge(windows)["passed"]
    # A switch that does not land: an "off" window that mostly speculated.
    stuck = [dict(w) for w in runs[(32100, 0.0)]]
    stuck[1].update(steps_on=600, steps_off=75)
    assert not recovery.judge(stuck)["passed"]


def test_draftkv_flip_point_and_judge() -> None:
    """Check 3's draft-KV half (draftkv.py, not yet run on a GPU): where the context-reading
    draft turns from the prompt's token to the repeated one, and the verdict on the three
    runs. The GPU run measures whether the synced run's off steps counted towards the flip."""
    for sibling in ("verify", "synthetic", "speed", "recovery"):
        _gputest_module(sibling)
    synthetic = _gputest_module("synthetic")
    draftkv = _gputest_module("draftkv")
    # g kv (f_A - f_B) = hidden: 8 * 1024 * (199 - n) = 2048 * (201 + n)  ->  n = 119
    assert synthetic.context_flip(200, 8.0, 2048, 1024) == pytest.approx(119.0)
    assert synthetic.context_flip(200, 16.0, 2048, 1024) > 119  # a louder context holds longer
    assert synthetic.context_flip(200, 0.0, 2048, 1024) == 0.0  # no context: never proposes A
    assert synthetic.context_flip(1, 8.0, 2048, 1024) == 0.0  # one A: B wins at once
    runs = {
        "control": {"accept_length": 1.05},
        "early": {"accept_length": 1.1},
        "synced": {"accept_length": 3.98},
    }
    assert draftkv.judge(runs)
    assert not draftkv.judge({**runs, "synced": {"accept_length": 1.2}})  # off steps not written
    assert not draftkv.judge({**runs, "control": {"accept_length": 3.9}})  # draft ignores context
    assert not draftkv.judge({**runs, "early": {"accept_length": None}})
    assert not draftkv.judge({k: v for k, v in runs.items() if k != "early"})
    prompts = [draftkv.prompt(run, i, 200) for run in range(3) for i in range(draftkv.CLIENTS)]
    assert len({tuple(p) for p in prompts}) == len(prompts)  # no shared prefix
    assert all(len(set(p)) == 2 and p[0] != p[-1] and len(p) == 201 for p in prompts)
    assert max(max(p) for p in prompts) < synthetic.VOCAB
    layers = draftkv.SHAPE["layers"]  # EAGLE-3's fc needs three distinct captured layers
    assert len({2, layers // 2, layers - 3}) == 3


LEAN_OK = dict(
    graph_runner=True,
    width=1,
    topk=1,
    rejection_sampling=False,
    dsa_seed=False,
    canary=False,
    mlp_sync=False,
    hip=False,
)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"graph_runner": False}, "no padded CUDA-graph draft-extend runner"),
        ({"width": 4}, "draft-extend graph width 4, not 1"),
        ({"topk": 2}, "--speculative-eagle-topk 2"),
        ({"rejection_sampling": True}, "rejection sampling"),
        ({"mlp_sync": True}, "DP attention / MLP sync"),
    ],
)
def test_lean_off_extend_only_where_it_holds(
    change: dict[str, Any], reason: str | None, patched_site: Path
) -> None:
    """The lean draft extend of speculation-off steps is used only where its shortcuts hold;
    anywhere else the step takes upstream's path, and the start-up log says why."""
    blockers = _module(patched_site).lean_extend_blockers(**{**LEAN_OK, **change})
    assert blockers == ([] if reason is None else [reason])


LAGGED_OK = dict(eagle3_one_layer=True, plain_kv_pool=True, dcp=False, mixed_chunk=False, hip=False)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"eagle3_one_layer": False}, "the draft is not a one-layer LlamaForCausalLMEagle3"),
        ({"plain_kv_pool": False}, "the draft KV pool is not a plain MHA pool"),
        ({"mixed_chunk": True}, "--enable-mixed-chunk"),
    ],
)
def test_lagged_draft_kv_only_where_it_holds(
    change: dict[str, Any], reason: str | None, patched_site: Path
) -> None:
    """The lagged draft KV write computes a one-layer EAGLE-3 draft's K and V from its inputs
    alone; any other draft or pool keeps a draft extend on every off step."""
    blockers = _module(patched_site).lagged_kv_blockers(**{**LAGGED_OK, **change})
    assert blockers == ([] if reason is None else [reason])


KV_ONLY_PREFILL_OK = dict(
    lagged_off=True,
    full_prefill_done=True,
    overlap=True,
    plain_extend=True,
    logprob=False,
    grammar=False,
    multimodal=False,
    next_batch=40,
    max_running=64,
    threshold=8,
    max_lagged_batch=64,
)


@pytest.mark.parametrize(
    "change",
    [
        {"lagged_off": False},  # off steps would not pass the last position on
        {"full_prefill_done": False},  # the relay's proposal buffers are sized by one
        {"overlap": False},
        {"plain_extend": False},  # a mixed batch
        {"logprob": True},
        {"grammar": True},
        {"multimodal": True},
        {"next_batch": 8},  # the next step speculates
        {"threshold": None},  # always speculate
        {"next_batch": 65, "max_running": 80},  # beyond the catch-up's graph
        {"next_batch": 12, "max_running": 8},  # a server that never runs more than 8
    ],
)
def test_a_prefill_writes_the_draft_kv_alone_only_before_a_likely_off_step(
    change: dict[str, Any], patched_site: Path
) -> None:
    """A prefill skips the draft's forward (and its first proposal) only where the next decode
    step will most likely be a lagged off step, which reads no proposal; everywhere else the
    draft prefills as upstream's does."""
    decide = _module(patched_site).draft_kv_only_prefill
    assert decide(**KV_ONLY_PREFILL_OK)
    assert not decide(**{**KV_ONLY_PREFILL_OK, **change})


def test_the_next_batch_guess_is_capped_at_the_running_limit(patched_site: Path) -> None:
    """On a full server a request finishes as another is prefilled: the last decode batch plus
    the prefill overshoots the catch-up's largest graph (the server's running limit, as the
    benchmarks size it), although the next decode batch cannot pass that limit. The guess is
    capped there, so such a prefill still writes the draft KV alone."""
    decide = _module(patched_site).draft_kv_only_prefill
    full = {**KV_ONLY_PREFILL_OK, "next_batch": 64 + 2, "max_running": 64}
    assert decide(**full)
    assert not decide(**{**full, "max_running": 128})


def test_prefills_are_counted_by_what_they_ran_of_the_draft(patched_site: Path) -> None:
    """Each prefill counts as one that wrote the draft KV alone or one that ran the draft's
    prefill, on the threshold controller; /v1/loads and /metrics show both."""
    srt = patched_site / "sglang" / "srt"
    worker = srt / "speculative" / "eagle_worker_v2.py"
    entry = _function(worker, "EAGLEWorkerV2.forward_batch_generation")
    (kv_only,) = [
        n
        for n in ast.walk(entry)
        if isinstance(n, ast.If) and ast.unparse(n.test).startswith("self._draft_kv_only_prefill(")
    ]
    body = [ast.unparse(n) for n in kv_only.body]
    assert "self.threshold_controller.prefills_draft_kv_only += 1" in body
    assert body[-1] == "return batch_output"
    (full,) = _calls(entry, "_draft_extend_for_prefill")
    full_counter = "self.threshold_controller.prefills_full_draft"
    counted = [
        n
        for n in ast.walk(entry)
        if isinstance(n, ast.AugAssign) and ast.unparse(n.target) == full_counter
    ]
    assert len(counted) == 1 and counted[0].lineno > full.lineno
    snapshot = (srt / "managers" / "load_snapshot.py").read_text()
    assert "prefills_draft_kv_only: Optional[int] = None" in snapshot
    assert "prefills_full_draft: Optional[int] = None" in snapshot
    metrics = (srt / "observability" / "metrics_collector.py").read_text()
    assert 'name="sglang:spec_prefills_total"' in metrics


def test_a_step_that_takes_one_slot_a_request_writes_them_as_plain_decoding_does(
    patched_site: Path,
) -> None:
    """An off step with its reserve in place takes the same number of KV slots for every
    request (one, or K with --speculative-off-step-tokens K). spec-v2's allocation then stores
    the slots with one indexed write at each request's current length, as plain decoding's
    alloc_for_decode does, not with the general Triton kernel, whose launch costs more host
    time; a step whose requests take different numbers keeps the kernel."""
    srt = patched_site / "sglang" / "srt"
    prepare = _function(srt / "speculative" / "eagle_utils.py", "eagle_prepare_for_decode")
    (alloc,) = _calls(prepare, "alloc_for_spec_decode")
    passed = {kw.arg: ast.unparse(kw.value) for kw in alloc.keywords}
    assert passed["slots_each"] == "slots_each or 0"
    flags = [
        ast.unparse(n)
        for n in ast.walk(prepare)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "slots_each"
    ]
    assert flags == ["slots_each = None", "slots_each = nxt - cur", "slots_each = 0"]
    allocation = _function(srt / "mem_cache" / "allocation.py", "alloc_for_spec_decode")
    (one,) = [
        n
        for n in ast.walk(allocation)
        if isinstance(n, ast.If) and ast.unparse(n.test) == "slots_each == 1"
    ]
    assert [ast.unparse(n) for n in one.body] == [
        "req_to_token_pool.req_to_token[req_pool_indices, cur_kv_lens.long()] = "
        "out_cache_loc.to(torch.int32)"
    ]
    (several,) = one.orelse
    assert isinstance(several, ast.If) and ast.unparse(several.test) == "slots_each > 1"
    assert ast.unparse(several.body[-1]).endswith(
        "= out_cache_loc.to(torch.int32).view(-1, slots_each)"
    )
    assert _calls(several.orelse[0], "assign_req_to_token_pool_func")


def _uniform_store(
    req_to_token: Any, rows: list[int], cur: list[int], out: list[int], k: int
) -> None:
    """The patch's k-slots-each store, in NumPy, whose advanced indexing torch's follows."""
    rows_a, cur_a, out_a = np.array(rows), np.array(cur), np.array(out)
    req_to_token[rows_a[:, None], cur_a[:, None] + np.arange(k)] = out_a.reshape(-1, k)


def _assign_kernel(
    req_to_token: list[list[int]], rows: list[int], cur: list[int], nxt: list[int], out: list[int]
) -> None:
    """assign_req_to_token_pool's semantics: request i's slots are out_cache_loc from the sum
    of the earlier requests' (nxt - cur), written at cur .. nxt - 1 of its row."""
    offset = 0
    for row, start, end in zip(rows, cur, nxt, strict=True):
        for pos in range(start, end):
            req_to_token[row][pos] = out[offset]
            offset += 1


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_uniform_store_writes_what_the_triton_kernel_writes(k: int) -> None:
    rows, cur = [3, 0, 2], [5, 1, 7]
    out = [100 + i for i in range(len(rows) * k)]
    expected = [[-1] * 16 for _ in range(4)]
    _assign_kernel(expected, rows, cur, [c + k for c in cur], out)
    got = np.full((4, 16), -1)
    _uniform_store(got, rows, cur, out, k)
    assert got.tolist() == expected
    # The off step's gather (_forward_plain_decode): forward i reads row i, request j's slot
    # at its length plus i, in one contiguous row per forward.
    rows_a, cur_a = np.array(rows), np.array(cur)
    slots = got[rows_a[None, :], cur_a[None, :] + np.arange(k)[:, None]]
    assert slots.shape == (k, len(rows)) and slots.flags["C_CONTIGUOUS"]
    assert [slots[i].tolist() for i in range(k)] == [
        [out[j * k + i] for j in range(len(rows))] for i in range(k)
    ]


def test_a_draft_kv_only_prefill_leaves_a_catch_up_and_no_proposal(patched_site: Path) -> None:
    """The worker's side of the prefill that writes the draft KV alone: it is decided before the
    draft's prefill runs, it keeps the prompts' last positions and asks for a catch-up (the
    first speculating step's proposal comes from there), and the relay gets the bonus token
    alone. Only a full draft prefill counts as the one that sizes the relay."""
    worker = patched_site / "sglang" / "srt" / "speculative" / "eagle_worker_v2.py"
    entry = _function(worker, "EAGLEWorkerV2.forward_batch_generation")
    (decided,) = _calls(entry, "_draft_kv_only_prefill")
    (full,) = _calls(entry, "_draft_extend_for_prefill")
    assert decided.lineno < full.lineno
    write = _function(worker, "EAGLEWorkerV2._write_prompt_draft_kv")
    assert _calls(write, "keep") and _calls(write, "write")
    assert any(
        isinstance(n, ast.Assign)
        and ast.unparse(n.targets[0]) == "self._lag_pending"
        and ast.unparse(n.value) == "True"
        for n in ast.walk(write)
    )
    (made,) = _calls(write, "EagleDraftInput")
    assert {kw.arg for kw in made.keywords} >= {"bonus_tokens"}
    assert not {"topk_p", "topk_index", "hidden_states"} & {kw.arg for kw in made.keywords}
    done = [
        n
        for n in ast.walk(entry)
        if isinstance(n, ast.Assign)
        and ast.unparse(n.targets[0]) == "self._full_draft_prefill_done"
    ]
    assert len(done) == 1 and done[0].lineno > full.lineno


def test_a_lagged_off_step_hands_back_host_accept_lengths(patched_site: Path) -> None:
    """An off step with the lagged write accepts one token a request: its accept lengths are a
    host tensor of ones kept across steps, so the result's copy to the host has nothing to
    copy (upstream's _async_d2h passes a host tensor through) where a GPU tensor cost a
    pinned allocation, a copy and a record_stream a step. Only upstream's draft extend
    reads them on the GPU, and that branch is not the lagged one."""
    srt = patched_site / "sglang" / "srt"
    worker = srt / "speculative" / "eagle_worker_v2.py"
    off = _function(worker, "EAGLEWorkerV2._forward_plain_decode_and_extend")
    (lagged,) = [
        n for n in ast.walk(off) if isinstance(n, ast.If) and ast.unparse(n.test) == "lagged_off"
    ]
    (handed,) = [
        n
        for n in lagged.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "batch_output.accept_lens"
    ]
    assert ast.unparse(handed.value).replace("\n", "").replace(" ", "") == (
        "self._host_constant(tokens,target_batch.batch_size)"
    )
    assert isinstance(lagged.body[-1], ast.Return)
    constant = ast.unparse(_function(worker, "EAGLEWorkerV2._host_constant"))
    assert "torch.full((n,), value, dtype=torch.int32)" in constant
    assert "device" not in constant
    d2h = ast.parse((srt / "managers" / "utils.py").read_text())
    (async_d2h,) = [
        n for n in d2h.body if isinstance(n, ast.FunctionDef) and n.name == "_async_d2h"
    ]
    (passes,) = [n for n in async_d2h.body if isinstance(n, ast.If)]
    assert ast.unparse(passes) == "if not t.is_cuda:\n    return t.to('cpu', non_blocking=True)"


@pytest.mark.parametrize(
    "blockers",
    ["lean_extend_blockers", "lagged_kv_blockers", "draft_kv_only_prefill", "off_step_tokens"],
)
def test_the_worker_passes_every_blocker_check(blockers: str, patched_site: Path) -> None:
    """The worker decides each off-step path with a pure function of keyword flags; a flag it
    does not pass would stop the server at start-up, on a GPU. Every one is passed."""
    spec = patched_site / "sglang" / "srt" / "speculative"
    (function,) = [
        n
        for n in ast.walk(ast.parse((spec / "spec_threshold.py").read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == blockers
    ]
    worker = ast.parse((spec / "eagle_worker_v2.py").read_text())
    (call,) = [
        n
        for n in ast.walk(worker)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == blockers
    ]
    assert {kw.arg for kw in call.keywords} == {a.arg for a in function.args.kwonlyargs}


def _assigned_attrs(source: Path, class_name: str) -> set[str]:
    """self.x names a class's methods assign, in a file."""
    names = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            names |= {
                sub.attr
                for sub in ast.walk(node)
                if isinstance(sub, ast.Attribute)
                and isinstance(sub.ctx, ast.Store)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == "self"
            }
    return names


def _scalar_index_assignments(function: ast.FunctionDef) -> list[str]:
    """`x[i] = <number>` statements in a function: on a CUDA tensor indexed by a tensor, torch
    copies the number to the GPU with a blocking copy, a stream sync."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Subscript) for t in node.targets):
            value = node.value.operand if isinstance(node.value, ast.UnaryOp) else node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)):
                found.append(f"{function.name}, line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_patch_adds_no_stream_sync_through_scalar_index_assignment(patched_site: Path) -> None:
    """Job 35 found `position[rows] = -1` in the lagged writer's forget() syncing the stream on
    every prefill (1.2 ms each at batch 128, the overlap scheduler's queue drained): no method
    the patch adds or changes on the worker's per-step path may assign a number through an
    index (index_fill_ and masked_fill_ take it as a kernel argument)."""
    (wheel,) = WHEELS.glob("sglang-0.5.17-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        upstream_worker = zf.read("sglang/srt/speculative/eagle_worker_v2.py").decode()

    def methods(source: str) -> dict[str, ast.FunctionDef]:
        return {
            f"{c.name}.{f.name}": f
            for c in ast.walk(ast.parse(source))
            if isinstance(c, ast.ClassDef)
            for f in c.body
            if isinstance(f, ast.FunctionDef)
        }

    speculative = patched_site / "sglang" / "srt" / "speculative"
    before = {name: ast.dump(f) for name, f in methods(upstream_worker).items()}
    changed = [
        f
        for name, f in methods((speculative / "eagle_worker_v2.py").read_text()).items()
        if before.get(name) != ast.dump(f)
    ]
    writer = methods((speculative / "lagged_draft_kv.py").read_text())
    assert "EAGLEWorkerV2._catch_up_lagged_draft_kv" in {f"EAGLEWorkerV2.{f.name}" for f in changed}
    assert {"LaggedDraftKvWriter.forget", "LaggedDraftKvWriter.keep"} <= set(writer)
    found = [hit for f in [*changed, *writer.values()] for hit in _scalar_index_assignments(f)]
    assert found == []
    # The check itself sees the statement it is for.
    bad = ast.parse("def forget(self, rows):\n    self.position[rows] = -1\n").body[0]
    assert isinstance(bad, ast.FunctionDef) and len(_scalar_index_assignments(bad)) == 1


def test_lagged_draft_kv_write_reads_what_the_eagle3_draft_has(patched_site: Path) -> None:
    """The lagged write recomputes the EAGLE-3 draft's first-layer K and V outside its
    forward, so it reads the draft's modules by name. Each name must be one SGLang's
    LlamaForCausalLMEagle3 defines (an update that renames one fails here, not on a GPU),
    and the graph capture hook must take what the decode runner passes it."""
    srt = patched_site / "sglang" / "srt"
    write = _function(srt / "speculative" / "lagged_draft_kv.py", "LaggedDraftKvWriter.write")
    eagle3 = srt / "models" / "llama_eagle3.py"
    llama = srt / "models" / "llama.py"
    has = {
        "m": _assigned_attrs(eagle3, "LlamaModel"),
        "layer": _assigned_attrs(eagle3, "LlamaDecoderLayer")
        | _assigned_attrs(llama, "LlamaDecoderLayer"),
        "attn": _assigned_attrs(llama, "LlamaAttention"),
        "radix": _assigned_attrs(srt / "layers" / "radix_attention.py", "RadixAttention"),
    }
    for name, defined in has.items():
        reads = _reads_of(write, name)
        assert reads, f"write reads nothing from {name}: the test lost track of it"
        assert reads <= defined, f"{name}: {sorted(reads - defined)} not defined by SGLang"
    # The decode runner calls capture_hook(runner, out, forward_batch, num_tokens).
    runner = srt / "model_executor" / "runner" / "decode_cuda_graph_runner.py"
    (call,) = [
        n
        for n in ast.walk(ast.parse(runner.read_text()))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "capture_hook"
    ]
    hook = _function_args(
        srt / "speculative" / "lagged_draft_kv.py", "LaggedDraftKvWriter.capture_hook"
    )
    assert len(hook) == 1 + len(call.args)  # self, then what the runner passes (itself first)


def _calls(func: ast.FunctionDef, name: str) -> list[ast.Call]:
    """Calls of self.<name>(...) or <name>(...) in a function, in source order."""
    found = [
        n
        for n in ast.walk(func)
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Attribute) and n.func.attr == name)
            or (isinstance(n.func, ast.Name) and n.func.id == name)
        )
    ]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def test_the_lagged_off_step_is_decided_while_the_batch_is_still_a_decode_batch(
    patched_site: Path,
) -> None:
    """The scheduler resolves an off step's inputs (the bonus token alone) on the worker's
    lagged_off_step, and the worker must take the same path. The predicate reads the batch's
    forward mode, which _forward_plain_decode turns into TARGET_VERIFY, and TARGET_VERIFY
    counts as extend: asked after that, it said no, and the off step ran a draft extend
    instead (envelope job 13). So the worker asks once, on entry, and passes the answer on."""
    srt = patched_site / "sglang" / "srt"
    worker = srt / "speculative" / "eagle_worker_v2.py"
    entry = _function(worker, "EAGLEWorkerV2.forward_batch_generation")
    (asked,) = _calls(entry, "lagged_off_step")
    (off_step,) = _calls(entry, "_forward_plain_decode_and_extend")
    (switch,) = _calls(entry, "activate_step_by_batch")
    assert asked.lineno < switch.lineno < off_step.lineno
    assert "lagged_off" in {getattr(a, "id", None) for a in off_step.args}
    for method in ("_forward_plain_decode_and_extend", "_forward_plain_decode"):
        assert not _calls(_function(worker, f"EAGLEWorkerV2.{method}"), "lagged_off_step")
    # The scheduler asks the same question before it resolves the step's inputs, on its
    # overlap path (the first in run_batch; only there does the relay carry spec extras).
    run_batch = _function(srt / "managers" / "scheduler.py", "Scheduler.run_batch")
    overlap_resolve = _calls(run_batch, "resolve_forward_inputs")[0]
    assert "bonus_only" in {kw.arg for kw in overlap_resolve.keywords}
    assert any(
        isinstance(n, ast.Constant) and n.value == "lagged_off_step" for n in ast.walk(run_batch)
    )


def test_only_a_speculation_off_step_tells_the_next_step_its_lengths(patched_site: Path) -> None:
    """Spec-v2 learns a step's lengths by pulling them from the GPU after the previous step
    has published them, since only the GPU knows how many drafts were accepted. An off step's
    lengths are the previous ones plus one and a prefill's are its prompts', so both publish
    them for the host too, and a next step whose rows all come from such steps skips the pull.
    A speculating step must never do so (its host lengths would be wrong), and the scheduler
    must name the published rows, or every publish forgets them all."""
    srt = patched_site / "sglang" / "srt"
    worker = srt / "speculative" / "eagle_worker_v2.py"

    def host_lengths(call: ast.Call) -> bool:
        return "new_seq_lens_cpu" in {kw.arg for kw in call.keywords}

    (off_publish,) = _calls(
        _function(worker, "EAGLEWorkerV2._forward_plain_decode_and_extend"), "on_publish"
    )
    assert host_lengths(off_publish)
    entry = _function(worker, "EAGLEWorkerV2.forward_batch_generation")
    prefill_publish, speculating_publish = _calls(entry, "on_publish")
    (verify,) = _calls(entry, "verify")
    assert prefill_publish.lineno < verify.lineno < speculating_publish.lineno
    assert host_lengths(prefill_publish)
    assert not host_lengths(speculating_publish)
    run_batch = _function(srt / "managers" / "scheduler.py", "Scheduler.run_batch")
    (partial_publish,) = [
        call
        for call in _calls(run_batch, "partial")
        if ast.unparse(call.args[0]) == "self.future_map.publish"
    ]
    assert "indices_cpu" in {kw.arg for kw in partial_publish.keywords}


def test_prompt_positions_come_from_one_host_array(patched_site: Path) -> None:
    """The draft-KV-only prefill's positions (prefix + offset, prompt after prompt) and each
    prompt's last index, as one array: one host-to-device copy, where a tensor a prompt cost
    about 100 us of host time a decode step at c = 16 (lab/NOTEBOOK.md job 45)."""
    positions = _module(patched_site).prompt_positions
    assert positions([0, 5, 2], [3, 2, 4]).tolist() == [0, 1, 2, 5, 6, 2, 3, 4, 5, 2, 4, 8]
    assert positions([7], [1]).tolist() == [7, 0]
    assert positions([], []).tolist() == []
    assert str(positions([1], [2]).dtype) == "int64"
    worker = patched_site / "sglang" / "srt" / "speculative" / "eagle_worker_v2.py"
    write = _function(worker, "EAGLEWorkerV2._write_prompt_draft_kv")
    assert len(_calls(write, "prompt_positions")) == 1
    assert _calls(write, "arange") == [] and _calls(write, "cat") == []


def test_prompt_kv_write_replays_a_graph_per_token_bucket(patched_site: Path) -> None:
    """The draft-KV-only prefill's write replays a CUDA graph of the smallest bucket that holds
    the prefill (powers of two, then the largest); above them all, or with graphs off, it runs
    kernel by kernel as before. Its padding rows write slot 0, the KV pool's padding slot. What
    the graphs save is measured on the GPU (lab/NOTEBOOK.md jobs 55-56)."""
    module = _module(patched_site)
    buckets = module.prompt_kv_graph_buckets(module.PROMPT_KV_GRAPH_MAX_TOKENS)
    assert buckets == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert module.prompt_kv_graph_buckets(100) == [16, 32, 64, 100]
    assert module.prompt_kv_graph_buckets(0) == []
    bucket = module.prompt_kv_bucket
    assert [bucket(n, buckets) for n in (1, 16, 17, 1024, 1025, 2048)] == [
        16,
        16,
        32,
        1024,
        2048,
        2048,
    ]
    assert bucket(2049, buckets) is None and bucket(0, buckets) is None
    assert bucket(5, []) is None

    speculative = patched_site / "sglang" / "srt" / "speculative"
    worker = _function(speculative / "eagle_worker_v2.py", "EAGLEWorkerV2._write_prompt_draft_kv")
    (graph_write,) = [c for c in _calls(worker, "write") if "graphs" in ast.unparse(c.func)]
    (eager_write,) = [c for c in _calls(worker, "write") if "writer" in ast.unparse(c.func)]
    assert graph_write.lineno < eager_write.lineno  # the graph first, kernel by kernel after
    # With a graph, the host builds one array and launches only the copies and the replay:
    # the shift, the tails' scatter and the keep are inside the graph.
    (graph_branch,) = [
        n
        for n in ast.walk(worker)
        if isinstance(n, ast.If) and ast.unparse(n.test) == "size is not None"
    ]
    graph_side = ast.Module(body=graph_branch.body, type_ignores=[])
    assert "prompt_kv_graph_inputs(" in ast.unparse(graph_side)
    assert "keep(" not in ast.unparse(graph_side) and "empty_like" not in ast.unparse(graph_side)
    assert "keep(" in ast.unparse(ast.Module(body=graph_branch.orelse, type_ignores=[]))
    capture = _function(
        speculative / "eagle_worker_v2.py", "EAGLEWorkerV2._capture_prompt_kv_graphs"
    )
    refusals = ast.unparse(capture)
    for reason in ("Backend.DISABLED", "world_size > 1"):
        assert reason in refusals
    graphs = speculative / "lagged_draft_kv.py"
    init = ast.unparse(_function(graphs, "PromptKvGraphs.__init__"))
    # Largest bucket first, the others in its memory pool; each body run once outside the
    # capture (cuBLAS chooses its kernels there); the warm-ups' keep into row 0 forgotten.
    assert "reversed(self.buckets)" in init and "pool=pool" in init
    assert init.index("self._write(size)") < init.index("torch.cuda.graph(")
    assert "writer.position.fill_(-1)" in init
    # Each warm-up and capture reads the padding layout of its own bucket (a larger bucket's
    # last indices left in its rows put the first try out of range).
    assert init.index("self.meta.zero_()") < init.index("self.meta[:size] = size")
    body = ast.unparse(_function(graphs, "PromptKvGraphs._write"))
    assert body.index("self.writer.write(") < body.index("self.writer.keep(")
    write = ast.unparse(_function(graphs, "PromptKvGraphs.write"))
    # The padding rows and the spare row write slot 0.
    assert "self.slots[n:size + 1].zero_()" in write and "replay()" in write


def test_prompt_kv_graph_inputs_pad_into_harmless_rows(patched_site: Path) -> None:
    """The host array of the prompts' draft KV graph: each prompt's last index, its row, every
    position. A NumPy transcription of the graph's body (PromptKvGraphs._write) run on it
    gives each real position the token after it (the next prompt token, or the prompt's tail
    at its end) and keeps each prompt's last position in its row; the padding's scatter lands
    on the spare row past the bucket, its keep on row 0 (the padding row), nowhere else."""
    import numpy as np

    inputs = _module(patched_site).prompt_kv_graph_inputs
    rng = np.random.default_rng(7)
    for size, prefix_lens, extend_lens in [
        (16, [0, 5, 2], [3, 2, 4]),
        (16, [3], [16]),
        (32, [0] * 17, [1] * 17),
        (64, [10, 0], [30, 1]),
    ]:
        count, total = len(extend_lens), sum(extend_lens)
        rows = list(rng.choice(np.arange(1, 100), size=count, replace=False))
        meta = inputs(prefix_lens, extend_lens, rows, size)
        assert meta.shape == (3 * size + 1,) and str(meta.dtype) == "int64"
        last, row_of, positions = meta[:size], meta[size : 2 * size], meta[2 * size :]
        input_ids = rng.integers(1000, 2000, size=size)  # past the prefill: stale rows
        tails = rng.integers(5000, 6000, size=size)  # past the prompts: stale entries
        tokens = np.zeros(size + 1, dtype=np.int64)
        tokens[: size - 1] = input_ids[1:size]
        tokens[last] = tails
        kept_rows = np.full(128, -1)
        kept_rows[row_of] = positions[last]

        starts = np.cumsum([0, *extend_lens])
        for i in range(count):
            run = slice(starts[i], starts[i + 1])
            expected_positions = np.arange(prefix_lens[i], prefix_lens[i] + extend_lens[i])
            assert positions[run].tolist() == expected_positions.tolist()
            expected_tokens = [*input_ids[starts[i] + 1 : starts[i + 1]], tails[i]]
            assert tokens[run].tolist() == expected_tokens
            assert kept_rows[rows[i]] == prefix_lens[i] + extend_lens[i] - 1
        assert (positions[total:] == 0).all() and (row_of[count:] == 0).all()
        assert (last[count:] == size).all()  # the spare row, never written to the KV pool
        touched = {int(r) for r in np.nonzero(kept_rows >= 0)[0]}
        assert touched <= {*map(int, rows), 0}
    with pytest.raises(ValueError, match="17 tokens"):
        inputs([0], [17], [1], 16)
    with pytest.raises(ValueError, match="rows"):
        inputs([0, 0], [1, 1], [1], 16)


def test_host_known_lengths_live_in_a_numpy_array(patched_site: Path) -> None:
    """The per-step read (every rows' lengths known, and their sum) and write of the lengths
    the host knows go through NumPy, not torch's dispatcher (about 30 us a step on the GPU
    host, job 45); the batch still gets a torch tensor."""
    overlap = patched_site / "sglang" / "srt" / "managers" / "overlap_utils.py"
    resolve = ast.unparse(_function(overlap, "FutureMap.resolve_seq_lens_cpu"))
    assert "self.host_known_seq_lens[batch.req_pool_indices_cpu.numpy()]" in resolve
    assert "batch.seq_lens_cpu = torch.from_numpy(known)" in resolve
    publish = ast.unparse(_function(overlap, "FutureMap.publish"))
    assert "self.host_known_seq_lens[indices_cpu.numpy()] = new_seq_lens_cpu.numpy()" in publish
    assert "np.full((self.req_pool_size,), -1, dtype=np.int64)" in overlap.read_text()


def test_decode_lengths_reach_the_gpu_in_one_copy_from_pinned_memory(patched_site: Path) -> None:
    """Every spec-v2 decode step sends the current and next KV lengths to the GPU. From pageable
    memory each copy is staged on the host; the patch makes them one copy of one pinned
    tensor, non-blocking. What it saves is measured on the GPU (GPU-RESULTS.md)."""
    source = patched_site / "sglang" / "srt" / "speculative" / "eagle_utils.py"
    (func,) = [
        node
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "eagle_prepare_for_decode"
    ]
    made = [
        call for call in _calls(func, "tensor") if "pin_memory" in {kw.arg for kw in call.keywords}
    ]
    assert len(made) == 1
    copies = [
        call for call in _calls(func, "to") if any(kw.arg == "non_blocking" for kw in call.keywords)
    ]
    assert [ast.unparse(call.func) for call in copies] == ["kv_lens_cpu.to"]


def _reads_of(func: ast.FunctionDef, name: str) -> set[str]:
    """Attributes read from the variable `name` in a function: name.x and getattr(name, "x")."""
    reads = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == name and isinstance(node.ctx, ast.Load):
                reads.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == name
            and isinstance(node.args[1], ast.Constant)
        ):
            reads.add(node.args[1].value)
    return reads


def test_lean_draft_extend_gives_the_graph_runner_all_it_reads(patched_site: Path) -> None:
    """The lean path (and the lagged write's catch-up) hands
    EAGLEDraftExtendCudaGraphRunner.execute a namespace built from the target's decode batch,
    not a ForwardBatch. Every field execute reads must be in it, so an SGLang update that reads
    one more fails here, not on a GPU."""
    spec = patched_site / "sglang" / "srt" / "speculative"
    execute = _function(
        spec / "eagle_draft_extend_cuda_graph_runner.py", "EAGLEDraftExtendCudaGraphRunner.execute"
    )
    lean = _function(spec / "eagle_worker_v2.py", "EAGLEWorkerV2._replay_draft_extend")
    (namespace,) = [
        n
        for n in ast.walk(lean)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "SimpleNamespace"
    ]
    given = {kw.arg for kw in namespace.keywords}
    # Read only when DP attention gathers MLP inputs, which the lean path excludes.
    only_with_mlp_gather = {"global_num_tokens_cpu"}
    missing = _reads_of(execute, "forward_batch") - given - only_with_mlp_gather
    assert not missing, f"execute reads {sorted(missing)}, which the lean namespace lacks"
    # The draft-extend input's fields that execute reads must be ones the lean path sets,
    # or ones execute sets itself before reading.
    (draft_input,) = [kw.value for kw in namespace.keywords if kw.arg == "spec_info"]
    set_by_lean = {kw.arg for kw in draft_input.keywords}
    spec_reads = {
        n.attr
        for n in ast.walk(execute)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "spec_info"
        and isinstance(n.ctx, ast.Load)
    }
    set_by_execute = {
        n.attr
        for n in ast.walk(execute)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "spec_info"
        and isinstance(n.ctx, ast.Store)
    }
    assert spec_reads <= set_by_lean | set_by_execute, spec_reads - set_by_lean - set_by_execute


def test_profile_summary_reads_a_torch_trace(tmp_path: Path) -> None:
    """gputest/profile_summary.py on a hand-made chrome trace: span, busy time (overlapping
    kernels counted once), kernels ranked by total time, graph launches, CPU ranges."""
    import gzip

    summary = _gputest_module("profile_summary")
    events = [
        {"ph": "X", "cat": "kernel", "name": "decode_attn", "ts": 0, "dur": 10_000},
        {"ph": "X", "cat": "kernel", "name": "decode_attn", "ts": 5_000, "dur": 10_000},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100_000, "dur": 50_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 2},
        {"ph": "X", "cat": "user_annotation", "name": "draft_extend", "ts": 0, "dur": 30},
        {"ph": "i", "cat": "kernel", "name": "not-a-span", "ts": 1},
    ]
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    s = summary.summarise(trace, top=5)
    assert s["span_ms"] == 150.0 and s["gpu_busy_ms"] == 65.0  # the overlap counted once
    assert [k["name"] for k in s["top_kernels"]] == ["gemm", "decode_attn"]
    assert s["top_kernels"][1]["count"] == 2
    assert s["cuda_graph_launches"] == 1
    assert s["annotations"] == {"draft_extend": {"count": 1, "mean_us": 30.0}}


def test_profile_summary_splits_a_decode_steps_host_time(tmp_path: Path) -> None:
    """--functions: Python functions' inclusive time per decode step, counting only the
    scheduler's run_batch ranges that hold a decode step (not prefills)."""
    import gzip

    summary = _gputest_module("profile_summary")

    def span(cat: str, name: str, ts: int, dur: int, tid: int = 1) -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        span("user_annotation", "scheduler.run_batch", 0, 1000),
        span("user_annotation", "step[DECODE bs=64]", 10, 900),
        span("python_function", "forward", 20, 600),
        span("python_function", "draft_extend", 650, 300),
        span("user_annotation", "scheduler.run_batch", 2000, 3000),
        span("user_annotation", "step[DECODE bs=64]", 2010, 2900),
        span("python_function", "forward", 2020, 1000),
        span("python_function", "forward", 2020, 1000, tid=2),  # another thread: not counted
        span("user_annotation", "scheduler.run_batch", 9000, 5000),  # a prefill: not counted
        span("user_annotation", "step[EXTEND bs=1 toks=32]", 9010, 4000),
        span("python_function", "forward", 9020, 4000),
    ]
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    n, mean, functions = summary.step_functions(trace)
    assert (n, mean) == (2, 2000.0)
    assert functions == {"forward": 800.0, "draft_extend": 150.0}
    # --kind EXTEND: the prefill's steps alone.
    assert summary.step_functions(trace, "EXTEND") == (1, 5000.0, {"forward": 4000.0})
    # --part: the loop's other ranges on the steps' thread (a nested repeat once), per range.
    more = [
        span("user_annotation", "scheduler.get_next_batch_to_run", 1000, 400),
        span("user_annotation", "scheduler.get_next_batch_to_run", 1010, 300),  # nested
        span("python_function", "prepare_for_decode", 1020, 200),
        span("user_annotation", "scheduler.get_next_batch_to_run", 5000, 600),
        span("python_function", "prepare_for_decode", 5010, 400),
        span("python_function", "filter_batch", 5420, 100),
        span("user_annotation", "scheduler.get_next_batch_to_run", 5000, 600, tid=2),
        span("python_function", "prepare_for_decode", 5010, 500, tid=2),
    ]
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events + more}, fh)
    assert summary.step_functions(trace, part="get_next_batch_to_run") == (
        2,
        500.0,
        {"prepare_for_decode": 300.0, "filter_batch": 50.0},
    )


def test_profile_summary_finds_the_syncs_that_block_the_host(tmp_path: Path) -> None:
    """--syncs: blocking syncs during the steps, grouped by call and by the Python frames around
    them on their thread (innermost first, object addresses dropped); syncs before the first
    step (the profiler starting) and runtime calls that do not block left out."""
    import gzip

    summary = _gputest_module("profile_summary")

    def span(cat: str, name: str, ts: int, dur: int, tid: int = 1) -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [span("cuda_runtime", "cudaDeviceSynchronize", 0, 900)]  # before any step
    for ts in (1000, 5000):
        events += [
            span("user_annotation", "step[EXTEND bs=1 toks=32]", ts, 3000),
            span("python_function", "worker.py(10): forward_batch_generation", ts, 2000),
            span("python_function", "lagged_draft_kv.py(61): forget", ts + 100, 1500),
            span("cuda_runtime", "cudaStreamSynchronize", ts + 200, 1100),
            span("cuda_runtime", "cudaLaunchKernel", ts + 1400, 5),  # not a sync
            span(
                "python_function",
                "<built-in method synchronize of Event object at 0x7f1>",
                ts + 2100,
                50,
            ),
            span("cuda_runtime", "cudaEventSynchronize", ts + 2110, 30),
        ]
    events[-1]["tid"] = 2  # the second event sync on another thread: no frame around it
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    steps, sites = summary.host_syncs(trace)
    assert steps == 2
    assert sites == {
        ("cudaStreamSynchronize", "forget < forward_batch_generation"): [1100.0, 1100.0],
        ("cudaEventSynchronize", "<built-in method synchronize of Event object>"): [30.0],
        ("cudaEventSynchronize", "(no Python frame)"): [30.0],
    }


def test_profile_summary_puts_gpu_time_per_step_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--gpu-per-step: per profiled step each trace's span, GPU busy time (overlaps once) and
    idle time, and its kernels; a level's servers side by side, plain first, kernels by their
    largest difference from plain; with --plot, the differences by kernel family."""
    import gzip

    summary = _gputest_module("profile_summary")

    def trace(folder: str, kernels: list[tuple[str, int, int]]) -> None:
        events = [
            {"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels
        ]
        events.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "ts": 0,
                "dur": 1_000_000,
            }
        )  # host side: not GPU time
        (tmp_path / folder).mkdir()
        with gzip.open(tmp_path / folder / "rank0.trace.json.gz", "wt") as fh:
            json.dump({"traceEvents": events}, fh)

    trace("plain-c16", [("gemm", 0, 300), ("attn", 300, 100), ("gemm", 1000, 300)])
    trace("patched-off-c16", [("gemm", 0, 300), ("kv_write", 250, 100), ("gemm", 1200, 300)])
    trace("plain-c64", [("gemm", 0, 500)])
    off = summary.gpu_per_step(tmp_path / "patched-off-c16" / "rank0.trace.json.gz", steps=2)
    assert off["span_us"] == 750 and off["busy_us"] == 325 and off["idle_us"] == 425
    assert off["kernels"] == {"gemm": 300, "kv_write": 50}
    assert summary.level_of(Path("x/patched-off-c64/t.json")) == ("c = 64", "patched-off")
    assert summary.level_of(Path("x/profiles/t.json")) == ("", "profiles")

    traces = sorted(tmp_path.rglob("*.trace.json*"))
    summary.print_gpu_per_step(traces, steps=2, top=5)
    out = capsys.readouterr().out
    sixteen = out.split("## c = 16")[1].split("## c = 64")[0]
    assert "| plain | patched-off | |" in sixteen
    assert "| 650 | 750 | **span** (the step's period; an upper bound) |" in sixteen
    assert "| 350 | 325 | **GPU busy** |" in sixteen
    rows = [line for line in sixteen.splitlines() if line.endswith("` |")]
    # attn and kv_write differ from plain by 50 us a step, gemm not at all.
    assert rows == [
        "| 50.0 | 0.0 | `attn` |",
        "| 0.0 | 50.0 | `kv_write` |",
        "| 300.0 | 300.0 | `gemm` |",
    ]
    assert "| plain | |" in out.split("## c = 64")[1]
    assert summary.by_level({"c = 128": 0, "c = 16": 0, "c = 64": 0}) == [
        "c = 16",
        "c = 64",
        "c = 128",
    ]
    # --plot: each server's GPU time over plain's by kernel family, one panel per level.
    png = tmp_path / "gpu.png"
    summary.print_gpu_per_step(traces, steps=2, top=5, plot=png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    family = summary.kernel_family
    assert family("nvjet_sm90_tst_64x64_64x13_4x1_v_bz_splitK_TNT") == "GEMMs"
    assert family("void cublasLt::splitKreduce_kernel<32, 16, int>") == "GEMMs"
    assert family("void flashinfer::norm::RMSNormKernel<8u>") == "norms"  # not attention
    assert family("_fwd_grouped_kernel_stage1") == "attention"
    assert family("void at::native::index_elementwise_kernel<128, 4>") == "gathers, scatters"
    assert family("Memcpy DtoD (Device -> Device)") == "copies, concatenations"
    assert family("assign_req_to_token_pool") == "other"


def test_profile_summary_splits_the_scheduler_thread_by_kind_of_step(tmp_path: Path) -> None:
    """--steps: run_batch ranges by the step they hold (nested ranges of one name once), the
    draft extend inside prefills, the loop's other parts, and the range holding no step (where
    the profiler started) kept out of the span's shares."""
    import gzip

    summary = _gputest_module("profile_summary")

    def span(name: str, ts: int, dur: int, tid: int = 1) -> dict[str, object]:
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        span("scheduler.run_batch", 0, 300),  # the profiler starting: no step inside
        span("scheduler.run_batch", 1000, 2000),
        span("scheduler.run_batch", 1010, 1900),  # nested, the same range again
        span("step[EXTEND bs=1 toks=32]", 1020, 1800),
        span("draft_extend", 2500, 400),
        span("scheduler.process_batch_result", 3100, 500),
        span("scheduler.run_batch", 4000, 1000),
        span("step[DECODE bs=64]", 4010, 900),
        span("scheduler.run_batch", 4000, 1000, tid=2),  # another thread
        span("scheduler.get_next_batch_to_run", 5100, 200),
        span("scheduler.run_batch", 6000, 1000),
        span("step[DECODE bs=64]", 6010, 900),
    ]
    trace = tmp_path / "rank0.trace.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    s = summary.step_kinds(trace)
    assert s["span_us"] == 7000
    assert s["kinds"] == {
        "other": {"count": 1, "run_batch_us": 300.0, "draft_extend_us": 0.0},
        "EXTEND": {"count": 1, "run_batch_us": 2000.0, "draft_extend_us": 400.0},
        "DECODE": {"count": 2, "run_batch_us": 2000.0, "draft_extend_us": 0.0},
    }
    assert s["parts"]["scheduler.process_batch_result"] == 500
    assert s["parts"]["scheduler.get_next_batch_to_run"] == 200


@pytest.mark.parametrize("interleave", [False, True])
def test_speed_script_orchestration_without_a_gpu(
    interleave: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """speed.py's bookkeeping with the servers faked: which servers run, in which order the
    windows go, medians, ratios to plain, and the upstream-extend server's environment. What it
    measures on a GPU is in GPU-RESULTS.md."""
    monkeypatch.syspath_prepend(str(ROOT / "lab" / "gpu"))
    speed = _gputest_module("speed")
    started: list[tuple[str, dict[str, str] | None]] = []
    fractions: list[str] = []
    windows: list[tuple[int, int]] = []
    rates = {30300: [100.0, 120.0, 110.0], 30301: [60.0, 50.0, 55.0]}

    class Proc:
        def terminate(self) -> None: ...
        def wait(self, timeout: float) -> int:
            return 0

    def fake_start(
        name: str, args: list[str], port: int, logs: Path, env: dict[str, str] | None = None
    ) -> Proc:
        started.append((name, env))
        fractions.append(args[args.index("--mem-fraction-static") + 1])
        return Proc()

    def fake_loop(port: int, clients: int, seconds: float, **kw: object) -> float:
        windows.append((port, clients))
        return rates[port][sum(1 for p, c in windows if p == port and c == clients) - 1]

    monkeypatch.setattr(speed, "start", fake_start)
    monkeypatch.setattr(speed, "wait_healthy", lambda port, proc, timeout: 1.0)
    monkeypatch.setattr(speed, "wait_for_log", lambda path, text, proc, timeout=300: None)
    monkeypatch.setattr(speed, "closed_loop", fake_loop)
    monkeypatch.setattr(speed, "spec_loads", lambda port: {"accept_length": 1.0})
    monkeypatch.setattr(speed.time, "sleep", lambda s: None)
    argv = [
        "speed.py",
        "--out",
        str(tmp_path),
        "--only",
        "plain,patched-off-upstream-extend",
        "--concurrency",
        "16",
        "--repeat",
        "3",
    ]
    if interleave:
        argv.append("--interleave")
    monkeypatch.setattr(sys, "argv", argv)
    assert speed.main() == 0
    result = json.loads((tmp_path / "speed.json").read_text())
    assert [name for name, _ in started] == ["plain", "patched-off-upstream-extend"]
    assert started[1][1] == {"SGLANG_SPEC_LEAN_OFF_DRAFT_EXTEND": "0"}
    assert result["tok_s"] == {"plain": {"16": 110.0}, "patched-off-upstream-extend": {"16": 55.0}}
    assert result["ratio_to_plain"] == {"patched-off-upstream-extend": {"16": 0.5}}
    ports = [p for p, _ in windows]
    expected = [30300, 30301] * 3 if interleave else [30300] * 3 + [30301] * 3
    assert ports == expected
    # Together, two servers must share the GPU's memory.
    assert fractions == (["0.40", "0.40"] if interleave else ["0.6", "0.6"])


@pytest.mark.parametrize("gpus", [2, 1])
def test_off_step_job_orchestration_without_a_gpu(gpus: int, tmp_path: Path) -> None:
    """off-step-2gpu.sh with the GPU runner and nvidia-smi stood in for: with two GPUs the
    checks run on GPU 0 beside the speed runs on GPU 1; with one, verify runs first and the
    speed runs after it on GPU 0, without draftkv. Either way the results come back as at most
    8 files at the top (the device tool returns no more), the rest in one archive."""
    import tarfile

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: H200'\n" for i in range(gpus)))
    calls = tmp_path / "calls.txt"
    runner = tmp_path / "run.sh"
    runner.write_text(f"""#!/usr/bin/env bash
echo "${{CUDA_VISIBLE_DEVICES:-none}} $3" >> {calls}
echo "$3 ${{*:4}}" >> {calls}.args
mkdir -p "$2"
case "$3" in
  verify) echo '{{"all_passed": true}}' > "$2/results.json" ;;
  draftkv) echo '{{"passed": true}}' > "$2/draftkv.json" ;;
  lab/bench/gpu_envelope.py)
    echo '{{"windows": []}}' > "$2/envelope.json"; echo log > "$2/plain.log" ;;
esac
""")
    for script in (smi, runner):
        script.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OFF_STEP_RUN": str(runner)}
    if gpus == 1:  # the checks' arguments can be chosen; by default prefill graphs as deployed
        env["OFF_STEP_CHECK_ARGS"] = "--checks control"
    result = subprocess.run(
        ["bash", str(ROOT / "lab" / "gpu" / "off-step-2gpu.sh"), "site.tar.xz", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ran = calls.read_text().split("\n")[:-1]
    if gpus == 2:
        assert sorted(ran) == sorted(
            ["none none", "0 verify", "0 draftkv", "1 lab/bench/gpu_envelope.py"]
        )
    else:
        assert ran == ["none none", "0 verify", "0 lab/bench/gpu_envelope.py"]
    # Checks and speed runs replay prefill graphs unless told otherwise (OFF_STEP_CHECK_ARGS
    # for the checks, the script's own arguments for the speed runs).
    args = dict(line.split(" ", 1) for line in Path(f"{calls}.args").read_text().splitlines())
    checks = "--prefill-graph-tokens 4096" if gpus == 2 else "--checks control"
    assert args["verify"] == checks and args.get("draftkv", checks) == checks
    assert "--prefill-graph-tokens 2048" in args["lab/bench/gpu_envelope.py"]
    top = sorted(p.name for p in out.iterdir())
    assert len(top) <= 8 and all(p.is_file() for p in out.iterdir())
    assert {"verify.json", "envelope.json", "logs.tar.xz"} <= set(top)
    assert ("draftkv.json" in top) == (gpus == 2)
    with tarfile.open(out / "logs.tar.xz") as archive:
        names = archive.getnames()
    assert "envelope/plain.log" in names and "setup/setup.log" in names


def _job(
    tmp_path: Path, script: str, env_var: str, *args: str, env: dict[str, str] | None = None
) -> tuple[list[str], Path]:
    """Run a job script of lab/bench/ with the GPU runner (named by `env_var`) stood in for: each
    run's `GPUS ARGS` line (GPUS `none` where the script named none), and where the results
    came back."""
    calls = tmp_path / "calls.txt"
    runner = tmp_path / "run.sh"
    runner.write_text(f"""#!/usr/bin/env bash
echo "${{CUDA_VISIBLE_DEVICES:-none}} ${{*:3}}" >> {calls}
mkdir -p "$2"
[ "$3" = none ] || {{ echo '{{"windows": []}}' > "$2/envelope.json"; echo log > "$2/plain.log"
  echo log > "$2/router.log"; }}
""")
    runner.chmod(0o755)
    out = tmp_path / "out"
    run_env = {**os.environ, env_var: str(runner), **(env or {})}
    result = subprocess.run(
        ["bash", str(ROOT / "lab" / "bench" / script), "site.tar.xz", str(out), *args],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return calls.read_text().splitlines(), out


def _two_run_job(
    tmp_path: Path, script: str, env_var: str, *args: str, env: dict[str, str] | None = None
) -> tuple[dict, Path]:
    """A two-GPU job script: what each GPU's run was told (the set-up run, on none, left out),
    and where the results came back."""
    lines, out = _job(tmp_path, script, env_var, *args, env=env)
    return dict(line.split(" ", 1) for line in lines if line[0] != "n"), out


def _results_came_back(out: Path, files: set[str], logs: set[str]) -> None:
    """At most 8 files at the top (what the device tool returns), the rest in one archive."""
    import tarfile

    top = sorted(p.name for p in out.iterdir())
    assert len(top) <= 8 and all(p.is_file() for p in out.iterdir())
    assert files | {"logs.tar.xz"} <= set(top)
    with tarfile.open(out / "logs.tar.xz") as archive:
        assert logs | {"setup/setup.log"} <= set(archive.getnames())


def test_workload_ab_job_orchestration_without_a_gpu(tmp_path: Path) -> None:
    """lab/bench/workload-ab-2gpu.sh: the long-request A/B on GPU 0 beside the prefill-graph A/B
    on GPU 1, each told its one change to the sweep's workload, and both the extra arguments."""
    ran, out = _two_run_job(
        tmp_path, "workload-ab-2gpu.sh", "WORKLOAD_AB_RUN", "--temperature", "0.9"
    )
    assert set(ran) == {"0", "1"}
    assert "--new-tokens 512,1024" in ran["0"] and "--prefill-graph-tokens" not in ran["0"]
    assert "--prefill-graph-tokens 2048" in ran["1"] and "--new-tokens" not in ran["1"]
    assert all("--extra patched-off" in a and a.endswith("--temperature 0.9") for a in ran.values())
    _results_came_back(out, {"long.json", "graphs.json"}, {"long/plain.log", "graphs/plain.log"})


def test_flush_ab_job_orchestration_without_a_gpu(tmp_path: Path) -> None:
    """lab/bench/flush-ab-2gpu.sh: the same A/B on both GPUs, prefix caches kept on GPU 0 and
    emptied before each window (and profiled) on GPU 1, on ports and models of their own."""
    ran, out = _two_run_job(tmp_path, "flush-ab-2gpu.sh", "FLUSH_AB_RUN", "--temperature", "1.0")
    assert set(ran) == {"0", "1"}
    assert "--flush-cache" not in ran["0"] and "--flush-cache" in ran["1"]
    assert "--profile-levels 16,64" in ran["1"] and "--port-base 31300" in ran["1"]
    for args in ran.values():
        assert "--extra patched-off" in args and "--prefill-graph-tokens 2048" in args
        assert args.endswith("--temperature 1.0")
    _results_came_back(out, {"kept.json", "flushed.json"}, {"kept/plain.log", "flushed/plain.log"})


def test_sweep_job_orchestration_without_a_gpu(tmp_path: Path) -> None:
    """lab/bench/sweep-2gpu.sh:
    the low levels with all four servers on GPU 0 beside the learned high
    levels on GPU 1, both as deployed (prefill graphs, emptied caches), on ports of their own."""
    ran, out = _two_run_job(tmp_path, "sweep-2gpu.sh", "SWEEP_RUN", "--seconds", "3")
    assert set(ran) == {"0", "1"}
    assert "--levels 4,8,2,1" in ran["0"] and "upstream-0step" in ran["0"]
    assert "--probe-interval 600" in ran["0"] and "--learn-seconds" not in ran["0"]
    assert "--levels 16,128,64,32" in ran["1"] and "--learn-seconds 90" in ran["1"]
    assert "--port-base 31300" in ran["1"] and "--port-base" not in ran["0"]
    for args in ran.values():
        assert "--prefill-graph-tokens 2048 --flush-cache" in args and "specgate-probes" in args
        assert args.endswith("--seconds 3")
    _results_came_back(out, {"low.json", "high.json"}, {"low/plain.log", "high/plain.log"})


def test_speculating_gap_job_orchestration_without_a_gpu(tmp_path: Path) -> None:
    """lab/bench/speculating-gap-2gpu.sh:
    verify then draftkv with prefill graphs on GPU 0, beside the
    deployed sweep of plain, always-on, the held-speculating routed engine (direct too) and
    pinned-off on GPU 1."""
    ran, out = _two_run_job(
        tmp_path, "speculating-gap-2gpu.sh", "SPECULATING_GAP_RUN", "--repeat", "4"
    )
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert [c.split()[:2] for c in calls if c[0] == "0"] == [["0", "verify"], ["0", "draftkv"]]
    assert all("--prefill-graph-tokens 4096" in c for c in calls if c[0] == "0")
    envelope = ran["1"]
    assert "--servers plain,always-on,specgate-probes --direct-too" in envelope
    assert "--router-threshold 146" in envelope and "--extra patched-off" in envelope
    assert "--prefill-graph-tokens 2048 --flush-cache" in envelope
    assert envelope.endswith("--repeat 4") and "--port-base 31300" in envelope
    _results_came_back(out, {"envelope.json"}, {"envelope/plain.log", "verify/plain.log"})
    # Each check's log ends with its exit status (job-lib.sh's gpu_check).
    for check in ("verify", "draftkv"):
        assert (out / f"{check}.log").read_text().splitlines()[-1] == f"{check}: exit 0"


def test_misses_job_orchestration_without_a_gpu(tmp_path: Path) -> None:
    """lab/bench/misses-2gpu.sh: off against plain with ten window pairs on GPU 0, beside the
    sweep's two missed levels with ten windows each after a learning phase on GPU 1, on
    engines admitting 128 requests and a router that does not probe within the job, both
    as deployed, on ports and models of their own."""
    ran, out = _two_run_job(tmp_path, "misses-2gpu.sh", "MISSES_RUN", "--temperature", "1.0")
    assert set(ran) == {"0", "1"}
    assert "--servers plain --extra patched-off --levels 16,64" in ran["0"]
    assert "--repeat 10" in ran["0"] and "--port-base" not in ran["0"]
    assert "--servers plain,always-on,specgate-probes --levels 16,4 --repeat 10" in ran["1"]
    assert "--learn-seconds 90 --max-running 128 --probe-interval 600" in ran["1"]
    assert "--port-base 31300" in ran["1"]
    for args in ran.values():
        assert "--prefill-graph-tokens 2048 --flush-cache" in args
        assert args.endswith("--temperature 1.0")  # the caller's arguments come last
    _results_came_back(out, {"gpu0.json", "misses.json"}, {"gpu0/plain.log", "misses/plain.log"})


def test_misses_job_runs_the_weak_draft_on_gpu0_when_asked(tmp_path: Path) -> None:
    """MISSES_GPU0=weak-draft: job 17's temperature 1.0 at c = 8 and 32 after learning, on
    models of its own; anything else is refused before a GPU is touched."""
    ran, _ = _two_run_job(
        tmp_path, "misses-2gpu.sh", "MISSES_RUN", env={"MISSES_GPU0": "weak-draft"}
    )
    assert "--servers plain,always-on,specgate-probes --levels 8,32 --repeat 5" in ran["0"]
    assert "--temperature 1.0 --learn-seconds 90 --max-running 128" in ran["0"]
    assert "--models /tmp/specgate-models-weak" in ran["0"]
    assert "--temperature 0.9" in ran["1"]
    script = ROOT / "lab" / "bench" / "misses-2gpu.sh"
    env = {**os.environ, "MISSES_GPU0": "fast", "MISSES_RUN": "/nonexistent"}
    done = subprocess.run(
        ["bash", str(script), "x", str(tmp_path / "bad")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and "MISSES_GPU0=fast: off, weak-draft or none" in done.stdout


def test_misses_job_on_one_gpu(tmp_path: Path) -> None:
    """MISSES_GPU0=none: the misses alone, on GPU 0; MISSES_GPU1=none: GPU 0's run alone."""
    lines, out = _job(tmp_path, "misses-2gpu.sh", "MISSES_RUN", env={"MISSES_GPU0": "none"})
    ran = [line for line in lines if not line.startswith("none")]
    assert len(ran) == 1 and ran[0].startswith("0 ") and "--levels 16,4" in ran[0]
    _results_came_back(out, {"misses.json"}, {"misses/plain.log"})
    (tmp_path / "alone").mkdir()
    alone, _ = _job(
        tmp_path / "alone",
        "misses-2gpu.sh",
        "MISSES_RUN",
        env={"MISSES_GPU0": "weak-draft", "MISSES_GPU1": "none"},
    )
    ran = [line for line in alone if not line.startswith("none")]
    assert len(ran) == 1 and ran[0].startswith("0 ") and "--levels 8,32" in ran[0]


def test_host_time_job_orchestration_without_a_gpu(tmp_path: Path) -> None:
    """lab/bench/host-time-1gpu.sh: job 41's pair on one GPU with ten window pairs, each window's
    scheduler recorded by the py-spy it unpacks from the carried wheel; without a wheel it
    stops before starting a server. With HOST_TIME_CHECKS=1 the checks run on GPU 1 beside."""
    import zipfile

    wheel = tmp_path / "py_spy-0.4.3-py2.py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("py_spy-0.4.3.data/scripts/py-spy", "#!/bin/sh\n")
    spy_dir = tmp_path / "spy"
    (tmp_path / "job").mkdir()
    lines, out = _job(
        tmp_path / "job",
        "host-time-1gpu.sh",
        "HOST_TIME_RUN",
        "--seconds",
        "3",
        env={"HOST_TIME_PYSPY": str(wheel), "SPECGATE_PYSPY_DIR": str(spy_dir)},
    )
    ran = [line.split(" ", 1)[1] for line in lines]
    assert ran[0] == "none" and len(ran) == 2
    args = ran[1]
    assert args.startswith("lab/bench/gpu_envelope.py --servers plain --extra patched-off")
    assert "--repeat 10 --gc-stats" in args and "--freeze-gc" not in args
    assert f"--pyspy {spy_dir / 'py-spy'} " in args and (spy_dir / "py-spy").stat().st_mode & 0o100
    assert "--prefill-graph-tokens 2048" in args and args.endswith("--seconds 3")
    _results_came_back(
        out, {"host-time.json", "host-time.log", "pyspy-steps.md"}, {"run/plain.log"}
    )
    # The stand-in's windows have no recordings: the summary says so rather than inventing one.
    assert "no window with a py-spy recording" in (out / "pyspy-steps.md").read_text()
    (tmp_path / "none").mkdir()
    result = subprocess.run(
        [
            "bash",
            str(ROOT / "lab" / "bench" / "host-time-1gpu.sh"),
            "site.tar.xz",
            str(tmp_path / "none" / "out"),
        ],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "HOST_TIME_RUN": str(tmp_path / "job" / "run.sh"),
            "HOST_TIME_PYSPY": "",
        },
        timeout=60,
    )
    assert result.returncode == 1 and "no py-spy: carry its wheel in .gpu/" in result.stdout
    (tmp_path / "checks").mkdir()
    lines, out = _job(
        tmp_path / "checks",
        "host-time-1gpu.sh",
        "HOST_TIME_RUN",
        env={
            "HOST_TIME_PYSPY": str(wheel),
            "SPECGATE_PYSPY_DIR": str(spy_dir),
            "HOST_TIME_CHECKS": "1",
        },
    )
    by_gpu = sorted(line.split(" ", 2)[:2] for line in lines)
    assert by_gpu == [
        ["0", "lab/bench/gpu_envelope.py"],
        ["1", "draftkv"],
        ["1", "verify"],
        ["none", "none"],
    ]
    _results_came_back(
        out, {"host-time.json", "pyspy-steps.md"}, {"verify.log", "draftkv.log", "run/plain.log"}
    )


def test_patch_checks_on_one_gpu_without_a_gpu(tmp_path: Path) -> None:
    """lab/gpu/patch-checks-1gpu.sh: verify, then draftkv, on GPU 0, each with the
    prefill CUDA graphs the operator's pods run; their results and logs come back on top."""
    lines, out = _job(tmp_path, "../gpu/patch-checks-1gpu.sh", "PATCH_CHECKS_RUN")
    assert lines == [
        "none none",
        "0 verify --prefill-graph-tokens 4096",
        "0 draftkv --prefill-graph-tokens 4096",
    ]
    _results_came_back(out, {"verify.log", "draftkv.log"}, {"verify", "draftkv"})
    assert "verify: exit 0" in (out / "verify.log").read_text()


def test_router_stall_job_orchestration_without_a_gpu(tmp_path: Path) -> None:
    """lab/bench/router-stall.sh:
    the routed engine and its own port at c = 128 twice on one GPU, one
    run after the other (a connection per request, then kept connections), on ports and
    models of their own; no py-spy wheel, no recording, and the job goes on."""
    lines, out = _job(
        tmp_path,
        "router-stall.sh",
        "ROUTER_STALL_RUN",
        "--seconds",
        "3",
        env={"ROUTER_STALL_PYSPY": ""},
    )
    ran = [line.split(" ", 1)[1] for line in lines]
    assert ran[0] == "none" and len(ran) == 3
    conn, keep = ran[1:]
    for args in (conn, keep):
        assert "--servers specgate-probes --direct-too --levels 128" in args
        assert "--router-threshold 146" in args and "--prefill-graph-tokens 2048" in args
        assert "--flush-cache" in args and args.endswith("--seconds 3")
    assert "--client-keepalive" not in conn and "--port-base" not in conn
    assert "--client-keepalive --port-base 31300" in keep
    _results_came_back(
        out, {"conn.json", "keep.json"}, {"conn/router.log", "keep/router.log", "host/net.txt"}
    )
    assert "no py-spy wheel" in (out / "pyspy.log").read_text()
    import tarfile

    with tarfile.open(out / "logs.tar.xz") as archive:
        member = archive.extractfile("host/net.txt")
        assert member is not None
        assert "net.core.somaxconn = " in member.read().decode()


def test_job_lib_splits_profiles_by_loop_part_and_lists_syncs(tmp_path: Path) -> None:
    """job-lib.sh's profile_splits, as the job scripts call it: the three loop parts' function
    tables, then the syncs, for a folder of traces."""
    import gzip

    trace = tmp_path / "profiles" / "plain-c16" / "rank0.trace.json.gz"
    trace.parent.mkdir(parents=True)
    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "scheduler.run_batch",
            "ts": 0,
            "dur": 900,
            "tid": 1,
        },
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "step[DECODE bs=16]",
            "ts": 10,
            "dur": 800,
            "tid": 1,
        },
        {
            "ph": "X",
            "cat": "python_function",
            "name": "x.py(1): forget",
            "ts": 20,
            "dur": 500,
            "tid": 1,
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaStreamSynchronize",
            "ts": 30,
            "dur": 400,
            "tid": 1,
        },
    ]
    with gzip.open(trace, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    script = f". lab/gpu/job-lib.sh && profile_splits {tmp_path / 'profiles'}"
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("# ")]
    assert headers == [
        "# profile_summary.py PROFILES --functions 50 --part run_batch",
        "# profile_summary.py PROFILES --functions 50 --part get_next_batch_to_run",
        "# profile_summary.py PROFILES --functions 50 --part process_batch_result",
        "# profile_summary.py PROFILES --syncs",
    ]
    assert "1 x cudaStreamSynchronize" in result.stdout and "in forget" in result.stdout


def test_pinned_job_orchestration_without_a_gpu(tmp_path: Path) -> None:
    """lab/bench/pinned-2gpu.sh: the c = 4 rerun on GPU 0 and the off A/B on GPU 1, each on its own
    half of the host's cores, on ports and model folders of their own."""
    ran, out = _two_run_job(tmp_path, "pinned-2gpu.sh", "PINNED_RUN")
    assert set(ran) == {"0", "1"}
    assert "--levels 4 " in ran["0"] and "--pin-cpus 1/2" in ran["0"]
    assert "--extra patched-off" in ran["1"] and "--pin-cpus 2/2" in ran["1"]
    assert "--port-base 31300" in ran["1"] and "--port-base" not in ran["0"]
    _results_came_back(out, {"c4.json", "off.json"}, {"c4/plain.log", "off/plain.log"})


def test_a_warm_gpu_machine_patches_again_when_the_patch_changed(tmp_path: Path) -> None:
    """run-on-gpu.sh unpacks and patches the archive once per patch: a second call with the same
    patch keeps the patched tree (the device keeps a machine warm between calls), one with a
    changed patch starts again from the archive. A marker that only said "patched" once ran a
    GPU job against the previous call's patch."""
    repo = tmp_path / "repo"
    (repo / "lab" / "gpu").mkdir(parents=True)
    shutil.copy(ROOT / "lab/gpu/run-on-gpu.sh", repo / "lab/gpu/")
    (repo / "worker-image" / "patches").mkdir(parents=True)
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    (pristine / "engine.py").write_text("speed = 1\n")
    archive = tmp_path / "site.tar.xz"
    subprocess.run(["tar", "-cJf", str(archive), "-C", str(pristine), "engine.py"], check=True)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho fake GPU\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    site = tmp_path / "site"
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "SPECGATE_SITE": str(site)}

    def run_with(new_line: str) -> str:
        patch = f"--- a/engine.py\n+++ b/engine.py\n@@ -1 +1 @@\n-speed = 1\n+{new_line}\n"
        (repo / "worker-image" / "patches" / "0001.patch").write_text(patch)
        subprocess.run(
            ["bash", "lab/gpu/run-on-gpu.sh", str(archive), str(tmp_path / "out"), "none"],
            cwd=repo,
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )
        return (site / "engine.py").read_text()

    assert run_with("speed = 2") == "speed = 2\n"
    (site / "engine.py").write_text("speed = 2\n# kept: same patch, no unpacking\n")
    assert run_with("speed = 2").endswith("# kept: same patch, no unpacking\n")
    assert run_with("speed = 3") == "speed = 3\n"
    assert (tmp_path / "site-upstream" / "engine.py").read_text() == "speed = 1\n"


def _step_profile_module(site: Path) -> ModuleType:
    # step_profile.py imports torch only inside the functions that time graphs or count.
    path = site / "sglang" / "srt" / "speculative" / "step_profile.py"
    return load_module(path, "step_profile_under_test")


def test_the_engine_step_profile_is_what_the_router_parses(patched_site: Path) -> None:
    """The profile the engine exports (/v1/loads `step_profile`) goes through the router's own
    parser: seeded points, live points that replace a seed after enough steps, and seeds
    shifted by the host time the live steps show (a graph replay leaves it out)."""
    from specgate_router import control

    module = _step_profile_module(patched_site)
    table = module.StepProfileTable([1, 2, 4, 8, 16, 32])
    assert table.to_wire() is None  # nothing measured yet: no profile rather than half of one
    for batch in table.batch_sizes:
        table.seed("on", batch, 0.004 + 0.0001 * batch)
        table.seed("off", batch, 0.002 + 0.0002 * batch)
    wire = table.to_wire()
    profile = control.StepProfile.from_wire(wire, off_step_tokens=4, num_steps=3)
    assert profile is not None and profile.on[0] == (1.0, 0.0041)
    # Live off steps at batch 8 (bucketed from 5-8) with 1 ms of host time beyond the seed:
    for _ in range(module.LIVE_MIN_STEPS - 1):
        table.observe(False, 7, 0.0036 + 0.001)
    assert dict(map(tuple, table.to_wire()["off"]))[8] == pytest.approx(0.0036)  # not yet
    table.observe(False, 6, 0.0036 + 0.001)
    off = dict(map(tuple, table.to_wire()["off"]))
    on = dict(map(tuple, table.to_wire()["on"]))
    assert off[8] == pytest.approx(0.0046)  # measured
    assert off[32] == pytest.approx(0.0084 + 0.001)  # seed plus the measured host offset
    assert on[16] == pytest.approx(0.0056 + 0.001)  # the other mode's offset until its own
    # A hostile or broken step never enters the table, and a few slow ones (a kernel compile
    # in a server's first steps) do not move a measured point.
    for bad in (float("nan"), float("inf"), -1.0, 0.0, 2.5):
        table.observe(True, 4, bad)
    for slow in (0.9, 0.5):
        table.observe(False, 8, slow)
    assert dict(map(tuple, table.to_wire()["off"]))[8] == pytest.approx(0.0046)
    table.observe(True, 64, 0.01)  # beyond the largest graph: no point for it
    assert control.StepProfile.from_wire(table.to_wire(), off_step_tokens=4, num_steps=3)


def test_the_engine_profile_keeps_at_most_the_contracts_points(patched_site: Path) -> None:
    module = _step_profile_module(patched_site)
    sizes = module.profile_batch_sizes(range(1, 513))
    assert len(sizes) == contract.MAX_PROFILE_POINTS == module.MAX_PROFILE_POINTS
    assert sizes[0] == 1 and sizes[-1] == 512 and sizes == sorted(set(sizes))
    assert module.profile_batch_sizes([8, 1, 4, 4, 0]) == [1, 4, 8]
    table = module.StepProfileTable([1, 4, 8])
    assert [table.bucket(b) for b in (1, 2, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 8),
        ("", 8),
        ("0", 0),
        ("16", 16),
        ("-1", "error"),
        ("often", "error"),
        ("2.5", "error"),
    ],
)
def test_the_off_agreement_sampling_rate_is_checked(
    value: Any, expected: Any, patched_site: Path
) -> None:
    module = _step_profile_module(patched_site)
    if expected == "error":
        with pytest.raises(ValueError, match=module.OFF_AGREEMENT_EVERY_ENV):
            module.parse_agreement_every(value)
    else:
        assert module.parse_agreement_every(value) == expected


def test_the_engine_counts_acceptance_as_the_router_reads_it(patched_site: Path) -> None:
    """Speculating steps' per-request accept lengths become the contract's counters; the
    router's tracker turns two readings into the accept length those steps had."""
    from specgate_router import control

    module = _module(patched_site)

    class Worker:
        speculative_num_steps = 3

    ctrl = module.ThresholdController(Worker(), 8)
    before = ctrl.model_inputs()
    assert before["step_profile"] is None and before["num_steps"] == 3
    assert ctrl.recent_accept_length is None
    for _ in range(20):
        ctrl.count_speculating_step([4, 1, 2, 3])  # mean 2.5; three of four first drafts taken
    after = ctrl.model_inputs()
    assert set(contract.ACCEPTANCE_COUNTERS) | set(contract.STEP_TIME_COUNTERS) <= set(after)
    # /v1/loads sets each of them on its `speculative` struct, which must declare them all.
    snapshot = patched_site / "sglang" / "srt" / "managers" / "load_snapshot.py"
    (struct,) = [
        node
        for node in ast.walk(ast.parse(snapshot.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "SpeculativeMetrics"
    ]
    declared = {
        item.target.id
        for item in struct.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }
    assert set(after) <= declared, set(after) - declared
    assert (after["spec_request_steps"], after["spec_accepted_tokens"]) == (80, 120)
    assert after["spec_first_agreed"] == 60
    assert ctrl.recent_accept_length == pytest.approx(2.5)
    tracker = control.AcceptanceTracker()
    tracker.update(control.counters_from_wire(before) or {}, at=0.0, num_steps=3)
    tracker.update(control.counters_from_wire(after) or {}, at=1.0, num_steps=3)
    current = tracker.current(1.0)
    assert current is not None
    assert (current.tau, current.source) == (pytest.approx(2.5), "measured")
    ctrl.count_speculating_step([])  # an empty step changes nothing
    assert ctrl.model_inputs()["spec_request_steps"] == 80
