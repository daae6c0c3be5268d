"""RATELIMIT_TUNED_STORAGES: petstore.ratelimit.storages by default, the `limits` library's own when off."""

from __future__ import annotations

from collections.abc import Callable

from flask import Flask
from limits.storage import MemoryStorage

from petstore.ratelimit import storages


def test_untuned_uris_are_the_configured_ones() -> None:
    assert storages.storage_uri("memory://", tuned=False) == "memory://"
    assert storages.storage_uri("redis://h:1/2", tuned=False) == "redis://h:1/2"


def test_the_setting_chooses_the_storage(make_app: Callable[..., Flask]) -> None:
    tuned = make_app().extensions["petstore.limiter"].storage
    untuned = make_app(RATELIMIT_TUNED_STORAGES=False).extensions["petstore.limiter"].storage
    assert isinstance(tuned, storages.SweepingMemoryStorage)
    assert type(untuned) is MemoryStorage
