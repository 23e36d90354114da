"""The engine on the timed simulated device: overlapped and serial loops give the same
tokens; the overlapped loop keeps the device busy while the host prepares the next step."""

from __future__ import annotations

import random

from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.executor.device import TimedDevice


def _engine(tiny_llama, overlap: bool | None) -> Engine:
    return Engine(
        EngineConfig(
            model=str(tiny_llama),
            simulated_device_time=True,
            simulated_device_cost=(0.002, 1e-6, 0.0),
            enable_overlap=overlap,
            page_size=4,
            max_num_batched_tokens=64,
            max_num_seqs=8,
        ),
        detokenize=False,
    )


def _run(
    engine: Engine, stops: dict[str, int] | None = None
) -> dict[str, tuple[list[int], str | None]]:
    rng = random.Random(0)
    for i in range(20):
        prompt = [rng.randrange(3, 400) for _ in range(rng.randrange(1, 80))]
        stop = [stops[f"r{i}"]] if stops and f"r{i}" in stops else []
        engine.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 30), stop_token_ids=stop)
        )
    engine.abort("r7")
    out: dict[str, tuple[list[int], str | None]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            tokens, _ = out.get(d.request_id, ([], None))
            assert out.get(d.request_id, ([], None))[1] is None, "output after the end"
            out[d.request_id] = (tokens + d.token_ids, d.finish_reason)
    engine.check_idle()
    return out


def test_timed_device_overlap_is_the_default_and_matches_serial(tiny_llama):
    overlapped = _engine(tiny_llama, None)
    assert overlapped.overlap and isinstance(overlapped.device, TimedDevice)
    serial = _engine(tiny_llama, False)
    assert not serial.overlap
    free = _run(serial)
    # some requests stop early, on a token they produce mid-run
    stops = {rid: ids[len(ids) // 2] for rid, (ids, _) in free.items() if len(ids) > 4}
    expected = _run(serial, stops)
    assert _run(overlapped, stops) == expected
    assert len(expected) == 20 and expected["r7"] == ([], "abort")
    assert {"stop", "length", "abort"} <= {reason for _, reason in expected.values()}
    # the device's busy time is the modelled time of every launched step in both loops
    assert overlapped.device.num_launched > 0 and overlapped.device.busy_s > 0
    # stopped requests had one more token computed in the overlapped loop, never emitted
    assert overlapped.scheduler.stats.num_discarded_tokens > 0
    assert serial.scheduler.stats.num_discarded_tokens == 0
    overlapped.close()
    serial.close()


def test_cpu_model_defaults_to_the_serial_loop(tiny_llama):
    engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32"))
    assert not engine.overlap and not engine.device.is_async
