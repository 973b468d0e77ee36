"""The start-up profiler: where a job's start went, on every node.

For jobs (standard library only, safe to import anywhere)::

    import bootseer.profile
    bootseer.profile.mark("first_step")          # or, in a shell: touch /.bootseer/first_step

For BootSeer's own parts: :func:`emit`, :func:`span`, :func:`traced`, :func:`counter` and the
hooks in :mod:`bootseer.profile.hooks`. Reading spools back, reports, timelines and merging many
nodes are :mod:`bootseer.profile.trace`, :mod:`bootseer.profile.render` and
:mod:`bootseer.profile.cluster`; ``bootseer profile --help`` is the command line. See
docs/profile.md.
"""

from bootseer.profile.events import (
    PHASES, Event, EventError, counter, disable, emit, enable, enabled, mark, span, traced, use_root,
)

__all__ = ["PHASES", "Event", "EventError", "counter", "disable", "emit", "enable", "enabled", "mark", "span",
           "traced", "use_root"]
