"""The attacks, each driven against the live cohort, each judged by what was observed: the
table of every row (:data:`ATTACKS`); the rows themselves are in host_rows, holder_rows,
collusion_rows, isolation_rows and ddp_rows.

An attack returns a :class:`Verdict`: whether the defence it names was *seen* to act (a
typed error from the orchestrator, a fault flag the host read in BAR0, an attacker's read
that failed, a travel that never happened) and whether the cohort carried on. The bytes of
plaintext the attacker obtained are counted afterwards, by searching its loot
(:mod:`gputravel.redteam.run`). Nothing here checks anything the system itself does not:
the verdict only reports what the real defences did.
"""

from __future__ import annotations

from gputravel.redteam.arena import Attack
from gputravel.redteam.collusion_rows import (
    baseline_then_travel,
    collusion_after_failed_rotation,
    confirmation_substitution,
    decrypt_snooped,
    drop_rotation_then_read,
    host_forges_gpfifo_get,
    switch_after_rotation,
)
from gputravel.redteam.ddp_rows import host_carries_allreduce
from gputravel.redteam.holder_rows import (
    altered_context,
    dump_vram,
    holder_pushes_counters_forward,
    kept_keys,
    never_returns,
    stale_context,
    work_after_return,
)
from gputravel.redteam.host_rows import (
    drop_rotation,
    drop_scrub,
    flip_ciphertext,
    replay_push,
    snoop_everything,
    split_dma_irq,
    wrong_cvm_during_travel,
    wrong_cvm_for_orchestrator,
)
from gputravel.redteam.isolation_rows import (
    holder_reads_peer_memory,
    host_reads_cvm_memory,
    orchestrator_self_quote,
)

