"""One runner for the lab's GPU jobs: a job is a table of runs, nothing else.

A run is one script of run-on-gpu.sh (a check beside this file, such as verify or draftkv, or a
path such as lab/bench/gpu_envelope.py) with its arguments and time limit. A job's runs form
lanes: the runs of a lane go one after another on one GPU, the lanes side by side, lane i on
GPU i (on a host with fewer GPUs, the lanes one after another on GPU 0, and a run that needs
more GPUs than the host has is left out). Each run writes into OUT/NAME, its output and exit
status into OUT/NAME.log; its results file comes back as OUT/NAME.json. The device tool returns
at most eight files, two folders down, so everything else (server logs, profiles, the set-up)
goes into OUT/logs.tar.xz.

    python3 lab/gpu/job.py JOB [--archive .gpu/site312.tar.xz] [--out OUT/JOB]
        [--only RUN,...] [--check-args "..."] [-- ARGS for every bench run]
    python3 lab/gpu/job.py --list

The jobs are the command lines of earlier GPU jobs, kept rerunnable (lab/NOTEBOOK.md and
lab/GPU-NOTEBOOK.md say what each found). SPECGATE_GPU_RUN replaces run-on-gpu.sh (the tests
stand in for the GPU with it); a job with py-spy finds its wheel in .gpu/ (py_spy-*.whl) or
SPECGATE_PYSPY_WHEEL, unpacked into SPECGATE_PYSPY_DIR (/tmp/specgate-pyspy).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENVELOPE = "lab/bench/gpu_envelope.py"
CHECK_RESULTS = {"verify": "results.json", "draftkv": "draftkv.json"}
DEPLOYED = "--prefill-graph-tokens 2048 --flush-cache"
"""Prefills replay SGLang's breakable CUDA graphs (its default and the operator's pods') and
every window starts from empty prefix caches."""
CHECK_GRAPHS = "--prefill-graph-tokens 4096"
"""The engine checks with the prefill CUDA graphs the operator's pods run."""
OFF_AB = "--servers plain --extra patched-off --levels 16,64 --extra-levels 16,64"
"""Plain against the patch pinned off at c = 16 and 64."""
PROBES = "--servers plain,always-on,specgate-probes"


STALL = (
    "--servers specgate-probes --direct-too --levels 128 --repeat 5 --router-threshold 146"
    f" --probe-interval 600 {DEPLOYED} --temperature 0.9 --mem-fraction 0.2"
    " --models /tmp/specgate-models-stall --deadline 210"
)


@dataclass(frozen=True)
class Run:
    name: str
    script: str
    """A check beside this file (verify, draftkv, recovery) or a path from the repository
    root; `record-router:RUN` records RUN's router with py-spy while it lives."""
    args: str = ""
    """Split at spaces; {out} and {pyspy} are replaced."""
    timeout: int = 540
    gpus: str | None = None
    """CUDA_VISIBLE_DEVICES where the run needs more than its lane's GPU ("0,1"; "" for all)."""
    needs_gpus: int = 1
    """Left out on a host with fewer GPUs."""

    @property
    def check(self) -> bool:
        return "/" not in self.script and not self.script.startswith("record-router")


@dataclass(frozen=True)
class Job:
    about: str
    lanes: tuple[tuple[Run, ...], ...]
    profiles: tuple[str, str] | None = None
    """(run, file): the run's torch profiles summarised by scheduler-loop part into OUT/file."""
    pyspy_steps: str | None = None
    """A run whose windows py-spy recorded: their us per decode step into OUT/pyspy-steps.md."""
    host_net: bool = False
    """The host's network limits into OUT/host/net.txt."""
    kcache: bool = False
    """The compiled kernels into OUT/kcache.tar.xz, for the next run (.gpu/kcache.tar.xz)."""


