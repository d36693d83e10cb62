"""How the parties of a cohort name each other on every link.

The orchestrator is one name, fixed: its certificate's common name, the PCIe MUX target that
means "the GPU is home", and the supervisor's control link to it. A data holder is named by
its own name (any other), so this is the one constant the two trust domains share.
"""

from __future__ import annotations

#: The orchestrator's party name.
ORCHESTRATOR = "orchestrator"
