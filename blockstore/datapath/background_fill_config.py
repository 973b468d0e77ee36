"""The background fill's settings (:mod:`.background_fill`), apart from it: the daemon and every control client
hold them, and none of them may pull in trio.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackgroundFillConfig:
    """The ``[datapath]`` settings of the background fill (the layer server's ``--*background-fill*`` options)."""

    enabled: bool = True  #: ``background_fill``: fill the rest of each served blob once the link is idle
    rate: int = 8 << 20  #: ``background_fill_rate``: stored bytes per second at most
    idle: float = 5.0  #: ``background_fill_idle``: seconds without any fetch before it starts (or goes on)
    batch: int = 4 << 20  #: stored bytes per batch at most (one fetch, one write)

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"background_fill_rate must be a positive number of bytes per second, not {self.rate}")
        if not 0 < self.idle <= 86400:
            raise ValueError(f"background_fill_idle must be seconds in (0, 86400], not {self.idle}")
        if self.batch <= 0:
            raise ValueError(f"the background fill's batch must be positive, not {self.batch}")


__all__ = ["BackgroundFillConfig"]
