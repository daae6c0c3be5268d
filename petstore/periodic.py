"""A worker's background loops (petstore/__init__.py lists them): one step every so often, in a
daemon thread, while what it works for lives."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

Owner = TypeVar("Owner")


def every(
    seconds: float,
    owner: Owner,
    step: Callable[[Owner], bool],
    name: str,
    failure: str,
    wait_first: bool = False,
) -> None:
    """Start the thread `name`: step(owner) every `seconds` (the first after `seconds`, if
    `wait_first`), until `step` says False or the owner is gone: the thread holds it by a weak
    reference, so an owner dropped by its owner (tests) ends its loop. A step that raises is
    logged (`failure`) and the loop goes on."""
    owner_ref = weakref.ref(owner)

    def run() -> None:
        if wait_first:
            time.sleep(seconds)
        while (found := owner_ref()) is not None:
            try:
                if not step(found):
                    return
            except Exception:
                log.exception(failure)
            del found
            time.sleep(seconds)

    threading.Thread(target=run, name=name, daemon=True).start()
