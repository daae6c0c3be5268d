"""The library internals petstore/overrides.py relies on: this fails loudly when an upgrade changes them."""

from __future__ import annotations

import inspect

import flask_limiter
from flask import Flask
from flask_limiter import Limiter
from limits.strategies import FixedWindowRateLimiter, RateLimiter

from petstore.overrides import PlanLimiter


def test_flask_limiter_is_the_version_the_overrides_were_checked_against() -> None:
    # A new version: re-read flask_limiter/_extension.py (init_app, _check_request_limit,
    # the `limiter` property) against petstore/overrides.py, then update this number.
    assert flask_limiter.__version__ == "4.1.1"


def test_the_attributes_the_overrides_use_exist() -> None:
    limiter = Limiter(lambda: "k", storage_uri="memory://", in_memory_fallback_enabled=True)
    limiter.init_app(Flask(__name__))
    for name in ("_storage_dead", "_limiter", "_fallback_limiter", "_in_memory_fallback_enabled"):
        assert hasattr(limiter, name), name
    assert limiter._storage_dead is False
    assert isinstance(limiter._limiter, RateLimiter)
    assert isinstance(limiter._fallback_limiter, RateLimiter)
    # The public `limiter` property picks the fallback while the storage is dead.
    limiter._storage_dead = True
    assert limiter.limiter is limiter._fallback_limiter
    limiter._storage_dead = False
    assert limiter.limiter is limiter._limiter
    assert "callable_name" in inspect.signature(Limiter._check_request_limit).parameters


def test_init_app_registers_three_hooks_and_plan_limiter_detaches_them() -> None:
    app = Flask(__name__)
    before = {name: list(hooks) for name, hooks in app.before_request_funcs.items()}
    plain = Limiter(lambda: "k", storage_uri="memory://")
    plain.init_app(app)
    registered = sum(len(hooks) for hooks in app.before_request_funcs.values())
    registered += sum(len(hooks) for hooks in app.after_request_funcs.values())
    registered += sum(len(hooks) for hooks in app.teardown_request_funcs.values())
    assert registered == 3, "flask-limiter's init_app registers other hooks now"

    ours = Flask(__name__)
    limiter = PlanLimiter(lambda: "k", storage_uri="memory://", in_memory_fallback_enabled=True)
    limiter.init_app(ours)
    assert not any(ours.before_request_funcs.values()), before
    assert not any(ours.after_request_funcs.values())
    assert not any(ours.teardown_request_funcs.values())
    assert isinstance(limiter.limiter, FixedWindowRateLimiter)


def test_a_failing_storage_counts_in_memory_until_it_answers_again() -> None:
    limiter = PlanLimiter(lambda: "k", storage_uri="memory://", in_memory_fallback_enabled=True)
    limiter.init_app(Flask(__name__))
    from limits import parse

    item = parse("2/minute")
    storage = limiter.storage
    real_incr, real_check = storage.incr, storage.check

    def down(*args: object, **kwargs: object) -> int:
        raise ConnectionError("storage down")

    storage.incr = down  # type: ignore[method-assign]
    storage.check = lambda: False  # type: ignore[method-assign]
    assert limiter.hit(item, "k") and limiter.hit(item, "k")
    assert not limiter.hit(item, "k"), "the fallback counts"
    assert limiter.storage_dead
    storage.incr, storage.check = real_incr, real_check  # type: ignore[method-assign]
    limiter.next_storage_check = 0.0
    assert limiter.hit(item, "k")
    assert not limiter.storage_dead, "back on the storage once it answers"
