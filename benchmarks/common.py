"""What the benchmarks share: threads, timing, peak memory, isolated rows, tables, JSON, plots, attention rows.

Timing. `time_interleaved` runs each implementation's warm-up calls (allocator, thread pools and
lazy inits settle), then rounds of one timed call per implementation, until `repeats` rounds are
done or an implementation's time budget is spent (at least one timed call each); the result is
the median, with the device synchronised around every call. Taking turns call by call matters
here: this machine's speed drifts by up to 1.7x within minutes, and rows timed one after the
other gave ratios that moved with it.

Allocator. The scripts run with freed memory kept in the process (`--allocator retain`, as the
trainers do: common/cpu_memory.py) or with the C library's defaults (`--allocator system`).

Peak memory. On CPU a row runs in a fresh process forked from the script's parent, which has
only imported the libraries (`run_in_fresh_process`); peak_mb is the growth of the process's
resident high-water mark (VmHWM, reset through /proc/self/clear_refs) over its resident size just
before the row started. So it counts everything the row touches: inputs, outputs, gradients,
workspace, caches, FAISS graphs, allocator slack, and the 10-25 MB of library pages and thread
stacks a row touches first; and nothing an earlier row left behind. On CUDA it is
torch.cuda.max_memory_allocated over the row (device memory only; FAISS graphs live on the host).
"""

import json
import math
import multiprocessing
import statistics
import sys
import time
import traceback
from pathlib import Path

import faiss
import torch

from common.cli import DTYPES
from common.cpu_memory import retain_freed_memory
from evaluation.loading import load_model, resolve_load_path
from evaluation.selection import model_keys as recorded_keys
from model.ann_attention import AnnAttention
from model.config import MiniMindConfig
from model.dense_attention import DenseAttention
from model.rope import Rope

from .flex_cores import FlexCore


def add_allocator_flag(parser):
    parser.add_argument(
        "--allocator", choices=("retain", "system"), default="retain",
        help="retain: freed memory stays in the process for reuse, as in the trainers (common/cpu_memory.py); "
        "system: the C library's defaults",
    )


def apply_allocator(choice):
    """Set the C allocator for this process and the rows it forks (before any row runs)."""
    if choice == "retain" and not retain_freed_memory():
        print("--allocator retain: no glibc mallopt here, the system allocator stays", file=sys.stderr)


def set_threads(threads):
    """The same thread count for torch and FAISS, so exact and HNSW retrieval compete fairly."""
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(calls, warmup, repeats, device, budget_s=math.inf):
    """{name: fn} -> {name: seconds of each timed call}: the calls take turns.

    Every fn runs `warmup` untimed times first, then rounds of one timed call each, in an order that
    rotates by one every round, so that a machine whose speed drifts (it does here, by up to 1.7x
    within minutes) slows every implementation alike and their ratio holds. A name leaves the rounds
    once its timed calls have used budget_s (after at least one), or after `repeats` calls.
    """
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    names = list(calls)
    times = {name: [] for name in names}
    for round_index in range(max(1, repeats)):
        shift = round_index % len(names)
        active = [name for name in names[shift:] + names[:shift] if not times[name] or sum(times[name]) < budget_s]
        if not active:
            break
        for name in active:
            begin = time.perf_counter()
            calls[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - begin)
    return times


def time_calls(fn, warmup, repeats, device, budget_s=math.inf):
    """Seconds of each timed call of fn(): warmup untimed calls first, then up to `repeats` timed ones."""
    return time_interleaved({"call": fn}, warmup, repeats, device, budget_s)["call"]


def median_ms(seconds):
    return 1000.0 * statistics.median(seconds)


