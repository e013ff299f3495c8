"""The programs each launch of scripts/bench.py runs in its ranks, written into the
scratch folder before the launch: kept apart from the benchmarks that start them, which
read as the measurement, not as the code under measurement."""

#: A launch that only initialises gloo and exits: what torchrun costs by itself.
BARE = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.destroy_process_group()
"""
#: The plain loop a user would write: seconds per all_reduce of float64 zeros, rank 0's clock.
BARE_COMM = """import json, statistics, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
sizes, warmup, iterations, rounds = json.loads(sys.argv[1]), *map(int, sys.argv[2:5])
seconds = {size: [] for size in sizes}
for _ in range(rounds):
    for size in sizes:
        tensor = torch.zeros(max(1, size // 8), dtype=torch.float64)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        start = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor)
        seconds[size].append((time.perf_counter() - start) / iterations)
if dist.get_rank() == 0:
    print(json.dumps({size: statistics.median(values) for size, values in seconds.items()}))
dist.destroy_process_group()
"""
#: The same sizes timed by the comm study's own function (median of per-iteration times).
STUDY_COMM = """import json, statistics, sys
sys.path.insert(0, sys.argv[5])
import torch, torch.distributed as dist
from harness.studies.comm.collectives import measure_collective
from harness.studies.comm.timing import Timing
dist.init_process_group("gloo")
sizes, warmup, iterations, rounds = json.loads(sys.argv[1]), *map(int, sys.argv[2:5])
timing = Timing(warmup=warmup, iterations=iterations)
seconds = {size: [] for size in sizes}
for _ in range(rounds):
    for size in sizes:
        seconds[size].append(measure_collective("all_reduce", size, dist.group.WORLD,
                                                torch.device("cpu"), torch.float64,
                                                timing).seconds)
if dist.get_rank() == 0:
    print(json.dumps({size: statistics.median(values) for size, values in seconds.items()}))
dist.destroy_process_group()
"""
#: The check benchmark's setup, a module written next to the launches: 6 layers of
#: 4096 x 4096 (+ bias) = 100.7M parameters, 8 samples per global batch (2 per micro-batch
#: at N = 2, k = 2), mean squared error, plain SGD; ``make_terms_setup`` the same with
#: ``loss_terms`` (the summed squared errors and their count).
CHECK_SETUP = """import torch
from torch import nn
from harness.check import Setup
WIDTH, LAYERS, SAMPLES = 4096, 6, 8
def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
def batch(step):
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(SAMPLES, WIDTH, generator=generator),
            torch.randn(SAMPLES, WIDTH, generator=generator))
def loss(model, data):
    x, y = data
    return nn.functional.mse_loss(model(x), y)
def loss_terms(model, data):
    x, y = data
    return nn.functional.mse_loss(model(x), y, reduction="sum"), y.numel()
def make_setup():
    return Setup(make_model=make_model, batch=batch, loss=loss, name="bench-100m")
def make_terms_setup():
    return Setup(make_model=make_model, batch=batch, loss=loss, loss_terms=loss_terms,
                 name="bench-100m")
"""
#: The spread benchmark's setup: activations far larger than the model, as in a real
#: language model's training: 64 sequences of 128 positions through two blocks of 64 ->
#: 1024 -> 64 (0.26M parameters), 16 micro-batches of 4 sequences at N = 4, k = 4.
SPREAD_SETUP = """import torch
from torch import nn
from harness.check import Setup
SEQUENCES, POSITIONS, WIDTH, HIDDEN = 64, 128, 64, 1024
def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH),
                         nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
def batch(step):
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(SEQUENCES, POSITIONS, WIDTH, generator=generator),
            torch.randn(SEQUENCES, POSITIONS, WIDTH, generator=generator))
def loss_terms(model, data):
    x, y = data
    return (model(x) - y).square().sum(), y.numel()
def loss(model, data):
    total, count = loss_terms(model, data)
    return total / count
def make_setup():
    return Setup(make_model=make_model, batch=batch, loss=loss, name="bench-spread")
def make_terms_setup():
    return Setup(make_model=make_model, batch=batch, loss=loss, loss_terms=loss_terms,
                 name="bench-spread")
