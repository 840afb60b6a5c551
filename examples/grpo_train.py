"""GRPO on arithmetic with an exact-match reward: the engine rolls out, a
plain PyTorch copy of the model trains, the new weights go back to the
engine in place, every step.

    python examples/grpo_train.py --steps 20                  # SmolLM2-135M on the CPU
    python examples/grpo_train.py --steps 60 --wandb --log-json run.json
    python examples/plot_run.py run.json run.png
    python examples/grpo_train.py --model qwen3-0.6b --load-format dummy --task token   # no checkpoint needed
    python examples/grpo_train.py --model qwen3-moe-mini --load-format dummy --task token --routing-replay
    torchrun --nproc-per-node 2 examples/grpo_train.py --fsdp                 # FSDP2 trainer over 2 ranks

Tasks: `arithmetic` (chat prompts "What is a + b?", reward 1 when the last
number of the response is the sum; needs a tokenizer) and `token` (random
token-id prompts, reward = the share of output tokens in a target set: the
tokens whose output embeddings lie furthest along one fixed random direction
of the initial model; a model with random weights can learn it by turning its
last hidden state toward that direction, so it suits presets without a
checkpoint).

Per step: `generate` n samples per prompt (temperature 1, raw logprobs),
rewards, group-normalised advantages, the trainer's own forward for the
sampled tokens' logprobs, a clipped-ratio policy-gradient step against the
engine's logprobs, `sync_to_engine`; on a GPU with the memory saver the
engine releases its memory for the trainer's step and resumes after.

With `--fsdp` (under torchrun) the trainer is sharded with FSDP2 over the
ranks; each rank rolls out its own prompts with its own engine and
`sync_to_engine` gathers the full weights into every rank's engine.

The train-inference mismatch is measured on every step before the update,
like with like: the engine's raw logprobs against the trainer's log-softmax
on the same weights, over the sampled tokens (mean and max of the absolute
gap, and the k1 estimate of KL(engine || trainer) per sequence).

With `--routing-replay` (MoE models) the engine returns each token's experts
and the trainer's forward sends every token to them
(`rollout_engine.integrations.routing_replay`); each step also logs the
mismatch of a forward without replay and the share of (token, MoE layer)
where the trainer's routers pick the engine's experts.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import time

import torch

from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.config import QUANTIZATIONS
from rollout_engine.integrations.fsdp import sync_to_engine
from rollout_engine.integrations.wandb import RolloutLogger
from rollout_engine.script_args import ScriptParser


def make_problems(rng: random.Random, count: int) -> list[tuple[str, int]]:
    problems = []
    for _ in range(count):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        problems.append((f"What is {a} + {b}? Answer with the number only.", a + b))
    return problems


def reward(text: str, answer: int) -> float:
    """1 when the last number in the response is the answer ("12 + 7 = 19"
    counts; a response that only repeats the question does not)."""
    found = re.findall(r"-?\d+", text or "")
    return float(bool(found) and int(found[-1]) == answer)


TARGET_SHARE = 0.25  # the token task's target set: this share of the vocabulary


def target_tokens(model, seed: int) -> set[int]:
    """The token task's targets: the ids whose output embeddings project
    furthest on a random unit direction (fixed by the seed, taken once from
    the initial weights). One direction of the last hidden state raises all
    of them together, so the reward is learnable from random weights."""
    emb = model.get_output_embeddings().weight.detach().float().cpu()
    direction = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(seed))
    k = max(1, int(TARGET_SHARE * emb.shape[0]))
    return set((emb @ direction).topk(k).indices.tolist())


def token_reward(output_ids: list[int], targets: set[int]) -> float:
    return sum(t in targets for t in output_ids) / max(1, len(output_ids))


def load_trainer(args, folder: str, dtype, device):
    """The trainer's model: the checkpoint, or for a preset (dummy weights)
    the same shape with transformers' own random init (pushed to the engine
    before the first rollout, so both start from one set of weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.load_format != "dummy":
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    from rollout_engine.models.presets import PRESETS

    shape = {k: v for k, v in PRESETS[args.model].items() if k != "architectures"}
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape), dtype=dtype)


