"""Requests to one server sent concurrently: the one fan-out of a served model's passes, its latency
iterations and its load levels."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any, TypeVar

from .. import progress
from .base import ALL_AT_ONCE, BatchLayout
from .http_client import EndpointClient

T = TypeVar("T")


def fan_out(client: EndpointClient, items: Sequence[Any], send: Callable[[Any], T], max_in_flight: int,
            layout: BatchLayout = ALL_AT_ONCE) -> list[T]:
    """``send`` each item: all at once (at most ``max_in_flight`` in flight) or in the layout's calls of ``size``
    concurrent requests; results in item order. The first failure ends the rest: those not sent are
    cancelled, those in flight at ``client`` aborted, so a hang costs one deadline, not one per request."""
    results: list[Any] = [None] * len(items)
    failed = threading.Event()

    def send_unless_failed(item: Any) -> T:
        # Set by the failing worker itself: the request it would pick up next is never sent.
        if failed.is_set():
            raise CancelledError
        try:
            result = send(item)
        except BaseException:
            failed.set()
            raise
        progress.advance()
        return result

    progress.expect(len(items))
    for batch in layout.batches(len(items)):
        with ThreadPoolExecutor(max_workers=max(1, min(len(batch), layout.size or max_in_flight))) as pool:
            futures = [pool.submit(send_unless_failed, items[i]) for i in batch]
            try:
                for i, future in zip(batch, futures):
                    results[i] = future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                client.abort()
                raise
    return results
