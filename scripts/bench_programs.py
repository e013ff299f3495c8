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
#: computed, without the time it waited for a core another process held), peak RSS and
#: the CPU seconds of its parts the program timed (``spent``), as a JSON file of its own
#: in the folder argv[4] (a file, not stdout: the ranks' lines would interleave).
RANK_REPORT = """
import json, resource
with open(f"{sys.argv[4]}/rank{dist_rank}.json", "w") as report:
    json.dump({"rank": dist_rank, "seconds": seconds, "cpu_seconds": cpu_seconds,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               **spent}, report)
"""
#: The check, timed in each rank around its whole command line (process group included);
#: argv[5] names the setup's factory. The CPU seconds (process_time: every thread, the
#: all-reduces' included) of the comparisons (every call of ``compare`` and
#: ``compare_each``, the scalars' all-reduces included), of the case's micro-steps
#: (``CaseModel.backward_window``: every forward and backward of the window, DDP's
#: all-reduce included) and of the reference (``compute_reference``: its model's copy,
#: its optimizer, its backward, probe, copies and step) are summed by wrappers set before
#: the check imports them: a call to process_time on entry and exit, microseconds
#: against seconds.
CHECK_RANK = """import os, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import harness.check.compare as compare
spent = {"compare_cpu_seconds": 0.0, "micro_steps_cpu_seconds": 0.0,
         "reference_cpu_seconds": 0.0}
def timed(function, key):
    def run(*args, **kwargs):
        cpu = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent[key] += time.process_time() - cpu
    return run
compare.compare = timed(compare.compare, "compare_cpu_seconds")
compare.compare_each = timed(compare.compare_each, "compare_cpu_seconds")
import harness.check.baseline as baseline
import harness.check.case as case
case.CaseModel.backward_window = timed(case.CaseModel.backward_window,
                                       "micro_steps_cpu_seconds")
baseline.compute_reference = timed(baseline.compute_reference, "reference_cpu_seconds")
from harness.grad_check.cli import main
start, cpu_start = time.perf_counter(), time.process_time()
code = main([f"bench_check_setup:{sys.argv[5]}", "--strategies", "ddp", "--world-sizes", "2",
             "--accum-steps", "2", "--dtype", "float32", "--quiet", "--out", sys.argv[3]])
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
dist_rank = int(os.environ["RANK"])
assert code == 0
assert all(spent.values()), f"the wrappers timed nothing: {spent}"
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
#: The micro-steps of the loop a user would write: DDP, no_sync for the first k-1.
MICRO_STEPS = """x, y = setup.batch(0)
per_piece = len(x) // (world_size * accum_steps)
for micro in range(accum_steps):
    first = (dist_rank * accum_steps + micro) * per_piece
    piece = (x[first:first + per_piece], y[first:first + per_piece])
    if micro < accum_steps - 1:
        with model.no_sync():
            (setup.loss(model, piece) / accum_steps).backward()
    else:
        (setup.loss(model, piece) / accum_steps).backward()
"""
#: The loop a user would write: DDP, no_sync for the first k-1 micro-steps, one SGD step.
#: With a count in argv[5], the rank first fills a tensor of that many float32 elements
#: and holds it throughout, outside the timing.
BARE_CHECK_RANK = """import os, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from bench_check_setup import make_setup
setup, accum_steps, spent = make_setup(), 2, {}
held = torch.ones(int(sys.argv[5])) if len(sys.argv) > 5 else None
start, cpu_start = time.perf_counter(), time.process_time()
dist.init_process_group("gloo")
dist_rank, world_size = dist.get_rank(), dist.get_world_size()
model = DistributedDataParallel(setup.make_model())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
""" + MICRO_STEPS + """optimizer.step()
optimizer.zero_grad(set_to_none=True)
dist.destroy_process_group()
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
""" + RANK_REPORT
#: The floor of a check of that loop: the work any check of it must do, by hand, with
#: nothing of the harness. Each rank copies the initial model for the reference, runs the
#: bare loop's micro-steps, then the big-batch reference's backward and one float64 pass
#: comparing its half of the case's gradient with the reference's (the tensors dealt by
#: size, every other one, as the check deals them at N = 2: their dot product, chunk by
#: chunk converted with ``.double()``, one all-reduce of the sum), then both SGD steps.
#: argv[5] says how the reference's gradient is computed: ``whole``, every rank
#: backpropagates the whole global batch, as the check's whole-batch reference does;
#: ``terms``, as the check's chunked reference does (harness/check/chunked.py and
#: spread.py): each rank backpropagates its contiguous 1/N of the batch in chunks of at
#: most a micro-batch's samples (each chunk's summed squared errors over a power of two
#: near the count), the ranks all-gather their counts and divisors, and exchange their
#: shares point to point in buckets of at most 4M elements of a parameter: each rank
#: receives its 1/N part of every bucket from the others, sums it in float64 weighted by
#: the counts (64K elements at a time), and sends the sum back to each of them. The CPU
#: seconds of the micro-steps, of the reference's backward (and exchange) and of the
#: comparison are reported apart.
FLOOR_CHECK_RANK = """import copy, math, os, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from bench_check_setup import loss_terms, make_setup
setup, accum_steps, chunked, spent = make_setup(), 2, sys.argv[5] == "terms", {}
BUCKET, SUM_CHUNK, COMPARE_CHUNK = 1 << 22, 1 << 16, 1 << 16
start, cpu_start = time.perf_counter(), time.process_time()
dist.init_process_group("gloo")
dist_rank, world_size = dist.get_rank(), dist.get_world_size()
others = [rank for rank in range(world_size) if rank != dist_rank]
initial = setup.make_model()
reference = copy.deepcopy(initial)
model = DistributedDataParallel(initial)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
def timed(key, work):
    cpu = time.process_time()
    work()
    spent[key] = time.process_time() - cpu
