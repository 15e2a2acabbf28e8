"""The GPU envelope: output tok/s and TPOT of four servers side by side, closed loop.

On the synthetic 3B-class pair (lab/gpu/synthetic.py: acceptance known by
construction, set by the request temperature), four servers run at once:

  plain           (a) SGLang 0.5.17 without speculation
  always-on       (b) EAGLE-3, no threshold
  upstream-0step  (c) EAGLE-3 + upstream --speculative-adaptive, drafting off above batch 8,
                      on unpatched SGLang where run-on-gpu.sh provides it
                      ($SPECGATE_UPSTREAM_SITE), else on the patched one (which also changes
                      adaptive mode: its draft-extend CUDA graphs get the right width)
  specgate        (d) EAGLE-3 + the specgate patch, behind specgate's router, which learns
                      and pushes the threshold (it starts at 8)

and, where asked (--extra), patched servers pinned off (patched-off: the lagged draft KV write
inside the target's decode graph), pinned off with a lean draft extend every step instead
(patched-off-lean), or with upstream's generic draft extend (patched-off-upstream-extend), or
with the draft's whole prefill where the patch writes only its KV (patched-off-full-prefill), or
with that KV-only write launched kernel by kernel, not from CUDA graphs
(patched-off-eager-prompt-kv), or decoding 2 or 4 tokens a request per off step
(patched-off-2, patched-off-4: --speculative-off-step-tokens), or at threshold 8 with no router
(patched-8), or with a threshold
above any batch, so that it speculates on every step with the threshold's machinery live
(patched-on: against always-on, what that machinery costs a speculating step), and EAGLE-3
always on from unpatched SGLang (upstream-always-on), measured at --extra-levels only.
--replicas N starts every server N times, each process with its own window in the rotation:
on this host one process can run 5-10% slower than another with the same code, which a ratio
between two processes takes in; several per kind average it out within one job.
--servers picks a different main set; --tp N runs every server tensor-parallel over the first
N GPUs. Two runs can share a host, one per GPU (CUDA_VISIBLE_DEVICES, --port-base, --out).
--switch-first switches specgate's engine off and back once before the sweep: at batch 1-2 the
patched and the adaptive servers ran 20-30% under always-on without ever having switched state,
and specgate against patched-8 side by side tells whether one switch (which re-applies the
speculating state) removes that. --direct-too also measures the routed server's engine at its
own port (the router still sets its threshold), in the same rotation: the proxy's cost.
--new-tokens, --prefill-graph-tokens and --pin-cpus change the workload or the host setup
(longer requests, prefills through SGLang's default breakable CUDA graphs, each process on
CPUs of its own); lab/bench/envelope_report.py reports such runs in sections of their own.
--client-keepalive gives each client one connection it keeps (SDK clients do; by default a
client opens a connection per request). Every window records the host's TCP counters (accept
queues overflowed, SYNs sent again) and, through the router, the router's CPU time and its
in-flight count sampled four times a second: at c = 128 the router held far fewer requests
than there were clients in some windows (lab/NOTEBOOK.md job 36), and these tell why. Every
window also records its GPU's SM and memory clocks, power, temperature, utilisation and
clock-event reasons, from one `nvidia-smi -lms 100` for the whole job (GpuTelemetry): one
server's decode-step rate swung 1.7x between adjacent windows in job 57, with no CPU
run-queue wait to explain it.
--flush-cache empties each server's prefix cache before each of its windows. Without it a
server's radix tree fills with finished requests and every allocation then evicts (host time
on each step or two); the speculative servers, with smaller KV pools, get there first.
Where a server's host time goes: --gc-stats times every garbage collection in every server
process, --pyspy records each window's scheduler with py-spy (lab/bench/pyspy_steps.py turns the
recordings into us per decode step), --freeze-gc-from-rep K runs the last repeats after SGLang's
/freeze_gc, and --scheduler-cores gives each scheduler's main thread a physical core of its
own (odd-reps: in every other repeat only, pinned against free side by side). --shape 8b
runs a Llama-3-8B-class target instead of the 3B-class one, whose decode step leaves more to
the GPU.

At every concurrency c the windows alternate between the servers (the order rotates each
repeat), so a host that drifts during the run slows all of them alike. Each window: c
closed-loop clients (32-token prompts, 64-192 new tokens, ignore_eos), output tok/s counted as
each request's share of tokens inside the window, and per-request time per output token
(e2e latency / tokens: with 32-token prompts the first token is one short prefill) for the
requests that finish inside it. Each engine's own `decode_moments` give the window's accept
length and mean batch. Before the sweep, --learn-seconds of load stepping through batch sizes
around the threshold let the router fit its cost lines, as live traffic would.

Results go to OUT/envelope.json after every window (a run cut short keeps what it measured);
lab/bench/envelope_report.py turns them into the table and plot. --engine sim runs the same
orchestration against simulated pods on the CPU (a rehearsal; its figures mean nothing).

    bash lab/gpu/run-on-gpu.sh SITE OUT lab/bench/gpu_envelope.py \\
        --levels 16,32,64,128 --repeat 3 --temperature 0.9 --learn-seconds 90
(about 2.5 min of start-up, 1.5 min of learning, 6 s per window: 48 windows fit one 10-minute
job; the low levels, which need no learning, are a second job.)
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import datetime
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "lab" / "gpu"))

import verify  # type: ignore[import-not-found]  # noqa: E402
from patchsum import patch_sha256  # type: ignore[import-not-found]  # noqa: E402
from speed import (  # type: ignore[import-not-found]  # noqa: E402
    ADAPTIVE_OFF_ABOVE_8,
    SHAPES,
    tokens_in_window,
    write_synthetic_pair,
)
from synthetic import acceptance  # type: ignore[import-not-found]  # noqa: E402

SERVERS = ("plain", "always-on", "upstream-0step", "specgate")
EXTRAS = (
    "patched-off",
    "patched-off-upstream-extend",
    "patched-off-lean",
    "patched-off-full-prefill",
    "patched-off-eager-prompt-kv",
    "patched-off-2",
    "patched-off-4",
    "patched-8",
    "patched-on",
    "upstream-always-on",
    "specgate-probes",
)
SPECULATING_THRESHOLD = 1024
"""patched-on's threshold: above any batch a job runs (the job refuses a --max-running that
reaches it), so the server speculates on every step while its threshold controller is live."""
ROUTED = ("specgate", "specgate-probes")
"""Servers behind specgate's router; specgate-probes' router also probes (control.probe*)."""
UPSTREAM = ("upstream-0step", "upstream-always-on")
"""Servers that run unpatched SGLang where run-on-gpu.sh provides it ($SPECGATE_UPSTREAM_SITE)."""
ROUTER_OFFSET = 500
"""The router listens at --port-base + ROUTER_OFFSET; the servers at --port-base + 0, 1, ..."""
MAX_REPLICAS = 4
"""--replicas' limit. Each replica is a whole server process: size --mem-fraction so that all
of them fit the GPU (two kinds, two replicas each: 0.2 apiece on an H200)."""
NEW_TOKENS = (64, 192)
"""Each request's max_new_tokens (ignore_eos), drawn uniformly from this range: the sweep's
workload, with 32-token prompts. Prefills are then about one step in 64 at c = 64."""
LEARN_PATTERN = (4, 8, 12, 16, 24, 32, 48, 64, 96, 64, 48, 32, 24, 16, 12, 8)
"""Closed-loop client counts the router sees before the sweep, 3 s each. The threshold moves at
most to 2T+1 per cooldown and needs samples of both modes around each new value, so from 8 to
past 64 takes three moves and batches up to about 1.5x the target."""


@dataclass
class Server:
    name: str
    port: int
    gpu: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    router_port: int | None = None
    """Where specgate's router listens in front of this server (specgate only)."""
    router_pid: int | None = None
    """The router's process, once started: each window records its CPU time."""
    cpus: list[int] | None = None
    """The CPUs it runs on, with --pin-cpus (else wherever the OS puts it)."""
    proc: subprocess.Popen[bytes] | None = None
    replica: int = 1
    """Which of --replicas processes of this server it is (1: the first, or the only one)."""

    @property
    def label(self) -> str:
        """The server's own name: its kind, with `-rK` for replica K past the first."""
        return replica_label(self.name, self.replica)

    @property
    def client_port(self) -> int:
        """Where the clients send: the router for specgate, the engine for the others."""
        return self.router_port if self.router_port is not None else self.port


def replica_label(name: str, replica: int) -> str:
    """`name` for the first process of a server kind, `name-rK` for the K-th (--replicas)."""
    return name if replica == 1 else f"{name}-r{replica}"