def _checks(*, draftkv_gpus: int = 1) -> tuple[Run, ...]:
    return (
        Run("verify", "verify", CHECK_GRAPHS, timeout=330),
        Run("draftkv", "draftkv", CHECK_GRAPHS, timeout=250, needs_gpus=draftkv_gpus),
    )


JOBS: dict[str, Job] = {
    "sweep": Job(
        "The envelope sweep as deployed at temperature 0.9: c = 4, 8, 2, 1 for plain, "
        "always-on, upstream's adaptive baseline and specgate (no probe within the job) on "
        "GPU 0; c = 16, 128, 64, 32 after 90 s of learning on GPU 1.",
        (
            (
                Run(
                    "low",
                    ENVELOPE,
                    "--servers plain,always-on,upstream-0step,specgate-probes"
                    f" --levels 4,8,2,1 --probe-interval 600 --mem-fraction 0.22 {DEPLOYED}"
                    " --temperature 0.9 --repeat 3 --deadline 530",
                    timeout=570,
                ),
            ),
            (
                Run(
                    "high",
                    ENVELOPE,
                    f"{PROBES} --levels 16,128,64,32 --learn-seconds 90"
                    " --mem-fraction 0.3 --port-base 31300 --models /tmp/specgate-models-high"
                    f" {DEPLOYED} --temperature 0.9 --repeat 3 --deadline 530",
                    timeout=570,
                ),
            ),
        ),
    ),
    "flush-ab": Job(
        "Plain against the patch pinned off at c = 16 and 64, prefix caches kept (GPU 0) and "
        "emptied before every window, then profiled (GPU 1): is the off server's gap its "
        "fuller cache?",
        (
            (
                Run(
                    "kept",
                    ENVELOPE,
                    f"{OFF_AB} --mem-fraction 0.25 --prefill-graph-tokens 2048"
                    " --repeat 8 --deadline 500",
                ),
            ),
            (
                Run(
                    "flushed",
                    ENVELOPE,
                    f"{OFF_AB} --mem-fraction 0.25 --prefill-graph-tokens"
                    " 2048 --repeat 8 --deadline 500 --flush-cache --profile-levels 16,64"
                    " --port-base 31300 --models /tmp/specgate-models-flushed",
                ),
            ),
        ),
        profiles=("flushed", "functions.txt"),
    ),
    "workload-ab": Job(
        "Plain against the patch pinned off at c = 16 and 64: 512-1024 new tokens a request "
        "(the decode steps' ratio nearly alone, GPU 0), and the sweep's requests with prefill "
        "graphs (GPU 1).",
        (
            (
                Run(
                    "long",
                    ENVELOPE,
                    f"{OFF_AB} --mem-fraction 0.25 --deadline 500 --repeat 6"
                    " --new-tokens 512,1024 --seconds 6",
                ),
            ),
            (
                Run(
                    "graphs",
                    ENVELOPE,
                    f"{OFF_AB} --mem-fraction 0.25 --deadline 500 --repeat 8"
                    " --prefill-graph-tokens 2048 --port-base 31300"
                    " --models /tmp/specgate-models-graphs",
                ),
            ),
        ),
    ),
    "pinned": Job(
        "Each run on half the host's physical cores, every server on whole cores of its own: "
        "c = 4 for plain, always-on and the routed server in 30 rotations (GPU 0); plain "
        "against the patch pinned off at c = 16 and 64 (GPU 1).",
        (
            (
                Run(
                    "c4",
                    ENVELOPE,
                    f"{PROBES} --levels 4 --repeat 30 --seconds 2 --warmup 0.5"
                    " --temperature 0.9 --probe-interval 600 --deadline 440 --pin-cpus 1/2",
                ),
            ),
            (
                Run(
                    "off",
                    ENVELOPE,
                    f"{OFF_AB} --repeat 10 --prefill-graph-tokens 2048"
                    " --temperature 0.9 --mem-fraction 0.25 --deadline 440 --pin-cpus 2/2"
                    " --port-base 31300 --models /tmp/specgate-models-off",
                ),
            ),
        ),
    ),
    "misses": Job(
        "Off against plain with ten window pairs (GPU 0), beside the sweep's two missed levels "
        "(c = 16, 4) with ten windows each after learning (GPU 1), engines admitting 128.",
        (
            (
                Run(
                    "gpu0",
                    ENVELOPE,
                    f"{OFF_AB} --repeat 10 --temperature 0.9 --mem-fraction"
                    f" 0.25 {DEPLOYED} --deadline 520",
                    timeout=560,
                ),
            ),
            (
                Run(
                    "misses",
                    ENVELOPE,
                    f"{PROBES} --levels 16,4 --repeat 10 --seconds 2"
                    " --warmup 0.5 --learn-seconds 90 --max-running 128 --probe-interval 600"
                    " --mem-fraction 0.3 --port-base 31300 --models /tmp/specgate-models-misses"
                    f" --temperature 0.9 {DEPLOYED} --deadline 520",
                    timeout=560,
                ),
            ),
        ),
    ),
    "weak-draft": Job(
        "Temperature 1.0 (a weak draft) at c = 8 and 32 after learning, for plain, always-on "
        "and specgate, engines admitting 128.",
        (
            (
                Run(
                    "weak",
                    ENVELOPE,
                    f"{PROBES} --levels 8,32 --repeat 5 --temperature 1.0"
                    " --learn-seconds 90 --max-running 128 --probe-interval 600 --mem-fraction"
                    f" 0.25 --models /tmp/specgate-models-weak {DEPLOYED} --deadline 520",
                    timeout=560,
                ),
            ),
        ),
    ),
    "speculating-gap": Job(
        "verify then draftkv with prefill graphs (GPU 0), beside the deployed sweep of plain, "
        "always-on, the routed engine held speculating (direct too) and pinned off (GPU 1).",
        (
            _checks(),
            (
                Run(
                    "envelope",
                    ENVELOPE,
                    f"{PROBES} --direct-too --levels 16,64,128 --extra"
                    " patched-off --extra-levels 16,64 --repeat 3 --router-threshold 146"
                    f" --probe-interval 600 {DEPLOYED} --temperature 0.9 --mem-fraction 0.2"
                    " --port-base 31300 --models /tmp/specgate-models-gap --deadline 500",
                ),
            ),
        ),
    ),
    "off-step": Job(
        "The engine checks (GPU 0; draftkv only with a second GPU), beside plain against the "
        "patch pinned off, lean and not, at c = 16 and 64, profiled at 64 (GPU 1).",
        (
            _checks(draftkv_gpus=2),
            (
                Run(
                    "envelope",
                    ENVELOPE,
                    "--servers plain --extra patched-off,patched-off-lean"
                    " --levels 16,64 --extra-levels 16,64 --repeat 6 --mem-fraction 0.25"
                    " --port-base 30300 --models /tmp/specgate-models-off-step --deadline 500"
                    " --profile-levels 64 --profile-servers plain,patched-off"
                    " --prefill-graph-tokens 2048",
                ),
            ),
        ),
        profiles=("envelope", "off-step-functions.txt"),
    ),
    "patch-checks": Job(
        "The engine checks a patch change needs: verify.py (runtime control, 400s, greedy "
        "identity while the threshold flips), then draftkv.py (the draft KV cache after an off "
        "stretch), with prefill graphs. --check-args replaces their arguments.",
        (_checks(),),
        kcache=True,
    ),
    "checks-tp2": Job(
        "verify.py --tp 2 and then --upstream-extend on GPU 0, beside recovery.py with the lean "
        "and upstream off-step draft extend (one per GPU).",
        (
            (
                Run("tp2", "verify", "--tp 2 --mem-fraction 0.25", gpus="", needs_gpus=2),
                Run(
                    "upstream-extend",
                    "verify",
                    "--upstream-extend --port 31100 --mem-fraction 0.25",
                ),
            ),
            (
                Run(
                    "recovery",
                    "recovery",
                    "--upstream-extend-too --after-log {out}/tp2/plain.log",
                    gpus="0,1",
                    needs_gpus=2,
                ),
            ),
        ),
        kcache=True,
    ),
    "host-time": Job(
        "Plain against the patch pinned off, ten window pairs at c = 16 and 64, every "
        "scheduler's garbage collections timed and each window recorded by py-spy: where an "
        "off step's extra host time goes.",
        (
            (
                Run(
                    "host-time",
                    ENVELOPE,
                    f"{OFF_AB} --repeat 10 --gc-stats --pyspy {{pyspy}}"
                    " --temperature 0.9 --mem-fraction 0.25 --prefill-graph-tokens 2048"
                    " --flush-cache --deadline 470",
                    timeout=500,
                ),
            ),
        ),
        pyspy_steps="host-time",
        kcache=True,
    ),
    "router-stall": Job(
        "The routed engine held speculating, through its router and at its own port, at "
        "c = 128: a connection per request (its router recorded by py-spy), then kept "
        "connections, one run after the other.",
        (
            (
                Run("conn", ENVELOPE, STALL, timeout=240),
                Run("keep", ENVELOPE, f"{STALL} --client-keepalive --port-base 31300", timeout=230),
            ),
            (Run("pyspy", "record-router:conn", timeout=240, needs_gpus=0),),
        ),
        host_net=True,
    ),
}


