"""The NCCL transport on a real GPU (``scripts/gpu_check.sh``): two processes, one device.

Every test here needs CUDA and is marked ``gpu``; without a GPU they are skipped, and
the device check fails if any of them is. Two ranks share the one GPU as NCCL allows
(``tests/gpu_pair.py`` says how).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from gpu_pair import STALL_DEADLINE, run_pair

from nccl_back.config import Settings
from nccl_back.errors import NcclBackError
from nccl_back.transport import (
    Transport,
    open_rendezvous,
    receiver_transport,
    recv_tensors,
    run_guarded,
    send_tensors,
)
from nccl_back.transport.nccl import nonblocking_timeout

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def _assert_clean_transfer(report: dict) -> None:
    s, r = report["sender"], report["receiver"]
    assert not report["hung"] and report["exitcodes"] == [0, 0], report
    assert s.get("outcome") == r.get("outcome") == "done", report
    assert s["hashes"] == r["hashes"], "sender and receiver hashes differ"
    assert s["cpu_gpu_equal"] and r["cpu_gpu_equal"], "CPU and GPU hashes of the same bytes differ"
    # NCCL's own threads may call the rendezvous; none may ask what it refuses.
    print("store calls from NCCL's threads:", s.get("store_calls"), r.get("store_calls"))
    refused = [c for side in (s, r) for c in side.get("store_calls", {})
               if c.startswith(("add@", "num_keys@"))]
    assert refused == [], report


@pytest.mark.timeout(180)
def test_every_dtype_arrives_bit_identical_between_two_processes() -> None:
    """bf16 (NaN payloads), fp32, fp16, fp8 x2, int8, bool, non-contiguous, odd-sized,
    larger than a bucket and exactly one bucket: byte-equal, hashes equal on CPU and GPU."""
    report = run_pair("ok")
    _assert_clean_transfer(report)
    assert report["receiver"]["bad"] == []


@pytest.mark.timeout(180)
def test_consolidated_skeletons_transfer_in_place() -> None:
    """Two skeletons built flat on the GPU (meta, then one allocation) transfer exactly."""
    _assert_clean_transfer(run_pair("flat"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", ["stall_connect", "stall_kernel"])
def test_stalled_receiver_is_aborted_cleanly_by_the_sender(scenario: str) -> None:
    """A receiver that stops before (or after) its first collective: the sender's transfer
    ends with a timeout near its deadline, no thread left, CUDA usable, inference unblocked."""
    report = run_pair(scenario, deadline_s=STALL_DEADLINE)
    s = report["sender"]
    assert report["exitcodes"][0] == 0 and not any("pair-0" in h for h in report["hung"]), report
    assert "Timeout" in s["outcome"], s
    assert s["seconds"] <= STALL_DEADLINE + nonblocking_timeout() + 5, s
    assert s["stuck_threads"] == 0, s
    assert s["cuda_usable"], s
    # Default-stream kernels never queued behind the stalled transfer.
    assert s["default_stream_max_s"] is not None and s["default_stream_max_s"] < 1.0, s


@pytest.mark.timeout(120)
def test_cuda_tensors_through_the_gloo_data_plane(redis_url: str, namespace: str) -> None:
    """bf16/fp32 CUDA tensors, bucketed and direct, arrive bit-identical over gloo."""
    from nccl_back.coord.registry import Registry

    s = Settings(advertise_host="127.0.0.1", redis_url=redis_url,
                 namespace=namespace)
    reg = Registry(s)
    g = torch.Generator(device=CUDA).manual_seed(0)
    want = {
        "a": torch.randn(1000, device=CUDA, generator=g).to(torch.bfloat16),
        "b": torch.randn(512, 512, device=CUDA, generator=g),
        "c": torch.randn(64, 32, device=CUDA, generator=g).t(),
    }
    got = {n: torch.zeros_like(t) for n, t in want.items()}
    tid = uuid.uuid4().hex
    errors: list[BaseException] = []
    with open_rendezvous(s, "gloo", device=CUDA, registry=reg) as rdv:
        deadline = time.monotonic() + 60

        def side(transport: Transport, fn: object) -> None:
            try:
                run_guarded(transport, fn, deadline)  # type: ignore[arg-type]
            except NcclBackError as e:
                errors.append(e)

        threads = [
            threading.Thread(target=side, args=(rdv.sender(tid),
                                                lambda t: send_tensors(t, want, 64 << 10))),
            threading.Thread(target=side, args=(
                receiver_transport(s, "gloo", rdv.address, tid, device=CUDA, registry=reg),
                lambda t: recv_tensors(t, got, 64 << 10))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert errors == []
    for name in want:
        assert torch.equal(got[name], want[name]), name
