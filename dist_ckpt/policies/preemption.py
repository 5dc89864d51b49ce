"""A signal that announces the end of the job (SIGTERM from a scheduler's preemption or time
limit, SIGUSR1 from SLURM's ``--signal``), turned into a flag the training loop reads between
steps.

The handler only records that the signal came: nothing is saved inside a signal handler (it
runs between two bytecodes of whatever the main thread was doing: a collective, a write).
The manager reads the flag at its next ``should_save`` and every rank agrees to save and stop
(``policies.schedule``). Megatron-LM's ``--exit-signal-handler`` works the same way.

Python runs signal handlers on the main thread only, so the watch can be armed only from it;
the handlers it replaced come back with ``disarm`` (the manager's ``close``).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Dict, Iterable, Optional, Union

from .save_policies import InvalidPolicyError

__all__ = ["PreemptionWatch"]

logger = logging.getLogger(__name__)

SignalSpec = Union[int, signal.Signals]


class PreemptionWatch:
    """Catches ``signals`` from ``arm()`` to ``disarm()``; ``received`` is the first one caught."""

    def __init__(self, signals: Iterable[SignalSpec]) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise InvalidPolicyError("preemption_signal names no signal")
        self.received: Optional[signal.Signals] = None
        self.received_at: Optional[float] = None  # time.monotonic() of its arrival
        self._previous: Dict[signal.Signals, Any] = {}

    def arm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise InvalidPolicyError("preemption_signal needs the CheckpointManager to be made on the main thread "
                                     "(Python runs signal handlers there only)")
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._caught)

    def _caught(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum), time.monotonic()

    def disarm(self) -> None:
        """Put back the handlers ``arm`` replaced (from the main thread; elsewhere they stay)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def armed(self) -> bool:
        return bool(self._previous)