def engine_args(
    name: str,
    common: list[str],
    eagle: list[str],
    adaptive: Path,
    routed_threshold: int = 8,
    off_step_tokens: int = 1,
) -> list[str]:
    """A server's engine flags; routed ones start at `routed_threshold`, which their router
    adopts from them (it continues from what a pod runs with). The routed servers and
    patched-8, whose steps go off where their threshold says, decode `off_step_tokens` a
    request per off step (--off-step-tokens); the pinned servers keep their own."""
    several = verify.off_step_flags(off_step_tokens)

    def patched(threshold: object, *more: str) -> list[str]:
        return [*common, *eagle, "--speculative-disable-batch-threshold", str(threshold), *more]

    routed = patched(routed_threshold, *several)
    # The pinned-off kinds differ from patched-off in their environment (gpu_envelope's envs)
    # or their tokens an off step, not in these flags.
    pinned_off = patched(0)
    return {
        "plain": common,
        "always-on": [*common, *eagle],
        "upstream-always-on": [*common, *eagle],
        "upstream-0step": [
            *common,
            *eagle,
            "--speculative-adaptive",
            "--speculative-adaptive-config",
            str(adaptive),
        ],
        "specgate": routed,
        "specgate-probes": routed,
        "patched-off": pinned_off,
        "patched-8": patched(8, *several),
        "patched-on": patched(SPECULATING_THRESHOLD),
        "patched-off-upstream-extend": pinned_off,
        "patched-off-lean": pinned_off,
        "patched-off-full-prefill": pinned_off,
        "patched-off-eager-prompt-kv": pinned_off,
        "patched-off-2": patched(0, *verify.off_step_flags(2)),
        "patched-off-4": patched(0, *verify.off_step_flags(4)),
    }[name]


SIM_THRESHOLD = {
    "plain": "0",
    "always-on": "none",
    "upstream-0step": "8",
    "patched-off": "0",
    "patched-8": "8",
    "patched-on": str(SPECULATING_THRESHOLD),
    "patched-off-upstream-extend": "0",
    "patched-off-lean": "0",
    "patched-off-full-prefill": "0",
    "patched-off-eager-prompt-kv": "0",
    "patched-off-2": "0",
    "patched-off-4": "0",
    "upstream-always-on": "none",
}
"""The simulated pods' thresholds (the routed ones start at --router-threshold)."""


def get_json(url: str, timeout: float = 10) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {verify.KEY}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


SPEC_COUNTERS = (
    "decode_steps_on",
    "decode_steps_off",
    "prefills_draft_kv_only",
    "prefills_full_draft",
)
"""The patched engine's counters in /v1/loads' speculative section (0 where absent): decode
steps that speculated and that did not, prefills that wrote the prompts' draft KV alone and
those that ran the draft's prefill."""


def moments(port: int) -> list[float]:
    """The engine's decode_moments plus its SPEC_COUNTERS."""
    load = get_json(f"http://127.0.0.1:{port}/v1/loads?include=core,spec")["loads"][0]
    spec = load.get("speculative") or {}
    sums = list(load.get("decode_moments") or [0.0] * 6)
    return [*sums, *(float(spec.get(k) or 0) for k in SPEC_COUNTERS)]


SCHEDULER_COMM = "sglang::schedul"
"""An SGLang scheduler process's name as /proc/PID/stat gives it (setproctitle's
"sglang::scheduler...", cut to 15 characters)."""


def process_table(proc: Path = Path("/proc")) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Every process's children and name (its comm), from /proc."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        names[int(entry.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children, names


