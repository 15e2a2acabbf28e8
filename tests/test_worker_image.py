"""The worker-image patch, checked on the CPU: it applies cleanly to the pinned SGLang 0.5.17
wheel and compiles, and the pure logic it adds agrees with specgate's control contract.

The GPU half (runtime control, output identity, speed) is lab/gpu/, run on a GPU
machine; its results are in lab/GPU-NOTEBOOK.md.
"""

from __future__ import annotations

import ast
import os
import re
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
