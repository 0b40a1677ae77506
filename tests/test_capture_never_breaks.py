"""Live capture never breaks the job and never loses a trace: real jobs run plain and under `plasmient
run`, their exit status, stdout and stderr compared byte for byte, every step looked up in the file. A job
ended by a signal: test_capture_signals.py; a collector that is dead, slow or flapping:
test_capture_collector_outages.py (both use the helpers here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from otlp_receiver import OtlpReceiver

from plasmient_trace.export.otlp_json import read_jsonl

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # generous: two cores shared by several test runs

STEPS_JOB = '''
import sys, time, torch
torch.manual_seed(0)
steps, pause = int(sys.argv[1]), float(sys.argv[2])
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
for i in range(steps):
    loss = model(torch.randn(16, 32)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {i} loss {loss.item():.6f}", flush=True)
    time.sleep(pause)
'''

COMPILE_JOB = '''
import torch
torch.manual_seed(0)
class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
    def forward(self, x):
        return torch.softmax(self.q(x) @ x.transpose(-1, -2), -1) @ x
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)
        self.attn = Attn()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)
class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(50, 16)
        self.h = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(16, 50)
    def forward(self, idx):
        x = self.wte(idx)
        for b in self.h:
            x = b(x)
        return self.head(x)
model = LM()
compiled = torch.compile(model)  # inductor on CPU
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
for i in range(4):
    idx = torch.randint(0, 50, (2, 8))
    loss = torch.nn.functional.cross_entropy(compiled(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {i} loss {loss.item():.6f}")
'''

HOSTILE_JOB = '''
import threading, torch
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU())
        self.b = torch.nn.Linear(64, 4)
    def forward(self, x):
        return self.b(checkpoint(self.a, x, use_reentrant=False))  # activation checkpointing
def batches(loader):  # a generator between the loader and the loop
    for x, y in loader:
        yield x, y
if __name__ == "__main__":
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(96, 16), torch.randint(0, 4, (96,)))
    loader = DataLoader(data, batch_size=16, num_workers=2, shuffle=False)  # worker processes
    probe = torch.nn.Linear(16, 4)
    side = []
    def background():  # a thread running its own forwards while the loop trains
        with torch.no_grad():
            for _ in range(20):
                side.append(float(probe(torch.ones(2, 16)).sum()))
    t = threading.Thread(target=background)
    t.start()
    for i, (x, y) in enumerate(batches(loader)):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {i} loss {loss.item():.6f}")
    t.join()
    print(f"side {len(side)} {side[-1]:.4f}")
'''


_CACHE: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _warm_cache(warm_cache: Path) -> None:
    """Every job here finds the observer built and the CPU calibrated, as on a user's second run. On a cold
    cache a job that ends before the calibration does says so on stderr (its steps carry no MFU), and these
    tests compare stderr byte for byte; that first-run message has its own test in test_capture_examples."""
    _CACHE["dir"] = str(warm_cache)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PLASMIENT_"))}
    env.update(PYTHONPATH=str(REPO), PLASMIENT_JOB_ID="never-breaks", PLASMIENT_CACHE_DIR=_CACHE["dir"], **extra)
    return env


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _plain(tmp_path: Path, script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, timeout=TIMEOUT)


def _traced(tmp_path: Path, script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "plasmient_trace.cli", "run", "--out", str(tmp_path / "t.jsonl"), "--",
           sys.executable, str(script), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path, **env), capture_output=True, timeout=TIMEOUT)


def _steps(path: Path) -> list[int]:
    """Step numbers of the step spans in an OTLP/JSON lines file (or every file of a spill segment set)."""
    files = [path] if path.is_file() else sorted(path.glob("traces*.jsonl"))
    steps: list[int] = []
    for f in files:
        t = read_jsonl(f).table
        level = t.column("plasmient.level").to_pylist()
        steps += [s for s, lv in zip(t.column("plasmient.step").to_pylist(), level) if lv == "step"]
    return sorted(steps)


def _span_ids(path: Path) -> Counter:
    files = [path] if path.is_file() else sorted(path.glob("traces*.jsonl"))
    out: Counter = Counter()
    for f in files:
        t = read_jsonl(f).table
        out.update(zip(t.column("trace_id").to_pylist(), t.column("span_id").to_pylist()))
    return out


def _received_ids(rx: OtlpReceiver) -> Counter:
    return Counter((s.trace_id, int.from_bytes(s.span_id, "big"))
                   for req in rx.traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans)


# CPython's multiprocessing resource tracker sometimes warns at exit, plain run or traced, that a spawned
# DataLoader worker's semaphore "leaked" after it was already unlinked (a race of its own, seen on a loaded
# 2-core machine). The warning and its source line are the interpreter's, never ours, so they are left out.
_RESOURCE_TRACKER_NOISE = re.compile(
    rb"^[^\n]*multiprocessing/resource_tracker\.py:\d+: UserWarning: resource_tracker: [^\n]*\n  warnings\.warn\([^\n]*\n",
    re.MULTILINE)


def _job_stderr(proc: subprocess.CompletedProcess) -> bytes:
    return _RESOURCE_TRACKER_NOISE.sub(b"", proc.stderr)


def _same_run(plain: subprocess.CompletedProcess, traced: subprocess.CompletedProcess) -> None:
    assert traced.returncode == plain.returncode, traced.stderr.decode()[-3000:]
    assert traced.stdout == plain.stdout
    assert _job_stderr(traced) == _job_stderr(plain)


# --------------------------------------------------------------------------------------------
# The job is untouched


def test_torch_compile_job_runs_unchanged_and_every_step_is_traced(tmp_path: Path) -> None:
    script = _script(tmp_path, "compiled.py", COMPILE_JOB)
    plain = _plain(tmp_path, script)
    assert plain.returncode == 0, plain.stderr.decode()[-2000:]
    traced = _traced(tmp_path, script, PLASMIENT_EVERY="2")
    _same_run(plain, traced)  # no AssertionError from dynamo, no UserWarning about our hooks
    assert _steps(tmp_path / "t.jsonl") == [0, 1, 2, 3]
    t = read_jsonl(tmp_path / "t.jsonl").table.to_pylist()
    full_ops = [r for r in t if r["plasmient.level"] == "op" and r["plasmient.step"] == 0]
    assert full_ops  # the compiled region still shows its ops
    # and Inductor's fused C++ kernels among them (named through the config hook set at torch's import):
    # busy time of unknown FLOPs
    fused = [r for r in full_ops if "cpp_fused" in r["name"]]
    assert fused and all(r["plasmient.busy_s"] > 0 and r["plasmient.flops"] is None for r in fused)


RECOMPILE_JOB = """
import torch, torch.nn as nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 1))
compiled = torch.compile(m)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
for i in range(8):
    x = torch.randn(8 if i < 4 else 12, 16)  # a smaller last batch, or a new sequence length: a recompile
    loss = compiled(x).square().mean(); opt.zero_grad(); loss.backward(); opt.step()
    print(i, f"{loss.item():.4f}")
