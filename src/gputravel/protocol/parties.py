"""The orchestrator's fixed party name (its certificate's CN, the MUX target meaning "GPU home"): the
one constant the two trust domains share; a holder is any other name."""

from __future__ import annotations

ORCHESTRATOR = "orchestrator"
