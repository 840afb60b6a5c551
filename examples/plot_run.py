"""Reward, train-inference mismatch and tokens/s against step, from the JSON
log of examples/grpo_train.py (--log-json), into a PNG.

    python examples/plot_run.py run.json run.png
"""
from __future__ import annotations

import argparse
import json


def plot(rows: list[dict], out: str, title: str = "GRPO") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(steps, [r["reward_mean"] for r in rows], marker=".")
    axes[0].set_ylabel("mean reward")
    axes[1].semilogy(steps, [max(r["mismatch_mean"], 1e-12) for r in rows], marker=".", label="mean")
    axes[1].semilogy(steps, [max(r["mismatch_max"], 1e-12) for r in rows], marker=".", label="max")
    axes[1].set_ylabel("|engine - trainer| logprob")
    axes[1].legend()
    axes[2].plot(steps, [r.get("output_tokens_per_s", 0) for r in rows], marker=".")
    axes[2].set_ylabel("output tok/s")
    axes[2].set_xlabel("step")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="the JSON list written by grpo_train.py --log-json")
    p.add_argument("png", help="the picture to write")
    p.add_argument("--title", default="GRPO")
    args = p.parse_args(argv)
    with open(args.log) as f:
        rows = json.load(f)
    if not rows:
        p.error(f"{args.log} holds no steps")
    plot(rows, args.png, args.title)


if __name__ == "__main__":
    main()
