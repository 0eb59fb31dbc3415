"""Named moments of a training step that a profiler outside the library may listen to; nothing happens
while nobody listens (one check of an empty list).

The core marks two kinds:

    @timed(HOOK)                  around each hook of the unit lifecycle (``sharding/lifecycle.py``: gather
                                  before forward and backward, free after, reduce, the end of backward)
    @timed(GRADIENT_ASSEMBLY)     around ``FullViews.backward`` (``sharding/full_views.py``): the parameters'
                                  gradients concatenated into the flat gradient that is reduced
    collective_started(record)    each collective, as the collective log records it (``collective_log.py``)

``experiments/measuring/breakdown.py`` splits a step's time with them. A listener has
``enter(point)``, ``leave(point)`` (around a timed call, nested calls included) and
``collective_started(record)``. The marks move with the code they mark, so renaming a
hook cannot silently stop a profiler from seeing it, as patching private names could.
"""

import functools

HOOK = "lifecycle hook"
GRADIENT_ASSEMBLY = "gradient assembly"

_listeners: list = []


def add_listener(listener) -> None:
    """Calls `listener` at every marked moment from now on, in this process."""
    _listeners.append(listener)


def remove_listener(listener) -> None:
    _listeners.remove(listener)


def timed(point: str):
    """Decorates a function so that listeners hear ``enter(point)`` before each call and ``leave(point)`` after."""
    def decorate(function):
        @functools.wraps(function)
        def marked(*args, **kwargs):
            if not _listeners:
                return function(*args, **kwargs)
            for listener in _listeners:
                listener.enter(point)
            try:
                return function(*args, **kwargs)
            finally:
                for listener in _listeners:
                    listener.leave(point)
        return marked
    return decorate


def collective_started(record) -> None:
    """Tells listeners of a collective this rank entered (a ``collective_log.CollectiveRecord``)."""
    for listener in _listeners:
        listener.collective_started(record)