def subtree(root: int, children: dict[int, list[int]]) -> list[int]:
    """`root` and every process under it, in pid order."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(found)


def process_tree(root: int, proc: Path = Path("/proc")) -> list[int]:
    """`root` and every process under it now, in pid order."""
    return subtree(root, process_table(proc)[0])


def scheduler_pids(
    server_pid: int,
    proc: Path = Path("/proc"),
    table: tuple[dict[int, list[int]], dict[int, str]] | None = None,
) -> list[int]:
    """The SGLang scheduler processes under a launched server (one per tensor-parallel rank):
    descendants of `server_pid` whose name says so, in pid order. `table`: a process_table()
    already read, to walk /proc once."""
    children, names = table or process_table(proc)
    return [
        pid
        for pid in subtree(server_pid, children)
        if pid != server_pid and names.get(pid, "").startswith(SCHEDULER_COMM)
    ]


def main_thread_times(pid: int, proc: Path = Path("/proc")) -> tuple[float, float] | None:
    """A process's main thread: ms on a CPU and ms waiting in a run queue for one
    (/proc/PID/task/PID/schedstat); None once it is gone. Wall time minus both is time it was
    blocked: on the GPU, a lock, a socket."""
    try:
        run_ns, wait_ns, _ = (proc / str(pid) / "task" / str(pid) / "schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(run_ns) / 1e6, int(wait_ns) / 1e6


def scheduler_times(pids: Sequence[int], proc: Path = Path("/proc")) -> list[tuple[float, float]]:
    """main_thread_times of each scheduler still there."""
    return [t for t in (main_thread_times(pid, proc) for pid in pids) if t is not None]


def scheduler_deltas(
    before: list[tuple[float, float]], after: list[tuple[float, float]]
) -> dict[str, list[float]]:
    """Each scheduler's main thread over a window: ms on a CPU and ms waiting for one (nothing
    where there is no scheduler, as with simulated pods, or one went away meanwhile)."""
    if not before or len(after) != len(before):
        return {}
    pairs = list(zip(before, after, strict=True))
    return {
        "scheduler_run_ms": [round(a[0] - b[0], 1) for b, a in pairs],
        "scheduler_runqueue_ms": [round(a[1] - b[1], 1) for b, a in pairs],
    }


GC_STATS = REPO / "lab" / "bench" / "gcstats"
"""Put first on a server's PYTHONPATH with SPECGATE_GC_STATS_DIR set (--gc-stats), its
sitecustomize.py times each of the server's processes' garbage collections."""


def read_gc_stats(folder: Path, pids: Sequence[int]) -> list[dict[str, Any]]:
    """The GC totals gcstats/sitecustomize.py last wrote for each of these processes (those
    with none yet, or unreadable, are left out)."""
    found = []
    for pid in pids:
        try:
            found.append(json.loads((folder / f"gc-{pid}.json").read_text()))
        except (OSError, ValueError):
            continue
    return found


def gc_deltas(
    before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> dict[str, list[list[float]]]:
    """Each scheduler's garbage collections over a window, per generation (0, 1, 2): ms spent
    collecting and collections run (nothing unless both reads found every scheduler)."""
    if not before or [b["pid"] for b in before] != [a["pid"] for a in after]:
        return {}
    pairs = list(zip(before, after, strict=True))
    return {
        "scheduler_gc_ms": [
            [round(x - y, 2) for x, y in zip(a["ms"], b["ms"], strict=True)] for b, a in pairs
        ],
        "scheduler_gc_collections": [
            [x - y for x, y in zip(a["collections"], b["collections"], strict=True)]
            for b, a in pairs
        ],
    }


@dataclass(frozen=True)
class PySpy:
    """Records a process with py-spy: folded stacks of busy samples only, each frame at its
    function's first line (so a function is one frame, whatever line it was on), taken
    without pausing the process."""

    binary: Path
    folder: Path
    rate: int = 200

    def start(self, pid: int, name: str, seconds: float) -> subprocess.Popen[bytes]:
        self.folder.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(self.binary),
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(self.rate),
            "--nonblocking",
            "--function",
            "--format",
            "raw",
            "--duration",
            str(max(1, round(seconds))),
            "--output",
            str(self.folder / f"{name}.txt"),
        ]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def freeze_gc(server: Server) -> bool:
    """SGLang's /freeze_gc: every object its processes hold now is left out of later
    collections (SGLang's advice once a server has warmed up). Whether it answered 200."""
    status, body = verify.call(server.port, "/freeze_gc", {})
    frozen: bool = status == 200
    if not frozen:
        verify.log(f"freeze_gc at :{server.port}: {status} {body}")
    return frozen


def frozen_last(
    windows: list[tuple[int, int, str]], from_rep: int | None
) -> list[tuple[int, int, str]]:
    """The sweep's (c, rep, server) windows with every repeat from `from_rep` on moved after
    all the others, order kept within each part (--freeze-gc-from-rep: freezing cannot be
    undone, so the frozen part runs last at every level)."""
    if from_rep is None:
        return windows
    return [w for w in windows if w[1] < from_rep] + [w for w in windows if w[1] >= from_rep]


TCP_COUNTERS = {
    "Tcp": ("ActiveOpens", "PassiveOpens", "AttemptFails", "EstabResets", "RetransSegs"),
    "TcpExt": ("ListenOverflows", "ListenDrops", "TCPSynRetrans", "TCPTimeouts"),
}
"""The host's TCP counters each window records the change of: accept queues that overflowed
and SYNs sent again (a connection waiting a second or more to open) tell connection churn
apart from a busy process."""


def tcp_counters(proc: Path = Path("/proc")) -> dict[str, int]:
    """TCP_COUNTERS from /proc/net/snmp and /proc/net/netstat (lines come in pairs: the names,
    then the values, each line led by its group); the ones this kernel lacks are left out."""
    found: dict[str, int] = {}
    for name in ("snmp", "netstat"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()
        except OSError:
            continue
        for head, values in zip(lines[::2], lines[1::2], strict=False):
            group, _, keys = head.partition(":")
            wanted = TCP_COUNTERS.get(group, ())
            for key, value in zip(keys.split(), values.partition(":")[2].split(), strict=False):
                if key in wanted:
                    found[key] = int(value)
    return found


CPU_TIME_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(proc: Path = Path("/proc")) -> dict[str, int]:
    """The host's CPU time (all CPUs, in clock ticks) by CPU_TIME_FIELDS, from /proc/stat's
    first line; empty where it cannot be read."""
    try:
        first = (proc / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return {}
    if not first or first[0] != "cpu":
        return {}
    return {name: int(v) for name, v in zip(CPU_TIME_FIELDS, first[1:], strict=False)}


def cpu_deltas(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """The window's share of the host's CPU time that was busy and that the hypervisor stole
    (a virtual CPU ready to run but not running: the guest sees no run-queue wait for it)."""
    total = sum(after.get(k, 0) - before.get(k, 0) for k in CPU_TIME_FIELDS)
    if not before or not after or total <= 0:
        return {}
    idle = sum(after.get(k, 0) - before.get(k, 0) for k in ("idle", "iowait"))
    steal = after.get("steal", 0) - before.get("steal", 0)
    return {"host_cpu_busy": round(1 - idle / total, 4), "host_cpu_steal": round(steal / total, 4)}


def time_wait_sockets(proc: Path = Path("/proc")) -> int:
    """Sockets in TIME_WAIT (state 06 in /proc/net/tcp and tcp6): what a client that opens a
    connection per request leaves behind, for 60 s each."""
    count = 0
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        count += sum(1 for line in lines if line.split()[3:4] == ["06"])
    return count


class RouterTrace:
    """Samples the router's own view of its pod while a window runs: requests the router holds
    (inFlight) against the batch the engine reported at its last scrape. A router holding
    fewer requests than there are clients means requests wait before reaching it."""

    def __init__(self, port: int, origin: float, every: float = 0.25) -> None:
        self.port, self.origin, self.every = port, origin, every
        self.samples: list[tuple[float, int | None, int | None]] = []
        """(seconds since `origin`, the router's in-flight count, the engine's batch)"""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-trace", daemon=True)

    def __enter__(self) -> RouterTrace:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            view = router_view(self.port, timeout=max(self.every, 1.0))
            self.samples.append(
                (round(time.time() - self.origin, 2), view.get("inFlight"), view.get("batch"))
            )

    def summary(self) -> dict[str, Any]:
        """The router's in-flight count from `origin` on, at its 10th and 50th percentiles,
        and every sample (those before `origin`, in the warm-up, too)."""
        held: list[float] = [n for t, n, _ in self.samples if t >= 0 and n is not None]
        return {
            "router_in_flight_p10": percentile(held, 0.1),
            "router_in_flight_p50": percentile(held, 0.5),
            "router_trace": [list(x) for x in self.samples],
        }


GPU_FIELDS = (
    "index",
    "uuid",
    "clocks.sm",
    "clocks.mem",
    "power.draw",
    "temperature.gpu",
    "utilization.gpu",
)
CLOCK_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
"""Why the clocks are below their maximum, as a bitmask (0x1: idle, 0x4: software power cap,
0x20/0x40: thermal slowdown); drivers before 535 know only the second name."""
IDLE_REASONS = {"0x0000000000000000", "0x0000000000000001", "0x0", "0x1", "Not Active"}
"""Reasons that say nothing about a busy GPU's speed: none, or idle."""


def parse_smi_line(line: str, fields: Sequence[str], at: float) -> dict[str, Any] | None:
    """One line of `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`, with the time
    it was read; None for anything else (a header, an error line)."""
    values = [v.strip() for v in line.split(",")]
    if len(values) != len(fields):
        return None
    sample: dict[str, Any] = {"t": at}
    for name, value in zip(fields, values, strict=True):
        if name in ("index", "uuid"):
            sample[name] = value
        elif name in CLOCK_REASON_FIELDS:
            sample["reasons"] = value
        else:
            try:
                sample[name] = float(value)
            except ValueError:  # "[N/A]", "[Not Supported]"
                sample[name] = None
    return sample


def gpu_window(
    samples: Sequence[dict[str, Any]], gpus: Collection[str], start: float, end: float
) -> dict[str, Any]:
    """The samples of `gpus` (indices or UUIDs, as CUDA_VISIBLE_DEVICES names them) read
    between `start` and `end`: the SM clock's mean and minimum, the memory clock's minimum,
    mean power and utilisation, the highest temperature, and the clock-event reasons seen
    other than idle. Empty when there are none."""
    wanted = set(gpus)
    mine = [
        x for x in samples if start <= x["t"] <= end and {x.get("index"), x.get("uuid")} & wanted
    ]

    def values(name: str) -> list[float]:
        return [x[name] for x in mine if x.get(name) is not None]

    if not mine:
        return {}
    sm, mem, power = values("clocks.sm"), values("clocks.mem"), values("power.draw")
    temp, util = values("temperature.gpu"), values("utilization.gpu")
    reasons = sorted({x["reasons"] for x in mine if x.get("reasons")} - IDLE_REASONS)
    return {
        "gpu_samples": len(mine),
        **(
            {"gpu_sm_mhz_mean": round(statistics.fmean(sm), 1), "gpu_sm_mhz_min": min(sm)}
            if sm
            else {}
        ),
        **({"gpu_mem_mhz_min": min(mem)} if mem else {}),
        **({"gpu_power_w_mean": round(statistics.fmean(power), 1)} if power else {}),
        **({"gpu_temp_c_max": max(temp)} if temp else {}),
        **({"gpu_util_mean": round(statistics.fmean(util), 1)} if util else {}),
        **({"gpu_clock_reasons": reasons} if reasons else {}),
    }


class GpuTelemetry:
    """nvidia-smi's clocks, power, temperature and utilisation of the job's GPUs every
    `every_ms` for the whole job, from one `nvidia-smi -lms` process and a thread that reads it;
    `between()` sums up a window's samples (gpu_window). Why: this host's decode-step rate
    swung 1.7x between adjacent windows of one server with no CPU run-queue wait (BENCHMARKS.md
    job 57); a GPU clocked down would show here. Without nvidia-smi it records nothing and
    says why (`describe()`)."""

    def __init__(self, gpus: Collection[str], every_ms: int = 100, smi: str = "nvidia-smi") -> None:
        self.gpus, self.every_ms, self.smi = sorted(gpus), every_ms, smi
        self.samples: list[dict[str, Any]] = []
        self.fields: tuple[str, ...] = ()
        self.problem: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def _query(self, fields: Sequence[str]) -> list[str]:
        return [
            self.smi,
            "-i",
            ",".join(self.gpus),
            f"--query-gpu={','.join(fields)}",
            "--format=csv,noheader,nounits",
        ]

    def _working_fields(self) -> tuple[str, ...] | None:
        """GPU_FIELDS with the first clock-reason field this driver knows (or none): one field
        it does not know makes nvidia-smi refuse the whole query."""
        for extra in [(name,) for name in CLOCK_REASON_FIELDS] + [()]:
            fields = (*GPU_FIELDS, *extra)
            try:
                done = subprocess.run(
                    self._query(fields), capture_output=True, text=True, timeout=15
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                self.problem = f"{self.smi}: {exc}"
                return None
            if done.returncode == 0:
                return fields
            self.problem = f"{self.smi} exited {done.returncode}: {done.stderr.strip()[-200:]}"
        return None

    def __enter__(self) -> GpuTelemetry:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        fields = self._working_fields()
        if fields is None:
            verify.log(f"no GPU telemetry: {self.problem}")
            return
        self.fields, self.problem = fields, None
        self._proc = subprocess.Popen(
            [*self._query(fields), f"-lms={self.every_ms}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, name="gpu-telemetry", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_smi_line(line, self.fields, time.time())
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)

    def between(self, gpus: str, start: float, end: float) -> dict[str, Any]:
        return gpu_window(self.samples, gpus.split(","), start, end)

    def describe(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "every_ms": self.every_ms,
            "fields": list(self.fields),
            **({"problem": self.problem} if self.problem else {}),
        }


class PersistentClient:
    """One client's keep-alive HTTP/1.1 connection, as SDK clients hold one (verify.call opens a
    connection per request). A connection the server closed meanwhile (idle between windows)
    is opened again once."""

    def __init__(self, port: int, timeout: float = 120) -> None:
        self.port, self.timeout = port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def call(self, path: str, body: object) -> tuple[int, object]:
        data = json.dumps(body).encode()
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                self.conn.request("POST", path, body=data, headers=verify.HEADERS)
                resp = self.conn.getresponse()
                raw = resp.read()
            except (http.client.HTTPException, OSError):
                self.close()
                if attempt:
                    return 0, None
                continue
            if resp.will_close:
                self.close()
            got: tuple[int, object] = verify.answer(resp.status, raw)
            return got
        return 0, None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def router_deltas(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> dict[str, float]:
    """The router's main thread over a window: ms on a CPU (about the window's length when the
    router is the bottleneck) and ms waiting for one."""
    if before is None or after is None:
        return {}
    return {
        "router_run_ms": round(after[0] - before[0], 1),
        "router_runqueue_ms": round(after[1] - before[1], 1),
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def flush_prefix_cache(port: int, wait: float = 10.0) -> bool:
    """Empty an idle engine's prefix cache (SGLang's /flush_cache, which waits up to `wait`
    seconds for running requests to finish); whether it did."""
    status, body = verify.call(port, f"/flush_cache?timeout={wait:g}", {}, timeout=wait + 30)
    flushed: bool = status == 200
    if not flushed:
        verify.log(f"flush_cache at :{port}: {status} {body}")
    return flushed


def window(
    server: Server,
    clients: int,
    seconds: float,
    warmup: float,
    temperature: float,
    seed: int,
    profile: Path | None = None,
    new_tokens: tuple[int, int] = NEW_TOKENS,
    flush: bool = False,
    keepalive: bool = False,
    gc_stats: Path | None = None,
    pyspy: PySpy | None = None,
    pyspy_name: str = "",
    profile_activities: tuple[str, ...] = ("CPU", "GPU"),
    telemetry: GpuTelemetry | None = None,
) -> dict[str, Any]:
    """One closed-loop window against one server; with `profile`, a torch profile of 24 decode
    steps (of `profile_activities`) is taken into that folder after the warm-up (the window's
    figures then carry the profiler's overhead: they are not measurements). With `flush`, the
    engine's prefix cache is emptied first (see --flush-cache); with `keepalive`, each client
    keeps one connection (see --client-keepalive). Through a router, the router's in-flight
    count is sampled. With `gc_stats` (the folder gcstats/sitecustomize.py writes to), the
    schedulers' garbage collections over the window; with `pyspy`, a recording of the first
    scheduler over the measured seconds, named `pyspy_name`; with `telemetry`, its GPU's clocks,
    power and temperature over the measured seconds."""
    flushed = flush_prefix_cache(server.port) if flush else None
    schedulers = scheduler_pids(server.proc.pid) if server.proc is not None else []
    time_wait = time_wait_sockets()
    spans: list[tuple[float, float, int]] = []
    errors: list[int] = []
    lock = threading.Lock()
    window_start = time.time() + warmup
    stop_at = window_start + seconds

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        conn = PersistentClient(server.client_port) if keepalive else None
        while time.time() < stop_at:
            ids = [rng.randrange(3, 32000) for _ in range(32)]
            sampling = {
                "max_new_tokens": rng.randint(*new_tokens),
                "temperature": temperature,
                "ignore_eos": True,
            }
            body = {"input_ids": ids, "sampling_params": sampling}
            began = time.time()
            status, answer = (
                conn.call("/generate", body)
                if conn is not None
                else verify.call(server.client_port, "/generate", body)
            )
            with lock:
                if status == 200 and isinstance(answer, dict):
                    spans.append((began, time.time(), len(answer["output_ids"])))
                else:
                    errors.append(status)
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    with (
        RouterTrace(server.router_port, origin=window_start)
        if server.router_port is not None
        else contextlib.nullcontext()
    ) as trace:
        for t in threads:
            t.start()
        time.sleep(max(0.0, window_start - time.time()))
        if profile is not None:
            status, body = verify.call(
                server.port,
                "/start_profile",
                {
                    "output_dir": str(profile),
                    "num_steps": 24,
                    "activities": list(profile_activities),
                },
            )
            verify.log(f"profile of {server.label} c={clients} into {profile}: {status} {body}")
        recorder = (
            pyspy.start(schedulers[0], pyspy_name, seconds)
            if pyspy is not None and schedulers
            else None
        )
        before = moments(server.port)
        gc_before = read_gc_stats(gc_stats, schedulers) if gc_stats is not None else []
        host_before = scheduler_times(schedulers)
        router_before = main_thread_times(server.router_pid) if server.router_pid else None
        tcp_before, cpu_before = tcp_counters(), cpu_times()
        time.sleep(max(0.0, stop_at - time.time()))
        tcp_after, cpu_after = tcp_counters(), cpu_times()
        router_after = main_thread_times(server.router_pid) if server.router_pid else None
        host_after = scheduler_times(schedulers)
        gc_after = read_gc_stats(gc_stats, schedulers) if gc_stats is not None else []
        after = moments(server.port)
        for t in threads:
            t.join()
    pyspy_error = None
    if recorder is not None:
        try:
            _, stderr = recorder.communicate(timeout=30)
            if recorder.returncode != 0:
                pyspy_error = stderr.decode(errors="replace")[-300:]
        except subprocess.TimeoutExpired:
            recorder.kill()
            pyspy_error = "py-spy did not stop"
    d = [a - b for a, b in zip(after, before, strict=True)]
    tokens = tokens_in_window(spans, window_start, stop_at)
    tpot = [
        1000 * (end - began) / n
        for began, end, n in spans
        if window_start <= end <= stop_at and n > 0
    ]
    p50, p99 = percentile(tpot, 0.5), percentile(tpot, 0.99)
    return {
        "tok_s": round(tokens / seconds, 1),
        "requests": len(tpot),
        "tpot_ms_p50": round(p50, 3) if p50 is not None else None,
        "tpot_ms_p99": round(p99, 3) if p99 is not None else None,
        "errors": len(errors),
        "mean_batch": round(d[1] / d[0], 2) if d[0] else None,
        "accept_length": round(d[5] / d[1], 3) if d[1] else None,
        "steps_on": d[6],
        "steps_off": d[7],
        "prefills_kv_only": d[8],
        "prefills_full_draft": d[9],
        "decode_steps": d[0],
        **({"cache_flushed": flushed} if flush else {}),
        **scheduler_deltas(host_before, host_after),
        **gc_deltas(gc_before, gc_after),
        **({"pyspy": f"{pyspy_name}.txt"} if recorder is not None else {}),
        **({"pyspy_error": pyspy_error} if pyspy_error else {}),
        **router_deltas(router_before, router_after),
        **(telemetry.between(server.gpu, window_start, stop_at) if telemetry is not None else {}),
        **cpu_deltas(cpu_before, cpu_after),
        **(trace.summary() if trace is not None else {}),
        "tcp": {k: tcp_after[k] - tcp_before[k] for k in tcp_after if k in tcp_before},
        "time_wait_sockets": time_wait,
        **({"client_keepalive": True} if keepalive else {}),
    }


def router_view(port: int, timeout: float = 10) -> dict[str, Any]:
    try:
        pods = get_json(f"http://127.0.0.1:{port}/specgate/pods", timeout=timeout)["pods"]
    except OSError as exc:
        return {"error": str(exc)}
    view: dict[str, Any] = pods[0] if pods else {}
    return view


MAX_THRESHOLD = 128
"""specgate's router moves the threshold up to here; specgate-probes' to PROBES' maxThreshold."""
PROBES = {"maxThreshold": 256}
"""specgate-probes' router: room to speculate at 128. Its trials' readings stand for
--probe-interval (60 s by default here, so that trials recur within a 10-minute job; the
router's own default is 1800 s)."""


def start_router(
    server: Server, out: Path, probe_interval: float, threshold: int = 8
) -> subprocess.Popen[bytes]:
    assert server.router_port is not None
    config = out / "router.yaml"
    config.write_text(
        json.dumps(
            {
                "backends": [f"http://127.0.0.1:{server.port}"],
                "engineApiKey": verify.KEY,
                "control": {
                    "threshold": threshold,
                    "maxThreshold": MAX_THRESHOLD,
                    "cooldownSeconds": 5,
                    "hysteresis": 1,
                    "minSamples": 4,
                    **(
                        {**PROBES, "probeIntervalSeconds": probe_interval}
                        if server.name == "specgate-probes"
                        else {}
                    ),
                },
            }
        )
    )  # JSON is YAML
    return launch_router(config, server.router_port, out)


def launch_router(config: Path, port: int, out: Path) -> subprocess.Popen[bytes]:
    """The router on loopback at `port` with the policy file `config`, its log in
    OUT/router.log; returns once it answers /readyz (RuntimeError after 60 s, or at once if it
    exits)."""
    # The router's own entry point: `specgate router` would import every component's CLI.
    code = (
        "import argparse, sys; from specgate_router import main as m; "
        "p = argparse.ArgumentParser(); m.add_arguments(p); "
        "sys.exit(m.run(p.parse_args(sys.argv[1:])))"
    )
    cmd = [
        sys.executable,
        "-c",
        code,
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
    ]
    log = open(out / "router.log", "wb")  # noqa: SIM115 (the router process writes it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with {proc.returncode}") from None
            time.sleep(0.5)
    raise RuntimeError("router not ready after 60 s")


def threshold_changes(router_log: str, origin: float) -> list[dict[str, Any]]:
    """The router's threshold changes with their reasons, from its JSON log lines
    (specgate.logs.JsonFormatter), as seconds since `origin`: the
    envelope polls the router once a window, and what it decided in between is only here."""
    changes = []
    for line in router_log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # uvicorn's start-up lines, a traceback
        if not isinstance(entry, dict):
            continue  # a line of text that happens to parse as JSON (a bare number)
        message = entry.get("msg", "")
        if entry.get("logger") == "specgate.router" and message.startswith("threshold of "):
            # UTC, with or without milliseconds and the "Z" (older routers wrote neither).
            stamp = datetime.datetime.fromisoformat(entry["ts"])
            at = calendar.timegm(stamp.utctimetuple()) + stamp.microsecond / 1e6
            changes.append({"t": round(at - origin), "change": message})
    return changes


def write_pair_once(models: Path, c: float, shape: str = "3b") -> None:
    """The synthetic pair in `models`, written by the first of the runs that share it; the
    others wait on the lock and find it written for their --c and --shape."""
    import fcntl

    models.mkdir(parents=True, exist_ok=True)
    done = models / "written-for-c"
    wanted = repr(c) if shape == "3b" else f"{c!r} {shape}"
    with open(models / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists() and done.read_text() == wanted:
            return
        done.unlink(missing_ok=True)
        write_synthetic_pair(models, c, SHAPES[shape])
        done.write_text(wanted)


def shape_name(shape: str) -> str:
    """The results' words for a --shape."""
    cfg = SHAPES[shape]
    return (
        f"Llama {shape.upper()}-class (hidden {cfg['hidden_size']}, "
        f"{cfg['num_hidden_layers']} layers, GQA {cfg['num_attention_heads']}/"
        f"{cfg['num_key_value_heads']}), synthetic pair, bf16"
    )


def core_groups(
    cpus: Collection[int], sysfs: Path = Path("/sys/devices/system/cpu")
) -> list[list[int]]:
    """`cpus` grouped by physical core (the hardware threads sysfs lists as siblings), in
    order of their first CPU; a CPU sysfs says nothing of is a core of its own."""
    groups: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        try:
            listed = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        except OSError:
            listed = str(cpu)
        siblings = sorted(set(parse_cpu_list(listed)) & set(cpus))
        groups.setdefault(siblings[0] if siblings else cpu, siblings or [cpu])
    return [groups[first] for first in sorted(groups)]


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's CPU list format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def cpu_slices(cores: Sequence[Sequence[int]], parts: int) -> list[list[int]]:
    """Whole physical cores dealt out in contiguous runs, as evenly as they go, so no two parts
    share a core (two busy threads on one core's hardware threads slow each other)."""
    if parts < 1 or len(cores) < parts:
        raise ValueError(f"{len(cores)} physical cores cannot give {parts} parts one each")
    per, extra = divmod(len(cores), parts)
    slices, at = [], 0
    for i in range(parts):
        n = per + (1 if i < extra else 0)
        slices.append(sorted(cpu for core in cores[at : at + n] for cpu in core))
        at += n
    return slices


def pin_plan(
    spec: str, cpus: Collection[int], servers: int, sysfs: Path = Path("/sys/devices/system/cpu")
) -> list[list[int]]:
    """--pin-cpus K/N: the K-th of N equal shares of `cpus` by physical core, cut into one
    slice for the benchmark process and one for each of `servers`."""
    share, _, shares = spec.partition("/")
    if not (share.isdigit() and shares.isdigit() and 1 <= int(share) <= int(shares)):
        raise ValueError("give K/N with 1 <= K <= N")
    cores = cpu_slices(core_groups(cpus, sysfs), int(shares))[int(share) - 1]
    return cpu_slices(core_groups(cores, sysfs), 1 + servers)


def scheduler_core_plan(
    cpus: Collection[int], servers: int, sysfs: Path = Path("/sys/devices/system/cpu")
) -> tuple[list[list[int]], list[int]]:
    """--scheduler-cores: the last `servers` physical cores of `cpus`, one per server (its
    scheduler's main thread runs on the core's first hardware thread and nothing on the
    others), and the CPUs left for everything else."""
    cores = core_groups(cpus, sysfs)
    if len(cores) <= servers:
        raise ValueError(
            f"{len(cores)} physical cores cannot give {servers} schedulers one "
            "each and leave one for the rest"
        )
    reserved = cores[-servers:]
    rest = sorted(set(cpus) - {cpu for core in reserved for cpu in core})
    return reserved, rest


def pin_scheduler(
    server_pid: int,
    core: Sequence[int] | None,
    rest: Collection[int],
    proc: Path = Path("/proc"),
    setaffinity: Callable[[int, Collection[int]], None] = os.sched_setaffinity,
) -> dict[str, Any]:
    """Every thread of a launched server onto `rest`, except its (first) scheduler's main
    thread, alone on `core`'s first hardware thread: whether a scheduler slows down when a busy
    thread shares its physical core (the same code ran 10-60% slower in one server than in
    another, lab/NOTEBOOK.md jobs 20, 23, 35, 46). No core: every thread onto `rest`, which
    undoes a pinning when `rest` is every CPU. What it did, for the results."""
    table = process_table(proc)  # one walk of /proc for the tree and its schedulers
    schedulers = scheduler_pids(server_pid, table=table) if core else []
    pinned: dict[str, Any] = {"scheduler": None, "threads_moved": 0}
    for pid in subtree(server_pid, table[0]):
        try:
            tids = [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
        except OSError:
            continue  # gone meanwhile
        for tid in tids:
            main = bool(schedulers) and tid == schedulers[0]
            try:
                setaffinity(tid, [core[0]] if core is not None and main else rest)
            except OSError:
                continue  # gone meanwhile
            if core is not None and main:
                pinned["scheduler"] = {"pid": tid, "cpu": core[0], "idle_siblings": core[1:]}
            else:
                pinned["threads_moved"] += 1
    return pinned


def off_step_tokens_of(args: Sequence[str]) -> int:
    """Tokens a request per off step in a server's SGLang flags (engine_args): what its
    simulated stand-in runs."""
    flag = "--speculative-off-step-tokens"
    return int(args[args.index(flag) + 1]) if flag in args else 1


def launch(servers: list[Server], out: Path, sim: bool, routed_threshold: int = 8) -> None:
    """Start every server: GPUs in parallel, the servers of one GPU one after another, each
    once the previous one has sized its memory (verify.MEMORY_SIZED)."""

    def one_gpu(group: list[Server]) -> None:
        for i, server in enumerate(group):
            if sim:
                cmd = [
                    str(Path(sys.executable).parent / "specgate"),
                    "sim",
                    "--port",
                    str(server.port),
                    "--api-key",
                    verify.KEY,
                    "--threshold",
                    str(routed_threshold) if server.name in ROUTED else SIM_THRESHOLD[server.name],
                    "--max-running-requests",
                    "128",
                    "--seed",
                    str(server.port),
                    "--off-step-tokens",
                    str(off_step_tokens_of(server.args)),
                    # As the patched SGLang engine reports today: no step profile.
                    "--no-model-inputs",
                ]
                with open(out / f"{server.label}.log", "wb") as log:
                    pin = verify.pin_to(server.cpus)
                    server.proc = subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin
                    )
                continue
            env = {**server.env, "CUDA_VISIBLE_DEVICES": server.gpu}
            server.proc = verify.start(
                server.label, server.args, server.port, out, env, cpus=server.cpus
            )
            if i + 1 < len(group):
                verify.wait_for_log(out / f"{server.label}.log", verify.MEMORY_SIZED, server.proc)

    groups: dict[str, list[Server]] = {}
    for server in servers:
        groups.setdefault(server.gpu, []).append(server)
    failures: list[BaseException] = []

    def guarded(group: list[Server]) -> None:
        try:
            one_gpu(group)
        except BaseException as exc:  # reported by the caller
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(g,)) for g in groups.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="envelope-results")
    parser.add_argument("--levels", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured part of a window")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--c", type=float, default=12.0, help="synthetic pair: the repeat logit")
    parser.add_argument("--learn-seconds", type=float, default=0.0)
    parser.add_argument(
        "--busy-idle",
        action="store_true",
        help="start the servers without --sleep-on-idle, as jobs 1-23 ran: "
        "each idle server then spins a core while another is measured",
    )
    parser.add_argument(
        "--learn-pattern",
        default=",".join(map(str, LEARN_PATTERN)),
        help="client counts of the learning phase, in turn",
    )
    parser.add_argument(
        "--learn-hold",
        type=float,
        default=3.0,
        help="seconds each client count of the learning phase holds",
    )
    parser.add_argument(
        "--switch-first",
        action="store_true",
        help="switch specgate's engine off and back once before the sweep",
    )
    parser.add_argument(
        "--probe-interval",
        type=float,
        default=60.0,
        help="specgate-probes' probeIntervalSeconds (the router's default: 600)",
    )
    parser.add_argument(
        "--direct-too",
        action="store_true",
        help="also measure the routed server's engine with no proxy in between "
        "(its router still sets the threshold), as ROUTED-direct in the same "
        "rotation: the proxy's cost, side by side",
    )
    parser.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help="comma-separated, the servers measured at every level",
    )
    parser.add_argument("--extra", default="", help=f"comma-separated, of {', '.join(EXTRAS)}")
    parser.add_argument("--extra-levels", default="16,64")
    parser.add_argument(
        "--deadline",
        type=float,
        default=560.0,
        help="stop starting windows this many seconds after start",
    )
    parser.add_argument("--mem-fraction", type=float, default=0.3)
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size: every server spans the first --tp GPUs",
    )
    parser.add_argument(
        "--port-base",
        type=int,
        default=30300,
        help="servers listen from here up, the router at +500 (two runs at once "
        "on one host need different bases)",
    )
    parser.add_argument(
        "--models",
        type=Path,
        default=Path("/tmp/specgate-models-synthetic"),
        help="where the synthetic pair is written (once per --c: runs sharing "
        "it wait for the first to write it)",
    )
    parser.add_argument("--engine", choices=["sglang", "sim"], default="sglang")
    parser.add_argument(
        "--profile-levels",
        default="",
        help="after the sweep, a torch profile of 24 decode steps per server at "
        "each of these levels, summarised into OUT/profiles.txt",
    )
    parser.add_argument(
        "--new-tokens",
        default=",".join(map(str, NEW_TOKENS)),
        help="MIN,MAX: each request's new tokens, drawn uniformly (the sweep's "
        "workload is the default; other ranges get their own report section)",
    )
    parser.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=0,
        help="prefills up to this many tokens replay SGLang's breakable CUDA "
        "graphs, as SGLang does by default (0: eager prefills, as the "
        "sweep's jobs ran; their own report section otherwise)",
    )
    parser.add_argument(
        "--pin-cpus",
        default="",
        help="K/N: take the K-th of N equal shares of the host's physical cores "
        "(two runs on one host: 1/2 and 2/2) and give this process (clients, "
        "router) and each server a slice of whole cores of its own",
    )
    parser.add_argument(
        "--router-threshold",
        type=int,
        default=8,
        help="the threshold the routed engine starts with and its router adopts "
        "(above the largest batch, with no learning phase and no probe within "
        "the run, the routed engine speculates throughout)",
    )
    parser.add_argument(
        "--off-step-tokens",
        type=int,
        default=1,
        help="tokens a request decodes per speculation-off step on the routed "
        "servers and patched-8 (the engine's --speculative-off-step-tokens; "
        "their own report section otherwise)",
    )
    parser.add_argument(
        "--client-keepalive",
        action="store_true",
        help="each client keeps one HTTP connection open, as SDK clients do "
        "(without it, a connection per request: about 140 new connections a "
        "second at c = 128)",
    )
    parser.add_argument(
        "--flush-cache",
        action="store_true",
        help="empty each server's prefix cache before each of its windows, so "
        "every window starts from the same empty cache (without it, servers with "
        "smaller KV pools, the speculative ones, fill theirs first, then "
        "evict from the radix tree every step or two; plain does not)",
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=0,
        help="servers admit and capture decode graphs up to this many running "
        "requests (default: the largest client count any phase runs, "
        "learning included; the sweep's learning jobs ran 128)",
    )
    parser.add_argument(
        "--profile-activities",
        default="CPU,GPU",
        help="what the profiles record: CPU,GPU (Python functions and ranges "
        "too, at twice the host time) or GPU (kernels alone: the GPU's busy "
        "time per step, for profile_summary.py --gpu-per-step)",
    )
    parser.add_argument(
        "--profile-servers",
        default="",
        help="comma-separated, the servers --profile-levels profiles (default: all)",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="3b",
        help="the synthetic target: 3b, the sweep's (a host-bound step on an "
        "H200), or 8b, a Llama-3-8B-class one whose decode step the GPU sets "
        "(--models then defaults to its own folder, /tmp/...-8b)",
    )
    parser.add_argument(
        "--scheduler-cores",
        nargs="?",
        const="always",
        default=None,
        choices=("always", "odd-reps"),
        help="once the servers are up, each server's scheduler main thread "
        "runs alone on a physical core of its own (the host's last ones); "
        "every other thread of the servers on the rest, and the clients and "
        "the router there throughout (see pin_scheduler). odd-reps: only in "
        "odd repeats, the servers' threads free on every CPU in even ones, so "
        "pinned and unpinned windows alternate on one host; each window says "
        "scheduler_pinned",
    )
    parser.add_argument(
        "--gc-stats",
        action="store_true",
        help="time every server process's garbage collections "
        "(lab/bench/gcstats/sitecustomize.py): each window records its schedulers' "
        "ms collecting and collections run, per generation",
    )
    parser.add_argument(
        "--freeze-gc-from-rep",
        type=int,
        default=None,
        metavar="K",
        help="run every level's repeats from K on last, after SGLang's "
        "/freeze_gc on every server; those windows say gc_frozen",
    )
    parser.add_argument(
        "--pyspy",
        type=Path,
        default=None,
        metavar="BINARY",
        help="py-spy records each window's first scheduler into OUT/pyspy/"
        "SERVER-cC-repR.txt (lab/bench/pyspy_steps.py sums them up)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="start each server N times (NAME, NAME-r2, ...) and give every "
        "process its own window in each rotation: one process can run 5-10%% "
        "slower than another with the same code on this host, so a ratio "
        "between two processes mixes that in; N > 1 averages it within one job "
        "(windows then say `replica`; no routed server)",
    )
    args = parser.parse_args()
    began = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sim = args.engine == "sim"
    levels = [int(c) for c in args.levels.split(",")]
    known = (*SERVERS, *EXTRAS)
    main_servers = [e for e in args.servers.split(",") if e]
    extras = [e for e in args.extra.split(",") if e]
    if bad := set(main_servers + extras) - set(known):
        parser.error(f"--servers/--extra: unknown {sorted(bad)}; choose from {', '.join(known)}")
    if not main_servers or len(set(main_servers + extras)) < len(main_servers + extras):
        parser.error("--servers: name at least one server, and none twice (with --extra)")
    routed = [n for n in main_servers + extras if n in ROUTED]
    if len(routed) > 1:
        parser.error(f"--servers/--extra: one of {', '.join(ROUTED)} at a time (one router)")
    if not 1 <= args.replicas <= MAX_REPLICAS:
        parser.error(f"--replicas {args.replicas}: 1 to {MAX_REPLICAS}")
    if args.replicas > 1 and routed:
        parser.error(
            f"--replicas {args.replicas}: not with {routed[0]} (one router, one "
            "engine behind it); replicate the static servers only"
        )
    if (args.switch_first or args.learn_seconds or args.direct_too) and not routed:
        parser.error(
            "--switch-first, --learn-seconds and --direct-too need a routed server "
            "(specgate or specgate-probes)"
        )
    extra_levels = [int(c) for c in args.extra_levels.split(",")] if extras else []
    first_probe = args.probe_interval + args.learn_hold
    probes_in_job = args.probe_interval < args.deadline
    if "specgate-probes" in routed and 0 < args.learn_seconds < first_probe and probes_in_job:
        # The router's first probe waits one probe interval after it starts (it starts once
        # every server is up): a shorter learning phase ends before any probe can run. An
        # interval past the deadline (the router's default, 600 s) means no probe in the job:
        # the learning phase then fits from its loads alone, as a new deployment does.
        parser.error(
            f"--learn-seconds {args.learn_seconds:g}: specgate-probes' first probe "
            f"comes {args.probe_interval:g} s after its router starts; learn "
            f"for at least {first_probe:g} s, or not at all"
        )
    if args.freeze_gc_from_rep is not None and not 0 < args.freeze_gc_from_rep < args.repeat:
        parser.error(
            f"--freeze-gc-from-rep {args.freeze_gc_from_rep}: between 1 and "
            f"--repeat - 1 ({args.repeat - 1}), so both parts get windows"
        )
    if args.pyspy is not None and not args.pyspy.is_file():
        parser.error(f"--pyspy {args.pyspy}: no such file; give the py-spy binary")
    if (args.pyspy or args.gc_stats or args.freeze_gc_from_rep) and sim:
        parser.error("--pyspy, --gc-stats and --freeze-gc-from-rep need SGLang servers")
    if args.scheduler_cores and args.pin_cpus:
        parser.error("--scheduler-cores and --pin-cpus: one way of placing the servers at a time")
    profile_levels = [int(c) for c in args.profile_levels.split(",") if c]
    profile_activities = tuple(a for a in args.profile_activities.split(",") if a)
    if not profile_activities or set(profile_activities) - {"CPU", "GPU"}:
        parser.error(f"--profile-activities: CPU, GPU or CPU,GPU, not {args.profile_activities!r}")
    profiled = [e for e in args.profile_servers.split(",") if e] or main_servers + extras
    if bad := set(profiled) - set(main_servers + extras):
        parser.error(f"--profile-servers: {sorted(bad)} not among --servers/--extra")
    learn_pattern = [int(c) for c in args.learn_pattern.split(",")]
    try:
        low, high = (int(n) for n in args.new_tokens.split(","))
    except ValueError:
        parser.error(f"--new-tokens {args.new_tokens!r}: give MIN,MAX, two whole numbers")
    if not 1 <= low <= high:
        parser.error(f"--new-tokens {args.new_tokens!r}: need 1 <= MIN <= MAX")
    new_tokens = (low, high)
    top_threshold = PROBES["maxThreshold"] if "specgate-probes" in routed else MAX_THRESHOLD
    if not 0 <= args.router_threshold <= top_threshold:
        parser.error(
            f"--router-threshold {args.router_threshold}: 0 to {top_threshold} for "
            f"{routed[0] if routed else 'a routed server'}"
        )
    if args.prefill_graph_tokens < 0:
        parser.error("--prefill-graph-tokens: 0 (eager prefills) or a positive token count")
    draft_tokens = int(verify.EAGLE[verify.EAGLE.index("--speculative-num-draft-tokens") + 1])
    if not 1 <= args.off_step_tokens <= draft_tokens:
        parser.error(
            f"--off-step-tokens {args.off_step_tokens}: 1 to {draft_tokens} (the "
            "engine's --speculative-num-draft-tokens)"
        )
    names = [*main_servers, *extras]
    processes = [(name, k) for k in range(1, args.replicas + 1) for name in names]
    pinned: list[list[int]] | None = None
    if args.pin_cpus:
        try:
            pinned = pin_plan(args.pin_cpus, os.sched_getaffinity(0), servers=len(processes))
        except ValueError as exc:
            parser.error(f"--pin-cpus {args.pin_cpus!r}: {exc}")
        os.sched_setaffinity(0, pinned[0])  # the clients' threads, and the router it starts
    # Servers admit and capture graphs up to the largest level anything runs at, profiles and
    # learning too: a job measuring c = 16 after learning once started engines admitting 16,
    # so every learning load above 16 ran at batch 16 and the router learned nothing above it.
    learned = learn_pattern if args.learn_seconds > 0 else []
    top = max(levels + extra_levels + profile_levels + learned)
    if args.max_running:
        if args.max_running < top:
            parser.error(
                f"--max-running {args.max_running}: below the largest client count "
                f"the job runs ({top}); give at least that"
            )
        top = args.max_running
    if "patched-on" in main_servers + extras and top >= SPECULATING_THRESHOLD:
        parser.error(
            f"--max-running {top}: patched-on speculates below "
            f"{SPECULATING_THRESHOLD} running requests only; give less"
        )
    models = args.models
    if args.shape != "3b" and models == parser.get_default("models"):
        models = Path(f"{models}-{args.shape}")
    if not sim:
        write_pair_once(models, args.c, args.shape)
        verify.log(f"synthetic pair ready after {time.time() - began:.0f}s")
    adaptive = out / "adaptive-off-above-8.json"
    adaptive.write_text(json.dumps(ADAPTIVE_OFF_ABOVE_8))
    common = verify.server_flags(
        models / "target",
        mem_fraction=args.mem_fraction,
        max_running=top,
        max_graph_batch=top,
        dummy_weights=False,
        sleep_on_idle=not args.busy_idle,
        prefill_graph_tokens=args.prefill_graph_tokens,
    )
    if args.tp > 1:
        common += ["--tp-size", str(args.tp)]
    eagle = [*verify.EAGLE, "--speculative-draft-model-path", str(models / "draft")]
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")
    if args.tp > len(gpus):
        parser.error(f"--tp {args.tp}: only {len(gpus)} GPUs in CUDA_VISIBLE_DEVICES")
    # Tensor-parallel servers each span the same first --tp GPUs; single-GPU ones spread out.
    placements = [",".join(gpus[: args.tp])] if args.tp > 1 else gpus
    profile_reserve = (args.warmup + args.seconds + 10) * len(profiled) * len(profile_levels)
    profile_reserve += 30 if profile_levels else 0
    upstream_site = os.environ.get("SPECGATE_UPSTREAM_SITE")
    envs: dict[str, dict[str, str]] = {name: {} for name in names}
    for name in names:
        if name.endswith("-upstream-extend"):
            envs[name] = dict(verify.UPSTREAM_EXTEND_ENV)
        if name.endswith("-lean"):
            envs[name] = dict(verify.LEAN_EXTEND_ENV)
        if name.endswith("-full-prefill"):
            envs[name] = dict(verify.FULL_PREFILL_ENV)
        if name.endswith("-eager-prompt-kv"):
            envs[name] = dict(verify.EAGER_PROMPT_KV_ENV)
        if upstream_site and name in UPSTREAM:
            envs[name]["PYTHONPATH"] = upstream_site
    gc_folder = out / "gc" if args.gc_stats else None
    if gc_folder is not None:
        gc_folder.mkdir(exist_ok=True)
        for env in envs.values():
            inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
            env["PYTHONPATH"] = f"{GC_STATS}:{inherited}" if inherited else str(GC_STATS)
            env["SPECGATE_GC_STATS_DIR"] = str(gc_folder)
    pyspy = PySpy(args.pyspy, out / "pyspy") if args.pyspy is not None else None
    servers = [
        Server(
            name,
            args.port_base + i,
            placements[i % len(placements)],
            engine_args(name, common, eagle, adaptive, args.router_threshold, args.off_step_tokens),
            envs[name],
            router_port=args.port_base + ROUTER_OFFSET if name in ROUTED else None,
            cpus=pinned[1 + i] if pinned else None,
            replica=replica,
        )
        for i, (name, replica) in enumerate(processes)
    ]
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "engine": args.engine,
        "patch_sha256": patch_sha256(),  # which patch the patched servers ran
        "shape": shape_name(args.shape),
        "temperature": args.temperature,
        "c": args.c,
        "new_tokens": list(new_tokens),
        "prefill_graph_tokens": args.prefill_graph_tokens,
        "benchmark_cpus": pinned[0] if pinned else None,
        "flush_cache": args.flush_cache,
        "router_threshold": args.router_threshold,
        "client_keepalive": args.client_keepalive,
        "off_step_tokens": args.off_step_tokens,
        "predicted_accept_length": round(acceptance(args.c, args.temperature, 3)[1], 3),
        "levels": levels,
        "repeat": args.repeat,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "extra": extras,
        "extra_levels": extra_levels,
        "tp": args.tp,
        "max_running": top,
        "learn_seconds": args.learn_seconds,
        "replicas": args.replicas,
        "probe_interval_seconds": args.probe_interval,
        "gc_stats": args.gc_stats,
        "freeze_gc_from_rep": args.freeze_gc_from_rep,
        "servers": {
            s.label: {
                "port": s.port,
                "gpu": s.gpu,
                "env": s.env,
                "args": s.args,
                "cpus": s.cpus,
                **({"replica_of": s.name} if s.replica > 1 else {}),
            }
            for s in servers
        },
        "windows": [],
        "router_log": [],
    }
    path = out / "envelope.json"

    def save() -> None:
        path.write_text(json.dumps(results, indent=1))

    router = None
    specgate: Server | None = None
    # Owned here: started before the servers, stopped with them in the finally below.
    telemetry = None if sim else GpuTelemetry({g for s in servers for g in s.gpu.split(",")})
    try:
        if telemetry is not None:
            telemetry.start()
            results["gpu_telemetry"] = telemetry.describe()
        launch(servers, out, sim, args.router_threshold)
        for s in servers:
            assert s.proc is not None
            s_up = verify.wait_healthy(s.port, s.proc, timeout=480)
            results["servers"][s.label]["healthy_after_s"] = round(time.time() - began, 1)
            verify.log(f"{s.label} healthy (waited {s_up:.0f}s more)")
        by_name = {s.label: s for s in servers}
        every_cpu = sorted(os.sched_getaffinity(0))
        cores: list[list[int]] = []
        rest = every_cpu
        pinned_now = False

        def place_schedulers(pinned: bool) -> dict[str, Any]:
            """--scheduler-cores: each scheduler's main thread alone on its core, or (not
            pinned) every thread of the servers free on every CPU again."""
            return {
                srv.label: pin_scheduler(
                    srv.proc.pid, core if pinned else None, rest if pinned else every_cpu
                )
                for srv, core in zip(servers, cores, strict=True)
                if srv.proc is not None
            }

        if args.scheduler_cores and not sim:
            cores, rest = scheduler_core_plan(every_cpu, len(servers))
            os.sched_setaffinity(0, rest)  # the clients' threads, and the router it starts
            results["scheduler_cores"] = place_schedulers(True)
            results["scheduler_cores_mode"] = args.scheduler_cores
            pinned_now = True
            verify.log(f"schedulers on cores of their own: {results['scheduler_cores']}")
        specgate = next((s for s in servers if s.name in ROUTED), None)
        if specgate is not None:
            router = start_router(specgate, out, args.probe_interval, args.router_threshold)
            specgate.router_pid = router.pid
            (out / "router.pid").write_text(f"{router.pid}\n")  # for a profiler to attach to
        if args.direct_too:
            # The same engine, reached at its own port: not launched or stopped on its own.
            assert specgate is not None
            direct = replace(specgate, name=f"{specgate.name}-direct", router_port=None)
            by_name[direct.name] = direct
            main_servers.append(direct.name)
            results["servers"][direct.name] = {
                "port": direct.port,
                "gpu": direct.gpu,
                "direct_of": specgate.name,
            }
        if args.switch_first:
            assert specgate is not None
            for value in (0, 8):
                status, body = verify.call(
                    specgate.port,
                    "/set_internal_state",
                    {"server_args": {"speculative_disable_batch_threshold": value}},
                )
                assert status == 200, body
                got = window(
                    specgate, 4, 1.0, 0.3, args.temperature, seed=99, new_tokens=new_tokens
                )
                verify.log(f"switch-first: threshold {value}: {got}")
            results["switched_first"] = True
        learn_until = time.time() + args.learn_seconds
        step = 0
        while time.time() < learn_until:
            assert specgate is not None and specgate.router_port is not None
            c = learn_pattern[step % len(learn_pattern)]
            got = window(
                specgate,
                c,
                args.learn_hold,
                0.5,
                args.temperature,
                seed=10_000 + step,
                new_tokens=new_tokens,
            )
            view = router_view(specgate.router_port)
            results["router_log"].append(
                {
                    "t": round(time.time() - began, 1),
                    "phase": "learn",
                    "clients": c,
                    "mean_batch": got["mean_batch"],
                    "threshold": view.get("threshold"),
                    "reason": view.get("reason"),
                }
            )
            verify.log(f"learn c={c}: {got['tok_s']} tok/s, router {results['router_log'][-1]}")
            step += 1
        save()
        # The extras join the four at the levels they share, so their ratios to plain are
        # side by side too; levels only they run come last.
        plan = [
            (c, rep, main_servers + (extras if c in extra_levels else []))
            for c in levels
            for rep in range(args.repeat)
        ]
        plan += [
            (c, rep, extras) for c in extra_levels if c not in levels for rep in range(args.repeat)
        ]
        # Every process of a server kind its own window, replicas after the first round.
        plan = [
            (
                c,
                rep,
                [replica_label(name, k) for k in range(1, args.replicas + 1) for name in group],
            )
            for c, rep, group in plan
        ]
        # Windows one after another until the deadline; the profiles after the sweep keep
        # their time (a window each, and the summary) and run even when the sweep is cut.
        windows = [
            (c, rep, name)
            for c, rep, group in plan
            for name in group[rep % len(group) :] + group[: rep % len(group)]
        ]
        windows = frozen_last(windows, args.freeze_gc_from_rep)
        frozen = False
        for c, rep, name in windows:
            needed = args.warmup + args.seconds + 8 + profile_reserve
            if time.time() - began + needed > args.deadline:
                results["stopped_early"] = f"deadline reached before {name} c={c}"
                verify.log(results["stopped_early"])
                break
            freeze_from = args.freeze_gc_from_rep
            if freeze_from is not None and rep >= freeze_from and not frozen:
                results["gc_frozen_at_s"] = round(time.time() - began, 1)
                results["gc_frozen"] = {srv.label: freeze_gc(srv) for srv in servers}
                verify.log(f"froze GC: {results['gc_frozen']}")
                frozen = True
            if args.scheduler_cores == "odd-reps" and pinned_now != (rep % 2 == 1):
                placed = place_schedulers(not pinned_now)
                pinned_now = not pinned_now
                verify.log(f"schedulers {'pinned' if pinned_now else 'free'}: {placed}")
            got = window(
                by_name[name],
                c,
                args.seconds,
                args.warmup,
                args.temperature,
                seed=c * 100 + rep,
                new_tokens=new_tokens,
                flush=args.flush_cache,
                keepalive=args.client_keepalive,
                gc_stats=gc_folder,
                pyspy=pyspy,
                pyspy_name=f"{name}-c{c}-rep{rep}",
                telemetry=telemetry,
            )
            got.update(server=by_name[name].name, c=c, rep=rep)
            if args.replicas > 1:
                got["replica"] = by_name[name].replica
            if args.freeze_gc_from_rep is not None:
                got["gc_frozen"] = frozen
            if args.scheduler_cores and not sim:
                got["scheduler_pinned"] = pinned_now
            if name.removesuffix("-direct") in ROUTED:
                assert specgate is not None and specgate.router_port is not None
                view = router_view(specgate.router_port)
                got["threshold"] = view.get("threshold")
                results["router_log"].append(
                    {
                        "t": round(time.time() - began, 1),
                        "phase": "sweep",
                        "clients": c,
                        "threshold": view.get("threshold"),
                        "reason": view.get("reason"),
                    }
                )
            results["windows"].append(got)
            save()
            verify.log(f"{name} c={c} rep={rep}: {got}")
        for c in profile_levels if not sim else []:
            for name in profiled:
                window(
                    by_name[name],
                    c,
                    args.seconds,
                    args.warmup,
                    args.temperature,
                    seed=7,
                    profile=out / "profiles" / f"{name}-c{c}",
                    new_tokens=new_tokens,
                    flush=args.flush_cache,
                    profile_activities=profile_activities,
                )
        if profile_levels and not sim:
            # The kernels and ranges, then the syncs that block the host (lab/NOTEBOOK.md job 35).
            summaries = [
                subprocess.run(
                    [
                        sys.executable,
                        str(REPO / "lab" / "gpu" / "profile_summary.py"),
                        str(out / "profiles"),
                        *extra,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                for extra in ([], ["--gpu-per-step", "--top", "30"], ["--syncs"])
            ]
            (out / "profiles.txt").write_text("".join(r.stdout + r.stderr for r in summaries))
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        verify.log(results["error"])
    finally:
        if router is not None and specgate is not None:
            # What the controller decided from, for lab/bench/replay_control.py (the router is
            # still up: it stops below).
            try:
                results["router_samples"] = get_json(
                    f"http://127.0.0.1:{specgate.router_port}/specgate/samples", timeout=10
                )
            except OSError as exc:
                verify.log(f"router samples not read: {exc}")
        verify.stop_all([router, *(s.proc for s in servers)])
        if telemetry is not None:
            telemetry.stop()
        if router is not None:
            log_text = (out / "router.log").read_text(errors="replace")
            results["router_changes"] = threshold_changes(log_text, began)
        results["wall_seconds"] = round(time.time() - began, 1)
        save()
    rates: dict[str, dict[int, list[float]]] = {}
    for w in results["windows"]:
        rates.setdefault(w["server"], {}).setdefault(w["c"], []).append(w["tok_s"])
    for name, by_c in rates.items():
        print(name, json.dumps({c: statistics.median(v) for c, v in by_c.items()}))
    return 0 if "error" not in results else 1


if __name__ == "__main__":
    sys.exit(main())