def _proc_status_kb(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


class PeakMemory:
    """peak_mb(): the most memory held at once since start(), above what was held at start()."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.start()

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            # "5" resets VmHWM to the current resident size (Linux >= 4.0).
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            self.baseline = _proc_status_kb("VmRSS") * 1024

    def peak_mb(self):
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _proc_status_kb("VmHWM") * 1024
        return (peak - self.baseline) / 2**20


class RowFailed(RuntimeError):
    pass


def _child_main(sender, fn, args):
    try:
        sender.send((True, fn(*args)))
    except BaseException:
        sender.send((False, traceback.format_exc()))
    finally:
        sender.close()


def run_in_fresh_process(fn, *args):
    """fn(*args) in a new process forked from this one; returns its (picklable) result or raises RowFailed.

    Forking costs milliseconds where a fresh interpreter would import torch and transformers
    again. The caller must not have run torch computations itself (OpenMP's thread pool does not
    survive a fork, and neither does a CUDA context): the bench scripts' parents only orchestrate.
    A child killed by the kernel (out of memory) raises RowFailed with its exit code.
    """
    # The child inherits unflushed output buffers and would print them a second time.
    sys.stdout.flush()
    sys.stderr.flush()
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child_main, args=(sender, fn, args))
    child.start()
    sender.close()
    try:
        ok, payload = receiver.recv()
    except EOFError:
        ok, payload = False, None
    child.join()
    if ok:
        return payload
    if payload is None:
        raise RowFailed(f"the row's process died with exit code {child.exitcode} (killed for memory?)")
    raise RowFailed(payload)


def measure_group(impls, reason_to_skip, measure_memory, measure_times, skip):
    """One group of rows that share a mode and length: each implementation's memory in a fresh
    process of its own, then all of them timed together (interleaved) in one more.

    reason_to_skip(impl) -> a reason or None; measure_memory(impl) -> dict and
    measure_times(impls) -> {impl: dict} run in the fresh processes; skip(impl, reason) records a
    row that did not run. Returns ({impl: (memory result, time result)}, failed processes).
    """
    memory, failures = {}, 0

    def failed(error):
        print(str(error), file=sys.stderr)
        return "failed: " + str(error).strip().splitlines()[-1]

    for impl in impls:
        reason = reason_to_skip(impl)
        if reason is None:
            try:
                memory[impl] = run_in_fresh_process(measure_memory, impl)
            except RowFailed as error:
                reason, failures = failed(error), failures + 1
        if reason is not None:
            skip(impl, reason)
    if not memory:
        return {}, failures
    try:
        times = run_in_fresh_process(measure_times, list(memory))
    except RowFailed as error:
        reason = failed(error)
        for impl in memory:
            skip(impl, reason)
        return {}, failures + 1
    return {impl: (result, times[impl]) for impl, result in memory.items()}, failures


class Extrapolator:
    """Predicts a row's cost at a longer length from the rows already measured in its series.

    The growth exponent comes from the last two measured lengths, clamped to what the caller
    knows about the series (attention at fixed batch: between linear and quadratic); with one
    point it is the upper bound, the cautious guess. Returns None with no measured point.
    """

    def __init__(self, min_exponent=1.0, max_exponent=2.0):
        self.min_exponent = min_exponent
        self.max_exponent = max_exponent
        self.points = {}

    def add(self, series, length, value):
        self.points.setdefault(series, []).append((length, value))

    def predict(self, series, length):
        points = sorted(self.points.get(series, []))
        if not points:
            return None
        (length_a, value_a), (length_b, value_b) = points[-2:] if len(points) > 1 else points * 2
        exponent = self.max_exponent
        if length_b > length_a and value_a > 0 and value_b > 0:
            growth = math.log(value_b / value_a) / math.log(length_b / length_a)
            exponent = min(self.max_exponent, max(self.min_exponent, growth))
        return value_b * (length / length_b) ** exponent


def skip_reason(estimated_s, max_row_s, estimated_mb=None, mem_limit_gb=math.inf):
    """Why a row should not run (its estimates exceed the limits), or None."""
    if estimated_mb is not None and estimated_mb > mem_limit_gb * 1024:
        return f"estimated {estimated_mb / 1024:.1f} GB > --mem_limit_gb {mem_limit_gb:g}"
    if estimated_s is not None and estimated_s > max_row_s:
        return f"estimated {estimated_s:.3g} s > --max_row_s {max_row_s:g}"
    return None


def format_table(rows, columns):
    """rows: dicts; columns: (header, key, format) triples. Missing values print as '-'."""
    cells = [[header for header, _, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(key) is None else fmt.format(row[key])) for _, key, fmt in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def machine_info(device):
    info = {
        "torch": torch.__version__,
        "device": str(device),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": multiprocessing.cpu_count(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def write_json(path, config, rows, **extra):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "rows": rows, **extra}, indent=2) + "\n")
    print(f"wrote {path}")


def png_path_for(json_path, png_path=None):
    return Path(png_path) if png_path else Path(json_path).with_suffix(".png")


def plot_panels(png_path, title, panels):
    """One panel per entry of `panels`: (title, xlabel, ylabel, {line label: [(x, y), ...]}), log-log;
    a fifth element "linear" keeps that panel's y axis linear (e.g. recall)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    # One colour per line label across all panels, so a panel missing a line does not shift the others.
    colours = {}
    for _, _, _, lines, *_ in panels:
        for label in lines:
            colours.setdefault(label, f"C{len(colours) % 10}")
    for axis, (panel_title, xlabel, ylabel, lines, *y_scale) in zip(axes.flat, panels):
        log_y = y_scale != ["linear"]
        for label, points in lines.items():
            points = sorted((x, y) for x, y in points if y is not None and (y > 0 or not log_y))
            if points:
                axis.plot(*zip(*points), marker="o", label=label, color=colours[label])
        axis.set_xscale("log", base=2)
        axis.set_yscale("log" if log_y else "linear")
        axis.set_title(panel_title)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
        if axis.lines:
            axis.legend()
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    print(f"wrote {png_path}")


# ----------------------------------------------------------------------------- attention rows
# The attention benchmarks' cores and inputs, from a settings dict (batch, heads, kv_heads,
# head_dim, window, block_size, top_n, auto_threshold, device, dtype).


ATTENTION_DTYPES = ("bfloat16", "float16", "float32")


def add_attention_row_flags(parser):
    """The flags of an attention row's shape and core settings (what build_core and random_qkv read)."""
    defaults = MiniMindConfig()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=defaults.ann_window)
    parser.add_argument("--block_size", type=int, default=defaults.ann_block_size)
    parser.add_argument("--top_n", type=int, default=defaults.ann_top_n)
    parser.add_argument("--auto_threshold", type=int, default=defaults.ann_auto_threshold, help="candidate blocks")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=ATTENTION_DTYPES, default="float32")


