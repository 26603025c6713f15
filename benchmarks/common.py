"""Small helpers shared by the benchmarks: a server to talk to, test images, statistics, output.

Nothing here knows what a benchmark measures; each benchmark module builds its workload on these.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import math
import random
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from launch.torchserve import REPO, ensure_demo_models, start_torchserve

BENCH_MODEL = REPO / "models" / "llava-bench"
TEXT_BENCH_MODEL = REPO / "models" / "text-bench"  # llava-bench's language model as a plain Llama


def ensure_bench_model(model_path: str | Path) -> None:
    """Build ``llava-bench`` (and ``text-bench``, its language model as a plain Llama) where a benchmark
    is pointed at one that is not built yet; any other path is the user's own."""
    path = Path(model_path).resolve()
    if path not in (BENCH_MODEL.resolve(), TEXT_BENCH_MODEL.resolve()):
        return
    ensure_demo_models(only=["bench"])
    if path == TEXT_BENCH_MODEL.resolve() and not TEXT_BENCH_MODEL.exists():
        from model_store.build_text_models import build_bench_twin

        build_bench_twin(TEXT_BENCH_MODEL.parent)


# ---------------------------------------------------------------- a peer engine in its own interpreter


def add_peer_arguments(parser: argparse.ArgumentParser, default_out: Path) -> None:
    """The options of a benchmark that runs vLLM beside us: its interpreter, repeats, our threads,
    its KV space, the output; and the hidden ones its worker (this script, in vLLM's interpreter) takes."""
    parser.add_argument("--vllm-python", default="", help="vLLM's interpreter; empty: ours only")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="our torch threads (0: measured)")
    parser.add_argument("--kv-cache-gb", type=int, default=4, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", default="", help=argparse.SUPPRESS)


def run_peer_worker(script: str, python: str, model: Path, seeds: list[int], kv_cache_gb: int):
    """Run ``script --worker`` in vLLM's interpreter ``python``; what it wrote (JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = [python, script, "--worker", "--model", str(model), "--seeds", ",".join(map(str, seeds)),
               "--kv-cache-gb", str(kv_cache_gb), "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
        if done.returncode or not out.exists():
            raise RuntimeError(f"the vLLM worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


# ---------------------------------------------------------------- server


def free_port(span: int = 5, host: str = "127.0.0.1") -> int:
    """A port P with P..P+span-1 all free (TorchServe takes inference, management, metrics and 2 gRPC ports)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 60000 - span)
        if all(_is_free(host, p) for p in range(port, port + span)):
            return port
    raise RuntimeError(f"no {span} consecutive free ports found on {host}")


def _is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@contextlib.contextmanager
def server_url(url: str | None, *, start_server: bool, model_path: Path | str, log_name: str) -> Iterator[str]:
    """Yield the base URL to benchmark: ``url`` as given, or a TorchServe started here and stopped on exit.

    The started instance runs in build/bench-<port>; its console output goes to <run dir>/<log_name>.
    """
    if url is not None:
        yield url.rstrip("/")
        return
    if not start_server:
        raise SystemExit("give --url of a running server or --start-server")
    model_path = Path(model_path)
    if model_path.resolve() == BENCH_MODEL.resolve():
        ensure_demo_models(REPO / "models", only=["bench"])
    port = free_port()
    run_dir = REPO / "build" / f"bench-{port}"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / log_name, "w") as log:
        ts = start_torchserve(port, run_dir=run_dir, model_path=model_path, stdout=log)
        try:
            ts.wait_ready(timeout_s=600)
            yield ts.url
        finally:
            ts.stop()


# ---------------------------------------------------------------- images


def image_data_url(seed: int, size: int = 336, cells: int = 21) -> str:
    """A deterministic PNG data URL: a cells x cells grid of seeded random colours, ``size`` px square.

    Distinct seeds give distinct images (so no image-embedding cache can be shared between them);
    the blocky pattern keeps the PNG small (a few KB) so upload time does not dominate.
    """
    from PIL import Image

    rng = random.Random(seed)
    grid = Image.frombytes("RGB", (cells, cells), bytes(rng.randrange(256) for _ in range(cells * cells * 3)))
    image = grid.resize((size, size), Image.NEAREST)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


# ---------------------------------------------------------------- output


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def bar_chart(path: Path, labels: Sequence[str], medians: Sequence[float], p90s: Sequence[float], *,
              title: str, ylabel: str = "latency (s)") -> Path:
    """Bars at the medians with a whisker up to p90 each; written as PNG (Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    upper = [max(p - m, 0.0) for m, p in zip(medians, p90s)]
    bars = ax.bar(labels, medians, yerr=[[0.0] * len(medians), upper], capsize=6,
                  color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"][:len(labels)])
    ax.bar_label(bars, labels=[f"{m:.2f} s" for m in medians], label_type="center", color="white")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.text(0.99, 0.98, "bar: median, whisker: p90", transform=ax.transAxes, ha="right", va="top", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
