"""Several callers on one engine: concurrent generate calls share batches and
give what they give alone; an abort from another thread stops only the
requests that exist when it is called."""
from __future__ import annotations

import threading
import time

from rollout_engine import RolloutEngine, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140)), [7] * 33]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def test_concurrent_generate_calls_equal_sequential(llama):
    _, folder = llama
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=2048)
    alone = [engine.generate(input_ids=[p], sampling_params=GREEDY)[0].output_token_ids for p in PROMPTS]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            results[i] = engine.generate(input_ids=[PROMPTS[i]], sampling_params=GREEDY)[0].output_token_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [results[i] for i in range(len(PROMPTS))] == alone
    engine.check_integrity()


def test_abort_from_another_thread(llama):
    _, folder = llama
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=2048)
    long = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    outs: list = []
    worker = threading.Thread(target=lambda: outs.extend(engine.generate(input_ids=PROMPTS[:2], sampling_params=long)))
    worker.start()
    deadline = time.monotonic() + 60
    while engine.metrics()["output_tokens"] < 4 and time.monotonic() < deadline:  # both under way
        time.sleep(0.005)
    assert engine.abort() == 2
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert all(0 < len(o.output_token_ids) < 400 for o in outs)
    # The abort is spent: a later call runs to its end.
    assert engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)[0].finish_reason == "length"
    engine.check_integrity()