cpu = time.process_time()
""" + MICRO_STEPS + """spent["micro_steps_cpu_seconds"] = time.process_time() - cpu

def exchanged(flat, weights):
    parts = [flat[rank * flat.numel() // world_size:(rank + 1) * flat.numel() // world_size]
             for rank in range(world_size)]
    mine = parts[dist_rank]
    shares = {rank: torch.empty_like(mine) for rank in others}
    for request in ([dist.isend(parts[rank], rank) for rank in others]
                    + [dist.irecv(shares[rank], rank) for rank in others]):
        request.wait()
    shares[dist_rank] = mine
    total = torch.empty(min(SUM_CHUNK, mine.numel()), dtype=torch.float64)
    for first in range(0, mine.numel(), SUM_CHUNK):
        stop = min(first + SUM_CHUNK, mine.numel())
        summed = total[:stop - first].copy_(shares[0][first:stop]).mul_(weights[0])
        for rank in range(1, world_size):
            summed.add_(shares[rank][first:stop], alpha=weights[rank])
        mine[first:stop].copy_(summed)
    for request in ([dist.isend(mine, rank) for rank in others]
                    + [dist.irecv(parts[rank], rank) for rank in others]):
        request.wait()

def chunked_backward():
    samples = len(x)
    first, stop = dist_rank * samples // world_size, (dist_rank + 1) * samples // world_size
    size, divisor, count = max(1, samples // (world_size * accum_steps)), None, 0.0
    for begin in range(first, stop, size):
        end = min(begin + size, stop)
        total, terms = loss_terms(reference, (x[begin:end], y[begin:end]))
        divisor = divisor or 2.0 ** round(math.log2(terms * samples / (end - begin)))
        (total / divisor).backward()
        count += terms
    numbers = [torch.empty(2, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(numbers, torch.tensor([divisor, count], dtype=torch.float64))
    counted = sum(float(n[1]) for n in numbers)
    weights = [float(n[0]) / counted for n in numbers]
    for param in reference.parameters():
        flat = param.grad.view(-1)
        for begin in range(0, flat.numel(), BUCKET):
            exchanged(flat[begin:begin + BUCKET], weights)

def compared_dot_product():
    pairs = sorted(zip(model.parameters(), reference.parameters()), key=lambda p: -p[0].numel())
    dot = torch.zeros((), dtype=torch.float64)
    for measured, expected in pairs[dist_rank::world_size]:
        m, r = measured.grad.view(-1), expected.grad.view(-1)
        for first in range(0, m.numel(), COMPARE_CHUNK):
            stop = first + COMPARE_CHUNK
            dot += torch.dot(m[first:stop].double(), r[first:stop].double())
    dist.all_reduce(dot)

timed("reference_cpu_seconds", chunked_backward if chunked
      else lambda: setup.loss(reference, (x, y)).backward())
timed("compare_cpu_seconds", compared_dot_product)
for step in (optimizer, reference_optimizer):
    step.step()
    step.zero_grad(set_to_none=True)
dist.destroy_process_group()
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
""" + RANK_REPORT
#: One rank of the frameworks benchmark: argv = target, k, out folder, repeat.
FRAMEWORKS_RANK = """import json, statistics, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from harness.grad_check.check_config import CheckConfig
from harness.check.load import validated_setup
from harness.grad_check.matrix import CheckRun, SetupCheck
from harness.placement import Launch, choose_placement
from harness.adapters.measure import measure
from harness.adapters import FRAMEWORKS

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
