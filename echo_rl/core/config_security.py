"""``[security]``: who may connect, what one peer may cost, and how delivered work is checked
(docs/security.md). Part of ``echo_rl.core.config``; import it from there."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from echo_rl.core.config_sections import _Section


class SecurityConfig(_Section):
    """Who may connect and what one peer may cost (docs/security.md)."""

    # CurveZMQ on every socket (control, chunks, relays): peers are their public keys. Off
    # only for experiments on loopback; a non-loopback learner.host without it is refused
    # unless ``insecure = true`` (then anyone can impersonate anyone).
    curve: bool = True
    insecure: bool = False  # allow plaintext on a non-loopback host (echo-rl learn --insecure)
    # Who may join: anyone with a key ("open"), a key that redeems a token from
    # `echo-rl token create` ("token"), or a key listed in ``allowlist_file`` ("allowlist").
    join: Literal["open", "token", "allowlist"] = "open"
    allowlist_file: str = ""  # one public key per line; "" = <run dir>/security/allowlist.txt
    max_workers: int = Field(1024, gt=0)  # joined sessions at once; more are refused
    handshakes_per_s: float = Field(200.0, gt=0)  # new encrypted connections, all peers
    handshakes_per_s_per_ip: float = Field(20.0, gt=0)  # ... from one IP address (burst 2x)
    joins_per_s: float = Field(50.0, gt=0)  # join requests, all peers (burst 2x)
    # Sybils (docs/security.md): a key without a session is a newcomer; each IP prefix (/24 of
    # IPv4, /48 of IPv6) may bring this many per second (and a burst), refused at the handshake
    # ("rate_limited", try later) past it: a thousand fresh keys from one host take minutes.
    newcomers_per_s_per_prefix: float = Field(2.0, gt=0)
    newcomer_burst: float = Field(32.0, ge=1)  # ... at once (a NAT whose workers all rejoin)
    prefix_v4: int = Field(24, ge=8, le=32)  # bits of an IPv4 address that make one source
    prefix_v6: int = Field(48, ge=16, le=128)  # ... of an IPv6 address
    # Snapshot notices sent per publication (members whose deliveries were admitted first, then
    # other members, then keys that have only joined); the others learn the version from their
    # next heartbeat reply. A notice costs a ticket and an encryption: at 7 publications/s (the
    # toy run) 128 notices took a third of the learner's step rate.
    notices_per_publication: int = Field(32, gt=0)
    peer_msgs_per_s: float = Field(200.0, gt=0)  # control messages one key may send (burst 2x)
    peer_mib_per_s: float = Field(64.0, gt=0)  # control-socket bytes one key may send (burst 2x)
    # Per peer and chunk server (burst 2x): 1000 x 1 MiB chunks is 1 GB/s, above what one
    # encrypted connection carries here; past it requests are dropped unanswered.
    peer_chunk_requests_per_s: float = Field(1000.0, gt=0)
    max_parked_per_peer: int = Field(64, gt=0)  # chunk requests one peer may have waiting
    max_parked_total: int = Field(4096, gt=0)  # ... all peers of one chunk server
    # Relay reports from one witness (a token's keys are one) that the learner's probes did not
    # confirm, after which its reports no longer count as evidence (nor start probes). Never a
    # ban: an intact probe is no proof, a relay may serve probes well and children badly
    # (docs/security.md).
    false_reports: int = Field(10, gt=0)
    # Probes of reported relays the reports of one witness (a token's keys; a key in open mode)
    # may start in a minute; past it they still move the reporter, and start nothing.
    report_probes_per_min: int = Field(4, gt=0)
    ticket_ttl_s: float = Field(3600.0, gt=0)  # how long a relay honours a pull ticket
    # What workers report is checked before it trains (docs/security.md, "Trust but verify").
    # Rewards are recomputed on the learner for adapters that can (``recomputes_rewards``);
    # a share of delivered groups is audited: behaviour log-probs recomputed under the claimed
    # snapshot version, and a test that the tokens were sampled from it.
    audit: bool = True
    audit_rate: float = Field(0.05, ge=0, le=1)  # share of groups audited after probation
    # Every delivered row screened in the step-start forward (echo_rl/control/screen.py): one whose
    # claimed behaviour log-probs are on average more than this many nats per token from the
    # learner's own is left out of the step and its group audited at once. 0: off.
    screen_nats: float = Field(4.0, ge=0)
    probation_groups: int = Field(4, ge=0)  # a worker's first groups: every one is audited
    audit_budget: float = Field(0.10, gt=0, le=1)  # audits may take this share of learner time
    # The model audits recompute log-probs in (docs/memory.md). policy: on a single-process
    # learner on the CPU, the trainer's own model between steps (its weights saved to a spill
    # file and restored bit for bit); elsewhere, and with copy, a float32 copy of the policy
    # (4 bytes a parameter more).
    audit_model: Literal["policy", "copy"] = "policy"
    # Groups waiting for audit; past it the oldest non-probation job is dropped (counted).
    audit_queue: int = Field(256, gt=0)
    # Mean per-token |claimed - recomputed| log-prob of one sample above this fails the audit.
    # Honest backends differ by ~0.01 mean (bf16, vLLM): 0.5 nats is far outside that.
    audit_logprob_tol: float = Field(0.5, gt=0)
    # An adapter whose reward is expensive (``expensive_reward``: the code adapter runs a
    # sandboxed program per sample). sampled: not recomputed at intake; a thread recomputes
    # every group of a worker on probation and reward_audit_rate of the others, off the
    # learner's step (echo_rl/control/reward_audit.py). every: recomputed at intake, every one, as a
    # cheap reward is (the learner's loop waits on it).
    expensive_reward_check: Literal["sampled", "every"] = "sampled"
    reward_audit_rate: float = Field(0.1, ge=0, le=1)
    # Sampling test (Azuma-Hoeffding on clipped log p + entropy): false-alarm bound per audit,
    # and the clip. Honest samples fail with probability <= audit_alpha whatever the model.
    audit_alpha: float = Field(1e-6, gt=0, lt=1)
    audit_clip: float = Field(4.0, gt=0)  # the clip of the sampling test
    strikes: int = Field(2, gt=0)  # failed checks before a worker is quarantined
    # Hand-backs are work products (docs/preemption.md, "Hand-backs are checked"). Before a
    # worker continues them, the prefix tokens a worker handed back are recomputed as an audit
    # would (a failure is a strike against their author): every group of a key's first
    # handback_probation, then handback_audit_rate of them (OS randomness). The group waits off
    # the queue for its check at most handback_hold_s, then goes out without the new prefixes.
    handback_audit_rate: float = Field(0.25, ge=0, le=1)
    handback_probation: int = Field(4, ge=0)  # groups of a key checked before sampling starts
    handback_hold_s: float = Field(60.0, gt=0)  # a held group waits at most this for its check
    # Per worker, groups handed back may exceed handback_share of the groups it was granted by
    # at most handback_allowance (about one preemption's grant), at handback_groups_per_min
    # (burst: the allowance). Past either bound the groups are taken back without their
    # prefixes (counted) and the worker gets one group per request while it stays past it.
    handback_share: float = Field(0.5, ge=0, le=1)
    handback_allowance: int = Field(16, ge=1)  # groups handed back beyond the share (and the burst)
    handback_groups_per_min: float = Field(16.0, gt=0)  # groups one worker may hand back a minute
    # Cherry-picking: the mean reward percentile of the groups a worker handed back (once
    # completed by others) is tested against 1/2 from handback_bias_min groups on, at checkpoints
    # 25 % apart (Hoeffding, union bound over its life: an honest worker is flagged with
    # probability at most handback_bias_alpha; echo_rl/control/handbacks.py). A flagged worker's prefixes are no longer kept; no strike.
    handback_bias_alpha: float = Field(1e-3, gt=0, lt=1)
    handback_bias_min: int = Field(32, ge=2)  # returned groups completed before the test may flag