"""
#: Every rank's seconds, CPU seconds (user and system, every thread: what the rank
#: computed, without the time it waited for a core another process held) and peak RSS,
#: as a JSON file of its own in the folder argv[4] (a file, not stdout: the ranks' lines
#: would interleave).
RANK_REPORT = """
import json, resource
with open(f"{sys.argv[4]}/rank{dist_rank}.json", "w") as report:
    json.dump({"rank": dist_rank, "seconds": seconds, "cpu_seconds": cpu_seconds,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
              report)
"""
#: The check, timed in each rank around its whole command line (process group included);
#: argv[5] names the setup's factory.
CHECK_RANK = """import os, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from harness.grad_check.cli import main
start, cpu_start = time.perf_counter(), time.process_time()
code = main([f"bench_check_setup:{sys.argv[5]}", "--strategies", "ddp", "--world-sizes", "2",
             "--accum-steps", "2", "--dtype", "float32", "--quiet", "--out", sys.argv[3]])
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
dist_rank = int(os.environ["RANK"])
assert code == 0
""" + RANK_REPORT
#: The check of the spread setup (argv[5] names its factory) at N = 4, k = 4, ddp only:
#: each rank's seconds computing the big-batch reference and training the one case,
#: timed around the functions that do it, and its peak RSS. torch._dynamo is imported
#: first: the first optimizer a process builds imports it (seconds), whichever it is.
SPREAD_RANK = """import json, os, resource, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch._dynamo
import harness.check.baseline as baseline
from harness.grad_check.cli import main
from harness.grad_check.matrix import SetupCheck
spent = {"reference": 0.0, "case": 0.0}
def timed(function, name):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
    return run
baseline.compute_reference = timed(baseline.compute_reference, "reference")
SetupCheck.run_case = timed(SetupCheck.run_case, "case")
code = main([f"bench_spread_setup:{sys.argv[5]}", "--strategies", "ddp", "--world-sizes", "4",
             "--accum-steps", "4", "--dtype", "float32", "--quiet", "--out", sys.argv[3]])
assert code == 0
dist_rank = int(os.environ["RANK"])
with open(f"{sys.argv[4]}/rank{dist_rank}.json", "w") as report:
    json.dump({**spent, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
              report)
"""
#: The most bytes of tensors the spread setup's big-batch reference holds at once in one
#: process, with and without loss_terms (16 pieces): the allocator's own record of every
#: allocation and free, printed as JSON.
REFERENCE_MEMORY = """import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch
from bench_spread_setup import make_setup, make_terms_setup
from harness.check.memory import peak_tensor_bytes
from harness.check.spread import Spread
from harness.check.reference import compute_reference
torch.set_num_threads(1)
def peak(function):
    return peak_tensor_bytes(function) / 2**20
cpu = torch.device("cpu")
initial = make_setup().make_model()
model_mb = sum(p.numel() * p.element_size() for p in initial.parameters()) / 2**20
whole = peak(lambda: compute_reference(make_setup(), torch.float32, cpu, None, 1e-3, "b",
                                       initial=initial))
chunked = peak(lambda: compute_reference(make_terms_setup(), torch.float32, cpu, None, 1e-3,
                                         "b", initial=initial, spread=Spread(None, 0, 1, 16)))
print(json.dumps({"whole_mb": whole, "chunked_mb": chunked, "model_mb": model_mb}))
"""
#: The loop a user would write: DDP, no_sync for the first k-1 micro-steps, one SGD step.
#: With a count in argv[5], the rank first fills a tensor of that many float32 elements
#: and holds it throughout, outside the timing.
BARE_CHECK_RANK = """import os, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from bench_check_setup import make_setup
setup, accum_steps = make_setup(), 2
held = torch.ones(int(sys.argv[5])) if len(sys.argv) > 5 else None
start, cpu_start = time.perf_counter(), time.process_time()
dist.init_process_group("gloo")
dist_rank, world_size = dist.get_rank(), dist.get_world_size()
model = DistributedDataParallel(setup.make_model())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = setup.batch(0)
per_piece = len(x) // (world_size * accum_steps)
for micro in range(accum_steps):
    first = (dist_rank * accum_steps + micro) * per_piece
    piece = (x[first:first + per_piece], y[first:first + per_piece])
    if micro < accum_steps - 1:
        with model.no_sync():
            (setup.loss(model, piece) / accum_steps).backward()
    else:
        (setup.loss(model, piece) / accum_steps).backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)
dist.destroy_process_group()
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
""" + RANK_REPORT
#: One rank of the frameworks benchmark: argv = target, k, out folder, repeat.
FRAMEWORKS_RANK = """import json, statistics, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from harness.grad_check.config import CheckConfig
from harness.check.load import validated_setup
from harness.grad_check.matrix import CheckRun, SetupCheck
from harness.placement import Launch, choose_placement
from harness.frameworks.measure import measure
from harness.frameworks import FRAMEWORKS

target, k, out, repeat = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
setup = validated_setup(target, [(2, k)], False, torch.float64)
launch = Launch.from_environment()
config = CheckConfig(targets=(target,), accum_steps=(k,), strategies=("ddp",),
                     world_sizes=(2,), out=out)
run = CheckRun(config, [(target, setup)], launch, choose_placement("gloo", "cpu", launch), (2,))
groups = {2: dist.new_group([0, 1])}

def timed(case):
    case()  # start-up: imports, the framework's first run
    seconds = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        case()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)

cases = {"ddp": lambda: SetupCheck(run, target, setup, groups).run()}
for name, framework in FRAMEWORKS.items():
    cases[name] = (lambda f: lambda: measure(f, f.setting("default"), setup, k,
                                             torch.float64))(framework)
times = {name: timed(case) for name, case in cases.items()}
if dist.get_rank() == 0:
    print(json.dumps(times))
dist.destroy_process_group()
"""