def build_core(settings, impl):
    """dense, ann_exact / ann_hnsw / ann_auto / ann_pruned, or the FlexAttention baselines flex_causal and
    flex_ann (benchmarks/flex_cores.py: ANN's keys with true positions as a block-sparse mask)."""
    config = MiniMindConfig(
        hidden_size=settings["heads"] * settings["head_dim"],
        num_attention_heads=settings["heads"],
        num_key_value_heads=settings["kv_heads"],
        num_hidden_layers=1,
        attn_impl="ann" if impl.startswith("ann") else "dense",
        ann_window=settings["window"],
        ann_block_size=settings["block_size"],
        ann_top_n=settings["top_n"],
        ann_retrieval=impl.removeprefix("ann_") if impl.startswith("ann") else "exact",
        ann_auto_threshold=settings["auto_threshold"],
        ann_block_position="true" if impl == "flex_ann" else "capped",
    )
    if impl.startswith("flex_"):
        return FlexCore(config, impl.removeprefix("flex_"))
    return DenseAttention(config) if impl == "dense" else AnnAttention(config)


def rope_at(settings, first, length):
    """The Rope of `length` new tokens from position `first` (the model shares one across its layers)."""
    positions = (first + torch.arange(length, device=settings["device"])).expand(settings["batch"], length)
    return Rope(positions, settings["head_dim"], 1e6, DTYPES[settings["dtype"]])


def random_qkv(settings, length, generator, requires_grad=False):
    device, dtype = settings["device"], DTYPES[settings["dtype"]]
    b, h, g, d = settings["batch"], settings["heads"], settings["kv_heads"], settings["head_dim"]
    shapes = [(b, h, length, d), (b, g, length, d), (b, g, length, d)]
    return [
        torch.randn(shape, generator=generator, device=device, dtype=dtype).requires_grad_(requires_grad)
        for shape in shapes
    ]


def model_keys(model_path, text_path, num_tokens, layers, chunk, overrides=None):
    """({layer: (keys, group queries), each (1, g, t, d or e)}, config) of an ANN model over the
    first `num_tokens` tokens of a text (evaluation/selection.model_keys), timed; overrides: config
    names -> values the model runs with (evaluation/loading.load_model)."""
    model, tokenizer = load_model(resolve_load_path(model_path), None, None, torch.device("cpu"), overrides)
    started = time.perf_counter()
    captured = recorded_keys(model, tokenizer, text_path, num_tokens, layers, chunk)
    print(f"ran {num_tokens} tokens through {model_path} in {time.perf_counter() - started:.0f} s; "
          f"keys of layers {list(captured)}")
    return captured, model.config
