"""vLLM's own metric families in the engine model: which event observes each, and the histograms.

The engine model (``reproduce.engine.model``) calls the methods below at its events; its counters
and gauges are plain attributes it increments at the events named here. Every family is
labelled ``engine`` and ``model_name`` (the driver's labels), as vLLM 0.32 labels them
(``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger.__init__``), except
``admission_rejections`` (``model_name``, ``reason``: no ``engine``). Bucket boundaries are
``foundation.vllmbuckets``'.

Counting rules, as vLLM 0.32 applies them (source functions named; ``stats`` is
``vllm/v1/metrics/stats.py``, ``output`` is ``vllm/v1/engine/output_processor.py``): each
family, the event that observes it, and where vLLM does so:
- ``vllm:prefix_cache_queries_total``, ``_hits_total``: an execution is first admitted to the
  running batch (a recompute after preemption is not exported). ``stats.PrefixCacheStats.record``.
- ``vllm:prompt_tokens_total``: its first output token reaches the frontend (the full prompt,
  cached part included). ``stats.IterationStats.update_from_output`` (``is_prefilling``).
- ``vllm:generation_tokens_total``: every output token that reaches the frontend. Same function.
- ``vllm:time_to_first_token_seconds``: the first output token (first token - arrival); an
  execution aborted afterwards stays in it. Same function.
- ``vllm:inter_token_latency_seconds``: every later output token (its time - the previous
  token's). Same function.
- ``vllm:request_success_total{finished_reason}``: the execution finishes in the engine (here
  always ``length``: the study ignores EOS). ``loggers.PrometheusStatLogger.record`` over
  ``IterationStats.finished_requests``.
- At that same finish, from ``stats.IterationStats.update_from_finished_request``:
  ``vllm:e2e_request_latency_seconds`` (finish - arrival), ``vllm:request_queue_time_seconds``
  (first scheduled - queued), ``vllm:request_prefill_time_seconds`` (first token - first
  scheduled), ``vllm:request_decode_time_seconds`` (last token - first token),
  ``vllm:request_prompt_tokens`` and ``vllm:request_generation_tokens``. (vLLM also observes
  inference time, time per output token and preemptions there; the model leaves them out, as
  ``foundation.vllmbuckets.SERIES_HISTOGRAMS`` says why.)
- ``vllm:num_preemptions_total``: a running execution is preempted.
  ``stats.IterationStats.update_from_events`` (PREEMPTED).
- ``vllm:admission_rejections_total{reason}``: ``--max-num-queued-reqs`` refuses a request
  (HTTP 503). ``loggers.PrometheusStatLogger.record_admission_rejection``.
- ``vllm:num_requests_waiting``, ``_running``, ``vllm:kv_cache_usage_perc``: gauges, refreshed
  once per step after its aborts. ``loggers.PrometheusStatLogger.record`` (``scheduler_stats``).

NOTE: a request its client abandons is dropped by the frontend without being recorded
(``output.OutputProcessor.abort_requests`` pops its state, and ``process_outputs`` ignores
outputs that arrive for it afterwards): it never reaches ``request_success_total`` (not even
``finished_reason="abort"``) nor any per-request histogram, and its tokens of the steps in flight
at the abort are in no counter. So an execution aborted while waiting or during its prefill is in
nothing but, once admitted, the prefix-cache queries; one aborted after its first token is in
TTFT, inter-token latency, the prompt- and generation-token counters, and nothing else.

NOTE (speed): a histogram is a fixed list of per-bucket counts filled by ``bisect``
(cumulative only at export); the inter-token latencies of a step's decodes share one value and
are observed as one weighted observation, so a step costs O(1) whatever the batch size.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from itertools import accumulate

from foundation import metricnames as mn
from foundation.timeseries import Sample
from foundation.vllmbuckets import SERIES_HISTOGRAMS, bucket_bounds, le_label

__all__ = ["Histogram", "VllmStats"]


class Histogram:
    """Counts per bucket (non-cumulative; the last is the ``+Inf`` bucket) and the sum."""

    __slots__ = ("_labelled", "bounds", "counts", "les", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.les = (*(le_label(b) for b in bounds), "+Inf")
        self.counts = [0.0] * (len(bounds) + 1)  # floats: exported as they are
        self.sum = 0.0
        # (name, labels) -> its sample names, label dicts, and last export (values, samples)
        self._labelled: dict[
            tuple[str, tuple[tuple[str, str], ...]],
            tuple[list[str], list[dict[str, str]], list[float], list[Sample]],
        ] = {}

    def observe(self, value: float, n: int = 1) -> None:
        """``n`` observations of ``value`` (Prometheus' ``le``: a value equal to a bound is in it)."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def samples(self, name: str, labels: Mapping[str, str]) -> list[Sample]:
        """``_bucket`` (cumulative, with ``le``), ``_count`` and ``_sum``, in prometheus_client's order.

        NOTE (speed): a simulated run exports every few simulated seconds and keeps every export,
        and what it keeps the garbage collector walks and the caches hold ever after. The names
        and label dicts are made once per label set, an export with nothing new is the previous
        one, and a sample whose value did not change is the previous tuple (samples are never
        mutated): a third fewer objects kept than new tuples every time."""
        key = (name, tuple(labels.items()))
        made = self._labelled.get(key)
        values = list(accumulate(self.counts))
        values.append(values[-1])
        values.append(self.sum)
        if made is None:
            bucket = name + "_bucket"
            names = [bucket] * len(self.les) + [name + "_count", name + "_sum"]
            dicts = [{**labels, "le": le} for le in self.les] + [dict(labels), dict(labels)]
        else:
            names, dicts, last_values, last = made
            if values == last_values:
                return last
            # a bucket that did not change is the same tuple as in the last export
            out = [
                old if v == was else (n, d, v)
                for old, was, n, d, v in zip(last, last_values, names, dicts, values, strict=True)
            ]
            self._labelled[key] = (names, dicts, values, out)
            return out
        out = list(zip(names, dicts, values, strict=True))
        self._labelled[key] = (names, dicts, values, out)
        return out


class VllmStats:
    """The per-request histograms of one engine, observed as vLLM observes them (module docstring)."""

    def __init__(self, max_model_len: int) -> None:
        self.histograms: dict[str, Histogram] = {
            name: Histogram(bucket_bounds(name, max_model_len)) for name in sorted(SERIES_HISTOGRAMS)
        }
        h = self.histograms
        self._ttft = h[mn.VLLM_TTFT]
        self._itl = h[mn.VLLM_INTER_TOKEN_LATENCY]
        self._e2e = h[mn.VLLM_E2E_LATENCY]
        self._queue = h[mn.VLLM_QUEUE_TIME]
        self._prefill = h[mn.VLLM_PREFILL_TIME]
        self._decode = h[mn.VLLM_DECODE_TIME]
        self._prompt = h[mn.VLLM_REQUEST_PROMPT_TOKENS]
        self._generation = h[mn.VLLM_REQUEST_GENERATION_TOKENS]

    def first_token(self, arrival: float, now: float) -> None:
        """An execution's first output token reached the frontend at ``now``."""
        h = self._ttft
        value = now - arrival
        h.counts[bisect_left(h.bounds, value)] += 1
        h.sum += value

    def later_tokens(self, gap: float, n: int) -> None:
        """``n`` later output tokens (of ``n`` executions) each came ``gap`` after their previous one."""
        if n > 0:
            h = self._itl
            h.counts[bisect_left(h.bounds, gap)] += n
            h.sum += gap * n

    def later_token_run(self, prev: float, ends: list[float], n: int) -> None:
        """``n`` executions each output a token at every time of ``ends`` but the last (a coalesced
        run of decode steps; their previous tokens came at ``prev``).

        NOTE (speed): a run's step lengths after its first never shrink (its context grows), so
        when the first, the second and the last of them fall in one bucket, all do: one weighted
        observation (their sum telescopes) instead of one per step."""
        itl = self._itl
        last = len(ends) - 2
        bounds = itl.bounds
        first = bisect_left(bounds, ends[0] - prev)
        if (
            last >= 1
            and first == bisect_left(bounds, ends[1] - ends[0])
            and first == bisect_left(bounds, ends[last] - ends[last - 1])
        ) or last == 0:
            itl.counts[first] += n * (last + 1)
            itl.sum += (ends[last] - prev) * n
            return
        for end in ends[: last + 1]:
            itl.observe(end - prev, n)
            prev = end

    def finished(
        self,
        arrival: float,
        scheduled: float,
        first_token: float,
        now: float,
        prompt_tokens: int,
        output_tokens: int,
    ) -> None:
        """An execution finished in the engine at ``now`` (its last token); ``scheduled``: when it
        was first scheduled (preemptions leave it unchanged)."""
        # NOTE (speed): Histogram.observe inlined and unrolled, once per finished execution and family
        h = self._e2e
        value: float = now - arrival
        h.counts[bisect_left(h.bounds, value)] += 1
        h.sum += value
        h = self._queue
        value = scheduled - arrival
        h.counts[bisect_left(h.bounds, value)] += 1
        h.sum += value
        h = self._prefill
        value = first_token - scheduled
        h.counts[bisect_left(h.bounds, value)] += 1
        h.sum += value
        h = self._decode
        value = now - first_token
        h.counts[bisect_left(h.bounds, value)] += 1
        h.sum += value
        h = self._prompt
        h.counts[bisect_left(h.bounds, prompt_tokens)] += 1
        h.sum += prompt_tokens
        h = self._generation
        h.counts[bisect_left(h.bounds, output_tokens)] += 1
        h.sum += output_tokens

    def samples(self, labels: Mapping[str, str]) -> list[Sample]:
        """Every histogram's samples, by family name."""
        out: list[Sample] = []
        for name, histogram in self.histograms.items():
            out.extend(histogram.samples(name, labels))
        return out
