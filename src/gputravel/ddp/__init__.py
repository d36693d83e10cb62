"""Data-parallel training between GPU TEEs: pairwise keys bound to attestation (`keys.py`), a
ring all-reduce whose every hop is sealed (`ring.py`), and the DDP communication hook that
runs it (`hook.py`)."""

from gputravel.ddp.hook import RingHookState, encrypted_allreduce_hook
from gputravel.ddp.keys import PairKeys, establish_pair_keys, pair_label, report_data
from gputravel.ddp.ring import DEFAULT_RECORD_BYTES, Ring, TorchPointToPoint, Variant, default_variant, record_aad

__all__ = ["DEFAULT_RECORD_BYTES", "PairKeys", "Ring", "RingHookState", "TorchPointToPoint", "Variant",
           "default_variant", "encrypted_allreduce_hook", "establish_pair_keys", "pair_label", "record_aad", "report_data"]