def token_logprobs(model, sequences: list[tuple[list[int], list[int]]], device, routes=None,
                   agreement: list[float] | None = None) -> list[torch.Tensor]:
    """The trainer's log-softmax of each sampled token, for a micro-batch of
    (prompt, output) pairs in one forward. Right padding: causal attention
    keeps the pad after a sequence from reaching its tokens. `routes` (MoE):
    the engine's routing of each sequence, replayed in the forward.
    `agreement`: gets the share of (token, MoE layer) whose free routing in
    this forward equals the engine's (`routes` given, replay off)."""
    width = max(len(p) + len(o) for p, o in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    for row, (p, o) in enumerate(sequences):
        ids[row, : len(p) + len(o)] = torch.tensor(p + o, device=device)
    if routes is None:
        logits = model(ids).logits
    else:
        from rollout_engine.integrations import routing_replay

        with (routing_replay.agreement(model, routes, agreement) if agreement is not None
              else routing_replay.replay(model, routes)):
            logits = model(ids).logits
    out = []
    for row, (p, o) in enumerate(sequences):
        picked = logits[row, len(p) - 1: len(p) + len(o) - 1].float()
        out.append(torch.log_softmax(picked, dim=-1).gather(-1, ids[row, len(p): len(p) + len(o), None]).squeeze(-1))
    return out


def grpo_step(model, optimizer, prompts, outs, rewards, n: int, clip: float, device,
              micro_batch: int = 16, tis_cap: float | None = None) -> dict[str, float]:
    """One update; returns the mismatch figures measured before it.
    Without `tis_cap` the clipped ratio is taken against the engine's
    logprobs. With it (truncated importance sampling): the ratio is the
    trainer's own (one update per batch, so 1 with its gradient), and each
    token's term is weighted by min(pi_trainer / pi_engine, tis_cap), which
    corrects for sampling from the engine's (e.g. fp8) policy. With the
    engine's routing in the outputs (MoE, --routing-replay), the trainer's
    forward replays it, and the mismatch without replay and the routers'
    agreement with the engine are measured too (an extra forward, no grad)."""
    model.train()
    groups = torch.tensor(rewards).view(-1, n)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    gaps, free_gaps, agree, kl, losses, tis = [], [], [], [], [], []
    optimizer.zero_grad()
    kept = [i for i, out in enumerate(outs) if out.output_token_ids]
    replaying = bool(kept) and outs[kept[0]].routed_experts is not None
    for start in range(0, len(kept), micro_batch):
        chunk = kept[start: start + micro_batch]
        pairs = [(prompts[i // n], outs[i].output_token_ids) for i in chunk]
        routes = [outs[i].routed_experts for i in chunk] if replaying else None
        if replaying:
            with torch.no_grad():
                free = token_logprobs(model, pairs, device, routes, agreement=agree)
            for i, f in zip(chunk, free):
                free_gaps.append((f - torch.tensor(outs[i].output_logprobs, device=device)).abs())
        news = token_logprobs(model, pairs, device, routes)
        loss = 0.0
        for i, new in zip(chunk, news):
            old = torch.tensor(outs[i].output_logprobs, device=device, dtype=torch.float32)
            gaps.append((new.detach() - old).abs())
            kl.append(float((old - new.detach()).sum()))
            if tis_cap is None:
                ratio, weight = torch.exp(new - old), 1.0
            else:
                ratio, weight = torch.exp(new - new.detach()), torch.exp(new.detach() - old).clamp(max=tis_cap)
                tis.append(weight)
            term = torch.min(ratio * adv[i], ratio.clamp(1 - clip, 1 + clip) * adv[i]) * weight
            loss = loss - term.mean() / len(outs)
        loss.backward()
        losses.append(float(loss.detach()))
    optimizer.step()
    gap = torch.cat(gaps) if gaps else torch.zeros(1)
    figures = {"mismatch_mean": float(gap.mean()), "mismatch_max": float(gap.max()),
               "kl_k1_per_seq": sum(kl) / max(1, len(kl)), "loss": sum(losses)}
    if tis:
        weights = torch.cat(tis)
        figures |= {"tis_weight_mean": float(weights.mean()), "tis_capped": float((weights >= tis_cap).float().mean())}
    if replaying:
        free = torch.cat(free_gaps)
        figures |= {"mismatch_free_mean": float(free.mean()), "mismatch_free_max": float(free.max()),
                    "router_agreement": sum(agree) / len(agree)}
    return figures


def init_ranks(gpu: bool) -> tuple[int, int, str | None]:
    """Under torchrun: this rank, the world size and this rank's device."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if gpu else "gloo")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if gpu:
        torch.cuda.set_device(local)
    return dist.get_rank(), dist.get_world_size(), f"cuda:{local}" if gpu else "cpu"


def shard(trainer) -> None:
    """FSDP2: every decoder layer, then the rest."""
    from torch.distributed.fsdp import fully_shard

    for layer in trainer.model.layers:
        fully_shard(layer)
    fully_shard(trainer)


def global_mean(values: list[float], world: int) -> float:
    """The mean over every rank's values."""
    if world == 1:
        return sum(values) / len(values)
    import torch.distributed as dist

    total = torch.tensor([float(sum(values)), float(len(values))], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def check_sync(trainer, engine) -> None:
    """Raise if the engine does not hold exactly the trainer's weights (cast
    to the engine's dtype, quantized where the engine quantizes). Collective
    under FSDP: every rank calls it."""
    from rollout_engine.fidelity import weights_checksum
    from rollout_engine.integrations.fsdp import iter_hf_tensors

    with torch.no_grad():
        ours = weights_checksum(iter_hf_tensors(trainer), engine.dtype, quantization=engine.config.quantization)
    theirs = engine.weights_checksum()
    wrong = sorted(n for n in theirs if ours.get(n) != theirs[n])
    if wrong:
        raise RuntimeError(f"the engine's weights differ from the trainer's in {len(wrong)} tensors: {wrong[:4]}")


def main(argv: list[str] | None = None) -> dict:
    p = ScriptParser("grpo_train.py", __doc__.split("\n\n")[0])  # usage errors in one line, misspellings named
    p.add_argument("--model", default="smollm2-135m", help="zoo name, Hugging Face folder, or a preset")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: a preset's shape with random weights (use --task token)")
    p.add_argument("--task", default="arithmetic", choices=["arithmetic", "token"],
                   help="arithmetic: reward an exact sum (needs a tokenizer); token: reward output tokens of a "
                        "target set (learnable from random weights)")
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("-n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per sample at most")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 1e-5 for arithmetic, a pretrained model; 3e-4 for token, "
                        "which starts from random weights)")
    p.add_argument("--clip", type=float, default=0.2, help="the PPO ratio clip")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="the engine's dtype (default: float32; bfloat16 for fp8 rollouts on a GPU, which need it); "
                        "the trainer keeps float32 weights (its optimizer's master copy)")
    p.add_argument("--device", default="auto", help="the engine's device: auto (a GPU where there is one), cuda or cpu")
    p.add_argument("--seed", type=int, default=0, help="the problems' and the sampling's seed")
    p.add_argument("--wandb", action="store_true", help="log to wandb (WANDB_MODE=offline works without network)")
    p.add_argument("--log-json", help="write every step's row here (a JSON list)")
    p.add_argument("--checksum-every", type=int, default=10, metavar="N",
                   help="every N steps (and the last) check that the engine holds exactly the trainer's weights "
                        "(weights_checksum on both sides); 0: never")
    p.add_argument("--routing-replay", action="store_true",
                   help="MoE models: the engine returns each token's experts and the trainer's forward replays "
                        "them; logs the routers' agreement and the mismatch without replay too")
    p.add_argument("--rollout-quantization", choices=QUANTIZATIONS, default=None,
                   help="the engine rolls out with fp8 linear layers (the trainer stays in fp32); the logged "
                        "mismatch is then fp8 engine vs trainer")
    p.add_argument("--tis-cap", type=float, default=None, metavar="C",
                   help="truncated importance sampling: weight each token's loss by min(pi_trainer / pi_engine, C), "
                        "C >= 1 (for rollouts from a policy other than the trainer's, e.g. fp8); default: off, the "
                        "clipped ratio against the engine's logprobs")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 trainer over the ranks of torchrun; each rank rolls out with its own engine")
    args = p.parse_args(argv)
    for name in ("steps", "prompts", "n", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"{'-n' if name == 'n' else '--' + name.replace('_', '-')} must be >= 1")
    if args.checksum_every < 0:
        p.error("--checksum-every must be >= 0")
    if args.lr is None:
        args.lr = 3e-4 if args.task == "token" else 1e-5
    if not (args.lr > 0 and math.isfinite(args.lr)):
        p.error("--lr must be a finite number > 0")
    if not (args.clip > 0 and math.isfinite(args.clip)):
        p.error("--clip must be a finite number > 0")
    if args.tis_cap is not None and not (args.tis_cap >= 1 and math.isfinite(args.tis_cap)):
        p.error("--tis-cap must be a finite number >= 1")
    if args.log_json and not os.path.isdir(os.path.dirname(os.path.abspath(args.log_json))):
        p.error(f"--log-json: the folder of {args.log_json!r} does not exist")

    from rollout_engine.model_zoo import resolve_model_path

    torch.manual_seed(args.seed)
    try:
        folder = resolve_model_path(args.model, args.load_format)
    except ValueError as e:
        p.error(f"--model: {e}")
    gpu = torch.cuda.is_available() and args.device != "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if gpu and args.rollout_quantization else "float32"
    rank, world, engine_device = 0, 1, args.device
    if args.fsdp:
        if "RANK" not in os.environ:
            p.error("--fsdp runs under torchrun: torchrun --nproc-per-node K examples/grpo_train.py --fsdp ...")
        rank, world, engine_device = init_ranks(gpu)
    engine = None
    try:  # Ctrl-C while the engine or the trainer loads: a clean exit too
        try:
            engine = RolloutEngine(folder, load_format=args.load_format, device=engine_device, dtype=args.dtype,
                                   seed=args.seed, enable_memory_saver=gpu, weights_cpu_backup=False,
                                   max_total_tokens=16384, enable_return_routed_experts=args.routing_replay,
                                   quantization=args.rollout_quantization)
        except ValueError as e:
            if args.routing_replay and "enable_return_routed_experts" in str(e):
                p.error(f"--routing-replay: {e} (e.g. --model qwen3-moe-mini --load-format dummy --task token)")
            p.error(str(e))  # a combination the engine refuses (e.g. --dtype float32 with fp8 on a GPU)
        device = engine.device
        if args.task == "arithmetic" and engine.tokenizer is None:
            p.error("--task arithmetic needs a model with a tokenizer; use --task token")
        trainer = load_trainer(args, folder, torch.float32, device)
        targets = target_tokens(trainer, args.seed) if args.task == "token" else set()
        if args.fsdp:
            shard(trainer)
        if args.load_format == "dummy":
            with torch.no_grad():
                sync_to_engine(trainer, engine, version=0)
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
        run = None
        if args.wandb:
            import wandb

            run = wandb.init(project="rollout-engine-grpo", config=vars(args)) if rank == 0 else None
        logger = RolloutLogger(run)
    except KeyboardInterrupt:
        if engine is not None:
            engine.shutdown()
        print("interrupted while starting", file=sys.stderr)
        raise SystemExit(130) from None
    rng = random.Random(args.seed + 7919 * rank)  # each rank its own prompts
    rows = []
    from tqdm import tqdm

    bar = tqdm(range(args.steps), desc="grpo", unit="step", disable=rank != 0)
    try:
        for step in bar:
            if args.task == "arithmetic":
                problems = make_problems(rng, args.prompts)
                prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q, _ in problems]
            else:
                vocab = engine.model_config.vocab_size
                prompts = [[rng.randrange(vocab) for _ in range(16)] for _ in range(args.prompts)]
            params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                    logprob_mode="raw", seed=args.seed + 1000 * step,
                                    return_routed_experts=args.routing_replay)
            timings = {}
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            timings["generate"] = time.perf_counter() - start
            if args.task == "arithmetic":
                rewards = [reward(o.text, problems[i // args.n][1]) for i, o in enumerate(outs)]
            else:
                rewards = [token_reward(o.output_token_ids, targets) for o in outs]
            freed = 0
            if gpu:
                start = time.perf_counter()
                freed = sum(engine.release_memory(["kv_cache"]).values())
                timings["release"] = time.perf_counter() - start
            start = time.perf_counter()
            figures = grpo_step(trainer, optimizer, prompts, outs, rewards, args.n, args.clip, device,
                                tis_cap=args.tis_cap)
            timings["train"] = time.perf_counter() - start
            if gpu:
                start = time.perf_counter()
                engine.resume_memory(["kv_cache"])
                timings["resume"] = time.perf_counter() - start
            start = time.perf_counter()
            with torch.no_grad():
                sync_to_engine(trainer, engine)
            timings["sync"] = time.perf_counter() - start
            if args.checksum_every and (step % args.checksum_every == args.checksum_every - 1
                                        or step == args.steps - 1):
                start = time.perf_counter()
                check_sync(trainer, engine)
                timings["checksum"] = time.perf_counter() - start
            row = logger.step(engine, outs, timings, {"reward_mean": global_mean(rewards, world),
                                                       "bytes_freed": freed, **figures})
            row["step"] = step
            logger.log(row, step)
            rows.append(row)
            if rank == 0:
                replay = (f" (without replay {row['mismatch_free_mean']:.2e}, routers agree "
                          f"{row['router_agreement']:.1%})" if "router_agreement" in row else "")
                tis = (f"  TIS weight {row['tis_weight_mean']:.3f} ({row['tis_capped']:.1%} capped)"
                       if "tis_weight_mean" in row else "")
                bar.write(f"step {step}: reward {row['reward_mean']:.3f}  mismatch mean {row['mismatch_mean']:.2e}"
                          f"{replay} max {row['mismatch_max']:.2e}{tis}  {row.get('output_tokens_per_s', 0):.0f} tok/s  "
                          f"weights v{row['weight_version']}  e.g. {outs[0].text or outs[0].output_token_ids[:8]!r}")
        # The final policy's greedy answer to a fixed prompt: equal on every
        # rank when FSDP synced one set of weights into every engine.
        probe = engine.generate(input_ids=[list(range(1, 9))],
                                sampling_params=SamplingParams(max_new_tokens=8, temperature=0))[0].output_token_ids
    except KeyboardInterrupt:
        if rank == 0:
            print(f"interrupted after {len(rows)} step{'s' if len(rows) != 1 else ''}" + (f"; their rows are in {args.log_json}"
                                                             if args.log_json else ""), file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        try:
            logger.finish()
            if args.log_json and rank == 0:
                with open(args.log_json, "w") as f:
                    json.dump(rows, f, indent=1)
        finally:
            engine.shutdown()
        if args.fsdp:
            import torch.distributed as dist

            dist.destroy_process_group()
    return {"rows": rows, "weight_version": rows[-1]["weight_version"] if rows else 0, "probe": probe,
            "rank": rank}


if __name__ == "__main__":
    main()
