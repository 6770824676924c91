"""The heap that existed before a load is kept out of garbage collection while it runs
(``nccl_back/load/heap.py``)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nccl_back.config import Settings
from nccl_back.load import heap
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import build

from models import TinyTransformer, fill_random, write_checkpoint


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    """Each test starts and ends with nothing frozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_heap_is_frozen_during_the_block_and_unfrozen_after() -> None:
    """Objects that exist when the window opens sit in the permanent generation until it closes."""
    before = gc.get_freeze_count()
    with heap.kept_out():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == 0


def test_an_application_that_froze_its_heap_is_left_as_it_is() -> None:
    """A heap the application froze is neither frozen again nor unfrozen at the end."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    young = [object()]  # frozen again, it would leave gc.get_objects()
    # A frozen object that dies leaves the count (other threads free some): bounds, not equality.
    with heap.kept_out():
        assert 0 < gc.get_freeze_count() <= frozen
        assert any(o is young for o in gc.get_objects())
    assert 0 < gc.get_freeze_count() <= frozen


def test_a_collector_switched_off_is_left_as_it_is() -> None:
    """With the collector disabled nothing is frozen (no collection runs anyway)."""
    gc.disable()
    try:
        with heap.kept_out():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_overlapping_loads_share_one_window_until_the_last_ends() -> None:
    """Two loads of one process at once: the heap is unfrozen only when both have ended."""
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with heap.kept_out():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with heap.kept_out():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() > 0  # the other load still runs
    release.set()
    t.join(10)
    assert gc.get_freeze_count() == 0


def test_a_window_that_raised_still_unfreezes() -> None:
    """An error inside the window leaves nothing frozen."""
    with pytest.raises(RuntimeError, match="boom"), heap.kept_out():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


@pytest.mark.timeout(60)
def test_a_load_runs_inside_the_window(redis_url: str, namespace: str, cache_dir: str,
                                       tmp_path: Path) -> None:
    """WeightService.load runs with the earlier heap frozen, and unfreezes it when done."""
    ckpt = str(write_checkpoint(fill_random(TinyTransformer(), seed=5), tmp_path / "ckpt"))
    seen: list[int] = []

    def storage(*args: Any, **kwargs: Any) -> Any:
        from nccl_back.load.storage_phase import load_checkpoint

        seen.append(gc.get_freeze_count())
        return load_checkpoint(*args, **kwargs)

    settings = Settings(redis_url=redis_url, namespace=namespace, cache_dir=cache_dir)
    with WeightService(settings, storage_loader=storage) as svc:
        result = svc.load(build(TinyTransformer), ModelSpec.from_dir(ckpt, cache_dir=cache_dir))
    assert result.source == "storage"
    assert seen and seen[0] > 0
    assert gc.get_freeze_count() == 0
