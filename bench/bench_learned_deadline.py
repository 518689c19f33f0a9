"""How close the proxy's learned deadline (``exporter.deadlines``) comes to the clients' true one.

Run: ``python bench/bench_learned_deadline.py`` (a few seconds; ``--seeds`` runs fewer). Each
mixture feeds synthetic abandon ages to a fresh ``DeadlineLearner``, in random order, and after
10, 25, 50, 100 and 200 abandons reads the class found nearest each true deadline. A client
that times out at T leaves at T x (1 + N(0, 1 %)) + an exponential network delay of mean 0.2 s;
a user's early cancel is uniform in [0, T]. Printed per mixture and checkpoint: for each true
deadline, the share of seeds where a class within ±10 % of it was found, and the median and 95th
percentile of the relative error of the nearest class found (``-`` when none was); and the
share of seeds whose deadline in force (``DeadlineLearner.in_force``) is within ±10 % of the
class with the most weight (of either, when two weigh the same), beside the same share for the
estimate the proxy used before (``q0.9``: the 0.9 quantile of the last 256 abandon ages). No
assertion: the figures are printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import deque
from collections.abc import Callable

from exporter.deadlines import DeadlineLearner

CHECKPOINTS = (10, 25, 50, 100, 200)
TOLERANCE = 0.10


def timeout(t: float) -> Callable[[random.Random], float]:
    return lambda rng: t * (1 + rng.gauss(0, 0.01)) + rng.expovariate(1 / 0.2)


def cancel(t: float) -> Callable[[random.Random], float]:
    return lambda rng: rng.uniform(0.0, t)


Draw = Callable[[random.Random], float]
# name -> (the true deadlines, those the deadline in force may be, [(weight, draw)])
MIXTURES: dict[str, tuple[tuple[float, ...], tuple[float, ...], list[tuple[float, Draw]]]] = {
    "one class at 120 s": ((120.0,), (120.0,), [(1.0, timeout(120.0))]),
    "30 s + 600 s, even": ((30.0, 600.0), (30.0, 600.0), [(0.5, timeout(30.0)), (0.5, timeout(600.0))]),
    "30 s (80 %) + 600 s (20 %)": ((30.0, 600.0), (30.0,), [(0.8, timeout(30.0)), (0.2, timeout(600.0))]),
    "120 s, 30 % cancels in [0, 120]": ((120.0,), (120.0,), [(0.7, timeout(120.0)), (0.3, cancel(120.0))]),
    "120 s, 60 % cancels in [0, 120]": ((120.0,), (120.0,), [(0.4, timeout(120.0)), (0.6, cancel(120.0))]),
}


def run(mixture: str, seeds: int) -> None:
    truths, dominant, parts = MIXTURES[mixture]
    weights = [w for w, _ in parts]
    draws = [d for _, d in parts]
    # errors[checkpoint][truth index] -> relative errors (None: no class found)
    errors: dict[int, list[list[float | None]]] = {c: [[] for _ in truths] for c in CHECKPOINTS}
    in_force_ok = dict.fromkeys(CHECKPOINTS, 0)
    quantile_ok = dict.fromkeys(CHECKPOINTS, 0)
    for seed in range(seeds):
        rng = random.Random(seed)
        learner = DeadlineLearner()
        recent: deque[float] = deque(maxlen=256)
        for n in range(1, CHECKPOINTS[-1] + 1):
            age = rng.choices(draws, weights)[0](rng)
            learner.observe(age)
            recent.append(age)
            if n not in CHECKPOINTS:
                continue
            found = learner.classes()
            for i, truth in enumerate(truths):
                err = min((abs(c.deadline_s - truth) / truth for c in found), default=None)
                errors[n][i].append(err)
            top = learner.in_force()
            if top is not None and any(abs(top.deadline_s - t) <= TOLERANCE * t for t in dominant):
                in_force_ok[n] += 1
            q = statistics.quantiles(recent, n=10, method="inclusive")[8]
            if any(abs(q - t) <= TOLERANCE * t for t in dominant):
                quantile_ok[n] += 1
    print(f"\n{mixture}  ({seeds} seeds)")
    print(
        f"{'abandons':>8}  "
        + "  ".join(f"{f'{t:g} s: found  med  p95':>26}" for t in truths)
        + "  in force ±10 %  q0.9 ±10 %"
    )
    for n in CHECKPOINTS:
        cells = []
        for i in range(len(truths)):
            errs = errors[n][i]
            hits = sum(1 for e in errs if e is not None and e <= TOLERANCE) / seeds
            known = sorted(e for e in errs if e is not None)
            if known:
                med = f"{statistics.median(known):.1%}"
                p95 = f"{known[min(len(known) - 1, int(0.95 * len(known)))]:.1%}"
            else:
                med = p95 = "-"
            cells.append(f"{hits:>13.0%} {med:>5} {p95:>5}")
        print(
            f"{n:>8}  "
            + "  ".join(f"{c:>26}" for c in cells)
            + f"  {in_force_ok[n] / seeds:>14.0%}  {quantile_ok[n] / seeds:>10.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="Runs per mixture.")
    args = parser.parse_args()
    for mixture in MIXTURES:
        run(mixture, args.seeds)


if __name__ == "__main__":
    main()
