"""What a holder reads before it approves a job: every value the digest covers, in words."""

from __future__ import annotations

import hashlib

from gputravel.manifest.sections import Broker, Data, Evaluation, Outputs, Release, Workload

FINGERPRINT_HEX = 32  # 128 bits of SHA-256: enough to tell keys apart by eye, short enough to read aloud


def key_fingerprint(public_key: bytes) -> str:
    """A recipient key's fingerprint, as `gputravel job show` prints it: ``sha256:`` and 32 hex digits."""
    return "sha256:" + hashlib.sha256(public_key).hexdigest()[:FINGERPRINT_HEX]


def _workload(w: Workload, data: Data, script: bool) -> list[str]:
    kind = "shipped with gputravel" if not w.code else \
        f"file {w.file or '(unnamed)'}, {'a training script' if script else 'a workload'}"
    lines = [f"workload    {w.name} ({kind})"]
    if w.code:
        lines.append(f"  code SHA-384 {w.code}")
    if data.schema_digest:
        lines.append(f"data        records, schema SHA-256 {data.schema_digest}")
    else:
        lines.append(f"data        tokens, tokenizer {data.tokenizer}")
    return lines


def _outputs(o: Outputs, rel: Release) -> list[str]:
    model = (f"released to the recipients once {rel.quorum} of {len(rel.holders)} holders sign"
             if o.model == "release" else "kept sealed to the orchestrator's measurement and job")
    return ["outputs",
            f"  model        {model}",
            f"  checkpoints  {'sealed to the orchestrator (resume only)' if o.checkpoints == 'sealed' else 'none'}",
            f"  samples      {'written (generated text can repeat training data)' if o.samples else 'none'}",
            f"  metrics      {'written to the run directory' if o.metrics else 'none'}"]


def _privacy(settings: dict[str, object], o: Outputs) -> list[str]:
    """The DP-SGD settings in words, and what the guarantee leaves out (docs/privacy.md)."""
    eps = settings.get("dp_epsilon")
    if not isinstance(eps, (int, float)) or not eps:
        return ["privacy     none: the model is not differentially private (dp_epsilon 0)"]
    said = (f"privacy     DP-SGD: epsilon {eps:g} at delta {settings.get('dp_delta')} "
            f"({settings.get('dp_accountant')} accountant), each record's gradient clipped to "
            f"{settings.get('dp_max_grad_norm')}; record-level over all holders' training records, for the model only")
    lines = [said]
    if o.metrics:
        lines.append("  the metrics written are not covered: a step's loss is its sample's; "
                     "evaluations, held-out records")
    return lines


def _retention(settings: dict[str, object]) -> str:
    """How long the orchestrator holds travelled records (train/loader.py Kept)."""
    mib = settings.get("resident_mib")
    if settings.get("dp_epsilon"):  # DP-SGD samples over every record, so keeps them all
        return ("retention   every holder's training records kept in the orchestrator CVM's memory for the job's "
                "steps (DP-SGD samples over all of them), zeroed at the end, never checkpointed")
    if not isinstance(mib, int) or not mib:
        return "retention   none: records are trained on from the GPU's buffer, scrubbed before each travel"
    every = " (every record: one shuffle over them all)" if settings.get("shuffle") == "all" else ""
    return (f"retention   up to {mib} MiB of travelled records{every} kept in the orchestrator CVM's memory for "
            "the job's steps (trained on again without travelling, while their holder stays in the cohort), "
            "zeroed at the end, never checkpointed")


def _release(rel: Release, broker: Broker) -> list[str]:
    lines = [f"release     {rel.quorum} of {len(rel.holders)} holders must sign: {', '.join(rel.holders)}"]
    lines += [f"  signer     {h}  certificate SHA-384 {rel.certificates[h]}" for h in rel.holders
              if h in rel.certificates]
    if not rel.certificates:
        lines.append("  signers    under the certificates the orchestrator's measurement binds")
    lines += [f"  recipient  {r.name}  key {key_fingerprint(r.key_bytes())}" for r in rel.recipients]
    lines = lines if rel.recipients else [*lines, "  recipients none"]
    who = (f"key {key_fingerprint(bytes.fromhex(broker.identity))}" if broker.identity
           else "the one the orchestrator's measurement names")
    return [*lines, f"key broker  {who}"]


def describe_lines(workload: Workload, settings: dict[str, object], data: Data, ev: Evaluation, outputs: Outputs,
                   rel: Release, broker: Broker) -> list[str]:
    """The manifest's tables in words: workload and code digest, schema digest, settings, evaluation,
    each output, k of n and the recipients' key fingerprints."""
    lines = [*_workload(workload, data, bool(settings.get("script"))), "settings"]
    lines += [f"  {k:<17}{v}" for k, v in settings.items()]
    lines += _privacy(settings, outputs)
    lines.append(_retention(settings))
    lines.append(f"evaluation  each holder holds out {ev.share * 100:g}% of its records, never trained on; "
                 f"metrics: {', '.join(ev.metrics) or 'none'}")
    return [*lines, *_outputs(outputs, rel), *_release(rel, broker)]