"""


def test_a_recompile_for_a_new_shape_leaves_the_job_s_stderr_alone_and_counts_no_tracing_work(tmp_path: Path) -> None:
    """Dynamo's recompile runs the model's ops on fake tensors with symbolic sizes: reading those sizes threw
    inside PyTorch ("INTERNAL ASSERT FAILED ... dispatch_on_subclass", a line of ours in the job's stderr),
    and the ops that did read counted as the step's work (46,479 FLOPs on the recompiling step against
    27,990 on the next one, which runs the same compiled code on the same shapes)."""
    script = _script(tmp_path, "recompiled.py", RECOMPILE_JOB)
    plain = _plain(tmp_path, script)
    assert plain.returncode == 0, plain.stderr.decode()[-2000:]
    traced = _traced(tmp_path, script, PLASMIENT_EVERY="1")
    _same_run(plain, traced)
    t = read_jsonl(tmp_path / "t.jsonl").table.to_pylist()
    flops = {r["plasmient.step"]: r["plasmient.flops"] for r in t if r["plasmient.level"] == "step"}
    assert sorted(flops) == list(range(8))
    assert flops[4] == flops[5] == flops[7] > flops[3]  # the recompiling step: the work of its shape, no more


COMPILED_LOOP_JOB = """
import torch, torch.nn as nn
import torch._dynamo.utils as dynamo_utils
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
compiled = torch.compile(m, backend="aot_eager")  # dynamo's guards without inductor's compile time
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(16, 64)
for i in range(12):
    opt.zero_grad(); loss = compiled(x).sum(); loss.backward(); opt.step()