ATTACKS: tuple[Attack, ...] = (
    Attack("replay-push", "host", "captured alice's push for record 0 from her bounce buffer during her copy; when she "
           "asked for the GPU back, wrote it in again as a new GPFIFO entry and rang the doorbell (same epoch, same "
           "channel)", replay_push),
    Attack("flip-ciphertext", "host", "mid-copy, flipped one ciphertext bit of bob's record 1 in its staging slot "
           "before the device read it", flip_ciphertext),
    Attack("wrong-cvm-during-travel", "host", "when the orchestrator sent the GPU to alice, mapped bob's bounce "
           "buffers and interrupt instead (and told the orchestrator it was alice)", wrong_cvm_during_travel),
    Attack("split-dma-irq", "host", "during alice's travel, mapped alice's bounce buffers but routed the device's "
           "interrupts to bob", split_dma_irq),
    Attack("drop-rotation", "host", "after alice handed the GPU back, dropped every doorbell until the orchestrator's "
           "rotation push and its retry had both gone unheard", drop_rotation),
    Attack("drop-scrub", "host", "dropped the doorbell of the orchestrator's scrub (an unanswered push) before a travel "
           "to bob", drop_scrub),
    Attack("kept-keys", "holder", "mallory kept every context blob; after alice's chunk arrived it lined its kept "
           "contexts up with the device's queues (from BAR0) and tried to read the buffer and send encrypted RPCs",
           kept_keys),
    Attack("dump-vram", "holder", "while holding the GPU right after alice's travel, mallory read its whole granted "
           "buffer, then VRAM just past the window and 16 MiB beyond it", dump_vram),
    Attack("work-after-return", "holder", "right after handing the GPU back, mallory submitted a read of the buffer "
           "with the keys it had just returned (before or while the orchestrator rotated)", work_after_return),
    Attack("stale-context", "holder", "mallory returned the context blob of an earlier travel, then one with its "
           "counters rewound (checksum recomputed)", stale_context),
    Attack("altered-context", "holder", "mallory returned a context blob with a channel key replaced (checksum "
           "recomputed), then one with a byte flipped", altered_context),
    Attack("holder-pushes-counters-forward", "holder", "mallory returned a context blob whose first sender's channel "
           "counter it moved forward by one (checksum recomputed), to push the orchestrator's IVs out of step with "
           "the device", holder_pushes_counters_forward),
    Attack("drop-rotation-then-read", "host+holder", "paper 6.3: the host dropped the rotation after mallory's travel, "
           "hid the pending kernel work and switched the GPU to mallory, which used its still-valid keys; after "
           "alice's travel the host switched to mallory again", drop_rotation_then_read),
    Attack("confirmation-substitution", "host+holder", "the host dropped the rotations after bob's travel, then let "
           "the device run only those pending rotations when the orchestrator rang for the next scrub, hoping a "
           "rotation's release would pass for the scrub's and bob's chunk would travel to mallory unscrubbed",
           confirmation_substitution),
    Attack("switch-after-rotation", "host+holder", "after alice's travel (and the rotation), the host switched the GPU "
           "to mallory unasked; mallory used its kept keys to read the buffer and send RPCs", switch_after_rotation),
    Attack("decrypt-snooped", "host+holder", "the host handed mallory every staging record and push it captured from "
           "alice; mallory tried every key it kept at 32 IVs each", decrypt_snooped),
    Attack("host-forges-gpfifo-get", "host+holder", "when mallory handed the GPU back, the host forged BAR0's kernel "
           "GPFIFO get (put + 1) so the kernel ring looked full just as the orchestrator submitted the rotation; "
           "then alice travelled, and mallory tried the keys of its travel on the host's captures of her bounce "
           "buffers (before the fix the rotation was never submitted, recovery swallowed it, and alice's travel "
           "exported mallory's epoch again)", host_forges_gpfifo_get),
    Attack("collusion-after-failed-rotation", "host+holder", "mallory took a travel and refused it (then, a second "
           "time, never answered); each time the host forged the kernel get so the rotation after it and the "
           "recovery rotation could not be submitted; then alice travelled and mallory tried the keys of that "
           "travel on the host's captures of alice's bounce buffers (the issue's probe read 262,144 of 262,144 bytes this "
           "way before the fix)", collusion_after_failed_rotation),
    Attack("baseline-then-travel", "host+holder", "alice's chunk went by the TLS baseline (the orchestrator's own "
           "copy through its bounce buffers, which the host captured), then mallory travelled and tried the keys of "
           "its travel on the host's captures of the orchestrator's bounce buffers",
           baseline_then_travel),
    Attack("holder-reads-peer-memory", "holder", "from its own process, mallory tried to read the memory "
           "(/proc/PID/mem at the mappings that hold datasets, bounce buffers and VRAM), maps, environment and "
           "descriptors (the VRAM memfd included) of alice, bob, the orchestrator, the device, the host and the TDX "
           "module, and their key files and datasets (told where to look by the launcher)", holder_reads_peer_memory,
           needs_isolation=True),
    Attack("host-reads-cvm-memory", "host", "from the host process, the host tried the same on alice, bob, mallory, "
           "the orchestrator, the device and the TDX module", host_reads_cvm_memory, needs_isolation=True),
    Attack("orchestrator-self-quote", "host+holder", "the host and mallory each asked the TDX module for a quote over "
           "report data of their own (binding a TLS key of theirs, to pass for the orchestrator), and mallory tried "
           "to read the module's memory and descriptors, where its quoting key lives", orchestrator_self_quote),
    Attack("never-returns", "holder", "mallory took a travel, read the buffer, and then never switched the GPU back "
           "nor replied", never_returns),
    Attack("wrong-cvm-for-orchestrator", "host", "when alice handed the GPU back, mapped bob's bounce buffers instead "
           "of the orchestrator's, so the orchestrator's rotation went to the wrong CVM", wrong_cvm_for_orchestrator),
    Attack("host-carries-allreduce", "host", "carried every record of a DDP step's encrypted ring all-reduce "
           "between 3 data-parallel ranks (rank 0's gradient a canary), recorded it all and searched it for the "
           "gradient; then flipped a bit of, replayed the record before in place of, and dropped one record rank 0 "
           "sent rank 1 in the last hop", host_carries_allreduce),
    Attack("snoop-everything", "host", "read every CVM's bounce buffers (the snooper at boot, and a snapshot at every "
           "doorbell and every switch), every push it captured, and every TLS byte between holders and the "
           "orchestrator, throughout the run", snoop_everything),
)
