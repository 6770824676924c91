"""NCCL transport and CUDA tensors, on a machine with one GPU (``scripts/gpu_check.sh``).

NCCL refuses two ranks of one communicator on the same GPU, so with one GPU these
tests cover what one device allows: the unique-id exchange through Redis, a 1-rank
communicator's broadcast, the receiver's bounded wait for an id that never comes,
and CUDA tensors through the gloo data plane (both ranks in this process).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from nccl_back.config import Settings
from nccl_back.errors import NcclBackError, TransferTimeoutError
from nccl_back.registry import Registry
from nccl_back.transport import (
    RECEIVER_RANK,
    SENDER_RANK,
    Transport,
    open_rendezvous,
    receiver_transport,
    recv_tensors,
    run_guarded,
    send_tensors,
)
from nccl_back.transport.nccl import NcclTransport, decode_uid, encode_uid, load_nccl, uid_key

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


@pytest.fixture
def registry(redis_url: str, namespace: str) -> Registry:
    return Registry(Settings(redis_url=redis_url, namespace=namespace))


def test_unique_id_survives_the_trip_through_redis(registry: Registry) -> None:
    """The sender's NCCL id, stored as base64 JSON, decodes to the same signed bytes."""
    nccl = load_nccl()
    uid = nccl.get_unique_id()
    registry.set_json(uid_key(registry, "t"), {"uid": encode_uid(uid)}, 10)
    value = registry.get_json(uid_key(registry, "t"))
    assert value is not None and decode_uid(value["uid"]) == tuple(uid)


@pytest.mark.timeout(60)
def test_single_rank_communicator_broadcasts_and_closes(registry: Registry) -> None:
    """A 1-rank communicator built from an id published in Redis runs a broadcast."""
    transport = NcclTransport(SENDER_RANK, uuid.uuid4().hex, device=CUDA, registry=registry,
                              world_size=1)
    data = torch.arange(1 << 20, dtype=torch.float32, device=CUDA)
    expected = data.clone()
    run_guarded(transport, lambda t: t.broadcast(data).wait(), time.monotonic() + 30)
    assert torch.equal(data, expected)
    assert registry.get_json(uid_key(registry, transport.transfer_id)) is not None


@pytest.mark.timeout(60)
def test_receiver_without_a_sender_times_out(registry: Registry) -> None:
    """No unique id ever arrives: the receiver gives up at its deadline, no communicator."""
    transport = NcclTransport(RECEIVER_RANK, uuid.uuid4().hex, device=CUDA, registry=registry)
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError):
        run_guarded(transport, lambda t: None, time.monotonic() + 1.0)
    assert time.monotonic() - start < 10


@pytest.mark.timeout(120)
def test_cuda_tensors_through_the_gloo_data_plane() -> None:
    """bf16/fp32 CUDA tensors, bucketed and direct, arrive bit-identical over gloo."""
    s = Settings(advertise_host="127.0.0.1", bind_host="127.0.0.1")
    g = torch.Generator(device=CUDA).manual_seed(0)
    want = {
        "a": torch.randn(1000, device=CUDA, generator=g).to(torch.bfloat16),
        "b": torch.randn(512, 512, device=CUDA, generator=g),
        "c": torch.randn(64, 32, device=CUDA, generator=g).t(),
    }
    got = {n: torch.zeros_like(t) for n, t in want.items()}
    tid = uuid.uuid4().hex
    errors: list[BaseException] = []
    with open_rendezvous(s, "gloo", device=CUDA) as rdv:
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
                receiver_transport(s, "gloo", rdv.address, tid, device=CUDA),
                lambda t: recv_tensors(t, got, 64 << 10))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert errors == []
    for name in want:
        assert torch.equal(got[name], want[name]), name