print("graphs", dynamo_utils.counters["stats"]["unique_graphs"], "frames", dict(dynamo_utils.counters["frames"]))
"""


def test_a_compiled_model_compiles_once_as_it_does_untraced(tmp_path: Path) -> None:
    """Dynamo traces global module hooks into the compiled frame: every attribute of ours a hook read before
    it saw that dynamo was tracing became a guard of the frame (the roots' ids, whether recording was on). So
    the model recompiled at each step as those changed (8 graphs where the job makes 1), hit dynamo's cache
    limit and then ran uncompiled, with dynamo's warning in the job's stderr; and since every step compiled,
    every step was measured at full depth."""
    script = _script(tmp_path, "compiled_loop.py", COMPILED_LOOP_JOB)
    plain = _plain(tmp_path, script)
    assert plain.returncode == 0, plain.stderr.decode()[-2000:]
    assert plain.stdout.startswith(b"graphs 1 ")
    traced = _traced(tmp_path, script)
    _same_run(plain, traced)
    t = read_jsonl(tmp_path / "t.jsonl").table.to_pylist()
    steps = {r["plasmient.step"]: r for r in t if r["plasmient.level"] == "step"}
    assert sorted(steps) == list(range(12))
    # step 0 (opened at its first module call) and step 1 measure, the 10th step is the periodic sample
    assert sorted(s for s, r in steps.items() if r["plasmient.sampled_depth"] == "full") == [0, 1, 10]
    assert {r["plasmient.flops.source"] for s, r in steps.items() if s not in (0, 1, 10)} == {"carried"}

FAST_STEPS_JOB = """
import sys, torch
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(2, 4)
for i in range(int(sys.argv[1])):
    loss = m(x).sum(); opt.zero_grad(); loss.backward(); opt.step()
print("ran", sys.argv[1])
"""


def test_a_loop_of_sub_millisecond_steps_loses_none_of_them(tmp_path: Path) -> None:
    # one bound of 64 waiting steps, full depth or not: 474 of 1,000 steps of 0.4 ms were not exported
    script = _script(tmp_path, "fast.py", FAST_STEPS_JOB)
    plain = _plain(tmp_path, script, "1000")
    traced = _traced(tmp_path, script, "1000")
    assert traced.returncode == plain.returncode == 0 and traced.stdout == plain.stdout
    # the one line allowed: samples put off while the stitch was behind (reduced depth, no step lost)
    ours = _job_stderr(traced).decode().splitlines()
    assert all("ran at step depth: the background stitch fell behind" in line for line in ours), ours
    assert _steps(tmp_path / "t.jsonl") == list(range(1000))


NO_STEP_JOB = """
import torch
model = torch.nn.Linear(32, 32)
with torch.no_grad():
    for _ in range(5):
        model(torch.randn(4, 32))
print("inference done")
"""


def test_a_job_that_never_ends_a_step_is_told_once_why_nothing_was_traced(tmp_path: Path) -> None:
    # an inference script with no optimizer, no prof.step() and no step context: its model ran, no step ended
    script = _script(tmp_path, "no_steps.py", NO_STEP_JOB)
    plain = _plain(tmp_path, script)
    traced = _traced(tmp_path, script)
    assert traced.returncode == plain.returncode == 0 and traced.stdout == plain.stdout == b"inference done\n"
    said = traced.stderr.decode().splitlines()
    assert plain.stderr == b"" and len(said) == 1
    assert said[0].startswith("plasmient-trace: no step ended, so nothing was traced") and "plasmient_trace.step()" in said[0]
    assert not (tmp_path / "t.jsonl").exists()


HELPER_JOB = STEPS_JOB + '''
import subprocess
helper = "import torch; print(torch.nn.Linear(4, 2)(torch.ones(1, 4)).shape)"  # an eval helper: a model, no step
done = subprocess.run([sys.executable, "-c", helper], capture_output=True, text=True)
print(done.returncode, done.stdout.strip(), repr(done.stderr))
'''


def test_a_helper_process_that_ends_no_step_says_nothing_when_the_job_s_steps_are_traced(tmp_path: Path) -> None:
    """A Python helper the job runs (an evaluation, an export) imports torch and runs a model, and is traced like
    every process of the command. It ended no step, and said "no step ended, so nothing was traced" into its
    own stderr, which the job read (or showed) though every one of its steps was traced. That line is for the
    command: said once at its end, only when no process of it ended a step (the test above)."""
    script = _script(tmp_path, "with_helper.py", HELPER_JOB)
    plain = _plain(tmp_path, script, "3", "0")
    assert plain.returncode == 0 and plain.stdout.endswith(b"0 torch.Size([1, 2]) ''\n"), plain.stderr.decode()
    traced = _traced(tmp_path, script, "3", "0")
    _same_run(plain, traced)
    assert _steps(tmp_path / "t.jsonl") == list(range(3))


FORK_JOB = """
import os, sys
import torch
torch.set_num_threads(1)  # GNU OpenMP's pool does not survive fork(): the plain job would hang, not ours
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def train_step():
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
for _ in range(2):
    train_step()
pid = os.fork()
if pid == 0:  # a helper forked mid-run that does some torch work of its own and exits normally
    train_step()
    print("child done", flush=True)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_is_not_traced_says_so_once_and_the_parents_steps_are(tmp_path: Path) -> None:
    # The child inherited the session but not its worker thread: at its exit it waited the flush timeout
    # (5 s) and printed "3 step(s) still being traced ... were not written" into the job's stderr.
    script = _script(tmp_path, "forks.py", FORK_JOB)
    plain = _plain(tmp_path, script)
    assert plain.returncode == 0 and plain.stdout == b"child done\nchild exit 0\n", plain.stderr.decode()[-2000:]
    traced = _traced(tmp_path, script, PLASMIENT_EVERY="1")
    assert traced.returncode == 0 and traced.stdout == plain.stdout and plain.stderr == b""
    assert traced.stderr.decode().splitlines() == [
        "plasmient-trace: this process was forked from a traced one and is not traced "
        "(start such processes with the spawn method to trace them)"]
    assert _steps(tmp_path / "t.jsonl") == [0, 1]  # the parent's


TRANSFORMING_JOB = """
import sys, torch
from torch.utils.data import DataLoader, Dataset
torch.manual_seed(0)
class Normalize(torch.nn.Module):  # torchvision's transforms are nn.Modules
    def forward(self, x):
        return (x - 0.5) / 0.25
class Images(Dataset):
    def __init__(self):
        self.transform = Normalize()
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return self.transform(torch.rand(32, generator=torch.Generator().manual_seed(i))), i % 8
if __name__ == "__main__":
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Images(), batch_size=16, num_workers=2, multiprocessing_context=sys.argv[1])
    for epoch in range(int(sys.argv[2])):
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"epoch {epoch} step {i} loss {loss.item():.5f}")
"""


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_dataloader_workers_that_run_transform_modules_say_nothing(tmp_path: Path, start: str) -> None:
    """Workers applying an nn.Module transform printed one of our lines each, every epoch: forked ones that
    they were not traced, spawned ones (a session of their own) that no step ended. (Spawned workers
    import torch afresh each epoch: one epoch of them.)"""
    epochs = 2 if start == "fork" else 1
    script = _script(tmp_path, "transforms.py", TRANSFORMING_JOB)
    plain = _plain(tmp_path, script, start, str(epochs))
    assert plain.returncode == 0 and _job_stderr(plain) == b"", plain.stderr.decode()[-2000:]
    traced = _traced(tmp_path, script, start, str(epochs), PLASMIENT_EVERY="2")
    _same_run(plain, traced)
    assert _steps(tmp_path / "t.jsonl") == list(range(4 * epochs))


def test_checkpointing_dataloader_workers_threads_and_generators_leave_the_job_unchanged(tmp_path: Path) -> None:
    script = _script(tmp_path, "hostile.py", HOSTILE_JOB)
    plain = _plain(tmp_path, script)
    assert plain.returncode == 0, plain.stderr.decode()[-2000:]
    traced = _traced(tmp_path, script, PLASMIENT_EVERY="2")
    _same_run(plain, traced)
    assert _steps(tmp_path / "t.jsonl") == list(range(6))  # 96 rows / 16 per batch


CHATTY_JOB = '''
import sys, threading, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
done = threading.Event()
def chatter():  # a thread writing to stderr all through training, as loggers do
    i = 0
    while not done.is_set() or i < 50:
        sys.stderr.write(f"side {i}\\n")
        i += 1
        done.wait(0.001)
t = threading.Thread(target=chatter)
t.start()
for i in range(6):
    model(torch.randn(16, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sys.stderr.write(f"step {i}\\n")  # one write a line (print writes the end apart: lines would mix)
done.set()
t.join()
'''


def test_the_torch_profiler_fallback_leaves_no_kineto_lines_in_the_jobs_stderr(tmp_path: Path) -> None:
    """PLASMIENT_CUPTI=kineto (what a GPU job without cupti-python gets) profiles every full-depth step with
    torch.profiler, whose Kineto writes two lines to fd 2 at each start and stop. The job's stderr is its own
    lines, every one, each thread's in order (how two threads' lines interleave is the scheduler's, traced or
    not); which source is in use is said only with PLASMIENT_VERBOSE=1."""
    script = _script(tmp_path, "chatty.py", CHATTY_JOB)
    plain = _plain(tmp_path, script)
    assert plain.returncode == 0, plain.stderr.decode()[-2000:]
    traced = _traced(tmp_path, script, PLASMIENT_EVERY="1", PLASMIENT_CUPTI="kineto")
    assert traced.returncode == 0 and traced.stdout == plain.stdout == b""
    theirs = traced.stderr.decode().splitlines()
    assert len(theirs) == len(set(theirs))  # nothing held back is written twice
    side = [line for line in theirs if line.startswith("side ")]
    assert [line for line in theirs if not line.startswith("side ")] == [f"step {i}" for i in range(6)]
    assert side == [f"side {i}" for i in range(len(side))] and len(side) >= 50  # none lost, none reordered
    assert _steps(tmp_path / "t.jsonl") == list(range(6))


FAILING_JOB = STEPS_JOB + '''
if sys.argv[3] == "raise":
    raise ValueError("the job's own bug, after its last step")
sys.exit(int(sys.argv[3]))
'''


@pytest.mark.parametrize("end", ["raise", "3"])  # a clean exit is every other test here
def test_a_job_that_fails_or_exits_keeps_its_traceback_and_status_and_every_step(tmp_path: Path, end: str) -> None:
    """The job's own exception (traceback and exit status 1) and its sys.exit code pass through unchanged, and
    the steps it finished before are all written: tracing flushes at interpreter exit whatever the exit is."""
    script = _script(tmp_path, "failing.py", FAILING_JOB)
    plain = _plain(tmp_path, script, "5", "0", end)
    assert plain.returncode == {"raise": 1, "3": 3}[end]
    traced = _traced(tmp_path, script, "5", "0", end, PLASMIENT_EVERY="2")
    _same_run(plain, traced)
    assert _steps(tmp_path / "t.jsonl") == list(range(5))


RAISING_STEP_JOB = STEPS_JOB + '''
def closure():
    raise ValueError("the job's own bug, inside its optimizer's step")
opt.step(closure)
'''


def test_an_exception_inside_the_optimizer_step_keeps_the_job_s_own_traceback(tmp_path: Path) -> None:
    """The wrapper that ends a step after torch's Optimizer.step# scope is a Python frame between the job's
    call and torch's: its line (plasmient_trace/capture/step_hooks.py, in step) was in the traceback of every
    exception raised inside an optimizer's step (a closure, a custom optimizer's bug)."""
    script = _script(tmp_path, "raising_step.py", RAISING_STEP_JOB)
    plain = _plain(tmp_path, script, "3", "0")
    assert plain.returncode == 1 and b"inside its optimizer's step" in plain.stderr
    traced = _traced(tmp_path, script, "3", "0")
    _same_run(plain, traced)
    assert _steps(tmp_path / "t.jsonl")[:3] == list(range(3))  # every step it finished (the failed one too)