def gpu_count() -> int:
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def pyspy_binary() -> Path | None:
    """py-spy from its wheel (carried in .gpu/: the device has no network), unpacked once."""
    wheel = os.environ.get("SPECGATE_PYSPY_WHEEL")
    if wheel is None:
        found = sorted(glob.glob(str(REPO / ".gpu" / "py_spy-*.whl")))
        wheel = found[0] if found else ""
    if not wheel or not Path(wheel).is_file():
        return None
    where = Path(os.environ.get("SPECGATE_PYSPY_DIR", "/tmp/specgate-pyspy"))
    binary = where / "py-spy"
    if not binary.exists():
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(where / "wheel")
        (script,) = (where / "wheel").glob("py_spy-*.data/scripts/py-spy")
        shutil.copy(script, binary)
        binary.chmod(0o755)
    return binary


class Runner:
    def __init__(self, job: Job, runs: list[list[Run]], args: argparse.Namespace) -> None:
        self.job, self.lanes, self.args = job, runs, args
        self.out: Path = args.out
        self.run_sh = os.environ.get("SPECGATE_GPU_RUN", str(REPO / "lab/gpu/run-on-gpu.sh"))
        self.pyspy: Path | None = None

    def script(self, run: Run, gpu: str) -> int:
        """One run, its output and exit status in OUT/NAME.log."""
        if run.script.startswith("record-router:"):
            return self.record_router(run)
        args = run.args.split()
        if run.check and self.args.check_args is not None:
            args = self.args.check_args.split()
        if not run.check:
            args += self.args.extra
        args = [a.replace("{out}", str(self.out)).replace("{pyspy}", str(self.pyspy)) for a in args]
        env = {**os.environ}
        visible = run.gpus if run.gpus is not None else gpu
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        else:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        command = ["bash", self.run_sh, self.args.archive, str(self.out / run.name), run.script]
        with open(self.out / f"{run.name}.log", "w") as log:
            try:
                code = subprocess.run(
                    [*command, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                    timeout=run.timeout, check=False,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                code = 124
            log.write(f"{run.name}: exit {code}\n")
        print(f"{run.name}: exit {code}", flush=True)
        return code

    def record_router(self, run: Run) -> int:
        """py-spy on the router of the run named after the colon, from its router.pid, for as
        long as the run may take (raw folded stacks into OUT/router.folded)."""
        target = self.out / run.script.split(":", 1)[1] / "router.pid"
        with open(self.out / f"{run.name}.log", "w") as log:
            if self.pyspy is None:
                log.write("record_router: no py-spy wheel\n")
                return 0
            deadline = time.monotonic() + run.timeout / 2
            while not target.exists() and time.monotonic() < deadline:
                time.sleep(0.5)
            if not target.exists():
                log.write(f"record_router: no {target}\n")
                return 0
            seconds = str(max(1, run.timeout - 30))
            command = [str(self.pyspy), "record", "--pid", target.read_text().strip(), "--rate",
                       "200", "--idle", "--format", "raw", "--nonblocking", "--duration",
                       seconds, "--output", str(self.out / "router.folded")]  # fmt: skip
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
            log.write(f"record_router: exit {code.returncode}\n")
            return code.returncode

    def lane(self, runs: list[Run], gpu: str) -> None:
        for run in runs:
            self.script(run, gpu)

    def main(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / "setup.log", "w") as log:
            setup = subprocess.run(
                ["bash", self.run_sh, self.args.archive, str(self.out / "setup"), "none"],
                stdout=log, stderr=subprocess.STDOUT, check=False,
            )  # fmt: skip
        if setup.returncode != 0:
            print((self.out / "setup.log").read_text()[-2000:])
            return 1
        self.record_host()
        on_gpus = [lane for lane in self.lanes if any(r.needs_gpus for r in lane)]
        beside = [lane for lane in self.lanes if lane not in on_gpus]  # no GPU: always beside
        if len(on_gpus) > max(1, gpu_count()):  # too few GPUs: one lane after another on GPU 0
            on_gpus = [[r for lane in on_gpus for r in lane]]
        threads = [
            threading.Thread(target=self.lane, args=(lane, str(i)))
            for i, lane in enumerate([*on_gpus, *beside])
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.collect()
        return 0

    def record_host(self) -> None:
        (self.out / "setup").mkdir(exist_ok=True)
        siblings = sorted(glob.glob("/sys/devices/system/cpu/cpu*/topology/thread_siblings_list"))
        (self.out / "setup" / "thread-siblings.txt").write_text(
            "".join(f"{p}: {Path(p).read_text().strip()}\n" for p in siblings)
        )
        if self.job.host_net:
            (self.out / "host").mkdir(exist_ok=True)
            keys = ("net.core.somaxconn", "net.ipv4.tcp_max_syn_backlog",
                    "net.ipv4.ip_local_port_range", "net.ipv4.tcp_tw_reuse",
                    "net.ipv4.tcp_syncookies", "net.ipv4.tcp_fin_timeout")  # fmt: skip
            lines = []
            for key in keys:
                path = Path("/proc/sys") / key.replace(".", "/")
                value = path.read_text().strip() if path.exists() else ""
                lines.append(f"{key} = {value}\n")
            (self.out / "host" / "net.txt").write_text("".join(lines))

    def collect(self) -> None:
        """Results on top, the rest in logs.tar.xz."""
        runs = [r for lane in self.lanes for r in lane]
        for run in runs:
            for name in (CHECK_RESULTS.get(run.script), "envelope.json", "held-load.json"):
                if name and (self.out / run.name / name).is_file():
                    shutil.copy(self.out / run.name / name, self.out / f"{run.name}.json")
                    break
        if self.job.profiles:
            source, target = self.job.profiles
            if (self.out / source / "profiles").is_dir():
                self.profile_splits(self.out / source / "profiles", self.out / target)
        if self.job.pyspy_steps:
            with open(self.out / "pyspy-steps.md", "w") as md:
                subprocess.run(
                    [sys.executable, str(REPO / "lab/bench/pyspy_steps.py"),
                     str(self.out / self.job.pyspy_steps), "--top", "45"],
                    stdout=md, stderr=subprocess.STDOUT, check=False,
                )  # fmt: skip
        if self.job.kcache and Path("/tmp/kcache").is_dir():
            with tarfile.open(self.out / "kcache.tar.xz", "w:xz") as archive:
                archive.add("/tmp/kcache", arcname="kcache")
        shutil.move(str(self.out / "setup.log"), str(self.out / "setup" / "setup.log"))
        parts = [p for p in ("setup", "host", *(r.name for r in runs)) if (self.out / p).is_dir()]
        with tarfile.open(self.out / "logs.tar.xz", "w:xz") as archive:
            for part in parts:
                archive.add(self.out / part, arcname=part)
        for part in parts:
            shutil.rmtree(self.out / part)
        for path in sorted(self.out.iterdir()):
            print(f"{path.stat().st_size:>10}  {path.name}")

    @staticmethod
    def profile_splits(profiles: Path, target: Path) -> None:
        """Host time per step by part of the scheduler loop, then the syncs that make the host
        wait for the GPU (profile_summary.py)."""
        summary = str(REPO / "lab/gpu/profile_summary.py")
        with open(target, "w") as out:
            for part in ("run_batch", "get_next_batch_to_run", "process_batch_result"):
                out.write(f"# profile_summary.py PROFILES --functions 50 --part {part}\n")
                out.flush()
                subprocess.run([sys.executable, summary, str(profiles), "--functions", "50",
                                "--part", part], stdout=out, stderr=subprocess.STDOUT,
                               check=False)  # fmt: skip
            out.write("# profile_summary.py PROFILES --syncs\n")
            out.flush()
            subprocess.run([sys.executable, summary, str(profiles), "--syncs"], stdout=out,
                           stderr=subprocess.STDOUT, check=False)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", nargs="?", help="one of --list")
    parser.add_argument("--list", action="store_true", help="the jobs and what each measures")
    parser.add_argument("--archive", default=".gpu/site312.tar.xz")
    parser.add_argument("--out", type=Path, help="default: $OUT/JOB (or out/JOB)")
    parser.add_argument("--only", help="these runs (comma-separated names) and no others")
    parser.add_argument("--check-args", help="the checks' arguments instead of the job's")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(extra) - ("--" in argv)])
    args.extra = extra  # after --: arguments for every bench run
    os.chdir(REPO)  # paths as the old job scripts took them: from the repository root
    if args.list or not args.job:
        for name, job in JOBS.items():
            runs = ", ".join(r.name for lane in job.lanes for r in lane)
            print(f"{name:16} {job.about} [runs: {runs}]")
        return 0 if args.list else 2
    if args.job not in JOBS:
        print(f"job.py: no job {args.job!r}; one of {', '.join(JOBS)} (--list says what each is)")
        return 2
    job = JOBS[args.job]
    gpus = gpu_count()
    only = set(args.only.split(",")) if args.only else None
    known = {r.name for lane in job.lanes for r in lane}
    if only is not None and not only <= known:
        print(f"job.py: --only {args.only}: {args.job}'s runs are {', '.join(sorted(known))}")
        return 2
    lanes = [
        [r for r in lane if (only is None or r.name in only) and r.needs_gpus <= max(gpus, 1)]
        for lane in job.lanes
    ]
    lanes = [lane for lane in lanes if lane]
    args.out = args.out or Path(os.environ.get("OUT", "out")) / args.job
    args.out = args.out.resolve()
    runner = Runner(job, lanes, args)
    if any("{pyspy}" in r.args for lane in lanes for r in lane):
        runner.pyspy = pyspy_binary()
        if runner.pyspy is None:
            print("job.py: no py-spy: carry its wheel in .gpu/ (py_spy-*.whl)")
            return 1
    elif any(r.script.startswith("record-router") for lane in lanes for r in lane):
        runner.pyspy = pyspy_binary()
    return runner.main()


if __name__ == "__main__":
    sys.exit(main())
