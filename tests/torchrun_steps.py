"""Run 3 learner steps on fixed batches, then one whose row 5 has a NaN advantage (the update
holding it must be skipped on every rank, the other applied); save the parameters and the step
statistics (used by test_torchrun.py).

    python tests/torchrun_steps.py OUT.pt                      # one process
    torchrun --nproc_per_node=2 tests/torchrun_steps.py OUT.pt # FSDP2, same data
    ... OUT.pt lora                                            # a LoRA adapter on the frozen base

With ``lora`` the saved state also holds a checkpoint round trip: the adapter's state loaded
back (``Load``) and gathered again.
"""

import sys

import torch

from echo_rl.core.config import EchoConfig
from echo_rl.data.adapter import LearnerBatch
from echo_rl.learner.policy import Load, Policy, Step, Sync


def batch(seed: int, n: int = 16, prompt: int = 4, completion: int = 3) -> LearnerBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 24, (n, prompt + completion), generator=g)
    mask = torch.zeros(n, prompt + completion - 1)
    mask[:, prompt - 1 :] = 1
    mask[::3, -1] = 0  # ragged completions: token-mean differs from seq-mean
    return LearnerBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        behaviour_logprobs=-torch.rand(n, prompt + completion - 1, generator=g) * 3,
        advantages=torch.randn(n, generator=g),
        rewards=torch.zeros(n),
        versions=torch.zeros(n, dtype=torch.long),
    )


def main(out: str, lora: bool = False) -> None:
    cfg = EchoConfig.model_validate(
        {
            "learner": {
                "lr": 1e-2,
                "prompts_per_step": 4,
                "group_size": 4,
                "lora": {"enabled": lora, "rank": 4},
                "beta": 0.05 if lora else 0.0,
            }
        }
    )
    policy = Policy(cfg)
    if not policy.par.is_main:
        policy.follow()
        policy.par.close()
        return
    poisoned = batch(3)
    poisoned.advantages[5] = float("nan")  # on one rank's shard of one mini-batch
    stats = [policy.command(Step(b))[0] for b in (batch(0), batch(1), batch(2), poisoned)]
    _, (model_sd, optim_sd) = policy.command(Sync())
    saved = {"params": {n: t for n, t in policy.named_tensors(model_sd)}, "stats": stats}
    if lora:  # resume from the adapter alone: the same adapter comes back
        policy.command(Load({"model": model_sd, "optimizer": optim_sd, **policy.rng_state()}))
        _, (again, _) = policy.command(Sync())
        saved["reloaded"] = dict(policy.named_tensors(again))
    torch.save(saved, out)
    policy.close()


if __name__ == "__main__":
    from echo_rl.learner.parallel import exit_rank

    main(sys.argv[1], lora=sys.argv[2:] == ["lora"])
    exit_rank(0)  # as echo-rl learn ends a rank: no finalisation for gloo to abort in
