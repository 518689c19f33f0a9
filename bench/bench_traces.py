"""How fast ``reproduce.workloads.traces.read_trace`` streams a trace, and that its memory stays flat.

Writes a generated trace of N records (1,000,000 by default) in each layout asked for to a
temporary file, line by line, then streams it through ``read_trace`` and prints the records per
second and the process's resident memory (RSS) at 10 %, 50 % and 100 % of the stream, and its
peak. Flat memory means the RSS at 100 % is the RSS at 10 %: nothing of the file is kept.

    .venv/bin/python bench/bench_traces.py [--records 1000000] [--layouts azure,mooncake,retrywatch]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TextIO

from reproduce.workloads.traces import read_trace

LAYOUTS = ("azure", "burstgpt", "mooncake", "retrywatch")


def rss_mib() -> float:
    """The resident memory of this process now (Linux /proc), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def write_trace(fh: TextIO, layout: str, n: int, seed: int = 0) -> None:
    """A bursty trace (exponential gaps, a burst every 1,000 calls) written row by row."""
    rng = random.Random(seed)
    start = datetime(2024, 5, 10, tzinfo=UTC)
    t = 0.0
    header = {
        "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n",
        "burstgpt": (
            "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        ),
        "retrywatch": "arrival_s,prompt_tokens,output_tokens,call_id,session,tenant,prefix_blocks\n",
    }.get(layout, "")
    fh.write(header)
    next_block = 1000
    for i in range(n):
        t += rng.expovariate(50.0 if i % 1000 < 100 else 5.0)
        prompt = int(rng.lognormvariate(7.0, 1.0)) + 1
        output = int(rng.lognormvariate(5.0, 0.8)) + 1
        if layout == "azure":
            stamp = (start + timedelta(seconds=t)).isoformat(sep=" ")
            fh.write(f"{stamp},{prompt},{output}\n")
        elif layout == "burstgpt":
            fh.write(f"{t:.1f},s{i % 5000},1,ChatGPT,{prompt},{output},{prompt + output},Conversation log\n")
        else:
            n_blocks = -(-prompt // 512)
            blocks = [0, *range(next_block, next_block + n_blocks - 1)]
            next_block += n_blocks
            if layout == "mooncake":
                row = {
                    "timestamp": int(t * 1000),
                    "input_length": prompt,
                    "output_length": output,
                    "hash_ids": blocks,
                }
                fh.write(json.dumps(row) + "\n")
            else:
                fh.write(
                    f"{t:.6f},{prompt},{output},c{i},s{i % 5000},t{i % 7},{' '.join(map(str, blocks))}\n"
                )


def measure(path: Path, n: int) -> dict[str, float]:
    marks = {n // 10: "rss_10pct_mib", n // 2: "rss_50pct_mib"}
    out: dict[str, float] = {}
    count = 0
    tokens = 0
    started = time.perf_counter()
    for record in read_trace(path):
        count += 1
        tokens += record.prompt_tokens
        if count in marks:
            out[marks[count]] = rss_mib()
    elapsed = time.perf_counter() - started
    assert count == n, f"read {count} of {n} records"
    out["rss_100pct_mib"] = rss_mib()
    out["records_per_s"] = count / elapsed
    out["seconds"] = elapsed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--layouts", default="azure,mooncake,retrywatch")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    for name in layouts:
        if name not in LAYOUTS:
            parser.error(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    print(f"streaming {args.records:,} generated records per layout")
    columns = ("file MiB", 9), ("records/s", 11), ("RSS 10%", 9), ("RSS 50%", 9), ("RSS 100%", 9), ("peak", 7)
    print(f"{'layout':<11} " + " ".join(f"{title:>{width}}" for title, width in columns))
    with tempfile.TemporaryDirectory() as tmp:
        for name in layouts:
            path = Path(tmp) / f"trace-{name}.txt"
            with path.open("w", encoding="utf-8") as fh:
                write_trace(fh, name, args.records)
            figures = measure(path, args.records)
            size = path.stat().st_size / 2**20
            path.unlink()
            rate = figures["records_per_s"]
            rss = " ".join(
                f"{figures[k]:>9.1f}" for k in ("rss_10pct_mib", "rss_50pct_mib", "rss_100pct_mib")
            )
            print(f"{name:<11} {size:>9.1f} {rate:>11,.0f} {rss} {peak_rss_mib():>7.1f}")
    print("RSS in MiB of this process; flat memory: RSS at 100 % equals RSS at 10 %.")


if __name__ == "__main__":
    main()
